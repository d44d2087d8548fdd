"""A state from a run under another policy, fitted to the step's precision state.

A checkpoint carries the loss-scale state and the scaled formats' state (FP8) of the
policy it was trained under, and the state structure is the same across ``float32``,
``mixed_bfloat16`` and ``mixed_float16`` (a policy with a scaled format fills its
``scaled`` field). Resumed as it is, a
``mixed_bfloat16`` run's scale of 1 would serve a ``mixed_float16`` step whose float16
gradients then underflow, and the dynamic scale takes 2,000 steps to double. So a state
the step did not return (a restored checkpoint, another step's state) gets, with a
warning saying what changed:

- the step's fresh loss-scale state where its scale cannot be one the step's loss scale
  uses: 1 (no scaling) in a step that scales the loss (float16), or anything but 1 in a
  step that does not; ``overflow_steps`` (``skipped_steps``) is kept;
- the step's fresh scaled-format state where the state has none, and none where the
  step's policy keeps none; where both have one, a module's fresh state where the state
  lacks it (a checkpoint from before stacked NNX layers kept theirs), and none for a
  module the step keeps none for.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxamp.loss_scale import LossScaleState
from jaxamp.train.plan import Plan
from jaxamp.train.state import TrainState

__all__ = ["Fresh", "fresh_of", "fitted", "remember"]

# Scale arrays known to fit a step that does (False) or does not (True) scale the loss:
# init's, the steps' results, and those read once. Keyed by id, each entry held weakly
# (arrays are not hashable), so a state a step returned, or one seen before, is never
# read again: no host sync on the step's path.
_FITTING = {True: weakref.WeakValueDictionary(), False: weakref.WeakValueDictionary()}


def _known(scale: Any, unit_scale: bool) -> bool:
  return _FITTING[unit_scale].get(id(scale)) is scale


def remember(state: Any, unit_scale: bool) -> None:
  """Notes that ``state``'s loss scale fits a step of that kind (``state`` a step
  returned, or ``init`` made)."""
  restored = _loss_scale(getattr(state, "opt_state", None))
  if restored is not None and _readable(restored.scale):
    _FITTING[unit_scale][id(restored.scale)] = restored.scale


class Fresh(NamedTuple):
  """Host copies of the precision state ``init`` made, and where it lives."""

  loss_scale: LossScaleState | None  # numpy leaves; None: not exactly one in the state
  loss_scale_shardings: Any
  scaled: Any  # numpy leaves, or None without scaled-format state
  scaled_shardings: Any
  unit_scale: bool  # the step does not scale the loss (plan.unit_scale)
  policy: str


def _is_scale(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def _loss_scale(opt_state: Any) -> LossScaleState | None:
  """The one :class:`LossScaleState` in ``opt_state``, or None (none, or several)."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_scale) if _is_scale(x)]
  return found[0] if len(found) == 1 else None


def _concrete(tree: Any) -> bool:
  return all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
             for x in jax.tree.leaves(tree))


def _value(x: Any) -> np.ndarray:
  """``x`` on the host; across processes, this process's copy of a replicated array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)
  return np.asarray(x)


def _readable(x: Any) -> bool:
  """Whether ``x`` has a value to read: an array, not a tracer or a shape."""
  return isinstance(x, (np.ndarray, np.generic)) or (
      isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


def _host(tree: Any) -> tuple[Any, Any]:
  return jax.tree.map(_value, tree), jax.tree.map(lambda x: x.sharding, tree)


def fresh_of(plan: Plan, state: TrainState) -> Fresh | None:
  """What :func:`fitted` needs of ``init``'s ``state`` (placed); None where it is not
  concrete (``jax.eval_shape(train.init, ...)``)."""
  scale = _loss_scale(state.opt_state)
  if not _concrete((scale, state.scaled)) or not all(
      x.is_fully_addressable or x.sharding.is_fully_replicated
      for x in jax.tree.leaves((scale, state.scaled))):
    return None
  scale_host, scale_shardings = _host(scale) if scale is not None else (None, None)
  scaled_host, scaled_shardings = (_host(state.scaled) if state.scaled is not None
                                   else (None, None))
  return Fresh(scale_host, scale_shardings, scaled_host, scaled_shardings,
               plan.unit_scale, plan.options.policy.name)


def _placed(host: Any, shardings: Any) -> Any:
  return jax.tree.map(jax.device_put, host, shardings)


def _scaled_fitted(fresh: Fresh, scaled: Any, stacklevel: int) -> Any:
  if (scaled is None) == (fresh.scaled is None):
    return _modules_fitted(fresh, scaled, stacklevel + 1)
  if scaled is None:
    warnings.warn(
        f"jaxamp: this state has no scaled-format state (it was made under a policy "
        f"without FP8 matmuls or another scaled format), but this step's policy "
        f"{fresh.policy!r} keeps state for its scaled matmuls (FP8 delayed scaling: amax "
        "histories and scales): it starts fresh, as in a new run.", RuntimeWarning,
        stacklevel=stacklevel)
    return _placed(fresh.scaled, fresh.scaled_shardings)
  warnings.warn(
      f"jaxamp: this state holds scaled-format state (FP8 amax histories and scales, made "
      f"under an FP8 policy, or another scaled format's), which this step's policy "
      f"{fresh.policy!r} does not use: it is dropped.", RuntimeWarning,
      stacklevel=stacklevel)
  return None


def _modules_fitted(fresh: Fresh, scaled: Any, stacklevel: int) -> Any:
  """``scaled`` keyed by the modules the step keeps state for: a module it lacks (a
  checkpoint from before stacked NNX layers kept theirs) starts fresh, one the step does
  not keep is dropped, with a warning naming them."""
  if not isinstance(scaled, dict) or not isinstance(fresh.scaled, dict) or (
      scaled.keys() == fresh.scaled.keys()):
    return scaled
  new = sorted(fresh.scaled.keys() - scaled.keys())
  gone = sorted(scaled.keys() - fresh.scaled.keys())
  warnings.warn(
      f"jaxamp: this state's scaled-format state (FP8 amax histories and scales) is not "
      f"kept for the modules this step's policy {fresh.policy!r} runs: "
      f"{'fresh state for ' + ', '.join(new) if new else ''}"
      f"{'; ' if new and gone else ''}{'dropped: ' + ', '.join(gone) if gone else ''} "
      "(a checkpoint saved before stacked NNX layers under nnx.scan kept FP8 state lacks "
      "theirs).", RuntimeWarning, stacklevel=stacklevel)
  placed = _placed(fresh.scaled, fresh.scaled_shardings)
  return {k: scaled[k] if k in scaled else placed[k] for k in fresh.scaled}


def _scale_fitted(fresh: Fresh, opt_state: Any, stacklevel: int) -> Any:
  restored = _loss_scale(opt_state)
  if fresh.loss_scale is None or restored is None or not _readable(restored.scale):
    return opt_state
  if _known(restored.scale, fresh.unit_scale):
    return opt_state  # init's, a step's result or read before: nothing to read
  scale, want = float(_value(restored.scale)), float(fresh.loss_scale.scale)
  if fresh.unit_scale:
    if scale == 1.0:
      _FITTING[True][id(restored.scale)] = restored.scale
      return opt_state
    why = (f"jaxamp: this state's loss scale is {scale:g} (a float16 run's), but this "
           f"step's policy {fresh.policy!r} does not scale the loss: its loss-scale state "
           "starts fresh at 1 (skipped_steps kept).")
  else:
    if scale != 1.0 or want == 1.0:
      _FITTING[False][id(restored.scale)] = restored.scale
      return opt_state
    why = (f"jaxamp: this state's loss scale is 1, as a run without loss scaling "
           f"(bfloat16, float32 or FP8 policies) leaves it, but this step's policy "
           f"{fresh.policy!r} scales the loss: at 1 small float16 gradients flush to zero, "
           f"and a dynamic scale grows only every growth_interval steps (2,000 by default). The loss-scale state starts "
           f"fresh at {want:g} (skipped_steps kept), as in a new run; a float16 run whose "
           "scale had backed off to 1 starts there again too, and backs off as it needs.")
  warnings.warn(why, RuntimeWarning, stacklevel=stacklevel)
  new = _placed(fresh.loss_scale, fresh.loss_scale_shardings)
  new = new._replace(overflow_steps=restored.overflow_steps)
  return jax.tree.map(lambda x: new if _is_scale(x) else x, opt_state, is_leaf=_is_scale)


def fitted(fresh: Fresh | None, state: Any, stacklevel: int = 4) -> Any:
  """``state`` with the loss-scale and scaled state the step's policy needs (see the module
  docstring), warning for each change; ``state`` itself where nothing changes.

  Args:
    fresh: :func:`fresh_of` the step's first state (None: fit nothing).
    state: a state the step did not return (a scale :func:`remember` noted is not
      read again).
    stacklevel: of the warnings, counted from here.
  """
  if fresh is None or not isinstance(state, TrainState):
    return state
  scaled = _scaled_fitted(fresh, state.scaled, stacklevel + 1)
  opt_state = _scale_fitted(fresh, state.opt_state, stacklevel + 1)
  if scaled is state.scaled and opt_state is state.opt_state:
    return state
  return state._replace(scaled=scaled, opt_state=opt_state)
