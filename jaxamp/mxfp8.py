"""MXFP8: OCP Microscaling FP8, 32-element blocks sharing one power-of-two E8M0 scale.

The ``'mixed_mxfp8'`` policy (Transformer Engine's ``MXFP8BlockScaling``, a
:class:`jaxamp.scaled.ScaledFormat` plugged in through :func:`jaxamp.scaled.register`)
runs the matmuls FP8 runs (:mod:`jaxamp.fp8`'s layers) on the OCP Microscaling Formats
(MX) v1.0 MXFP8 format: each operand is cut into blocks of 32 consecutive elements along
the matmul's contraction, and each block is stored as 32 E4M3 elements and one shared
scale ``X = 2**e``, a ``float8_e8m0fnu`` (an 8-bit biased exponent: ``2**-127`` to
``2**127``, ``0xFF`` NaN, no zero, no sign). The element ``x`` is stored as
``q = E4M3(clip(x / X, -448, 448))`` (round to nearest even) and read back as ``q * X``.

- forward ``y = x @ W``: ``x`` in blocks along its features, ``W`` along its input rows;
- input gradient ``dx = g @ W^T``: ``g`` and ``W`` re-quantized from their
  high-precision values in blocks along the output features (this matmul's contraction);
- weight gradient ``dW = x^T @ g``: ``x`` and ``g`` in blocks along the batch.

All three products take E4M3 operands (TE's ``MXFP8BlockScaling`` default, and
``jax.nn.get_scaled_dot_general_config('mxfp8')``'s), accumulate in float32 and return the
compute dtype. A contraction that is not a multiple of 32 is padded with zeros to one:
the padding changes neither a block's amax nor the sum, so the product is exactly that
of a last block shorter than 32 (no warning; an MX GEMM needs whole blocks).

The scale of a block (``amax = max |x|`` over its 32 elements, float32):

- ``scale_rule='round_up'`` (the default): ``e = ceil(log2(amax / 448))``, the smallest
  power of two with ``amax / X <= 448``, so no element is clipped. This is the rule of
  ``jax.nn.scaled_dot_general`` (``jax/_src/cudnn/scaled_matmul_stablehlo.py``:
  ``quantize`` divides the amax by the E4M3 maximum and ``cast_to_e8m0_with_rounding_up``
  rounds it up to a power of two), of Transformer Engine's MXFP8 quantization and of
  cuBLAS's MX recipes; computed here exactly, from the amax's bits.
- ``scale_rule='ocp'``: the OCP MX v1.0 specification's rule (section 6.3),
  ``e = floor(log2(amax)) - emax_elem`` with ``emax_elem = 8`` for E4M3 (its largest power
  of two, 256): a block's largest element lands in ``[256, 512)``, so values above 448
  saturate to 448 (up to 12.5 % of the largest element lost), as the spec's conversion
  does; in exchange small elements keep up to one more bit.

Both clamp ``e`` to E8M0's ``[-127, 127]``. An all-zero block (whose ``log2`` is
``-inf``) gets the smallest scale, ``2**-127`` (E8M0 code 0), as ``jax.nn``'s rule gives
for amax 0; its elements are zeros. A block holding an inf or NaN gets the NaN scale
(code ``0xFF``) and NaN elements (E4M3 has no inf): the products it enters are NaN, so a
step with a non-finite input is skipped exactly, as without FP8. XLA on CPU flushes
float32 subnormals to zero (below ``2**-126``): such inputs quantize to zeros there.

The matmul on the quantized blocks is ``jax.lax.scaled_dot`` (E4M3 operands, E8M0 scales
``[..., rows, K / 32]``, float32 result): a ``stablehlo.composite "xla.scaled_dot"``
that XLA may run as a block-scaled GEMM where the backend has one, and otherwise runs
its decomposition (each block's elements times its scale, exactly, in bfloat16, then a
``dot_general`` accumulating in float32): on CPU, and on GPUs without MX tensor cores
(H100), an emulation with the numerics of the format. With ``cudnn=True`` a program
lowered for CUDA calls cuDNN's block-scaled GEMM instead (``jax.nn.scaled_matmul``, the
``__op$block_scaled_dot`` custom call: Blackwell GPUs only; elsewhere the same
``lax.scaled_dot``). ``jax.nn.scaled_dot_general`` itself is not used: it raises on CPU
(its ``scaled_matmul`` primitive lowers for CUDA and ROCm only) and has only the
round-up rule.

Example:
  >>> import jax, jax.numpy as jnp, jaxamp
  >>> x = jnp.arange(64.0).reshape(2, 32)      # two blocks (rows), amax 31 and 63
  >>> q, s = jax.jit(jaxamp.mxfp8.quantize)(x)
  >>> q.dtype, s.dtype, s.shape, s.astype(jnp.float32)[:, 0].tolist()
  (dtype(float8_e4m3fn), dtype(float8_e8m0fnu), (2, 1), [0.125, 0.25])
  >>> jax.jit(jaxamp.mxfp8.dequantize)(q, s)[1, -4:].tolist()  # 60..63 / 0.25 in E4M3
  [60.0, 60.0, 64.0, 64.0]
  >>> jaxamp.get_policy('mixed_mxfp8').fp8
  MXFP8Scaling(scale_rule='round_up', cudnn=False)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp import dtypes, scaled
from jaxamp.recipes import E4M3

__all__ = ["BLOCK_SIZE", "E8M0", "MXFP8", "MXFP8Scaling", "MXFP8_FORMAT", "SCALE_RULES", "block_exponents",
           "dequantize", "mxfp8_dot_general", "quantize"]

_F32 = jnp.float32
E8M0 = jnp.float8_e8m0fnu
BLOCK_SIZE = 32  # OCP MX v1.0: k = 32 for every MX format
SCALE_RULES = ("round_up", "ocp")
_EMAX_ELEM = 8  # E4M3's largest power of two, 2**8 (OCP MX v1.0, table 2: emax_elem)
_E_MIN, _E_MAX = -127, 127  # E8M0's exponents; code = e + 127, 0xFF is NaN
_E4M3_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class MXFP8Scaling:
  """The MXFP8 recipe (``'mixed_mxfp8'``; the module docstring has the rule).

  Args:
    scale_rule: ``'round_up'`` (``2**ceil(log2(amax / 448))``, never saturates: jax.nn's,
      Transformer Engine's and cuBLAS's) or ``'ocp'`` (the OCP MX v1.0 spec's
      ``2**(floor(log2(amax)) - 8)``, saturating the largest values to 448).
    cudnn: in a program lowered for CUDA, run the block-scaled product through
      ``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM: Blackwell GPUs only) instead
      of ``jax.lax.scaled_dot``.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> p = jaxamp.Policy(jnp.float32, jnp.bfloat16, fp8=jaxamp.MXFP8Scaling(scale_rule='ocp'))
    >>> p.fp8.scale_rule
    'ocp'
  """

  scale_rule: str = "round_up"
  cudnn: bool = False

  def __post_init__(self):
    if self.scale_rule not in SCALE_RULES:
      raise ValueError(f"MXFP8Scaling.scale_rule must be one of {SCALE_RULES}, got "
                       f"{self.scale_rule!r}.")
    if not isinstance(self.cudnn, bool):
      raise ValueError(f"MXFP8Scaling.cudnn must be a bool, got {self.cudnn!r}.")


def _check_rule(scale_rule: str) -> None:
  if scale_rule not in SCALE_RULES:
    raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}.")


# --- exact powers of two (XLA on CPU flushes subnormals: no factor below 2**-126) --------


def _pow2(k: jax.Array) -> jax.Array:
  """``2.0 ** k`` for int32 ``k`` in ``[-126, 127]``, exactly (its float32 bits)."""
  return lax.bitcast_convert_type(((k + 127).astype(jnp.uint32) << 23), _F32)


def _times_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
  """``x * 2**k`` for ``|k| <= 254`` as two exact multiplications by normal powers of
  two (``2**-127`` itself is a float32 subnormal, which XLA on CPU reads as 0)."""
  half = k // 2
  return x * _pow2(half) * _pow2(k - half)


def block_exponents(amax: jax.Array, scale_rule: str = "round_up") -> jax.Array:
  """Each block's scale exponent ``e`` (int32; the scale is ``2**e``) from its finite
  float32 ``amax``: ``ceil(log2(amax / 448))`` (``'round_up'``) or ``floor(log2(amax)) -
  8`` (``'ocp'``), clamped to ``[-127, 127]``; ``-127`` where ``amax`` is 0.

  Read off the amax's bits, exactly: with ``amax = 2**E * (1 + m)``, ``floor(log2 amax) =
  E``, and ``amax / 448 = 2**(E - 8) * (1 + m) / 1.75`` rounds up to ``2**(E - 8)``, or
  ``2**(E - 7)`` where ``1 + m > 1.75``.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> amax = jnp.array([448.0, 449.0, 0.0, 1.0])
    >>> jaxamp.mxfp8.block_exponents(amax).tolist()
    [0, 1, -127, -8]
    >>> jaxamp.mxfp8.block_exponents(amax, 'ocp').tolist()
    [0, 0, -127, -8]
  """
  _check_rule(scale_rule)
  bits = lax.bitcast_convert_type(amax.astype(_F32), jnp.uint32)
  biased = ((bits >> 23) & 0xFF).astype(jnp.int32)
  e = biased - 127 - _EMAX_ELEM
  if scale_rule == "round_up":
    e = e + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
  # Zero (and a subnormal amax, below any E8M0 scale's reach) takes the smallest scale.
  return jnp.clip(jnp.where(biased == 0, _E_MIN, e), _E_MIN, _E_MAX)


def _blocks(x: jax.Array) -> jax.Array:
  """``x`` float32 with its last axis padded with zeros to whole blocks and split:
  ``[..., K / 32, 32]``."""
  k = x.shape[-1]
  pad = -k % BLOCK_SIZE
  x = x.astype(_F32)
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(x.shape[:-1] + ((k + pad) // BLOCK_SIZE, BLOCK_SIZE))


def _quantize_padded(x: jax.Array, scale_rule: str) -> tuple[jax.Array, jax.Array]:
  """``(q, s)``: ``q`` E4M3 ``[..., Kp]`` (``K`` padded to whole blocks), ``s`` E8M0
  ``[..., Kp / 32]``."""
  xb = _blocks(x)
  amax = jnp.max(jnp.abs(xb), axis=-1)  # NaN where the block holds one
  finite = jnp.isfinite(amax)
  e = block_exponents(jnp.where(finite, amax, 0.0), scale_rule)
  y = jnp.clip(_times_pow2(xb, -e[..., None]), -_E4M3_MAX, _E4M3_MAX)
  q = jnp.where(finite[..., None], y, jnp.nan).astype(E4M3)
  code = jnp.where(finite, e + 127, 255).astype(jnp.uint8)
  return q.reshape(xb.shape[:-2] + (-1,)), lax.bitcast_convert_type(code, E8M0)


def quantize(x: jax.Array, scale_rule: str = "round_up") -> tuple[jax.Array, jax.Array]:
  """``x`` in MXFP8 blocks along its last axis: ``(q, s)``, ``q`` E4M3 of ``x``'s shape and
  ``s`` the E8M0 scales ``[..., ceil(K / 32)]`` (a last partial block is padded with
  zeros). :func:`dequantize` reads them back.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> import jax
    >>> x = jnp.array([[1.0, 500.0, 3.0], [1.0, 500.0, jnp.nan]])
    >>> q, s = jax.jit(jaxamp.mxfp8.quantize)(x)
    >>> q.astype(jnp.float32).tolist()    # scale 2: 500 / 2 = 250 rounds to 256 in E4M3
    [[0.5, 256.0, 1.5], [nan, nan, nan]]
    >>> s.astype(jnp.float32).tolist()    # a block with a NaN: the NaN scale
    [[2.0], [nan]]
  """
  _check_rule(scale_rule)
  q, s = _quantize_padded(jnp.asarray(x), scale_rule)
  return q[..., :x.shape[-1]], s


def dequantize(q: jax.Array, s: jax.Array) -> jax.Array:
  """float32 ``q * s``: each E4M3 element times its block's E8M0 scale (blocks of 32
  along the last axis), exactly; NaN where the scale is NaN."""
  code = lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32)
  k = q.shape[-1]
  qb = _blocks(q.astype(_F32))
  out = jnp.where(code[..., None] == 255, jnp.nan,
                  _times_pow2(qb, code[..., None] - 127))
  return out.reshape(qb.shape[:-2] + (-1,))[..., :k]


# --- the block-scaled dot -------------------------------------------------------------


def _as_rows(x: jax.Array, contract: tuple[int, ...], batch: tuple[int, ...]) -> jax.Array:
  """``x`` as ``[*batch, rows, K]``: its batch dimensions, its free ones flattened, its
  contracted ones flattened (the blocks run along ``K``)."""
  free = [i for i in range(x.ndim) if i not in contract and i not in batch]
  t = jnp.transpose(x, list(batch) + free + list(contract))
  return t.reshape([x.shape[i] for i in batch]
                   + [math.prod(x.shape[i] for i in free),
                      math.prod(x.shape[i] for i in contract)])


def _cudnn_product(qa, sa, qb, sb):
  """``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM) on ``[*batch, rows, Kp]``."""
  lead = qa.shape[:-2]
  b = math.prod(lead)
  to3 = lambda t: t.reshape((b,) + t.shape[-2:])
  out = jax.nn.scaled_matmul(to3(qa), to3(qb), to3(sa), to3(sb),
                             preferred_element_type=_F32)
  return out.reshape(lead + out.shape[-2:])


def _lax_product(qa, sa, qb, sb):
  """``jax.lax.scaled_dot`` on ``[*batch, rows, Kp]`` operands: ``[*batch, M, N]``."""
  n = qa.ndim
  batch = tuple(range(n - 2))
  return lax.scaled_dot(qa, qb, lhs_scale=sa, rhs_scale=sb,
                        dimension_numbers=(((n - 1,), (n - 1,)), (batch, batch)),
                        preferred_element_type=_F32)


def _mx_dot(a, b, dims, scale_rule, cudnn):
  """``dot_general(a, b, dims)`` on MXFP8 operands, each in blocks along its own
  contraction: float32, laid out as ``lax.dot_general``'s result."""
  (ac, bc), (ab, bb) = dims
  qa, sa = _quantize_padded(_as_rows(a, ac, ab), scale_rule)
  qb, sb = _quantize_padded(_as_rows(b, bc, bb), scale_rule)
  if cudnn:
    out = lax.platform_dependent(qa, sa, qb, sb, cuda=_cudnn_product,
                                 default=_lax_product)
  else:
    out = _lax_product(qa, sa, qb, sb)
  free = lambda x, c, bt: [x.shape[i] for i in range(x.ndim) if i not in c and i not in bt]
  return out.reshape([a.shape[i] for i in ab] + free(a, ac, ab) + free(b, bc, bb))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _mxfp8_dot(lhs, rhs, amaxes, dims, scale_rule, cudnn):
  del amaxes
  return _mx_dot(lhs, rhs, dims, scale_rule, cudnn).astype(lhs.dtype)


def _mxfp8_dot_fwd(lhs, rhs, amaxes, dims, scale_rule, cudnn):
  return _mxfp8_dot(lhs, rhs, amaxes, dims, scale_rule, cudnn), (lhs, rhs)


def _mxfp8_dot_bwd(dims, scale_rule, cudnn, residuals, g):
  lhs, rhs = residuals
  (lc, rc), (lb, rb) = dims
  dot = lambda a, b, d: _mx_dot(a, b, d, scale_rule, cudnn)
  d_lhs = scaled.transpose_lhs(g, lhs.ndim, rhs.ndim, dims, lambda g_, d: dot(g_, rhs, d))
  d_rhs = scaled.transpose_lhs(g, rhs.ndim, lhs.ndim, ((rc, lc), (rb, lb)),
                               lambda g_, d: dot(g_, lhs, d), swap_ans=True)
  amaxes = jnp.stack([scaled.amax(lhs), scaled.amax(rhs), scaled.amax(g)])
  return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), amaxes


_mxfp8_dot.defvjp(_mxfp8_dot_fwd, _mxfp8_dot_bwd)


def mxfp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                      precision: Any = None, preferred_element_type: Any = None, *,
                      state: jax.Array | None = None, recipe: MXFP8Scaling | None = None,
                      **kwargs: Any) -> jax.Array:
  """``lax.dot_general`` with MXFP8 operands (``lhs`` the input, ``rhs`` the kernel):
  E4M3 blocks of 32 along each product's contraction with E8M0 scales, forward and both
  gradients; float32 accumulation; the result in ``preferred_element_type`` (None:
  ``lhs``'s dtype). ``precision`` is ignored.

  ``state``: the module's float32 ``[3]`` amaxes (under ``jax.grad`` their cotangent is
  this pass's largest input, kernel and output-gradient magnitudes); None: zeros.
  ``recipe``: a :class:`MXFP8Scaling`; None: the default one. ``kwargs``:
  ``out_sharding`` (Flax layers pass it; must be None).

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> import jax
    >>> x, w = jnp.ones((2, 40)), jnp.full((40, 3), 0.5)   # 40: padded to 2 blocks
    >>> dot = jax.jit(jaxamp.mxfp8.mxfp8_dot_general, static_argnums=2)
    >>> dot(x, w, (((1,), (0,)), ((), ()))).tolist()
    [[20.0, 20.0, 20.0], [20.0, 20.0, 20.0]]
  """
  del precision
  scaled.refuse_extra_arguments(kwargs, "MXFP8 dot", "mxfp8_dot_general")
  recipe = MXFP8Scaling() if recipe is None else recipe
  state = jnp.zeros((3,), _F32) if state is None else state
  dtype = jnp.result_type(lhs) if preferred_element_type is None else preferred_element_type
  rhs = rhs.astype(lhs.dtype) if rhs.dtype != lhs.dtype else rhs
  out = _mxfp8_dot(lhs, rhs, state, scaled.dims(dimension_numbers), recipe.scale_rule,
                   recipe.cudnn)
  return out.astype(dtype)


class MXFP8(scaled.ScaledFormat):
  """The :class:`jaxamp.scaled.ScaledFormat` of :class:`MXFP8Scaling`. Its state per
  module, float32 ``[3]``, is the last pass's largest input, kernel and output-gradient
  magnitudes (for inspection: every block's scale is its own, of this pass)."""

  name = "MXFP8"
  min_compute_capability = 10.0  # MX block-scaled tensor cores: Blackwell
  census_dtypes = dtypes.FP8

  def init_state(self, recipe: MXFP8Scaling) -> jax.Array:
    return jnp.zeros((3,), _F32)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, state, recipe, **kwargs):
    return mxfp8_dot_general(lhs, rhs, dimension_numbers, precision,
                             preferred_element_type, state=state, recipe=recipe, **kwargs)

  def update(self, state: jax.Array, cotangent: jax.Array,
             recipe: MXFP8Scaling) -> jax.Array:
    return cotangent

  def stateless_warning(self, recipe: MXFP8Scaling, what: str) -> str | None:
    return None  # each block's scale is of this pass: the same without state

  def whatif(self, x: jax.Array, role: str, recipe: MXFP8Scaling) -> tuple[jax.Array, Any]:
    """The numerics monitor's what-if (:attr:`jaxamp.scaled.ScaledFormat.whatif`): each
    block of 32 along the contraction divided by its power-of-two scale, E4M3 (the
    ``'ocp'`` rule's largest values exceed 448: they saturate)."""
    del role  # E4M3 for every operand, every layout
    xb = _blocks(x)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    e = block_exponents(jnp.where(jnp.isfinite(amax), amax, 0.0), recipe.scale_rule)
    y = _times_pow2(xb, -e[..., None])
    return y.reshape(xb.shape[:-2] + (-1,))[..., :x.shape[-1]], E4M3

  def describe(self, recipe: MXFP8Scaling) -> str:
    """What a report prints for a matmul run in this format.

    Example:
      >>> import jaxamp
      >>> jaxamp.mxfp8.MXFP8_FORMAT.describe(jaxamp.MXFP8Scaling())
      'mxfp8 e4m3fn, 1x32 blocks, e8m0 scales (round_up)'
    """
    return f"mxfp8 e4m3fn, 1x{BLOCK_SIZE} blocks, e8m0 scales ({recipe.scale_rule})"


MXFP8_FORMAT = MXFP8()
scaled.register(MXFP8Scaling, MXFP8_FORMAT, names={"mxfp8": MXFP8Scaling},
                policies={"mixed_mxfp8": MXFP8Scaling})
