"""Stages one and two of the step: the scaled loss's gradients, and their accumulation.

:func:`loss_and_grads` runs ``loss_fn`` on the model bound to the params under its
policies, differentiates the loss times the loss scale, and with ``grad_accum_steps``
sums the micro-batches' gradients in float32 (float64 ones in float64) inside a
``lax.scan``. It works on one device's data; ``devices`` wraps it for a mesh.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxamp import adapters
from jaxamp import gather as gather_lib
from jaxamp import numerics as numerics_lib
from jaxamp import scaled as scaled_lib
from jaxamp.casting import at_least_float32
from jaxamp.residuals import (checkpointed, half_residuals, save_all_but_gathers,
                               save_half_and_statistics)
from jaxamp.rules import asks_for_fp8 as asks_for_scaled
from jaxamp.rules import leaf_name
from jaxamp.train.loss import call_user, combine_aux, split_loss
from jaxamp.train.plan import Plan, autocast_under_level
from jaxamp.train.watch import Watch

__all__ = ["Grads", "loss_and_grads"]


class Grads(NamedTuple):
  """What the gradient stage (and the devices stage around it) returns.

  Attributes:
    grads: the gradients of the loss times the loss scale.
    loss: the (unscaled, float32) loss, averaged over micro-batches.
    aux: ``loss_fn``'s aux, combined over micro-batches.
    model_state: the model state after the step's forward passes.
    scaled: the scaled formats' state after them (:mod:`jaxamp.scaled`), or None.
    numerics: with the numerics monitor, ``{'activation': {path: raw record},
      'cotangent': {...}}`` (:mod:`jaxamp.numerics`); else None.
  """

  grads: Any
  loss: jax.Array
  aux: Any
  model_state: Any
  scaled: Any
  numerics: Any = None


def _grad_fn(plan: Plan, weight: jax.Array, axes: Any,
             changed: set[int] | None = None, watch: Watch | None = None
             ) -> Callable[..., Any]:
  """``(params, scaled, model_state, batch, key) -> (grads, new scaled, (loss, aux, new
  model state))``: the gradients of the loss times ``weight``, and the scaled formats'
  state updated from its cotangent (:func:`jaxamp.scaled.merge_state`: what the forward
  and backward passes observed, reduced over the mesh ``axes`` inside ``shard_map``, if
  any). The positions of the model-state leaves a call changed are added to
  ``changed``, if given. With ``watch``, a fourth result: the numerics records
  (:attr:`Grads.numerics`)."""
  options = plan.options
  used: set[str] = set()  # modules of a scaled format that ran, known once traced

  keys: list[Any] = []  # the numerics taps, listed by a discovery pass
  input_keys: list[Any] = []
  whatif = options.debug.numerics.formats if watch is not None else ()

  def scaled_loss(p, sc, ms, mb, key, probes=None):
    # A scope even with no state, if some layer runs a scaled format: those that run
    # without state (all inside scans, say) warn.
    record = bool(sc) or asks_for_scaled(options.policy)
    watching = (numerics_lib.scope(probes, axes, whatif)
                if watch is not None else contextlib.nullcontext())
    with watching as seen, scaled_lib.state_scope(sc, record=record) as scope, \
        gather_lib.prefetching(plan.prefetch):
      model, new_state = plan.adapter.bind(
          p, ms, key, options.policy, train=True, float32_outputs=options.float32_outputs,
          **({"shards": plan.shards} if plan.layer_gather else {}))
      loss, aux = split_loss(call_user(options.loss_fn, model, mb), options.has_aux)
      used.update(scope.used if scope is not None else ())
    if watch is None:
      return loss * weight, (loss, aux, new_state())
    watch.dtypes.update(seen.dtypes)
    numerics_lib.warn_unobserved(seen)
    if probes is None:
      keys[:], input_keys[:] = seen.keys, seen.input_keys
    return loss * weight, (loss, aux, new_state())

  loss = autocast_under_level(options, scaled_loss, batch_argnum=3)
  if plan.layer_gather:
    # Parameters gathered at their reads are gathered again in the backward pass (both
    # policies say so); a slice used raw (not through its read) is refused.
    policy = save_half_and_statistics if plan.half_residuals else save_all_but_gathers
    loss = checkpointed(loss, policy, inspect=functools.partial(
        gather_lib.check_reads, shards=plan.shards, names=_param_names(plan)))
  elif plan.half_residuals:
    loss = half_residuals(loss)
  raw_grad_fn = jax.grad(loss, argnums=(0, 1) if watch is None else (0, 1, 5), has_aux=True)

  def grad_fn(p, sc, ms, mb, key):
    if watch is None:
      (g, sc_cot), out = raw_grad_fn(p, sc, ms, mb, key)
    else:  # a discovery pass lists the outputs to tap (shapes only, nothing runs)
      jax.eval_shape(loss, p, sc, ms, mb, key, None)
      zero = jnp.zeros((numerics_lib.size(whatif),), jnp.float32)
      zeros = dict.fromkeys(keys, zero)
      probes = {"activation": zeros, "cotangent": dict(zeros),
                "input": dict.fromkeys(input_keys, zero)}
      (g, sc_cot, probe_cot), out = raw_grad_fn(p, sc, ms, mb, key, probes)
    _check_same_structure(ms, out[2])
    if changed is not None:  # unchanged leaves come back as the very tracers passed in
      changed.update(i for i, (new, old) in enumerate(zip(jax.tree.leaves(out[2]),
                                                          jax.tree.leaves(ms)))
                     if new is not old)
    if sc:
      sc = scaled_lib.merge_state(sc, sc_cot, used, plan.scaled_recipes, axes)
    if watch is None:
      return g, sc, out
    return g, sc, out, {kind: numerics_lib.by_path(probe_cot[kind]) for kind in probe_cot}

  return grad_fn


def _param_names(plan: Plan) -> list[str]:
  """The path of each param leaf, in ``jax.tree.leaves`` order."""
  return [leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(
      plan.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]]


def _names(tree: Any) -> list[str]:
  return [leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=adapters.is_node)[0]]


def _check_same_structure(before: Any, after: Any) -> None:
  """Refuses a step that changed the model state's structure (the state carries it from
  step to step, and the skip's cond and the micro-batch scan need it fixed), naming the
  entries and the usual cause."""
  if jax.tree.structure(before) == jax.tree.structure(after):
    return
  old, new = _names(before), _names(after)
  added = [n for n in new if n not in old] or new
  removed = [n for n in old if n not in new]
  raise ValueError(
      "loss_fn's model changed the structure of its state during the step"
      f"{': ' + ', '.join(added[:8]) + ' appeared' if added else ''}"
      f"{'; ' + ', '.join(removed[:8]) + ' disappeared' if removed else ''}. The train "
      "state carries the model state from step to step, so its entries must stay the "
      "same. An NNX module that sows (self.sow(nnx.Intermediate, ...)) needs them taken "
      "out in loss_fn: intermediates = nnx.pop(model, nnx.Intermediate); a Linen module "
      "sows only into collections it had at init.")


def loss_and_grads(plan: Plan, params: Any, model_state: Any, batch: Any, rng: jax.Array,
                   scale: jax.Array, scaled: Any = None, keep_float32: bool = False,
                   axes: Any = None, changed: set[int] | None = None,
                   watch: Watch | None = None) -> Grads:
  """Scaled-loss gradients over micro-batches, accumulated in at least float32
  (complex64 for complex parameters; kept so with ``keep_float32``), and the new state
  of the scaled formats (``scaled``: ``TrainState.scaled``).

  ``axes``: inside ``shard_map``, the batch axes: the scaled formats' observations (FP8
  amaxes, maxed) are reduced over them after every micro-batch, so each device scales
  the next micro-batch as one device holding the whole batch would. ``changed``: a set the positions (in
  ``jax.tree.leaves(model_state)``) of the state leaves the model updated are added to.

  Returns:
    :class:`Grads`: the gradients of the loss times ``scale``, the (unscaled, float32)
    loss, ``loss_fn``'s aux combined over micro-batches, and the model state and the
    scaled formats' state after the step's forward passes.
  """
  k = plan.options.grad_accum_steps
  # Each micro-batch's loss is scaled by scale / k (torch's recipe: the loss divided by
  # k before scaling), so its float16 backward pass carries the values of the k=1 step's
  # and overflows no sooner; the accumulated sum is then the mean's scaled gradient.
  grad_fn = _grad_fn(plan, scale if k == 1 else scale / k, axes, changed, watch)
  if k == 1:
    grads, scaled, (loss, aux, model_state), *seen = grad_fn(params, scaled, model_state,
                                                             batch, rng)
    return Grads(grads, loss, aux, model_state, scaled, *seen)
  return _accumulated(plan, grad_fn, params, model_state, batch, rng, scaled, keep_float32)


def _accumulated(plan: Plan, grad_fn: Callable[..., Any], params: Any, model_state: Any,
                 batch: Any, rng: jax.Array, scaled: Any, keep_float32: bool) -> Grads:
  """``grad_fn`` over the batch's ``grad_accum_steps`` micro-batches in a ``lax.scan``,
  the gradients summed in at least float32, the model and scaled state threaded
  through."""
  k = plan.options.grad_accum_steps
  split, rebuild = _micro_batches(batch, k)
  # float32 sums (float64 for float64 parameters; a complex parameter's in complex64,
  # its imaginary part kept).
  acc0 = jax.tree.map(lambda p: jnp.zeros(p.shape, at_least_float32(p.dtype)), params)

  def body(carry, xs):
    acc, ms, sc = carry
    mb, i = xs
    mb = rebuild(mb)
    key = None if rng is None else jax.random.fold_in(rng, i)  # None: the model takes none
    g, sc, (loss, aux, ms), *seen = grad_fn(params, sc, ms, mb, key)
    acc = jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
    return (acc, ms, sc), (loss, aux, *seen)

  (acc, model_state, scaled), (losses, auxes, *seen) = jax.lax.scan(
      body, (acc0, model_state, scaled), (split, jnp.arange(k)))
  seen = [jax.tree.map(numerics_lib.combine_axis, s) for s in seen]  # over micro-batches
  # Accumulated in float32 (or wider). Master weights (and the rounding modes) take them
  # so; otherwise they go on in each parameter's dtype, so the optimizer state keeps its dtypes (and the step its single
  # trace).
  grads = jax.tree.map(lambda a, p: a if plan.widens or keep_float32
                       else a.astype(p.dtype), acc, params)
  return Grads(grads, jnp.mean(losses), combine_aux(auxes, over_axis=0), model_state,
               scaled, *seen)


def _micro_batches(batch: Any, k: int) -> tuple[list[jax.Array], Callable[[list[Any]], Any]]:
  """``batch``'s leaves of one dimension or more, each split into ``k`` micro-batches
  along its leading dimension (stacked: ``[k, rows / k, ...]``, what ``lax.scan`` takes),
  and a function putting one micro-batch's leaves back into a batch. 0-d leaves (a
  weight, a temperature) are not split: every micro-batch gets them unchanged.

  Raises:
    ValueError: a leaf's leading dimension is not divisible by ``k``, naming the leaf.
  """
  found, treedef = jax.tree_util.tree_flatten_with_path(batch)
  leaves = [x for _, x in found]
  rows = [i for i, x in enumerate(leaves) if jnp.ndim(x)]
  for i in rows:
    n = jnp.shape(leaves[i])[0]
    if n % k:
      raise ValueError(
          f"grad_accum_steps={k} must divide the batch size {n} of "
          f"batch{jax.tree_util.keystr(found[i][0])} (shape {list(jnp.shape(leaves[i]))}; "
          "per device, with a mesh): each leaf of one dimension or more is split into "
          f"{k} micro-batches along its first. Give it a multiple of {k} rows, or pass a "
          "value every micro-batch shares as a 0-d array.")

  def rebuild(micro: list[Any]) -> Any:
    full = list(leaves)
    for i, x in zip(rows, micro):
      full[i] = x
    return treedef.unflatten(full)

  split = [leaves[i].reshape(k, leaves[i].shape[0] // k, *leaves[i].shape[1:]) for i in rows]
  return split, rebuild
