"""The contract of a user's ``loss_fn``/``eval_fn``: how it is called, what it returns.

``loss_fn(model, batch)`` returns a scalar floating loss, or ``(loss, aux)`` with
``has_aux=True``. The checks here turn a broken contract into an error that names the
fix, at ``make_train_step`` (the signature) or on the first trace (the result).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp.casting import at_least_float32

F32 = np.dtype(jnp.float32)

LOSS_FN_HINT = ("jaxamp calls loss_fn(model, batch): model is the model running under its "
                "policy (call it: model(batch['x'])), batch is what was passed to "
                "train.step. Check the order of loss_fn's arguments, and that it does not "
                "expect parameters in place of the model.")


def check_signature(fn: Callable[..., Any], what: str) -> None:
  """Refuses a ``what`` (loss_fn, eval_fn) that cannot be called as ``fn(model, batch)``."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return  # no signature to read (a builtin, say): the call itself will tell
  try:
    signature.bind(None, None)
  except TypeError as e:
    raise TypeError(f"{what} must take (model, batch), but {what}{signature} cannot be "
                    f"called so ({e}).") from None


def call_user(fn: Callable[..., Any], model: Any, batch: Any) -> Any:
  """``fn(model, batch)``; a TypeError, AttributeError or lookup error gets a hint."""
  try:
    return fn(model, batch)
  except (TypeError, AttributeError, KeyError, IndexError) as e:
    e.add_note(LOSS_FN_HINT)
    raise


def split_loss(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
  """``loss_fn``'s result as ``(scalar loss, aux)``, the loss in float32 (float64 stays
  float64), or a TypeError naming the fix."""
  if has_aux:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(f"With has_aux=True, loss_fn must return (loss, aux); it returned "
                      f"{_describe(out)}.")
    loss, aux = out
  elif isinstance(out, (tuple, list)):
    raise TypeError(f"loss_fn returned a {type(out).__name__} of {len(out)} items; a loss_fn "
                    "that returns (loss, aux) needs make_train_step(..., has_aux=True).")
  else:
    loss, aux = out, None
  try:
    loss = jnp.asarray(loss)
  except TypeError:
    raise TypeError(f"loss_fn must return a scalar float loss, got {_describe(loss)}.") from None
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(f"loss_fn must return a floating loss, got dtype {loss.dtype}; a loss of "
                    "another dtype has no gradient.")
  if loss.shape != ():
    raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}; reduce it "
                     "(e.g. .mean()).")
  return loss.astype(at_least_float32(loss.dtype)), aux


def _describe(x: Any) -> str:
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)} items"
  shape = getattr(x, "shape", None)
  return f"an array of shape {shape}" if shape is not None else f"a {type(x).__name__}"


def combine_aux(tree: Any, over_axis: int | None = None, over_devices: Any = None) -> Any:
  """``loss_fn``'s aux over micro-batches (stacked on ``over_axis``) or, inside
  ``shard_map``, over the batch's ``over_devices`` axes, as the whole batch's.

  Floating leaves are averaged (a per-example mean stays a mean), integer leaves summed
  (a count stays the batch's count), boolean leaves or-ed (a flag set by any part of the
  batch); other leaves (PRNG keys) are the last micro-batch's, or each device's own.
  """
  def combine(a: Any) -> Any:
    if jnp.issubdtype(a.dtype, jnp.inexact):
      return (jnp.mean(a, axis=over_axis) if over_devices is None
              else jax.lax.pmean(a, over_devices))
    if jnp.issubdtype(a.dtype, jnp.bool_):
      return (jnp.any(a, axis=over_axis) if over_devices is None
              else jax.lax.pmax(a.astype(jnp.int32), over_devices).astype(jnp.bool_))
    if jnp.issubdtype(a.dtype, jnp.integer):
      return (jnp.sum(a, axis=over_axis, dtype=a.dtype) if over_devices is None
              else jax.lax.psum(a, over_devices))
    return a[-1] if over_devices is None else a
  return jax.tree.map(combine, tree)
