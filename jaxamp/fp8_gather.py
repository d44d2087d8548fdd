"""FSDP's all-gather of an FP8 kernel: E4M3 bytes and one float32 scale on the wire.

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
(In bfloat16, float32's range, that takes an amax below about 1e-33.) Delayed scaling
(:class:`jaxamp.DelayedScaling`) quantizes with a scale from its state, not from the
kernel's amax; its kernels keep the compute-dtype gather.

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["gather_e4m3"]


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
  if np.dtype(x.dtype) != np.dtype(jnp.bfloat16):
    return None
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  amax = lax.pmax(amax, axes) if axes else amax
  scale = scale_of(amax)
  q = gather(quantize(x, jnp.float8_e4m3fn, scale))
  # A non-finite kernel comes out all NaN (its inf would arrive as 448 / scale, finite).
  # jnp.where, not adding 0 or NaN: a -0 stays -0, E4M3's 0x80 bit for bit.
  out = jnp.where(jnp.isfinite(amax), q.astype(jnp.float32) / scale, jnp.nan)
  return out.astype(x.dtype)
