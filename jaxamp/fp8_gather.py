"""FSDP's all-gather of an FP8 kernel: E4M3 bytes and float32 scales on the wire.

With per-tensor current scaling (:class:`jaxamp.CurrentScaling`) the FP8 matmul
quantizes its kernel with ``scale = 448 / amax / 2**margin`` from the kernel's own
amax. Under :func:`jaxamp.fsdp` each device holds a slice of the kernel, so the gather
can quantize before it moves anything (as torchao's float8 all-gather does): each
device takes its slice's amax, one scalar ``lax.pmax`` over the mesh axes splitting it
gives the whole kernel's amax, hence the matmul's scale; the slice is quantized to
E4M3 with it and gathered (half the bytes of bfloat16), then dequantized to the compute
dtype. The matmul, quantizing that value again, gets the same E4M3 values bit for bit:
its amax is the same (the largest element comes back as ``E4M3(amax * scale) / scale``,
which rounds to ``amax`` in bfloat16), so its scale is, and each element
``q / scale``, rounded to bfloat16 (8 significant bits) and multiplied
by ``scale`` again, lies within half an E4M3 step (3 significant bits) of ``q``. A
non-finite kernel comes out all NaN, so the step is skipped as without the gather.

Only a bfloat16 compute dtype gathers so: in float32 the argument above leaves an ulp of
doubt, and in float16 ``q / scale`` of a kernel with a small amax (below about 1e-2)
can fall under float16's smallest subnormal, where it would not round back to ``q``.
(In bfloat16, float32's range, that takes an amax below about 1e-33.)

Delayed scaling (:class:`jaxamp.DelayedScaling`) quantizes with the kernel scale its
state holds (from earlier steps' amaxes), which the gather is handed: each device
quantizes its slice with that scale, and the elements holding the largest E4M3
magnitude arrive as the kernel's amax (one scalar all-reduce, as above; their sign
kept). The matmul, quantizing with the same scale, gets the same E4M3 values (the other
elements by the argument above; those put back: ``amax * scale`` rounds to that largest
value, as the kernel's largest element did, or saturates at 448 as it did), and the amax
it records in the history is the kernel's own, so the next step's scale is the same.

Block scaling (:class:`jaxamp.BlockScaling`, :func:`gather_e4m3_blocks`) scales each
weight block by its own amax: each device quantizes its slice per block, and the E4M3
values and each block's float32 amax are gathered (1 byte an element, 4 a block). It
applies where the blocks of the slice are those of the whole kernel (each split
dimension's local size a multiple of the block; an unsplit one may end in a partial
block, zero-padded alike) and are those the matmul reads: a 2-D kernel, square blocks
(the forward reads ``[K, N]`` blocks, the input gradient the same blocks transposed, and
Equinox's ``[out, in]`` weight is read transposed), a module reading it as one matrix
(:meth:`jaxamp.scaled.ScaledFormat.gathers_read`: not an Einsum, whose pattern may make
a kernel dimension a batch one, nor a convolution, read as an im2col GEMM). Each
element comes back as ``q / s`` rounded to bfloat16, except those holding the block's
largest ``|q|``, which come back as ``±amax``: so the block's amax, hence its scale, is
the same bit for bit (with ``power_of_two`` too, where ``E4M3(amax * s) / s`` may exceed
the amax and its power of two), and every other element requantizes to its ``q`` by the
per-tensor argument (with a power-of-two scale ``q / s`` is even exact). The floor of
``1e-12`` on a block's amax keeps ``q / s`` above ``4e-18``, far from bfloat16's
subnormals. A block holding inf or NaN keeps its NaN elements: the step is skipped.

Rowwise (:mod:`jaxamp.rowwise`) and MXFP8 (:mod:`jaxamp.mxfp8`) scaling quantize the
kernel along ``K`` in the forward product and along ``N`` in the input gradient, both
from the high-precision kernel: a kernel gathered quantized in one layout would reach
the other product rounded twice, so they keep the compute-dtype gather (as torchao
gathers float8 only for tensorwise scaling).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxamp import fp8, fp8_gather
  >>> w = jnp.linspace(-3.0, 2.0, 16, dtype=jnp.float32).astype(jnp.bfloat16)
  >>> scale_of = lambda amax: fp8._current_scale(amax, 448.0, 0)
  >>> moved = fp8_gather.gather_e4m3(w, (), lambda q: q, scale_of, fp8.quantize)
  >>> s = scale_of(jnp.max(jnp.abs(w)).astype(jnp.float32))
  >>> bool((fp8.quantize(moved, fp8.E4M3, s) == fp8.quantize(w, fp8.E4M3, s)).all())
  True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["BlockRule", "gather_e4m3", "gather_e4m3_blocks"]


def _exact_in(dtype: Any) -> bool:
  """Whether a kernel in ``dtype`` requantizes exactly after the gather: bfloat16 only."""
  return np.dtype(dtype) == np.dtype(jnp.bfloat16)


def gather_e4m3(x: jax.Array, axes: tuple[str, ...], gather: Callable[[jax.Array], jax.Array],
                scale_of: Callable[[jax.Array], jax.Array],
                quantize: Callable[[jax.Array, Any, jax.Array], jax.Array]
                ) -> jax.Array | None:
  """Inside ``shard_map``: the slice ``x`` (in its reader's compute dtype) all-gathered as
  E4M3 values with the scale ``scale_of(amax)`` of the whole tensor's amax (maxed over
  ``axes``), dequantized to ``x``'s dtype; None for a compute dtype other than bfloat16
  (see the module's docstring).

  Args:
    x: this device's slice, in the compute dtype.
    axes: the mesh axes the slice is split over (its amax is maxed over them).
    gather: all-gathers an array laid out as ``x``.
    scale_of: the recipe's scale of an amax (a float32 scalar).
    quantize: ``quantize(x, dtype, scale)``, the recipe's cast.
  """
  if not _exact_in(x.dtype):
    return None
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  amax = lax.pmax(amax, axes) if axes else amax
  scale = scale_of(amax)
  q = gather(quantize(x, jnp.float8_e4m3fn, scale)).astype(jnp.float32)
  # The elements holding the largest |q| come back as +-amax (their sign, -0 kept): the
  # kernel's amax, which a delayed-scaling matmul records, is the original's bit for bit
  # (its scale is from its history, so the largest q need not be 448).
  out = jnp.where(jnp.abs(q) == jnp.max(jnp.abs(q)), jnp.copysign(amax, q), q / scale)
  # A non-finite kernel comes out all NaN (its inf would arrive as 448 / scale, finite).
  # jnp.where, not adding 0 or NaN: a -0 stays -0, E4M3's 0x80 bit for bit.
  return jnp.where(jnp.isfinite(amax), out, jnp.nan).astype(x.dtype)


class BlockRule(NamedTuple):
  """A block-scaled format's rule for a 2-D kernel, as :func:`gather_e4m3_blocks` needs
  it (all float32, per-block arrays ``[ceil(R / rows), ceil(C / columns)]``).

  Attributes:
    block: the ``(rows, columns)`` of a block.
    amax: ``x ->`` each block's largest magnitude, NaN where the block is not finite.
    scale: ``amax ->`` each block's multiplier, the format's own rule.
    quantize: ``(x, scale) ->`` ``x`` in E4M3 with each block's multiplier, the
      format's own cast (NaN where ``x`` is not finite).
    spread: ``(per_block, shape) ->`` each block's value on its elements.
  """

  block: tuple[int, int]
  amax: Callable[[jax.Array], jax.Array]
  scale: Callable[[jax.Array], jax.Array]
  quantize: Callable[[jax.Array, jax.Array], jax.Array]
  spread: Callable[[jax.Array, tuple[int, ...]], jax.Array]


def _aligned(x: jax.Array, full: tuple[int, ...], block: tuple[int, int]) -> bool:
  """Whether the slice's blocks are the whole kernel's: every split dimension's local
  size a multiple of its block."""
  return all(n == f or n % b == 0 for n, f, b in zip(x.shape, full, block))


def gather_e4m3_blocks(x: jax.Array, gather: Callable[[jax.Array], jax.Array],
                       rule: BlockRule) -> jax.Array | None:
  """Inside ``shard_map``: the 2-D slice ``x`` (in its reader's compute dtype)
  all-gathered as E4M3 values with one float32 amax per ``rule.block``, dequantized to
  ``x``'s dtype so that the format's block quantization of the result equals that of
  the kernel gathered in ``x``'s dtype, bit for bit; None where that is not provable
  (see the module's docstring): a dtype other than bfloat16, a rank other than 2, a split
  dimension whose local size the block does not divide.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxamp import block, fp8_gather
    >>> w = jnp.linspace(-3.0, 2.0, 48, dtype=jnp.float32).reshape(6, 8)
    >>> w = w.astype(jnp.bfloat16)
    >>> rule = block.BLOCK.block_rule(block.BlockScaling(weight_block=(4, 4)))
    >>> q = lambda k: block.quantize(k, (4, 4))[0].view(jnp.uint8)
    >>> moved = lambda w: fp8_gather.gather_e4m3_blocks(w, lambda a: a, rule)
    >>> bool(jax.jit(lambda w: q(moved(w)) == q(w))(w).all())
    True
  """
  if not _exact_in(x.dtype) or x.ndim != 2:
    return None
  if not _aligned(x, jax.eval_shape(gather, x).shape, rule.block):
    return None
  amax = rule.amax(x)
  q, amax = gather(rule.quantize(x, rule.scale(amax))), gather(amax)
  q32, shape = q.astype(jnp.float32), q.shape
  # Divided, not multiplied by a reciprocal (the barrier keeps XLA from rewriting it).
  out = q32 / lax.optimization_barrier(rule.spread(rule.scale(amax), shape))
  # The elements holding the block's largest |q| come back as +-amax (its sign, -0 kept):
  # the block's amax, hence its scale, is the original's bit for bit.
  top = rule.spread(rule.amax(q32), shape)
  amax_e = rule.spread(amax, shape)
  keep = jnp.isfinite(amax_e) & (jnp.abs(q32) == top)
  return jnp.where(keep, jnp.copysign(amax_e, q32), out).astype(x.dtype)
