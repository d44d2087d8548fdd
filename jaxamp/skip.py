"""The exact skip of a non-finite step, in one place.

A step whose gradients hold an inf or a NaN (a float16 overflow) is skipped: the
parameters and every optimizer-state leaf stay bit-identical, and only the loss scale
moves (it backs off, as jmp's ``DynamicLossScale.adjust`` and torch's ``GradScaler``
do). This module holds every part of that decision, written once, and both
:func:`skip_nonfinite` / the loss scales (``jaxamp.loss_scale``) and the train step
(``jaxamp.train.update``) use it:

- the verdict: :func:`unscaled_norm_and_finite` (one reduction gives the global norm and
  whether the step is finite), :func:`all_finite`;
- what a caller that has checked the gradients tells the optimizer: :class:`Verdict`,
  passed as optax extra arguments (optax's own mechanism, as for ``value``);
- the loss-scale state and its rule (:class:`LossScaleState`, :class:`ScaleRule`)::

    if finite:
      count += 1
      if count >= growth_interval: scale, count = min(scale * growth, max_scale), 0
    else:
      scale, count = max(scale * backoff, min_scale), 0
      overflow_steps += 1

- what a skipped step keeps: :func:`select_tree`, :func:`keep_unless_finite`,
  :func:`skip_nonfinite`, and :func:`overflow_rule` (the rule as a function of the
  loss-scale state alone, so a train step's skip branch need not trace the optimizer).

Example:
  >>> import jax.numpy as jnp, optax, jaxamp
  >>> from jaxamp import skip
  >>> opt = skip.skip_nonfinite(optax.chain(jaxamp.dynamic_loss_scale(), optax.adam(1e-3)))
  >>> state = opt.init(jnp.zeros(2))
  >>> _, state = opt.update(jnp.array([1.0, jnp.inf]), state)
  >>> float(optax.tree_utils.tree_get(state, 'LossScaleState').scale)
  16384.0
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core

from jaxamp.casting import at_least_float32, is_inexact_array

__all__ = [
    "GLOBAL_NORM",
    "GRADS_FINITE",
    "GRADS_UNSCALED",
    "KnownNorm",
    "LossScaleState",
    "ScaleRule",
    "SkipNonfiniteState",
    "Verdict",
    "all_finite",
    "keep_unless_finite",
    "loss_scale_states",
    "on_overflow",
    "overflow_rule",
    "select_tree",
    "skip_nonfinite",
    "skipped_for_params",
    "unscale",
    "unscaled_norm_and_finite",
    "zero_unless",
]


# --- the state --------------------------------------------------------------------------


class LossScaleState(NamedTuple):
  """State of a loss-scale transformation.

  Holds only what changes from step to step; the hyperparameters (growth and
  backoff factors, interval, floor, ceiling) live in the transformation, so they
  survive ``jax.tree.flatten``/``unflatten``, ``jax.jit`` and checkpointing.

  Attributes:
    scale: float32 scalar the loss is multiplied by (always float32, whatever
      the gradients' dtype).
    growth_count: int32 scalar, consecutive finite steps since the scale last
      changed or the last non-finite step.
    finite: bool scalar, whether the last step's unscaled gradients were all
      finite (``True`` after ``init``).
    overflow_steps: int32 scalar, total number of non-finite steps.
  """

  scale: jax.Array
  growth_count: jax.Array
  finite: jax.Array
  overflow_steps: jax.Array


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner_state: the wrapped optimizer's state.
  """

  inner_state: Any


def _is_loss_scale_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def loss_scale_states(opt_state: Any) -> list[LossScaleState]:
  """Every :class:`LossScaleState` in ``opt_state``, in tree order."""
  return [x for x in jax.tree.leaves(opt_state, is_leaf=_is_loss_scale_state)
          if _is_loss_scale_state(x)]


# --- the verdict protocol ---------------------------------------------------------------

# The optax extra arguments by which a caller that has already checked the gradients
# (make_train_step) tells the optimizer what it knows; read them with Verdict.read.
GRADS_FINITE = "jaxamp_grads_finite"  # a Python bool: the verdict (no check, no select)
GRADS_UNSCALED = "jaxamp_grads_unscaled"  # True: divided already, or never multiplied
GLOBAL_NORM = "jaxamp_global_norm"  # a KnownNorm: the gradients' global norm


@dataclasses.dataclass(frozen=True, eq=False)
class KnownNorm:
  """The float32 (or float64) global norm of the arrays ``leaves`` (a caller's offer to
  reuse it).

  Not a pytree: optax passes extra arguments through, never maps over them.
  """

  norm: jax.Array
  leaves: tuple[Any, ...]

  @classmethod
  def of(cls, tree: Any, norm: jax.Array) -> KnownNorm:
    return cls(norm, tuple(jax.tree.leaves(tree)))

  def norm_of(self, tree: Any) -> jax.Array | None:
    """The norm, if ``tree``'s leaves are the very arrays it was taken of; else None."""
    leaves = jax.tree.leaves(tree)
    if len(leaves) != len(self.leaves):
      return None
    if all(a is b for a, b in zip(leaves, self.leaves)):
      return self.norm
    return None


class Verdict(NamedTuple):
  """What a caller that has checked the gradients tells an optimizer about them, as
  optax extra arguments (:meth:`extra_args`; an update reads them with :meth:`read`).

  Attributes:
    finite: whether every gradient is finite, as a Python bool; None: not checked
      (the loss scale checks them itself).
    unscaled: the gradients are unscaled already (the loss scale must not divide).
    norm: their global norm, for :func:`jaxamp.clip_by_global_norm` to reuse.

  Example:
    >>> from jaxamp.skip import Verdict
    >>> args = Verdict(finite=False, unscaled=True).extra_args()
    >>> Verdict.read(args).finite, Verdict.read({}).finite
    (False, None)
  """

  finite: bool | None = None
  unscaled: bool = False
  norm: KnownNorm | None = None

  @classmethod
  def read(cls, extra_args: Mapping[str, Any]) -> Verdict:
    """The verdict an update's ``**extra_args`` carry (the defaults where they carry none)."""
    finite = extra_args.get(GRADS_FINITE)
    norm = extra_args.get(GLOBAL_NORM)
    return cls(finite=None if finite is None else bool(finite),
               unscaled=bool(extra_args.get(GRADS_UNSCALED)),
               norm=norm if isinstance(norm, KnownNorm) else None)

  def extra_args(self) -> dict[str, Any]:
    """The optax extra arguments that carry this verdict."""
    args: dict[str, Any] = {}
    if self.finite is not None:
      args[GRADS_FINITE] = self.finite
    if self.unscaled:
      args[GRADS_UNSCALED] = True
    if self.norm is not None:
      args[GLOBAL_NORM] = self.norm
    return args


# --- the finite check and the unscaled norm ---------------------------------------------


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every floating or complex array leaf of ``tree`` is finite.

  A complex element is finite when its real and imaginary parts both are. Integer,
  boolean and other leaves count as finite; an empty tree is finite.

  Args:
    tree: a pytree.

  Returns:
    A bool scalar ``jax.Array``.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> bool(jaxamp.all_finite({'a': jnp.ones(2), 'ids': jnp.arange(2)}))
    True
    >>> bool(jaxamp.all_finite([jnp.array([1.0, jnp.inf], jnp.float16)]))
    False
  """
  # lax, not jnp: one primitive per operation (jnp wraps each in its own jit), which
  # keeps the train step's trace short; the answer is the same.
  checks = [_reduce_all(_is_finite(x)) for x in jax.tree.leaves(tree) if is_inexact_array(x)]
  return functools.reduce(jax.lax.bitwise_and, checks) if checks else jnp.asarray(True)


def _is_finite(x: jax.Array) -> jax.Array:
  """Elementwise ``jnp.isfinite``: both parts of a complex element finite."""
  if x.dtype.kind == "c":  # a complex dtype (cheaper than jnp.issubdtype per leaf)
    return jax.lax.bitwise_and(jax.lax.is_finite(jax.lax.real(x)),
                               jax.lax.is_finite(jax.lax.imag(x)))
  return jax.lax.is_finite(x)


def _reduce_all(x: jax.Array) -> jax.Array:
  return jax.lax.reduce_and(x, tuple(range(x.ndim))) if x.ndim else x


def _sum_of_squares(x: jax.Array, dtype: np.dtype) -> jax.Array:
  """``sum(|x| ** 2)`` in ``dtype`` (a real dtype), in lax primitives (a complex element
  counts both parts, as ``optax.tree.norm`` does)."""
  if x.dtype.kind == "c":  # a complex dtype (cheaper than jnp.issubdtype per leaf)
    return jax.lax.add(_sum_of_squares(jax.lax.real(x), dtype),
                       _sum_of_squares(jax.lax.imag(x), dtype))
  if x.dtype != dtype:
    x = jax.lax.convert_element_type(x, dtype)
  square = jax.lax.square(x)
  return jax.lax.reduce_sum(square, tuple(range(x.ndim))) if x.ndim else square


def _unscale_leaf(g: Any, scale: jax.Array) -> Any:
  if not is_inexact_array(g):
    return g
  # In float32 (float64 stays float64, complex64 complex64): a scale above 65504 is inf
  # in float16. Divided by the real scale, a complex gradient keeps its dtype.
  wide = at_least_float32(g.dtype)
  real = jnp.finfo(wide).dtype if wide.kind == "c" else wide
  return (g.astype(wide) / scale.astype(real)).astype(g.dtype)


def unscale(grads: Any, scale: jax.Array) -> Any:
  """``grads`` divided by ``scale`` as a loss scale does it: in float32, cast back.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.skip import unscale
    >>> unscale({'w': jnp.array([8.0], jnp.float16)}, jnp.float32(4.0))['w']
    Array([2.], dtype=float16)
  """
  return jax.tree.map(lambda g: _unscale_leaf(g, scale), grads)


def unscaled_norm_and_finite(grads: Any, scale: jax.Array | None
                             ) -> tuple[Any, jax.Array, jax.Array]:
  """``unscale(grads, scale)``, its global norm (float32; float64 if any gradient is) and
  whether that norm is finite.

  One sum of squares gives both. The norm is finite exactly when every element is finite
  and the sum of squares stays within its dtype's range (float32: a norm below about
  1.8e19; float64 where a leaf is float64).
  Gradients past that are treated like an overflow: clipping by global norm would turn
  them into a zero update, and Adam's second moment would hold inf from then on.
  Gradients computed in float16 stay far below it. No exact per-element check is traced
  besides: it would double the number of reductions XLA compiles for a distinction that
  no update could use. ``scale=None``: the gradients were never scaled (no division is
  traced).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.skip import unscaled_norm_and_finite
    >>> _, norm, finite = unscaled_norm_and_finite({'w': jnp.array([3.0, 4.0])}, None)
    >>> float(norm), bool(finite)
    (5.0, True)
    >>> bool(unscaled_norm_and_finite({'w': jnp.array([1e20, 0.0])}, None)[2])
    False
  """
  unscaled = grads if scale is None else unscale(grads, scale)
  leaves = [x for x in jax.tree.leaves(unscaled) if is_inexact_array(x)]
  # float32, float64 where a leaf is float64 (the real dtype of a complex one).
  dtype = np.dtype(jnp.finfo(at_least_float32(*(x.dtype for x in leaves))).dtype)
  total = functools.reduce(jax.lax.add, (_sum_of_squares(x, dtype) for x in leaves),
                           np.zeros((), dtype))
  # The verdict is read off the norm, not the sum: the same answer (a sum of squares is
  # finite exactly when its root is), and the sum then has one consumer, so XLA fuses
  # every leaf's reduction into the one kernel that takes the root, where three
  # consumers left each reduction its own kernel ahead of the skip's branch.
  norm = jax.lax.sqrt(total)
  return unscaled, norm, jax.lax.is_finite(norm)


# --- what a skipped step keeps ----------------------------------------------------------


def zero_unless(finite: jax.Array, tree: Any) -> Any:
  """``tree`` where ``finite``, else zeros in every numeric array leaf.

  A select, not a multiply, so NaN and inf never leak into the result.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.skip import zero_unless
    >>> zero_unless(jnp.asarray(False), jnp.array([jnp.nan, 1.0]))
    Array([0., 0.], dtype=float32)
  """

  def leaf(x: Any) -> Any:
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.number):
      return jnp.where(finite, x, jnp.zeros_like(x))
    return x

  return jax.tree.map(leaf, tree)


def select_tree(pred: jax.Array, new: Any, old: Any) -> Any:
  """Leafwise ``new if pred else old`` for two trees of one structure; jit-able.

  Selecting (rather than blending arithmetically) keeps the chosen leaves
  bit-identical, NaN and inf in the other tree included.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.skip import select_tree
    >>> select_tree(jnp.asarray(False), {'a': jnp.nan}, {'a': 2.0})['a']
    Array(2., dtype=float32, weak_type=True)
  """
  return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


def keep_unless_finite(finite: jax.Array, new: Any, old: Any) -> Any:
  """``new`` optimizer state where ``finite``, else ``old``, except that every
  :class:`LossScaleState` is ``new``'s (a skipped step moves only the loss scale)."""

  def keep(n: Any, o: Any) -> Any:
    return n if _is_loss_scale_state(n) else select_tree(finite, n, o)

  return jax.tree.map(keep, new, old, is_leaf=_is_loss_scale_state)


def skipped_for_params(params_finite: jax.Array, new: Any, old: Any) -> Any:
  """``new`` optimizer state where ``params_finite``, else ``old`` with the step counted
  as skipped in its loss-scale state (the scale itself is kept: an update that would
  store a float16 parameter as inf did not come from the scale)."""

  def pick(n: Any, o: Any) -> Any:
    if _is_loss_scale_state(n):
      skipped = o._replace(growth_count=jnp.zeros_like(o.growth_count),
                           finite=jnp.asarray(False),
                           overflow_steps=o.overflow_steps + 1)
      return select_tree(params_finite, n, skipped)
    return select_tree(params_finite, n, o)

  return jax.tree.map(pick, new, old, is_leaf=_is_loss_scale_state)


# --- the loss-scale rule ----------------------------------------------------------------


class ScaleRule(NamedTuple):
  """A loss scale's hyperparameters (validated Python numbers) and its rule.

  ``growth_interval=None`` never grows (a fixed scale).
  """

  growth_factor: float
  backoff_factor: float
  growth_interval: int | None
  min_scale: float
  max_scale: float

  def adjust(self, state: LossScaleState, finite: bool | jax.Array) -> LossScaleState:
    """The state after a step whose gradients were (``finite``) or were not finite.

    ``finite`` a Python bool (the caller checked): the step traces only its branch.
    The next scale is clamped into ``[min_scale, max_scale]``, so a restored state from
    a run with another rule takes this one from its next step on.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxamp.skip import LossScaleState, ScaleRule
      >>> rule = ScaleRule(2.0, 0.5, 2, 1.0, 2.0**24)
      >>> state = LossScaleState(jnp.float32(8), jnp.int32(0), jnp.asarray(True), jnp.int32(0))
      >>> float(rule.adjust(state, False).scale), float(rule.adjust(state, True).scale)
      (4.0, 8.0)
    """
    known = bool(finite) if isinstance(finite, (bool, np.bool_)) else None
    scale = jnp.asarray(state.scale, jnp.float32)
    count = state.growth_count + 1
    if self.growth_interval is None:
      grow, grown = np.bool_(False), scale
    else:
      grow = count >= self.growth_interval
      grown = jnp.where(grow, jnp.minimum(scale * self.growth_factor, self.max_scale), scale)
    backed_off = lambda: jnp.maximum(scale * self.backoff_factor, self.min_scale)
    if known is None:
      new_scale = jnp.where(finite, grown, backed_off())
      growth_count = jnp.where(finite & ~grow, count, 0)
      overflow_steps = state.overflow_steps + jnp.where(finite, 0, 1)
      finite_leaf = finite
    elif known:
      new_scale = grown
      growth_count = count if self.growth_interval is None else jnp.where(grow, 0, count)
      overflow_steps = state.overflow_steps
      finite_leaf = jnp.asarray(True)
    else:
      new_scale, growth_count, overflow_steps = backed_off(), 0, state.overflow_steps + 1
      finite_leaf = jnp.asarray(False)
    return LossScaleState(
        scale=jnp.clip(new_scale, self.min_scale, self.max_scale).astype(jnp.float32),
        growth_count=jnp.asarray(growth_count, jnp.int32),
        finite=finite_leaf,
        overflow_steps=jnp.asarray(overflow_steps, jnp.int32))


def on_overflow(rule: Callable[[LossScaleState], LossScaleState], opt_state: Any) -> Any:
  """``opt_state`` after a skipped step, given :func:`overflow_rule`'s ``rule``: each
  loss-scale state moved by it, every other leaf as it was."""
  return jax.tree.map(lambda s: rule(s) if _is_loss_scale_state(s) else s,
                      opt_state, is_leaf=_is_loss_scale_state)


# --- skip_nonfinite ---------------------------------------------------------------------


def skip_nonfinite(optimizer: optax.GradientTransformation
                   ) -> optax.GradientTransformationExtraArgs:
  """Makes a non-finite step an exact no-op for ``optimizer``'s state.

  On a non-finite step the updates are zeros and every leaf of the inner state is
  bit-identical to before, except the :class:`LossScaleState`, which advances
  (the scale backs off, the counters move). A step is non-finite when a loss-scale
  element inside ``optimizer`` says so, or, if it has none, when any incoming
  gradient is inf or NaN. Chooses with ``jnp.where``, so it is jit-able.

  Args:
    optimizer: the transformation to wrap, usually
      ``optax.chain(dynamic_loss_scale(), ...)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`SkipNonfiniteState`.

  Example:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> opt = jaxamp.skip_nonfinite(optax.chain(jaxamp.dynamic_loss_scale(), optax.adam(1e-3)))
    >>> state = opt.init(jnp.zeros(2))
    >>> updates, state = opt.update(jnp.array([1.0, jnp.nan]), state)
    >>> updates, optax.tree_utils.tree_get(state, 'count'), jaxamp.get_loss_scale(state)
    (Array([0., 0.], dtype=float32), Array(0, dtype=int32), Array(16384., dtype=float32))
  """
  inner = optax.with_extra_args_support(optimizer)

  def init_fn(params: Any) -> SkipNonfiniteState:
    return SkipNonfiniteState(inner.init(params))

  def update_fn(updates: Any, state: SkipNonfiniteState, params: Any = None,
                **extra_args: Any) -> tuple[Any, SkipNonfiniteState]:
    new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
    if Verdict.read(extra_args).finite is True:  # checked by the caller: nothing to skip
      return new_updates, SkipNonfiniteState(new_inner)
    scales = loss_scale_states(new_inner)
    if scales:
      finite = functools.reduce(jnp.logical_and, [s.finite for s in scales])
    else:
      finite = all_finite(updates)
    inner_state = keep_unless_finite(finite, new_inner, state.inner_state)
    return zero_unless(finite, new_updates), SkipNonfiniteState(inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --- the rule of a skipped step, as a function of the loss-scale state ------------------


def _on_plain_path(opt_state: Any) -> int:
  """How many loss-scale states ``opt_state`` holds on a path of plain containers:
  chains (tuples, lists), ``named_chain`` (dicts) and :func:`skip_nonfinite`."""
  if _is_loss_scale_state(opt_state):
    return 1
  if isinstance(opt_state, SkipNonfiniteState):
    return _on_plain_path(opt_state.inner_state)
  if isinstance(opt_state, dict):
    return sum(_on_plain_path(v) for v in opt_state.values())
  if type(opt_state) in (tuple, list):
    return sum(_on_plain_path(v) for v in opt_state)
  return 0


def overflow_rule(optimizer: optax.GradientTransformation, params: Any
                  ) -> Callable[[LossScaleState], LossScaleState] | None:
  """What ``optimizer``'s loss scale does to its state on a non-finite step, as a
  function of the state alone, or None if that cannot be known without running the
  whole update.

  Known when ``optimizer`` holds exactly one loss-scale state, reached through chains,
  ``named_chain`` and :func:`skip_nonfinite` only (wrappers such as
  ``inject_hyperparams`` keep state of their own that a skipped update also moves), and
  the new loss-scale state of an update told ``Verdict(finite=False)`` is computed from
  the old one alone. The rule is read off that update's jaxpr (traced once, abstractly):
  the equations the new loss-scale state needs, nothing else, so a train step's skip
  branch runs the loss scale's own operations without tracing the rest of the update.

  Example:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> from jaxamp.skip import overflow_rule
    >>> tx = optax.chain(jaxamp.dynamic_loss_scale(initial_scale=64.0), optax.adam(1e-3))
    >>> rule = overflow_rule(tx, {'w': jnp.ones(3)})
    >>> state = tx.init({'w': jnp.ones(3)})[0]  # the chain's first element's state
    >>> float(rule(state).scale), int(rule(state).overflow_steps)
    (32.0, 1)
  """
  shapes = jax.eval_shape(optimizer.init, params)
  if len(loss_scale_states(shapes)) != 1 or _on_plain_path(shapes) != 1:
    return None
  tx = optax.with_extra_args_support(optimizer)
  flags = Verdict(finite=False, unscaled=True).extra_args()

  def skipped(ls_state: LossScaleState, opt_state: Any, params: Any, value: Any) -> Any:
    opt_state = on_overflow(lambda _: ls_state, opt_state)
    _, new = tx.update(params, opt_state, params, value=value, **flags)
    return loss_scale_states(new)[0]

  value = jax.ShapeDtypeStruct((), jnp.float32)  # the loss, optax's ``value``
  closed = jax.make_jaxpr(skipped)(loss_scale_states(shapes)[0], shapes, params, value)
  return _slice(closed, len(LossScaleState._fields))


def _slice(closed: Any, n_inputs: int) -> Callable[[LossScaleState], LossScaleState] | None:
  """``closed``'s outputs as a function of its first ``n_inputs`` inputs, running only
  the equations they need; None if they need another input or an effect."""
  jaxpr = closed.jaxpr
  needed = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if not any(v in needed for v in eqn.outvars):
      continue
    if eqn.effects:
      return None
    kept.append(eqn)
    needed.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
  inputs = jaxpr.invars[:n_inputs]
  if needed & set(jaxpr.invars[n_inputs:]):
    return None
  kept.reverse()
  run = jex_core.jaxpr_as_fun(closed.replace(jaxpr=jaxpr.replace(invars=inputs, eqns=kept)))

  def rule(state: LossScaleState) -> LossScaleState:
    return LossScaleState(*run(*jax.tree.leaves(state)))

  return rule
