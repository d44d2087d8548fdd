"""The convolutions of an FP8 convolution layer: forward, and the two backward ones.

:func:`jaxamp.fp8.scaled_conv_general_dilated` quantizes; this module convolves what it
quantized. The forward convolution takes the E4M3 input and kernel as they are; the
backward ones (the input and kernel gradients, lax's two transposes of the forward one,
written out here for any strides, dilations, padding and feature or batch groups) take
the E5M2 output gradient and the E4M3 operands widened to bfloat16, which holds every
E4M3 and E5M2 value exactly: the products are those of the FP8 values, accumulated in
float32 (``preferred_element_type``), in the 16-bit convolutions a GPU runs. (lax's own
transposes, under ``jax.vjp``, would cast the operands to the cotangent's dtype: float32
convolutions, or a bfloat16 cotangent refused.)

Example:
  >>> import jax.numpy as jnp
  >>> from jaxamp import fp8_conv
  >>> x, k = jnp.ones((1, 5, 2), jnp.float8_e4m3fn), jnp.ones((3, 2, 4), jnp.float8_e4m3fn)
  >>> p = fp8_conv.conv_params(x.shape, k.shape, (1,), 'VALID', None, None,
  ...                          ('NWC', 'WIO', 'NWC'), 1, 1)
  >>> y = fp8_conv.conv(x, k, p)
  >>> y.shape, y.dtype, float(y[0, 0, 0])
  ((1, 3, 4), dtype('float32'), 6.0)
  >>> g = jnp.ones(y.shape, jnp.float8_e5m2)
  >>> [(d.shape, d.dtype) for d in fp8_conv.conv_grads(g, x, k, p)]
  [((1, 5, 2), dtype('float32')), ((3, 2, 4), dtype('float32'))]
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp import patch_conv

__all__ = ["ConvParams", "conv", "conv_grads", "conv_params", "conv_transpose",
           "transpose_lhs", "transpose_rhs", "with_conv_transpose"]

_F32 = jnp.float32
# The dtype the backward convolutions take their FP8 operands in: exact for E4M3 and E5M2
# (bfloat16's 8 exponent bits and 7 mantissa bits hold both), half float32's bytes.
WIDE = jnp.bfloat16


class ConvParams(NamedTuple):
  """A convolution's static arguments, hashable (a ``custom_vjp``'s ``nondiff_argnums``),
  padding explicit (``(low, high)`` per spatial dimension, as lax resolves
  ``'SAME'``/``'VALID'``)."""

  strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  dimension_numbers: lax.ConvDimensionNumbers
  feature_group_count: int
  batch_group_count: int


def _ints(x: Sequence[Any]) -> tuple[int, ...]:
  return tuple(int(i) for i in x)


def conv_params(lhs_shape: Sequence[int], rhs_shape: Sequence[int],
                window_strides: Sequence[int], padding: Any,
                lhs_dilation: Sequence[int] | None, rhs_dilation: Sequence[int] | None,
                dimension_numbers: Any, feature_group_count: int,
                batch_group_count: int) -> ConvParams:
  """The :class:`ConvParams` of ``lax.conv_general_dilated`` called with these
  arguments on operands of these shapes (string padding resolved as lax resolves it)."""
  spatial = len(lhs_shape) - 2
  dn = lax.conv_dimension_numbers(tuple(lhs_shape), tuple(rhs_shape), dimension_numbers)
  dn = lax.ConvDimensionNumbers(*(_ints(s) for s in dn))
  lhs_dilation = _ints(lhs_dilation or (1,) * spatial)
  rhs_dilation = _ints(rhs_dilation or (1,) * spatial)
  padding = patch_conv.explicit_padding(
      padding, np.take(lhs_shape, dn.lhs_spec[2:]), np.take(rhs_shape, dn.rhs_spec[2:]),
      window_strides, lhs_dilation, rhs_dilation)
  return ConvParams(_ints(window_strides), padding, lhs_dilation, rhs_dilation, dn,
                    int(feature_group_count), int(batch_group_count))


def conv(lhs: jax.Array, rhs: jax.Array, p: ConvParams) -> jax.Array:
  """The forward convolution, accumulated and returned in float32."""
  return lax.conv_general_dilated(lhs, rhs, p.strides, p.padding, p.lhs_dilation,
                                  p.rhs_dilation, p.dimension_numbers,
                                  p.feature_group_count, p.batch_group_count,
                                  preferred_element_type=_F32)


def _reshape_axis_into(src: int, dst: int, x: jax.Array) -> jax.Array:
  # ``dst`` counts dimensions after ``src`` is removed (as lax's own helper).
  perm = [i for i in range(x.ndim) if i != src]
  perm.insert(dst, src)
  shape = list(np.delete(x.shape, src))
  shape[dst] *= x.shape[src]
  return jnp.transpose(x, perm).reshape(shape)


def _reshape_axis_out_of(src: int, size: int, x: jax.Array) -> jax.Array:
  shape = list(x.shape)
  shape[src:src + 1] = [size, shape[src] // size]
  return x.reshape(shape)


def _spec_t(spec: Sequence[int]) -> tuple[int, ...]:
  return (spec[1], spec[0]) + tuple(spec[2:])


def transpose_lhs(g: jax.Array, rhs: jax.Array, lhs_shape: Sequence[int],
                  p: ConvParams) -> jax.Array:
  """The input gradient of :func:`conv` (lax's ``_conv_general_dilated_transpose_lhs``,
  operands in their own dtypes, float32 result)."""
  lhs_spec, rhs_spec, out_spec = p.dimension_numbers
  groups = p.feature_group_count
  if groups > 1 or p.batch_group_count > 1:
    # The group axis moves into the transposed kernel's output features.
    groups = max(groups, p.batch_group_count)
    rhs = _reshape_axis_into(rhs_spec[0], rhs_spec[1],
                             _reshape_axis_out_of(rhs_spec[0], groups, rhs))
  k = patch_conv.dilated(np.take(rhs.shape, rhs_spec[2:]), p.rhs_dilation)
  before = k - np.array([lo for lo, _ in p.padding]) - 1
  after = (patch_conv.dilated(np.take(lhs_shape, lhs_spec[2:]), p.lhs_dilation) + k - 1
           - patch_conv.dilated(np.take(g.shape, out_spec[2:]), p.strides) - before)
  out = lax.conv_general_dilated(
      g, lax.rev(rhs, rhs_spec[2:]), p.lhs_dilation, list(zip(_ints(before), _ints(after))),
      p.strides, p.rhs_dilation,
      lax.ConvDimensionNumbers(out_spec, _spec_t(rhs_spec), lhs_spec), groups, 1,
      preferred_element_type=_F32)
  if p.batch_group_count > 1:
    out = _reshape_axis_into(lhs_spec[1], lhs_spec[0],
                             _reshape_axis_out_of(lhs_spec[1], p.batch_group_count, out))
  return out


def transpose_rhs(g: jax.Array, lhs: jax.Array, rhs_shape: Sequence[int],
                  p: ConvParams) -> jax.Array:
  """The kernel gradient of :func:`conv` (lax's ``_conv_general_dilated_transpose_rhs``,
  operands in their own dtypes, float32 result)."""
  dn = p.dimension_numbers
  lhs_t, rhs_t, out_t = (_spec_t(s) for s in dn)
  # Feature groups become batch groups and back.
  features, batches = p.batch_group_count, p.feature_group_count
  lo = [low for low, _ in p.padding]
  k = patch_conv.dilated(np.take(rhs_shape, dn.rhs_spec[2:]), p.rhs_dilation)
  hi = (patch_conv.dilated(np.take(g.shape, dn.out_spec[2:]), p.strides)
        - patch_conv.dilated(np.take(lhs.shape, dn.lhs_spec[2:]), p.lhs_dilation) + k
        - np.array(lo) - 1)
  return lax.conv_general_dilated(
      lhs, g, p.rhs_dilation, list(zip(_ints(lo), _ints(hi))), p.lhs_dilation, p.strides,
      lax.ConvDimensionNumbers(lhs_t, out_t, rhs_t), features, batches,
      preferred_element_type=_F32)


def conv_grads(g: jax.Array, lhs: jax.Array, rhs: jax.Array,
               p: ConvParams) -> tuple[jax.Array, jax.Array]:
  """The input and kernel gradients of :func:`conv` for the output gradient ``g``, all
  three FP8, widened to bfloat16 (exact), products accumulated in float32."""
  g, lhs, rhs = (x.astype(WIDE) for x in (g, lhs, rhs))
  if g.size == 0:  # as lax: no degenerate convolution with an empty window
    return jnp.zeros(lhs.shape, _F32), jnp.zeros(rhs.shape, _F32)
  return transpose_lhs(g, rhs, lhs.shape, p), transpose_rhs(g, lhs, rhs.shape, p)


def _transpose_padding(k: int, s: int, padding: Any) -> tuple[int, int]:
  # lax.conv_transpose's padding of the transposed convolution (Keras's convention).
  if padding == "SAME":
    total = k + s - 2
    before = k - 1 if s > k - 1 else int(np.ceil(total / 2))
  elif padding == "VALID":
    total, before = k + s - 2 + max(k - s, 0), k - 1
  else:  # (low, high) of the forward convolution
    before, total = k - padding[0] - 1, 2 * k - padding[0] - padding[1] - 2
  return before, total - before


_DEFAULT_DN = {2: ("NC", "IO", "NC"), 3: ("NHC", "HIO", "NHC"), 4: ("NHWC", "HWIO", "NHWC"),
               5: ("NHWDC", "HWDIO", "NHWDC")}


def conv_transpose(conv_general_dilated: Callable[..., jax.Array], lhs: jax.Array,
                   rhs: jax.Array, strides: Sequence[int], padding: Any,
                   rhs_dilation: Sequence[int] | None = None, dimension_numbers: Any = None,
                   transpose_kernel: bool = False, precision: Any = None,
                   preferred_element_type: Any = None,
                   use_consistent_padding: bool = False) -> jax.Array:
  """``lax.conv_transpose`` with its convolution ``conv_general_dilated`` (same arguments
  as lax's): how Flax's ``ConvTranspose`` layers run an FP8 convolution.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxamp import fp8_conv
    >>> x, k = jnp.arange(10.0).reshape(1, 5, 2), jnp.arange(24.0).reshape(3, 4, 2)
    >>> y = fp8_conv.conv_transpose(jax.lax.conv_general_dilated, x, k, (2,), 'SAME',
    ...                             transpose_kernel=True)
    >>> bool((y == jax.lax.conv_transpose(x, k, (2,), 'SAME', transpose_kernel=True)).all())
    True
  """
  if dimension_numbers is None:
    if lhs.ndim not in _DEFAULT_DN:
      raise ValueError(f"no default dimension_numbers for {lhs.ndim}-d operands: give them")
    dimension_numbers = _DEFAULT_DN[lhs.ndim]
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  rhs_dilation = tuple(rhs_dilation or (1,) * (rhs.ndim - 2))
  if use_consistent_padding or padding in ("SAME", "VALID"):
    pads = padding if not isinstance(padding, str) else [padding] * len(strides)
    window = patch_conv.dilated(np.take(rhs.shape, dn.rhs_spec[2:]), rhs_dilation)
    padding = tuple(_transpose_padding(k, s, p) for k, s, p in zip(window, strides, pads))
  if transpose_kernel:  # spatial dimensions flipped, input and output features swapped
    rhs = jnp.flip(rhs, dn.rhs_spec[2:]).swapaxes(dn.rhs_spec[0], dn.rhs_spec[1])
  return conv_general_dilated(lhs, rhs, (1,) * (lhs.ndim - 2), padding, tuple(strides),
                              rhs_dilation, dn, precision=precision,
                              preferred_element_type=preferred_element_type)


class _Lax:
  """``jax.lax`` with another ``conv_transpose``."""

  def __init__(self, conv_transpose: Callable[..., jax.Array]):
    self.conv_transpose = conv_transpose

  def __getattr__(self, name: str) -> Any:
    return getattr(lax, name)


def with_conv_transpose(fn: types.FunctionType,
                        conv_transpose: Callable[..., jax.Array]) -> types.FunctionType:
  """A copy of ``fn`` whose ``lax.conv_transpose`` is ``conv_transpose``: Flax's
  ``ConvTranspose`` layers call ``lax.conv_transpose`` themselves, and their own code
  (batch dimensions, padding modes, mask, bias) then runs around an FP8 convolution. Only
  the copy's globals differ (its name ``lax``); no module or global is changed.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax import lax
    >>> from jaxamp import fp8_conv
    >>> def layer(x, k):
    ...   return lax.conv_transpose(x, k, (2,), 'SAME') + 1
    >>> copy = fp8_conv.with_conv_transpose(layer, lambda *a, **k: jnp.zeros(3))
    >>> copy(jnp.ones((1, 4, 2)), jnp.ones((3, 2, 5))).tolist()
    [1.0, 1.0, 1.0]
  """
  if fn.__globals__.get("lax") is not lax:
    raise TypeError(f"{fn.__qualname__} does not call jax.lax as `lax`: its "
                    "conv_transpose cannot be replaced (a flax version jaxamp does not know: "
                    "keep ConvTranspose out of FP8 with jaxamp.set_policy)")
  copy = types.FunctionType(fn.__code__, dict(fn.__globals__, lax=_Lax(conv_transpose)),
                            fn.__name__, fn.__defaults__, fn.__closure__)
  copy.__kwdefaults__ = fn.__kwdefaults__
  return copy
