"""Block-scaled FP8: DeepSeek-V3's fine-grained quantization, 1x128 tiles and 128x128 blocks.

The ``'mixed_fp8_block'`` policy (:class:`BlockScaling`, a
:class:`jaxamp.scaled.ScaledFormat` plugged in through :func:`jaxamp.scaled.register`)
runs the matmuls FP8 runs (:mod:`jaxamp.fp8`'s layers) with the scheme of the DeepSeek-V3
technical report (section 3.3.2, "Fine-grained quantization"; Transformer Engine's
``Float8BlockScaling``, DeepGEMM's reference casts): *current* scaling, every operand
E4M3, and

- activations and output gradients: one scale per row per tile of ``act_block`` (128)
  consecutive elements along the matmul's contraction (``[M, K/128]`` scales for an
  ``[M, K]`` input);
- weights: one scale per ``weight_block`` (128x128) block (``[K/128, N/128]`` scales for
  a ``[K, N]`` kernel).

Each backward matmul quantizes its operands again, from their high-precision values,
along its own contraction (DeepSeek's Figure 7, TE): the input gradient ``dx = g @ W^T``
takes ``g`` in 1x128 tiles along the output features and ``W`` in its 128x128 blocks; the
weight gradient ``dW = x^T @ g`` takes ``x`` and ``g`` in tiles of 128 along the batch
(their contraction). The backward pass so keeps the input and kernel in the compute
dtype.

The rule, per tile or block (``amax = max |x|`` over it, float32): the multiplier ``s =
448 / max(amax, 1e-12)``, so a dequantizing scale of ``amax / 448``; with
``power_of_two=True`` rounded down to a power of two (TE's ``force_pow_2_scales``, its
default for this recipe); ``s = 1`` where the amax is 0 (an all-zero tile) or not finite.
``q = clip(x * s, -448, 448)`` cast to E4M3 (round to nearest even), NaN where ``x`` is
not finite (E4M3 has no inf): the NaN reaches the product, so a non-finite batch is
skipped exactly. Dequantized: ``q / s``. The ``1e-12`` floor on the amax (torchao's, as
:mod:`jaxamp.rowwise`) only keeps ``448 / amax`` finite; DeepGEMM's reference clamps the
amax at ``1e-4`` instead, which changes only tiles whose amax is below ``1e-4``.

The product, accumulated in float32 as DeepSeek promotes it: the contraction is split
into chunks of 128 (the tile), each chunk's FP8 partial product is one ``dot_general``
on E4M3 operands with a float32 result (a batch dimension of chunks), divided by the
chunk's activation-row and weight-block scales, and the chunks summed in float32. So the
lowered program has E4M3 operands, the ``[M, K/128]`` and ``[K/128, N/128]`` scales, and
a float32 ``[K/128, M, N]`` partial product: on CPU it is emulated (FP8 upcast), and no
GPU GEMM with block scales is called (XLA has none to fuse into), so it costs more
memory and time than ``'mixed_fp8'``.

Shapes that do not divide the tiles (a contraction of 200, a kernel of 200x100) are padded
with zeros up to the block multiple, which changes neither an amax nor a product, and the
result sliced back: every matmul runs the recipe, none falls back. Several contracted
dimensions (a ``DenseGeneral``) are flattened, in order, into one contraction; batch
dimensions (an ``Einsum``'s) get their own tiles and blocks.

Under :func:`jaxamp.fsdp` a 2-D kernel read as one matrix (not an Einsum's nor a
convolution's) is gathered as E4M3 values and one float32 amax per block where the
weight blocks are square and no block straddles two devices, the block matmul getting
the same E4M3 values bit for bit (:func:`jaxamp.fp8_gather.gather_e4m3_blocks`).

Example:
  >>> import jax.numpy as jnp, jaxamp
  >>> x = jnp.arange(256.0).reshape(1, 256)
  >>> q, s = jaxamp.block.quantize(x, (1, 128))
  >>> s.shape, (448 / s).tolist()  # one scale per 128 elements: amax / 448 dequantizes
  ((1, 2), [[127.0, 255.0]])
  >>> jaxamp.get_policy('mixed_fp8_block').fp8
  BlockScaling(act_block=128, weight_block=(128, 128), power_of_two=False)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp import dtypes, fp8_gather, scaled
from jaxamp.recipes import E4M3

__all__ = ["EPS", "BlockFp8", "BlockScaling", "block_dot_general", "block_scale",
           "dequantize", "quantize"]

_F32 = jnp.float32
EPS = 1e-12  # the floor on a tile's amax: keeps 448 / amax finite


def _positive_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True)
class BlockScaling:
  """The block-scaled FP8 recipe (``'mixed_fp8_block'``; the module docstring has the
  rule).

  Args:
    act_block: how many consecutive elements along the contraction share a scale in an
      activation or output gradient (a ``1 x act_block`` tile). DeepSeek-V3: 128.
    weight_block: the ``(rows, columns)`` of a weight block sharing one scale, rows along
      the forward contraction. DeepSeek-V3: ``(128, 128)``.
    power_of_two: round each scale down to a power of two (Transformer Engine's
      ``Float8BlockScaling`` does by default): ``s = 2**floor(log2(448 / amax))``.

  Example:
    >>> import jaxamp
    >>> jaxamp.BlockScaling(act_block=64, weight_block=(64, 64)).weight_block
    (64, 64)
  """

  act_block: int = 128
  weight_block: tuple[int, int] = (128, 128)
  power_of_two: bool = False

  def __post_init__(self):
    if not _positive_int(self.act_block):
      raise ValueError(f"BlockScaling.act_block must be an int > 0, got "
                       f"{self.act_block!r}.")
    block = self.weight_block
    if isinstance(block, list):
      block = tuple(block)
      object.__setattr__(self, "weight_block", block)  # hashable, as a policy must be
    if not (isinstance(block, tuple) and len(block) == 2 and all(map(_positive_int, block))):
      raise ValueError(f"BlockScaling.weight_block must be a pair of ints > 0 (rows, "
                       f"columns), got {self.weight_block!r}.")
    if not isinstance(self.power_of_two, bool):
      raise ValueError(f"BlockScaling.power_of_two must be a bool, got "
                       f"{self.power_of_two!r}.")


def _pad_last_two(x: jax.Array, multiples: tuple[int, int]) -> jax.Array:
  pad = [(0, 0)] * (x.ndim - 2) + [(0, -x.shape[-2] % multiples[0]),
                                   (0, -x.shape[-1] % multiples[1])]
  return jnp.pad(x, pad) if any(hi for _, hi in pad) else x


def block_scale(x: jax.Array, block: tuple[int, int], dtype: Any = E4M3,
                power_of_two: bool = False) -> jax.Array:
  """The multiplier of each ``block`` of ``x``'s last two dimensions (zero-padded to a
  multiple of it): ``FP8_MAX / max(amax, 1e-12)``, rounded down to a power of two with
  ``power_of_two``; 1 where the amax is 0 or not finite. float32, ``[..., ceil(R / rows),
  ceil(C / columns)]``.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> x = jnp.array([[3.0, -1.0, 0.0, 0.0], [1.0, 2.0, jnp.inf, 1.0]])
    >>> jaxamp.block.block_scale(x, (1, 2), power_of_two=True).tolist()
    [[128.0, 1.0], [128.0, 1.0]]
  """
  return _scale_of(_block_amax(x, block), dtype, power_of_two)


def _block_amax(x: jax.Array, block: tuple[int, int]) -> jax.Array:
  """Each ``block``'s largest magnitude, float32; NaN where the block is not finite."""
  rows, cols = block
  xp = _pad_last_two(x.astype(_F32), block)
  *lead, r, c = xp.shape
  tiles = xp.reshape(*lead, r // rows, rows, c // cols, cols)
  amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
  # Not finite where any element is: XLA's CPU max reductions may drop a NaN.
  finite = jnp.all(jnp.isfinite(tiles), axis=(-3, -1))
  return jnp.where(finite, amax, jnp.nan)


def _scale_of(amax: jax.Array, dtype: Any, power_of_two: bool) -> jax.Array:
  """The multiplier of a block of amax ``amax`` (:func:`_block_amax`'s, NaN: not finite)."""
  s = dtypes.format_of(dtype).max / jnp.maximum(amax, EPS)
  if power_of_two:
    # 2**floor(log2(s)), exactly: s is a positive normal float32 (at most 448 / 1e-12),
    # so clearing its mantissa bits rounds it down to a power of two.
    bits = lax.bitcast_convert_type(s.astype(_F32), jnp.uint32)
    s = lax.bitcast_convert_type(bits & jnp.uint32(0xFF800000), _F32)
  return jnp.where((amax > 0) & jnp.isfinite(amax), s, 1.0).astype(_F32)


def _per_element(s: jax.Array, block: tuple[int, int], shape: tuple[int, ...]) -> jax.Array:
  """Each block's value spread over its elements, cut to ``shape``'s last two dims."""
  s = jnp.repeat(jnp.repeat(s, block[0], axis=-2), block[1], axis=-1)
  return s[..., :shape[-2], :shape[-1]]


def quantize(x: jax.Array, block: tuple[int, int], dtype: Any = E4M3,
             power_of_two: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x`` quantized to ``dtype`` with one scale per ``block`` of its last two dimensions:
  ``(q, s)``, ``q = clip(x * s)`` in ``dtype`` (non-finite elements NaN) of ``x``'s shape,
  ``s`` the :func:`block_scale`; :func:`dequantize` inverts it.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> q, s = jaxamp.block.quantize(jnp.array([[1.0, 448.0, 0.0]]), (1, 2))
    >>> q.dtype, q.tolist(), s.tolist()
    (dtype(float8_e4m3fn), [[1.0, 448.0, 0.0]], [[1.0, 1.0]])
  """
  s = block_scale(x, block, dtype, power_of_two)
  return _quantize_with(x, s, block, dtype), s


def _quantize_with(x: jax.Array, s: jax.Array, block: tuple[int, int],
                   dtype: Any = E4M3) -> jax.Array:
  """``clip(x * s)`` in ``dtype`` with each block's multiplier ``s``, NaN where ``x`` is
  not finite."""
  fp8_max = dtypes.format_of(dtype).max
  x32 = x.astype(_F32)
  scaled_x = jnp.clip(x32 * _per_element(s, block, x.shape), -fp8_max, fp8_max)
  return jnp.where(jnp.isfinite(x32), scaled_x, jnp.nan).astype(dtype)


def dequantize(q: jax.Array, s: jax.Array, block: tuple[int, int]) -> jax.Array:
  """``q / s`` with each block's ``s`` (what :func:`quantize` returned), float32, each
  element divided (not multiplied by a reciprocal: exact to the rule)."""
  # The barrier keeps XLA from rewriting a division by a broadcast scale into a
  # multiplication by its reciprocal, one rounding off.
  return q.astype(_F32) / lax.optimization_barrier(_per_element(s, block, q.shape))


def _tiled_dot(a: jax.Array, b: jax.Array, a_block: tuple[int, int],
               b_block: tuple[int, int], power_of_two: bool) -> jax.Array:
  """``a [*B, M, K] @ b [*B, K, N]`` in float32 on E4M3 operands, ``a`` scaled per
  ``a_block`` (rows, K), ``b`` per ``b_block`` (K, columns): the contraction split into
  chunks each operand's scales are constant on, each chunk's FP8 partial product
  divided by its scales, the chunks summed in float32."""
  m, k = a.shape[-2:]
  n = b.shape[-1]
  ka, kb = a_block[1], b_block[0]
  chunk = math.gcd(ka, kb)
  k_pad = -k % (ka * kb // chunk)
  if k_pad:  # zeros: no amax nor product changes
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, k_pad)])
    b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, k_pad), (0, 0)])
  qa, sa = quantize(a, a_block, E4M3, power_of_two)
  qb, sb = quantize(b, b_block, E4M3, power_of_two)
  lead, nb, chunks = a.shape[:-2], a.ndim - 2, (k + k_pad) // chunk
  # Each row's (resp. column's) multiplier per chunk: [*B, M, chunks], [*B, chunks, N].
  sa_rows = jnp.repeat(jnp.repeat(sa, a_block[0], axis=-2)[..., :m, :], ka // chunk, axis=-1)
  sb_cols = jnp.repeat(jnp.repeat(sb, kb // chunk, axis=-2), b_block[1], axis=-1)[..., :n]
  batch = tuple(range(nb))
  part = lax.dot_general(  # [*B, chunks, M, N]: one FP8 product per chunk
      qa.reshape(*lead, m, chunks, chunk), qb.reshape(*lead, chunks, chunk, n),
      (((nb + 2,), (nb + 1,)), (batch + (nb + 1,), batch + (nb,))),
      preferred_element_type=_F32)
  # Divided one scale at a time (as q / s dequantizes): no product of two scales to
  # overflow or underflow float32.
  part = part / jnp.swapaxes(sa_rows, -1, -2)[..., None] / sb_cols[..., None, :]
  return jnp.sum(part, axis=nb)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _block_matmul(a, b, amaxes, recipe):
  del amaxes
  return _tiled_dot(a, b, *_blocks(recipe, "fwd"), recipe.power_of_two).astype(a.dtype)


def _block_matmul_fwd(a, b, amaxes, recipe):
  return _block_matmul(a, b, amaxes, recipe), (a, b)


def _blocks(recipe: BlockScaling, role: str) -> tuple[tuple[int, int], tuple[int, int]]:
  """The blocks of ``a`` and ``b`` in ``a [*B, M, K] @ b [*B, K, N]`` for ``role``."""
  t, (wr, wc) = recipe.act_block, recipe.weight_block
  # fwd x @ W: x in 1 x t tiles, W in its blocks. dgrad g @ W^T: g in 1 x t tiles along
  # the outputs, W in its own blocks. wgrad x^T @ g: both in tiles of t along the batch.
  return {"fwd": ((1, t), (wr, wc)), "dgrad": ((1, t), (wc, wr)),
          "wgrad": ((1, t), (t, 1))}[role]


def _block_matmul_bwd(recipe, residuals, g):
  a, b = residuals
  p2 = recipe.power_of_two
  g = g.astype(a.dtype)
  da = _tiled_dot(g, jnp.swapaxes(b, -1, -2), *_blocks(recipe, "dgrad"), p2)
  db = _tiled_dot(jnp.swapaxes(a, -1, -2), g, *_blocks(recipe, "wgrad"), p2)
  amaxes = jnp.stack([scaled.amax(a), scaled.amax(b), scaled.amax(g)])
  return da.astype(a.dtype), db.astype(b.dtype), amaxes


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def block_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                      precision: Any = None, preferred_element_type: Any = None, *,
                      state: jax.Array | None = None, recipe: BlockScaling | None = None,
                      **kwargs: Any) -> jax.Array:
  """``lax.dot_general`` with block-scaled E4M3 operands (``lhs`` the input, in 1x128
  tiles; ``rhs`` the kernel, in 128x128 blocks), float32 accumulation, the result in
  ``preferred_element_type`` (None: ``lhs``'s dtype). ``precision`` is ignored.

  The operands are laid out as ``[*batch, M, K]`` and ``[*batch, K, N]`` (the contracted
  dimensions flattened in order, the free ones into ``M`` and ``N``) and the result laid
  back out as ``dot_general``'s.

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type: as
      ``lax.dot_general``'s.
    state: the module's float32 ``[3]`` amaxes (under ``jax.grad`` their cotangent is
      this pass's largest input, kernel and output-gradient magnitudes); None: zeros.
    recipe: a :class:`BlockScaling`; None: the default one.
    **kwargs: ``out_sharding`` (Flax layers pass it; must be None).
  """
  del precision
  scaled.refuse_extra_arguments(kwargs, "block FP8 dot", "block_dot_general")
  recipe = BlockScaling() if recipe is None else recipe
  state = jnp.zeros((3,), _F32) if state is None else state
  dtype = jnp.result_type(lhs) if preferred_element_type is None else preferred_element_type
  rhs = rhs.astype(lhs.dtype) if rhs.dtype != lhs.dtype else rhs
  a, b, back = scaled.matmul_layout(lhs, rhs, dimension_numbers)
  return back(_block_matmul(a, b, state, recipe)).astype(dtype)


class BlockFp8(scaled.ScaledFormat):
  """The :class:`jaxamp.scaled.ScaledFormat` of :class:`BlockScaling`. Its state per
  module, float32 ``[3]``, is the last pass's largest input, kernel and output-gradient
  magnitudes (for inspection: the scales are each pass's own)."""

  name = "FP8 block"
  census_dtypes = frozenset({"float8_e4m3fn"})

  def init_state(self, recipe: BlockScaling) -> jax.Array:
    return jnp.zeros((3,), _F32)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, state, recipe, **kwargs):
    return block_dot_general(lhs, rhs, dimension_numbers, precision,
                             preferred_element_type, state=state, recipe=recipe, **kwargs)

  def update(self, state: jax.Array, cotangent: jax.Array,
             recipe: BlockScaling) -> jax.Array:
    return cotangent

  def stateless_warning(self, recipe: BlockScaling, what: str) -> str | None:
    return None  # current scaling: the same without state

  def product(self, role: str, a: jax.Array, b: jax.Array,
              recipe: BlockScaling) -> jax.Array:
    """One of the three matmuls (:meth:`jaxamp.scaled.ScaledFormat.product`)."""
    return _tiled_dot(a, b, *_blocks(recipe, role), recipe.power_of_two)

  def whatif(self, x: jax.Array, role: str, recipe: BlockScaling) -> tuple[jax.Array, Any]:
    """The numerics monitor's what-if (:attr:`jaxamp.scaled.ScaledFormat.whatif`): an
    input or output gradient scaled per ``1 x act_block`` tile along its contraction (the
    features; the tokens in the weight-gradient product), E4M3."""
    del role  # every layout alike
    tile = (1, recipe.act_block)
    s = block_scale(x, tile, E4M3, recipe.power_of_two)
    return x.astype(_F32) * _per_element(s, tile, x.shape), E4M3

  def gathers_read(self, read: str, recipe: BlockScaling) -> bool:
    """Only kernels read as one matrix (:meth:`jaxamp.scaled.ScaledFormat.gathers_read`):
    an Einsum's pattern may make a kernel dimension a batch one, a convolution reads its
    kernel as an im2col GEMM; their blocks are not the stored kernel's."""
    del recipe
    return read == "matrix"

  def block_rule(self, recipe: BlockScaling) -> fp8_gather.BlockRule:
    """The recipe's weight-block rule, as :func:`jaxamp.fp8_gather.gather_e4m3_blocks`
    takes it."""
    block = recipe.weight_block
    return fp8_gather.BlockRule(
        block, functools.partial(_block_amax, block=block),
        functools.partial(_scale_of, dtype=E4M3, power_of_two=recipe.power_of_two),
        functools.partial(_quantize_with, block=block),
        lambda per_block, shape: _per_element(per_block, block, shape))

  def gather_quantized(self, x, axes, gather, recipe, state=None):
    """FSDP's kernel gather in E4M3 with per-block amaxes
    (:func:`jaxamp.fp8_gather.gather_e4m3_blocks`): square weight blocks only, which
    the forward, the input gradient and a kernel stored ``[out, in]`` all read alike."""
    del axes, state  # each block's amax is its own: nothing to reduce across devices
    rows, cols = recipe.weight_block
    if rows != cols:
      return None
    return fp8_gather.gather_e4m3_blocks(x, gather, self.block_rule(recipe))

  def describe(self, recipe: BlockScaling) -> str:
    """``'fp8 e4m3fn, 1x128 act / 128x128 weight blocks'`` (``', pow2 scales'`` added
    with ``power_of_two``)."""
    rows, cols = recipe.weight_block
    return (f"fp8 e4m3fn, 1x{recipe.act_block} act / {rows}x{cols} weight blocks"
            + (", pow2 scales" if recipe.power_of_two else ""))


BLOCK = BlockFp8()
scaled.register(BlockScaling, BLOCK, names={"block": BlockScaling},
                policies={"mixed_fp8_block": BlockScaling})
