"""FP8 for Flax's ``ConvTranspose`` layers (NNX and Linen).

They call ``lax.conv_transpose`` themselves, so no field of theirs takes a convolution (as
``Conv``'s ``conv_general_dilated`` does). Under a format that runs convolutions (every
built-in one: :func:`jaxamp.scaled.runs_conv`), the module wrappers run their call as
:func:`nnx_call` and :func:`linen_call` give it: the layer's own ``__call__`` (batch
dimensions, padding modes including ``'CIRCULAR'``, mask, bias) with ``lax.conv_transpose``
taken through the format's convolution (:func:`jaxamp.fp8_conv.conv_transpose`), keyed by
the module's path (:func:`jaxamp.scaled.conv_for`): per-tensor FP8's E4M3 convolution,
or the other formats' im2col GEMM (:mod:`jaxamp.patch_conv`), state per layer.

Example:
  >>> import jaxamp
  >>> from flax import nnx
  >>> from jaxamp import fp8_conv_transpose
  >>> layer = nnx.ConvTranspose(2, 3, (3,), strides=(2,), rngs=nnx.Rngs(0))
  >>> own = nnx.ConvTranspose.__call__
  >>> fp8_conv_transpose.nnx_call(layer, jaxamp.get_policy('mixed_fp8'), own) is own
  False
  >>> fp8_conv_transpose.nnx_call(layer, jaxamp.get_policy('mixed_bfloat16'), own) is own
  True

The tests run both layers against a reference of the dequantized operands and read the
E4M3 forward and bfloat16 backward convolutions in the lowered program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jaxamp import _warn_once
from jaxamp import fp8 as fp8_lib
from jaxamp import fp8_conv, fp8_stacked, scaled

__all__ = ["linen_call", "nnx_call"]


def _with(call: Any, conv: Callable[..., Any]) -> Any:
  return fp8_conv.with_conv_transpose(call, functools.partial(fp8_conv.conv_transpose, conv))


def _own_call(cls: type) -> None:
  _warn_once.warn_once(
      ("fp8.own_conv_transpose", cls),
      f"jaxamp: {cls.__name__} overrides ConvTranspose.__call__: its convolution runs in the "
      "compute dtype, not FP8 (jaxamp reaches ConvTranspose's own call only). Keep it out "
      f"with jaxamp.set_policy({cls.__name__}, 'mixed_bfloat16') to silence this.",
      RuntimeWarning, stacklevel=4)


def nnx_call(module: Any, policy: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
  """What an NNX module's call ``fn`` runs under ``policy``: for an ``nnx.ConvTranspose``
  whose format has a convolution, its own ``__call__`` with the format's; else ``fn`` (a
  subclass's own ``__call__`` with a warning: it runs in the compute dtype)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if not isinstance(module, nnx.ConvTranspose) or not fp8_lib.runs_fp8(type(module), policy):
    return fn
  if fn is not nnx.ConvTranspose.__call__:
    if getattr(fn, "__name__", None) == "__call__":
      _own_call(type(module))
    return fn  # a subclass's own call or another method: theirs to keep
  path, what = fp8_lib.nnx_where(module)
  path, own = fp8_stacked.nnx_reads(module, path, policy.fp8)  # a stacked layer's slice
  return _with(fn, scaled.conv_for(path, policy.fp8, what, own))


def linen_call(module: Any, path: tuple[str, ...], policy: Any,
               next_fun: Callable[..., Any], lifted: bool) -> Callable[..., Any]:
  """As :func:`nnx_call`, for a Linen ``module``'s ``__call__`` (``next_fun``); where
  ``lifted`` (inside ``nn.scan`` & co.) with the state the transform lifts
  (:func:`jaxamp.fp8_stacked.linen_reads`)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  if not isinstance(module, nn.ConvTranspose) or not fp8_lib.runs_fp8(type(module), policy):
    return next_fun
  if type(module).__call__ is not nn.ConvTranspose.__call__:
    _own_call(type(module))
    return next_fun
  name = "/".join(path)
  key, own = fp8_stacked.linen_reads(module, name, policy.fp8, lifted)
  call = _with(nn.ConvTranspose.__call__.__wrapped__, scaled.conv_for(
      key, policy.fp8, f"{type(module).__name__} {name}", own))
  return lambda *args, **kwargs: call(module, *args, **kwargs)
