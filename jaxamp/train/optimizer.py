"""The optimizer a train step runs: the user's, with a loss scale and the exact skip.

A loss-scale element the user put in the chain is used where it is (and refused where
it cannot work: after clipping, inside ``masked``...); without one, the policy's (or the
opt level's) is put first. The whole chain is wrapped in ``skip_nonfinite``; with ``MemoryConfig.opt_state_dtype`` the
user's optimizer is wrapped in :func:`jaxamp.opt_state_dtype` first.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp import loss_scale as _ls
from jaxamp import rounding as rounding_lib
from jaxamp.train.plan import Options
from jaxamp.train.update import float16_leaves

__all__ = ["Built", "build"]


class Built(NamedTuple):
  """The optimizer and what the step needs to know of its loss scale."""

  optimizer: optax.GradientTransformation
  unit_scale: bool  # a scale fixed at 1: the step multiplies and divides by nothing
  overflow: Callable[[Any], Any] | None  # the loss scale's rule for a skipped step


def build(options: Options, params: Any) -> Built:
  """The step's optimizer for ``params``; warns or refuses combinations that cannot
  train correctly (``stacklevel`` points at the caller of ``TrainStep.init``)."""
  shapes = jax.eval_shape(options.optimizer.init, params)
  # After clipping (torch's "clip before unscale" pitfall), inside masked/MultiSteps...:
  # refused, with what to write instead.
  _ls.check_loss_scale_placement(shapes)
  tx = options.optimizer
  memory = options.memory
  if memory.opt_state_dtype is not None:
    # Inside the loss scale and the skip: a skipped step keeps the stored moments and
    # the rounding key; the loss scale's state is not narrowed.
    tx = rounding_lib.opt_state_dtype(
        tx, memory.opt_state_dtype, seed=options.seed + 1,
        rounding="stochastic" if memory.rounding == "stochastic" else "nearest")
  unit_scale = False
  if not optax.tree_utils.tree_get_all_with_path(shapes, "LossScaleState"):
    scale = (options.level.make_loss_scale() if options.level is not None
             else _ls.loss_scale_for(options.policy))
    # A scale fixed at 1 (bfloat16, float32) needs no multiply and no divide (a restored
    # state's other scale is reset to 1 on entry: jaxamp.train.resume).
    unit_scale = _ls.is_no_loss_scale(scale)
    tx = optax.chain(scale, tx)
  if (unit_scale and options.sharding.mesh is not None
      and options.sharding.grad_reduce_dtype == np.dtype(jnp.float16)):
    warnings.warn(
        "jaxamp: grad_reduce_dtype=float16 with no loss scale (policy "
        f"{options.policy.name!r}): gradients below float16's smallest value (6e-8) are "
        "averaged as 0 and ones past 65504 as inf. Use bfloat16 (float32's range), or "
        "a policy that scales the loss.", RuntimeWarning, stacklevel=4)
  # skip_nonfinite=False (apply every update, as optax and the peers do without a loss
  # scaler) only where float16 does not need skips: an overflowing float16 step, or a
  # float16 param pushed past 65504, must not be applied.
  if not options.skip_nonfinite and (not unit_scale or float16_leaves(params)):
    why = ("a parameter is stored in float16 (an update past 65504 would store inf)"
           if unit_scale else
           "the optimizer has a loss scale (an overflowing step's update would be applied)")
    raise ValueError(f"skip_nonfinite=False cannot be honoured: {why}. Drop it, or "
                     "train in bfloat16/float32 without a loss-scale element in the chain.")
  tx = _ls.skip_nonfinite(tx)
  # A skipped step moves only the loss scale; when that is all the optimizer's rule can
  # do, the step traces the rule rather than a second, dead copy of the whole update.
  overflow = _ls.overflow_rule(tx, params) if options.skip_nonfinite else None
  return Built(tx, unit_scale, overflow)
