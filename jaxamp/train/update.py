"""Stage four of the step: unscale, check, and apply the update or skip it exactly.

One reduction of the gradients gives their global norm and the verdict (every element
finite, and the norm within float32's range); that, what a skipped step keeps and the
loss scale's rule on it are :mod:`jaxamp.skip`'s. A ``lax.cond`` then runs the optimizer
only on a finite step; on a skipped one only the loss scale moves (it backs off) and
the parameters, every optimizer-state leaf and the model state stay bit-identical, and
the scaled formats' state is what each format keeps on a skip (FP8: its old state, bit
for bit). With master weights the optimizer updates float32 copies and the stored
params are their casts; with ``master_weights='stochastic'`` or ``'kahan'`` it reads
float32 copies and the update is added in float32 and stored back by
:mod:`jaxamp.rounding`'s apply step. A float16 parameter an update would make inf skips the step too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp import scaled as scaled_lib
from jaxamp import skip as skip_lib
from jaxamp.casting import NarrowCotangents, is_floating_array, widen_floating
from jaxamp.train.plan import Plan
from jaxamp.train.state import MasterWeightsState, RoundingState, TrainState

__all__ = ["Applied", "apply_or_skip", "float16_leaves"]


class Applied(NamedTuple):
  """What :func:`apply_or_skip` returns: the new parts of the state and the verdicts."""

  params: Any
  opt_state: Any
  model_state: Any
  scaled: Any
  grads_finite: jax.Array
  grad_norm: jax.Array
  params_finite: Any  # a bool array, or True where no parameter is float16


def apply_or_skip(plan: Plan, state: TrainState, grads: Any, loss: jax.Array,
                  model_state: Any, scaled: Any, scale: jax.Array,
                  found: NarrowCotangents | None) -> Applied:
  """The state after ``grads`` (scaled by ``scale``) are applied, or after the step is
  skipped if they are not finite (``skip_nonfinite``).

  ``found`` names the float32 gradients that are a half-precision read's cotangent
  widened (:func:`jaxamp.casting.narrow_cotangents`); the cond holds those narrow.
  """
  unit = None if plan.unit_scale else scale
  kept = lambda old, new: scaled_lib.kept_on_skip(old, new, plan.scaled_recipes)

  def received(grads: Any) -> Any:
    # What the optimizer receives (unscaled): float32 (or wider) for master weights and
    # the rounding modes, else each parameter's dtype.
    return widen_floating(grads) if plan.widens else grads

  opt_grads, grad_norm, grads_finite = skip_lib.unscaled_norm_and_finite(received(grads), unit)
  # The cond holds each gradient as narrow as it was computed and widens (and unscales)
  # it inside the branch, as a step without the skip does in its update: a float32
  # gradient that is a half-precision cotangent widened crosses as that cotangent, and
  # a half-precision gradient before its cast to float32 master weights. The same
  # values, half the bytes, and the widening fused into the update, where a float32
  # copy of each such gradient was written ahead of the branch and read back in it.
  held, widened = zip(*(_held(g, o, found) for g, o in zip(jax.tree.leaves(grads),
                                                           jax.tree.leaves(opt_grads))))
  opt_treedef = jax.tree.structure(opt_grads)

  def widen(held: Any, dtype: np.dtype | None) -> Any:
    if dtype is None:  # held as the optimizer receives it
      return held
    wide = received(held.astype(dtype))
    return wide if unit is None else skip_lib.unscale(wide, unit)

  def unpack(held: list[Any]) -> Any:
    # In the branch: each held gradient back as the optimizer receives it.
    return opt_treedef.unflatten([widen(h, d) for h, d in zip(held, widened)])

  # The branches take what they read as operands, as flat leaves (_flat_cond).
  def apply(operands):
    state, held, loss, grad_norm, model_state, scaled = operands
    opt_grads = unpack(held)
    # jaxamp.clip_by_global_norm in the chain reuses the norm (XLA cannot share it
    # with a second one computed inside this branch).
    known_norm = skip_lib.KnownNorm.of(opt_grads, grad_norm)
    opt_state, params = _update(plan, state, opt_grads, loss, finite=True,
                                known_norm=known_norm)
    # A float16 parameter past 65504 (a master weight that grew, or a float16 update)
    # would be stored as inf: skip such a step like an overflowing one.
    params_finite = _params_finite(params)
    if params_finite is None:
      return params, opt_state, model_state, scaled, np.bool_(True)
    opt_state = skip_lib.skipped_for_params(params_finite, opt_state, state.opt_state)
    keep = lambda new, old: skip_lib.select_tree(params_finite, new, old)
    return (keep(params, state.params), opt_state, keep(model_state, state.model_state),
            keep(scaled, kept(state.scaled, scaled)), params_finite)

  def skip(operands):
    # Only the loss scale moves (it backs off); the rest of the state is kept.
    state, held = operands[:2]
    if plan.overflow is not None:  # skip_lib.overflow_rule: the loss scale's rule alone
      opt_state = skip_lib.on_overflow(plan.overflow, state.opt_state)
    else:
      opt_state, _ = _update(plan, state, unpack(held), operands[2], finite=False)
    return (state.params, opt_state, state.model_state, kept(state.scaled, operands[5]),
            np.bool_(True))

  operands = (state, list(held), loss, grad_norm, model_state, scaled)
  if plan.options.skip_nonfinite:
    outs = _flat_cond(grads_finite, apply, skip, operands)
  else:
    # skip_nonfinite=False: every update applied, no lax.cond (whose predicate an XLA
    # GPU program reads back to the host before running a branch). init refused it
    # with float16 params, so apply checks none.
    outs = apply(operands)
  return Applied(*outs[:4], grads_finite=grads_finite, grad_norm=grad_norm,
                 params_finite=outs[4])


def _update(plan: Plan, state: TrainState, grads: Any, loss: jax.Array, *, finite: bool,
            known_norm: skip_lib.KnownNorm | None = None) -> tuple[Any, Any]:
  """The optimizer's new state and the new params, told whether ``grads`` are finite
  (and, if known, their global norm). The loss goes along as optax's ``value`` extra
  argument (``optax.contrib.reduce_on_plateau`` reads it; chains give it only to the
  elements that take it)."""
  # Unscaled already, by apply_or_skip.
  flag = skip_lib.Verdict(finite=finite, unscaled=True, norm=known_norm).extra_args()
  flag["value"] = loss
  if plan.param_apply is not None:
    # No master weights: the optimizer reads float32 copies, and the update is added
    # in float32 and stored back by the rounding (its key or compensation kept on a skip).
    rounding, inner = state.opt_state
    updates, inner = plan.optimizer.update(grads, inner, widen_floating(state.params), **flag)
    params = state.params
    if finite:
      params, rounding = plan.param_apply.apply(state.params, updates, rounding)
    return RoundingState(rounding, inner), params
  if plan.master_weights:
    master, inner = state.opt_state
    updates, inner = plan.optimizer.update(grads, inner, master, **flag)
    master = optax.apply_updates(master, updates) if finite else master
    params = jax.tree.map(lambda n, o: n.astype(o.dtype), master, state.params)
    return MasterWeightsState(master, inner), params
  updates, opt_state = plan.optimizer.update(grads, state.opt_state, state.params, **flag)
  return opt_state, optax.apply_updates(state.params, updates)


def float16_leaves(params: Any) -> list[Any]:
  return [x for x in jax.tree.leaves(params) if x.dtype == jnp.float16]


def _params_finite(params: Any) -> jax.Array | None:
  """Whether every float16 parameter is finite; None if none is stored in float16."""
  half = float16_leaves(params)
  return skip_lib.all_finite(half) if half else None


def _held(grad: Any, opt_grad: Any, found: NarrowCotangents | None
          ) -> tuple[Any, np.dtype | None]:
  """What the skip's cond holds for one gradient: ``(narrow, dtype)``, the gradient as
  narrow as it was computed and the dtype ``grad`` has (the branch widens it to that and
  on as ``opt_grad`` was made), or ``(opt_grad, None)`` where nothing narrower exists."""
  if not is_floating_array(grad):
    return opt_grad, None
  narrow = found.narrow(grad) if found is not None else None
  if narrow is not None:
    return narrow, np.dtype(grad.dtype)
  if opt_grad is not grad and np.dtype(grad.dtype).itemsize < np.dtype(opt_grad.dtype).itemsize:
    return grad, np.dtype(grad.dtype)
  return opt_grad, None


def _flat_cond(pred: jax.Array, true_fn: Callable[[Any], Any],
               false_fn: Callable[[Any], Any], operands: Any) -> Any:
  """``jax.lax.cond(pred, true_fn, false_fn, operands)``, given the operands' leaves.

  The same program; only cheaper to trace. ``cond`` names every leaf of a structured
  operand and result by its key path and rebuilds the trees several times, which for a
  train state of hundreds of leaves (NNX ``State``s) is a noticeable share of the
  step's trace; here each tree is flattened and rebuilt once.
  """
  leaves, treedef = jax.tree.flatten(operands)
  out_trees = []

  def branch(fn: Callable[[Any], Any]) -> Callable[..., list[Any]]:
    def run(*leaves: Any) -> list[Any]:
      out, out_tree = jax.tree.flatten(fn(treedef.unflatten(leaves)))
      out_trees.append(out_tree)
      return out
    return run

  out = jax.lax.cond(pred, branch(true_fn), branch(false_fn), *leaves)
  if out_trees[0] != out_trees[1]:
    raise TypeError(f"cond branches return different structures: {out_trees[0]} and "
                    f"{out_trees[1]}")
  return out_trees[0].unflatten(out)
