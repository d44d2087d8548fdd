"""A convolution as an im2col GEMM: the input's patches times the reshaped kernel.

What a scaled format without a convolution of its own runs a convolution layer with
(:meth:`jaxamp.scaled.ScaledFormat.conv_general_dilated`'s default): the input's patches,
``[N, *out_spatial, C * prod(window)]`` (each output position's window, channel-major:
the values of ``lax.conv_general_dilated_patches``), go through the format's own
``dot_general`` with the kernel laid out as ``[C_in * prod(window), C_out]``, and the
product is laid back out as the convolution's output. Any ``dimension_numbers``, 1-, 2-
and 3-d, strides, string or explicit padding, input (``lhs``) and kernel (``rhs``)
dilation; feature and batch groups become a batch dimension of the dot (the formats'
dots take batch dimensions, as an ``Einsum``'s).

The patches are cut with pads and strided slices, in float32 (the input is widened
first), then narrowed to the input's dtype for the dot: in the backward pass the
patches' gradient, where windows overlap, is summed in float32 and rounded once. (Not
``lax.conv_general_dilated_patches`` itself: that is a convolution with an identity
kernel, which reports and the matmul census would count as a float32 convolution of
``prod(window)`` times the GEMM's input FLOPs, and which runs at the backend's default
precision.) The patches take ``prod(window)`` times the input's memory: this is an
emulation, the matmul a GEMM, not a native FP8 convolution.

Example:
  >>> import jax.numpy as jnp
  >>> from jax import lax
  >>> from jaxamp import patch_conv
  >>> x, k = jnp.arange(24.0).reshape(1, 6, 4), jnp.arange(24.0).reshape(3, 4, 2)
  >>> dn = ('NWC', 'WIO', 'NWC')
  >>> y = patch_conv.conv_general_dilated(lax.dot_general, x, k, (2,), 'SAME',
  ...                                     dimension_numbers=dn)
  >>> bool((y == lax.conv_general_dilated(x, k, (2,), 'SAME', dimension_numbers=dn)).all())
  True
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["conv_general_dilated", "dilated", "explicit_padding", "patches"]


def _ints(x: Sequence[Any] | None, n: int) -> tuple[int, ...]:
  return (1,) * n if x is None else tuple(int(i) for i in x)


def dilated(shape: Sequence[int], dilation: Sequence[int]) -> np.ndarray:
  """Each size of ``shape`` once dilated (``d - 1`` holes between neighbours):
  ``1 + d * (s - 1)``, 0 for an empty dimension, as lax computes a dilated window's (or
  input's) extent."""
  return np.array([0 if s == 0 else 1 + d * (s - 1) for s, d in zip(shape, dilation)],
                  dtype=int)


def explicit_padding(padding: Any, in_shape: Sequence[int], window_shape: Sequence[int],
                     strides: Sequence[int], lhs_dilation: Sequence[int],
                     rhs_dilation: Sequence[int]) -> tuple[tuple[int, int], ...]:
  """``padding`` as ``(low, high)`` per spatial dimension (``in_shape``: the input's spatial
  sizes), a string (``'SAME'``, ``'VALID'``) resolved as lax resolves it for the
  ``rhs_dilation``-dilated window; refused with a string and an ``lhs_dilation``, as
  ``lax.conv_general_dilated`` refuses it.

  Example:
    >>> from jaxamp import patch_conv
    >>> patch_conv.explicit_padding('SAME', (5,), (3,), (1,), (1,), (2,))
    ((2, 2),)
  """
  if isinstance(padding, str):
    if any(d != 1 for d in lhs_dilation):
      raise ValueError(f"padding {padding!r} (a string) with lhs_dilation "
                       f"{tuple(lhs_dilation)}: as lax.conv_general_dilated, give explicit "
                       "(low, high) pairs")
    padding = lax.padtype_to_pads(in_shape, dilated(window_shape, rhs_dilation), strides,
                                  padding)
  pads = tuple(tuple(int(i) for i in p) for p in padding)
  if len(pads) != len(in_shape) or any(len(p) != 2 for p in pads):
    raise ValueError(f"padding {padding!r}: one (low, high) pair per spatial dimension "
                     f"({len(in_shape)}), or 'SAME' / 'VALID'")
  return pads


def patches(lhs: jax.Array, window_shape: Sequence[int], window_strides: Sequence[int],
            padding: Any, lhs_dilation: Sequence[int] | None = None,
            rhs_dilation: Sequence[int] | None = None,
            lhs_spec: Sequence[int] | None = None) -> jax.Array:
  """``lhs``'s patches, ``[N, *out_spatial, C * prod(window_shape)]``: each output
  position's window of the (dilated, padded) input, channel-major (feature ``c *
  prod(window) + w`` is channel ``c`` at window position ``w``, row-major), as
  ``lax.conv_general_dilated_patches`` orders them, laid out channels-last.

  Args:
    lhs: the input, its dimensions as ``lhs_spec`` says.
    window_shape, window_strides, padding, lhs_dilation, rhs_dilation: as
      ``lax.conv_general_dilated``'s (``window_shape``: the kernel's spatial sizes).
    lhs_spec: the input's batch, feature and spatial dimensions, in that order
      (``lax.ConvDimensionNumbers.lhs_spec``); None: ``N, C, *spatial``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp import patch_conv
    >>> x = jnp.arange(10.0).reshape(1, 2, 5)  # N, C, W
    >>> patch_conv.patches(x, (2,), (2,), 'VALID')[0].tolist()  # (c0 w0, c0 w1, c1 w0, c1 w1)
    [[0.0, 1.0, 5.0, 6.0], [2.0, 3.0, 7.0, 8.0]]
  """
  n = lhs.ndim - 2
  spec = tuple(range(lhs.ndim)) if lhs_spec is None else tuple(int(i) for i in lhs_spec)
  window, strides = tuple(int(w) for w in window_shape), _ints(window_strides, n)
  lhs_dil, rhs_dil = _ints(lhs_dilation, n), _ints(rhs_dilation, n)
  x = jnp.transpose(lhs, (spec[0], *spec[2:], spec[1]))  # N, *spatial, C
  dilated_window = dilated(window, rhs_dil)
  pads = explicit_padding(padding, x.shape[1:-1], window, strides, lhs_dil, rhs_dil)
  zero = jnp.zeros((), x.dtype)
  x = lax.pad(x, zero, [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(pads, lhs_dil)]
              + [(0, 0, 0)])
  out = [max(0, (size - dw) // s + 1) if size >= dw else 0
         for size, dw, s in zip(x.shape[1:-1], dilated_window, strides)]
  if 0 in out or 0 in window:
    return jnp.zeros((x.shape[0], *out, x.shape[-1] * math.prod(window)), x.dtype)
  cut = []
  for offset in itertools.product(*(range(w) for w in window)):  # row-major
    start = [0] + [o * d for o, d in zip(offset, rhs_dil)] + [0]
    limit = ([x.shape[0]] + [b + (m - 1) * s + 1 for b, m, s in zip(start[1:], out, strides)]
             + [x.shape[-1]])
    cut.append(lax.slice(x, start, limit, (1, *strides, 1)))
  stacked = jnp.stack(cut, axis=-1)  # N, *out, C, window
  return stacked.reshape(*stacked.shape[:-2], -1)


def conv_general_dilated(dot_general: Callable[..., jax.Array], lhs: jax.Array,
                         rhs: jax.Array, window_strides: Sequence[int], padding: Any,
                         lhs_dilation: Sequence[int] | None = None,
                         rhs_dilation: Sequence[int] | None = None,
                         dimension_numbers: Any = None, feature_group_count: int = 1,
                         batch_group_count: int = 1, precision: Any = None,
                         preferred_element_type: Any = None) -> jax.Array:
  """``lax.conv_general_dilated(lhs, rhs, ...)`` computed as one ``dot_general`` (called
  as ``lax.dot_general``, ``lhs`` the patches, ``rhs`` the kernel) of :func:`patches` (cut
  in float32, narrowed to ``lhs``'s dtype) and the kernel as ``[C_in * prod(window),
  C_out]``; feature or batch groups a batch dimension of the dot, leading in both
  operands. The arguments are checked, and the output shaped, as lax's.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax import lax
    >>> from jaxamp import patch_conv
    >>> x, k = jnp.ones((1, 4, 5, 5)), jnp.ones((6, 2, 3, 3))  # NCHW, OIHW, 2 groups
    >>> y = patch_conv.conv_general_dilated(lax.dot_general, x, k, (1, 1), 'VALID',
    ...                                     feature_group_count=2)
    >>> y.shape, float(y[0, 0, 0, 0])
    ((1, 6, 3, 3), 18.0)
  """
  n = lhs.ndim - 2
  want = jax.eval_shape(functools.partial(
      lax.conv_general_dilated, window_strides=window_strides, padding=padding,
      lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
      dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
      batch_group_count=batch_group_count, preferred_element_type=preferred_element_type),
      lhs, jax.ShapeDtypeStruct(rhs.shape, lhs.dtype))  # lax's checks and output shape
  lhs_spec, rhs_spec, out_spec = lax.conv_dimension_numbers(lhs.shape, rhs.shape,
                                                            dimension_numbers)
  window = tuple(rhs.shape[d] for d in rhs_spec[2:])
  wide = jnp.promote_types(lhs.dtype, jnp.float32)
  p = patches(lhs.astype(wide), window, window_strides, padding, lhs_dilation, rhs_dilation,
              lhs_spec).astype(lhs.dtype)  # [N, *S, C * W]
  kernel = jnp.transpose(rhs, (rhs_spec[1], *rhs_spec[2:], rhs_spec[0]))  # I, *window, O
  k, c_out = math.prod(kernel.shape[:-1]), kernel.shape[-1]
  groups = max(int(feature_group_count), int(batch_group_count))
  if groups == 1:
    y = dot_general(p, kernel.reshape(k, c_out), (((n + 1,), (0,)), ((), ())), precision,
                    preferred_element_type)  # [N, *S, O]
  else:
    kernel = jnp.swapaxes(kernel.reshape(k, groups, c_out // groups), 0, 1)  # G, K, O/G
    if feature_group_count > 1:  # the input's channels split into groups, group-major
      p = p.reshape(*p.shape[:-1], groups, k)  # N, *S, G, K
      dims = (((n + 2,), (1,)), ((n + 1,), (0,)))
    else:  # the batch split into groups, group-major
      p = p.reshape(groups, p.shape[0] // groups, *p.shape[1:])  # G, N/G, *S, K
      dims = (((n + 2,), (1,)), ((0,), (0,)))
    y = dot_general(p, kernel, dims, precision, preferred_element_type)  # G, N', *S, O/G
    y = jnp.moveaxis(y, 0, -2)
    y = y.reshape(*y.shape[:-2], c_out)
  order = [0] * (n + 2)  # out_spec's positions of the canonical N, *S, O
  order[out_spec[0]], order[out_spec[1]] = 0, n + 1
  for i, d in enumerate(out_spec[2:]):
    order[d] = i + 1
  y = jnp.transpose(y, order)
  if y.shape != want.shape:  # a dot_general that lays its result out otherwise
    raise ValueError(f"the convolution's GEMM gave shape {y.shape}; lax's convolution "
                     f"gives {want.shape}")
  return y
