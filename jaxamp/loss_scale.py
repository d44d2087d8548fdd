"""Loss scaling as optax gradient transformations.

float16 has a narrow exponent range: small gradients flush to zero. Loss scaling
multiplies the loss by a scale before differentiation and divides the gradients
by it afterwards. A loss-scale transformation is the *first* element of an
``optax.chain``: it receives the scaled gradients, unscales them, and every later
element (clipping, Adam, weight decay) sees true gradients. On a step where any
gradient is inf or NaN it emits zeros and backs the scale off, as torch's
``GradScaler`` does. bfloat16 has float32's exponent range and needs no scaling
(:func:`loss_scale_for` picks for a policy).

The scale lives in the optimizer state (:class:`LossScaleState`), so the loss is
scaled with :func:`scale_loss` from that state. Zero updates still advance the
later elements' state (Adam's moments decay, its count grows); wrap the chain in
:func:`skip_nonfinite` where an overflow step must leave it exactly as it was.

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxamp
  >>> opt = optax.chain(jaxamp.dynamic_loss_scale(), optax.clip_by_global_norm(1.0),
  ...                   optax.adamw(3e-4))
  >>> params = {'w': jnp.ones(3, jnp.float16)}
  >>> state = opt.init(params)
  >>> def loss(p):
  ...   return jnp.mean(p['w'] ** 2)
  >>> @jax.jit
  ... def step(params, state):
  ...   grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p), state))(params)
  ...   updates, state = opt.update(grads, state, params)
  ...   return optax.apply_updates(params, updates), state
  >>> params, state = step(params, state)
  >>> jaxamp.get_loss_scale(state)
  Array(32768., dtype=float32)
  >>> params['w'].dtype, bool(params['w'][0] < 1)
  (dtype('float16'), True)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp import dtypes
from jaxamp.casting import at_least_float32
from jaxamp.policy import PolicyLike, get_policy
# The exact skip (the verdict, the state, its rule, skip_nonfinite) is jaxamp.skip's;
# its public names are re-exported here, where they have always been.
from jaxamp.skip import (
    LossScaleState,
    ScaleRule,
    SkipNonfiniteState,
    Verdict,
    all_finite,
    loss_scale_states,
    overflow_rule,
    skip_nonfinite,
    unscale,
    unscaled_norm_and_finite,
    zero_unless,
)

__all__ = [
    "LossScaleState",
    "SkipNonfiniteState",
    "all_finite",
    "check_loss_scale_placement",
    "dynamic_loss_scale",
    "get_loss_scale",
    "loss_scale_for",
    "no_loss_scale",
    "scale_loss",
    "skip_nonfinite",
    "static_loss_scale",
]


_FLOAT32_MAX = dtypes.FORMATS["float32"].max
_INT32_MAX = int(np.iinfo(np.int32).max)


def _hyperparameter(name: str, value: Any) -> float:
  """``value`` as a finite Python float, or a ValueError naming it."""
  try:
    number = float(value)
  except jax.errors.ConcretizationTypeError:
    raise TypeError(
        f"{name} must be a concrete number, got the traced value {value!r}. Loss-scale "
        "hyperparameters are fixed when the transformation is built; pass them to "
        "optax.inject_hyperparams as static_args, or wrap a chain factory instead.") from None
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}.") from None
  if not math.isfinite(number):
    raise ValueError(f"{name} must be finite, got {value!r}.")
  return number


def _check_scale(name: str, value: Any) -> float:
  """``value`` as a Python float that stays positive and finite in float32."""
  number = _hyperparameter(name, value)
  # The scale lives in a float32 state: 1e-50 would round to 0 there, 1e39 to inf.
  if not (0 < number <= _FLOAT32_MAX and np.float32(number) > 0):
    raise ValueError(f"{name} must be > 0 and float32 must hold it (about 1.4e-45 to "
                     f"{_FLOAT32_MAX:.4g}, the float32 maximum), got {value!r}.")
  return number


def _loss_scale(initial_scale: float, growth_factor: float, backoff_factor: float,
                growth_interval: int | None, min_scale: float,
                max_scale: float) -> optax.GradientTransformation:
  """The shared rule; arguments are already validated Python numbers.

  ``growth_interval=None`` never grows. Gradients are divided by the scale in the
  *state*, the one :func:`scale_loss` multiplied by (unless the caller passes the
  :class:`~jaxamp.skip.Verdict` ``unscaled``: it divided already, or never multiplied), even
  a scale this transformation would not have chosen (a state restored from a run with another loss
  scale): scaling and unscaling can never disagree. The next scale is then clamped into
  ``[min_scale, max_scale]``, so such a state takes this transformation's rule from its
  next step on (a fixed scale returns to its value).
  """

  rule = ScaleRule(growth_factor, backoff_factor, growth_interval, min_scale, max_scale)

  def init_fn(params: Any) -> LossScaleState:
    del params
    return LossScaleState(scale=jnp.asarray(initial_scale, jnp.float32),
                          growth_count=jnp.zeros([], jnp.int32),
                          finite=jnp.asarray(True),
                          overflow_steps=jnp.zeros([], jnp.int32))

  def update_fn(updates: Any, state: LossScaleState, params: Any = None,
                **extra_args: Any) -> tuple[Any, LossScaleState]:
    del params
    verdict = Verdict.read(extra_args)
    if not verdict.unscaled:
      updates = unscale(updates, jnp.asarray(state.scale, jnp.float32))
    if verdict.finite is None:
      # Checked after unscaling: a scale below 1 can overflow a finite float16 gradient.
      finite = all_finite(updates)
      updates = zero_unless(finite, updates)
    else:  # the caller checked these very gradients (make_train_step does)
      finite = verdict.finite
      if not finite:
        updates = zero_unless(jnp.asarray(False), updates)
    return updates, rule.adjust(state, finite)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dynamic_loss_scale(initial_scale: float = 2.0**15,
                       growth_factor: float = 2.0,
                       backoff_factor: float = 0.5,
                       growth_interval: int = 2000,
                       min_scale: float = 1.0,
                       max_scale: float = 2.0**24) -> optax.GradientTransformation:
  """Dynamic loss scaling (torch ``GradScaler``'s rule), as an optax transformation.

  Put it first in an ``optax.chain`` and compute gradients of
  ``scale_loss(loss, opt_state)``. Each update divides the gradients by the scale
  (in float32, cast back to each leaf's dtype; complex leaves are divided too, other
  non-floating leaves pass through).
  If any element is inf or NaN every numeric update leaf is zeros, the scale becomes ``max(scale * backoff_factor, min_scale)``
  and ``growth_count`` resets; otherwise ``growth_count`` grows, and on reaching
  ``growth_interval`` the scale becomes ``min(scale * growth_factor, max_scale)``
  and the count resets.

  Defaults are Keras' (initial 2^15; torch uses 2^16), with jmp's floor of 1 and
  Apex's ceiling of 2^24 (neither torch nor Keras bounds the scale).

  Args:
    initial_scale: the first scale.
    growth_factor: multiplier after ``growth_interval`` finite steps, >= 1.
    backoff_factor: multiplier after a non-finite step, in (0, 1).
    growth_interval: consecutive finite steps before growing, an integer >= 1.
    min_scale: floor of the scale, > 0.
    max_scale: ceiling of the scale; ``min_scale <= initial_scale <= max_scale``.

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`LossScaleState`.

  Raises:
    ValueError: a hyperparameter is out of range; the message names it.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> ls = jaxamp.dynamic_loss_scale(initial_scale=400.0)
    >>> state = ls.init(None)
    >>> updates, state = ls.update({'w': jnp.array([800.0, jnp.inf])}, state)
    >>> updates['w'], state.scale, state.overflow_steps
    (Array([0., 0.], dtype=float32), Array(200., dtype=float32), Array(1, dtype=int32))
  """
  initial = _check_scale("initial_scale", initial_scale)
  growth = _hyperparameter("growth_factor", growth_factor)
  backoff = _hyperparameter("backoff_factor", backoff_factor)
  interval = _hyperparameter("growth_interval", growth_interval)
  low = _check_scale("min_scale", min_scale)
  high = _check_scale("max_scale", max_scale)
  if growth < 1:
    raise ValueError(f"growth_factor must be >= 1, got {growth_factor!r}.")
  if not 0 < backoff < 1:
    raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}.")
  if interval < 1 or interval != int(interval):
    raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval!r}.")
  if interval > _INT32_MAX:
    raise ValueError(f"growth_interval must be <= {_INT32_MAX}, got {growth_interval!r}.")
  if not low <= initial <= high:
    raise ValueError(
        "Need min_scale <= initial_scale <= max_scale, got "
        f"min_scale={min_scale!r}, initial_scale={initial_scale!r}, max_scale={max_scale!r}.")
  return _loss_scale(initial, growth, backoff, int(interval), low, high)


def static_loss_scale(scale: float) -> optax.GradientTransformation:
  """A fixed loss scale: unscales, zeroes non-finite steps and counts them.

  Like :func:`dynamic_loss_scale` with the scale never changing; ``growth_count``
  counts consecutive finite steps since the last non-finite one.

  Args:
    scale: the scale, a finite number > 0.

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`LossScaleState`.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> ls = jaxamp.static_loss_scale(128.0)
    >>> updates, state = ls.update(jnp.array([256.0]), ls.init(None))
    >>> updates, state.scale
    (Array([2.], dtype=float32), Array(128., dtype=float32))
  """
  value = _check_scale("scale", scale)
  return _loss_scale(value, 1.0, 1.0, None, value, value)


def no_loss_scale() -> optax.GradientTransformation:
  """No scaling (scale 1), but non-finite steps are still zeroed and counted.

  For bfloat16 and float32, whose exponent range needs no scaling. Keeping the
  same state as the other loss scales means a train step, :func:`get_loss_scale`
  and :func:`skip_nonfinite` treat every policy alike, and an inf or NaN
  gradient never reaches the optimizer, whatever the policy.

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`LossScaleState`
    with ``scale`` fixed at 1.0.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> tx = jaxamp.no_loss_scale()
    >>> updates, state = tx.update({'w': jnp.array([jnp.nan, 1.0])}, tx.init(None))
    >>> updates['w'].tolist(), int(state.overflow_steps), float(state.scale)
    ([0.0, 0.0], 1, 1.0)
  """
  tx = _loss_scale(1.0, 1.0, 1.0, None, 1.0, 1.0)
  tx.update.jaxamp_no_loss_scale = True  # see is_no_loss_scale
  return tx


def is_no_loss_scale(tx: Any) -> bool:
  """Whether ``tx`` is a :func:`no_loss_scale` transformation (scale fixed at 1)."""
  return getattr(getattr(tx, "update", None), "jaxamp_no_loss_scale", False)


# Wrappers that hand their inner transformation every step's whole gradient tree and keep
# its state as it returns it: a loss scale may sit inside them (first in their chain).
_PASS_THROUGH = {"SkipNonfiniteState": "inner_state",
                 "InjectHyperparamsState": "inner_state",
                 "InjectStatefulHyperparamsState": "inner_state"}

_PUT_IT_FIRST = ("Put the loss scale first, outside any wrapper: optax.chain("
                 "jaxamp.dynamic_loss_scale(), optax.clip_by_global_norm(1.0), optax.adamw(3e-4))")

# Why a loss scale must not sit inside these (by state class name).
_WRAPPER_PROBLEMS = {
    "MultiStepsState": (
        "optax.MultiSteps hands it accumulated gradients, keeps its state only every k-th "
        "step (so it reports a stale overflow in between) and turns one overflow into NaN "
        "for every later window. Put the loss scale outside: jaxamp.skip_nonfinite("
        "optax.chain(jaxamp.dynamic_loss_scale(), optax.MultiSteps(opt, k))), or use "
        "make_train_step(..., grad_accum_steps=k)"),
    "ApplyIfFiniteState": (
        "optax.apply_if_finite drops an overflowing step before the loss scale sees it, so "
        "the scale never backs off. Use jaxamp.skip_nonfinite(optax.chain("
        "jaxamp.dynamic_loss_scale(), ...)) instead"),
    "MaskedState": (
        "optax.masked hands it only part of the gradients; the rest stays multiplied by the "
        "scale. " + _PUT_IT_FIRST),
}
for _name in ("MultiTransformState", "PartitionState"):
  _WRAPPER_PROBLEMS[_name] = (
      "optax.multi_transform (optax.partition) hands it only part of the gradients; the "
      "rest stays multiplied by the scale. " + _PUT_IT_FIRST)


def _placement_problem(opt_state: Any, path: tuple[Any, ...]) -> str | None:
  """Why the loss scale at ``path`` of ``opt_state`` does not see raw gradients first."""
  node = opt_state
  for key in path:
    name = type(node).__name__
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # a NamedTuple state
      field = getattr(key, "name", None)
      if _PASS_THROUGH.get(name) == field:
        node = getattr(node, field)
        continue
      return _WRAPPER_PROBLEMS.get(name, (
          f"jaxamp cannot tell whether the transformation whose state is {name} hands it "
          f"every step's whole, untouched gradients. {_PUT_IT_FIRST}"))
    if isinstance(node, (tuple, list)):  # optax.chain: the first element only
      if getattr(key, "idx", None) != 0:
        return ("an earlier element of the chain would see (and clip, or decay with) "
                f"gradients still multiplied by the scale. {_PUT_IT_FIRST}")
      node = node[0]
      continue
    if isinstance(node, dict):  # optax.named_chain: the first name, in chain order
      first = next(iter(node))
      if getattr(key, "key", None) != first:
        return (f"optax.named_chain applies {first!r} before it, which would see gradients "
                f"still multiplied by the scale. {_PUT_IT_FIRST}")
      node = node[first]
      continue
    return (f"jaxamp cannot tell what the {name} around it does to the gradients. "
            f"{_PUT_IT_FIRST}")
  return None


def check_loss_scale_placement(opt_state: Any) -> None:
  """Raises a ValueError unless every loss scale in ``opt_state`` sees raw gradients first.

  A loss scale must be the first element of the optimizer, applied to every step's whole
  gradient tree: inside ``optax.chain`` / ``optax.named_chain`` (first),
  :func:`skip_nonfinite` and ``optax.inject_hyperparams``. After another element (which
  would clip or decay scaled gradients), inside ``optax.masked`` /
  ``optax.multi_transform`` (part of the tree left scaled), ``optax.MultiSteps`` or
  ``optax.apply_if_finite`` it trains wrongly; the error says what to write instead.
  :func:`scale_loss` and :func:`jaxamp.make_train_step` call it.

  Args:
    opt_state: an optimizer state, or its ``jax.eval_shape`` skeleton.

  Example:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> bad = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.dynamic_loss_scale())
    >>> jaxamp.check_loss_scale_placement(bad.init(jnp.ones(2)))
    Traceback (most recent call last):
    ...
    ValueError: The loss scale at [1] of the optimizer state is misplaced: an earlier element ...
  """
  is_state = lambda x: isinstance(x, LossScaleState)
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_state)[0]:
    if not is_state(leaf):
      continue
    problem = _placement_problem(opt_state, path)
    if problem is not None:
      raise ValueError(f"The loss scale at {jax.tree_util.keystr(path)} of the optimizer "
                       f"state is misplaced: {problem}.")


def get_loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale in ``opt_state``: a float32 scalar, 1.0 if it has none.

  Looks through any nesting (``optax.chain``, ``inject_hyperparams``,
  :func:`skip_nonfinite`, ``MultiSteps``).

  Args:
    opt_state: an optimizer state (any pytree).

  Returns:
    The scale as a float32 scalar ``jax.Array``.

  Raises:
    ValueError: ``opt_state`` holds more than one :class:`LossScaleState`.

  Example:
    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = optax.chain(jaxamp.dynamic_loss_scale(), optax.sgd(0.1))
    >>> float(jaxamp.get_loss_scale(tx.init({'w': jnp.ones(2)})))
    32768.0
    >>> float(jaxamp.get_loss_scale(optax.sgd(0.1).init({'w': jnp.ones(2)})))
    1.0
  """
  states = loss_scale_states(opt_state)
  if not states:
    return jnp.ones([], jnp.float32)
  if len(states) > 1:
    raise ValueError(f"The optimizer state holds {len(states)} LossScaleStates; a chain "
                     "should have exactly one loss-scale transformation, first.")
  return jnp.asarray(states[0].scale, jnp.float32)


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
  """``loss`` in float32 (float64 stays float64) times the current loss scale of ``opt_state``.

  Differentiate this, not ``loss``: the backward pass then runs on scaled values,
  which the loss-scale transformation divides out again.

  Raises:
    ValueError: the loss scale in ``opt_state`` does not see the raw gradients first
      (see :func:`check_loss_scale_placement`); the message says what to write instead.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> state = jaxamp.static_loss_scale(8.0).init(None)
    >>> jaxamp.scale_loss(jnp.float16(1.5), state)
    Array(12., dtype=float32)
  """
  check_loss_scale_placement(opt_state)
  loss = jnp.asarray(loss)
  return loss.astype(at_least_float32(loss.dtype)) * get_loss_scale(opt_state)


def loss_scale_for(policy: PolicyLike) -> optax.GradientTransformation:
  """The loss scale a policy needs: dynamic for float16 compute, none otherwise.

  Args:
    policy: anything :func:`jaxamp.get_policy` accepts.

  Returns:
    ``dynamic_loss_scale()`` if the compute dtype is float16, else ``no_loss_scale()``.

  Example:
    >>> import jaxamp
    >>> [float(jaxamp.loss_scale_for(p).init(None).scale)
    ...  for p in ('mixed_float16', 'mixed_bfloat16')]
    [32768.0, 1.0]
  """
  if get_policy(policy).compute_dtype == np.dtype(jnp.float16):
    return dynamic_loss_scale()
  return no_loss_scale()

