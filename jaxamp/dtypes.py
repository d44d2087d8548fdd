"""The floating formats jaxamp knows, in one table every layer reads.

Each :class:`FloatFormat` says a format's name (as numpy and ml_dtypes spell it), its
spelling in XLA's HLO text, its width, largest finite value and smallest normal value,
and what role it can play: a half-precision compute dtype (16 bits), or an FP8 matmul
operand (8 bits with a mantissa; E8M0, a power-of-two scale format, is not one). Policy
parsing, the matmul census, ``precision_report``, the collective byte counts of
:mod:`jaxamp.sharding` and autocast read it; a new format is one row here.

Example:
  >>> from jaxamp import dtypes
  >>> fmt = dtypes.FORMATS["float16"]
  >>> fmt.max, fmt.smallest_normal, fmt.half, fmt.fp8
  (65504.0, 6.103515625e-05, True, False)
  >>> sorted(dtypes.HALF), dtypes.itemsize("f8e4m3fn"), dtypes.itemsize("bf16")
  (['bfloat16', 'float16'], 1, 2)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = ["FloatFormat", "FORMATS", "HALF", "FP8", "format_of", "is_half", "itemsize"]


class FloatFormat(NamedTuple):
  """One floating format.

  Attributes:
    name: the numpy / ml_dtypes name (``'bfloat16'``, ``'float8_e4m3fn'``).
    hlo: its spelling in HLO text (``'bf16'``, ``'f8e4m3fn'``; StableHLO's
      ``f8E4M3FN`` lowercased).
    bits: its width.
    max: its largest finite value.
    smallest_normal: its smallest positive normal value (values below it lose bits or
      flush to zero).
    half: a 16-bit format, one a policy computes in.
    fp8: an 8-bit format with a mantissa, one FP8 matmuls take as operands.
  """

  name: str
  hlo: str
  bits: int
  max: float
  smallest_normal: float
  half: bool
  fp8: bool

  @property
  def short(self) -> str:
    """Its name in reports' shape strings: the HLO spelling, FP8's without ``f8``
    (``'bf16'``, ``'e4m3fn'``, ``'e5m2'``; ``'e4m3'`` is IEEE-like E4M3, another format)."""
    return self.hlo[2:] if self.fp8 else self.hlo

  @property
  def itemsize(self) -> int:
    """Bytes per element as stored (sub-byte formats take a byte each)."""
    return max(1, self.bits // 8)


# (name, HLO spelling); formats this jax's ml_dtypes lacks are left out.
_NAMES = (("float64", "f64"), ("float32", "f32"), ("float16", "f16"), ("bfloat16", "bf16"),
          ("float8_e4m3fn", "f8e4m3fn"), ("float8_e5m2", "f8e5m2"),
          ("float8_e4m3fnuz", "f8e4m3fnuz"), ("float8_e5m2fnuz", "f8e5m2fnuz"),
          ("float8_e4m3b11fnuz", "f8e4m3b11fnuz"), ("float8_e4m3", "f8e4m3"),
          ("float8_e3m4", "f8e3m4"), ("float8_e8m0fnu", "f8e8m0fnu"),
          ("float6_e2m3fn", "f6e2m3fn"), ("float6_e3m2fn", "f6e3m2fn"),
          ("float4_e2m1fn", "f4e2m1fn"))


def _format(name: str, hlo: str) -> FloatFormat:
  info = jnp.finfo(getattr(jnp, name))
  return FloatFormat(name, hlo, int(info.bits), float(info.max), float(info.smallest_normal),
                     half=info.bits == 16, fp8=info.bits == 8 and info.nmant > 0)


FORMATS: dict[str, FloatFormat] = {name: _format(name, hlo) for name, hlo in _NAMES
                                   if hasattr(jnp, name)}
HALF = frozenset(f.name for f in FORMATS.values() if f.half)
FP8 = frozenset(f.name for f in FORMATS.values() if f.fp8)

# Bytes per element of the other types HLO and StableHLO texts name.
_OTHER_ITEMSIZES = {"pred": 1, "i1": 1, "s8": 1, "u8": 1, "i8": 1, "ui8": 1, "s16": 2, "u16": 2,
                    "i16": 2, "ui16": 2, "s32": 4, "u32": 4, "i32": 4, "ui32": 4, "s64": 8,
                    "u64": 8, "i64": 8, "ui64": 8, "c64": 8, "c128": 16, "complex64": 8,
                    "complex128": 16, "tf32": 4, "s4": 1, "u4": 1, "i4": 1, "ui4": 1, "s2": 1, "u2": 1,
                    "i2": 1, "ui2": 1}
_ITEMSIZES = {**_OTHER_ITEMSIZES, **{f.name: f.itemsize for f in FORMATS.values()},
              **{f.hlo: f.itemsize for f in FORMATS.values()}}


def format_of(dtype: Any) -> FloatFormat | None:
  """The :class:`FloatFormat` of ``dtype`` (a dtype, scalar type or name), or None for a
  type that is not floating."""
  if dtype is None:  # np.dtype(None) would be float64
    return None
  try:
    name = np.dtype(dtype).name
  except TypeError:
    return None
  return FORMATS.get(name)


def is_half(dtype: Any) -> bool:
  """Whether ``dtype`` is a half-precision (16-bit) floating format."""
  fmt = format_of(dtype)
  return fmt is not None and fmt.half


def itemsize(name: str) -> int:
  """Bytes per element of a type named as numpy, HLO or StableHLO name it (``'bfloat16'``,
  ``'bf16'``, ``'f8E4M3FN'``, ``'s32'``, ``'pred'``).

  Raises:
    ValueError: a name the table does not know (rather than a guessed size).
  """
  try:
    return _ITEMSIZES[name.lower()]
  except KeyError:
    raise ValueError(f"Unknown element type {name!r}: jaxamp.dtypes knows "
                     f"{', '.join(sorted(_ITEMSIZES))}.") from None
