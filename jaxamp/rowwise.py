"""Rowwise FP8: one scale per row of the input and per output column of the kernel.

The ``'mixed_fp8_rowwise'`` policy (torchao's ``rowwise`` recipe, a
:class:`jaxamp.scaled.ScaledFormat` plugged in through :func:`jaxamp.scaled.register`)
runs the matmuls FP8 runs (:mod:`jaxamp.fp8`'s layers) with *current* scaling (no state
carried between steps) and one scale per row of each operand along the matmul's
contraction:

- forward ``y = x @ W``: ``x`` scaled per row (amax over the contracted dimension),
  ``W`` per output column (amax over the contracted dimension), both E4M3 (max 448);
- input gradient ``dx = g @ W^T``: ``g`` E5M2 (max 57344) per row (amax over the output
  features), ``W`` re-quantized from its high-precision value to E4M3 per input row
  (amax over the output features): each operand is scaled along its own contraction, so
  the scales factor out of the sum, as an FP8 GEMM with row/column scales needs;
- weight gradient ``dW = x^T @ g``: ``x`` E4M3 and ``g`` E5M2 scaled per column along
  the batch (their contraction), or, with ``wgrad_high_precision=True`` (torchao's
  ``rowwise_with_gw_hp``), in the compute dtype without quantization.

Products are accumulated in float32 and returned in the compute dtype. The backward
pass keeps the input and the kernel in the compute dtype (each backward matmul quantizes
them along its own contraction), as torchao does.

The scale rule (for each row, ``amax = max |x|`` over the contracted dimensions; FP8's
multiplier, what a value is multiplied by before the cast): ``s = FP8_MAX /
max(amax, 1e-12)`` (torchao's ``amax_to_scale``, its ``EPS = 1e-12``), i.e. a dequantizing
scale ``amax / 448`` for E4M3; with ``power_of_two=True`` the multiplier is rounded *down*
to a power of two, ``s = 2**floor(log2(s))`` (torchao's
``_round_scale_down_to_power_of_2``, ``torch.exp2(torch.floor(torch.log2(scale)))``,
applied with ``round_scales_to_power_of_2=True``; computed here exactly, by clearing
the float32 multiplier's mantissa bits), so a scaled value never exceeds ``FP8_MAX``. A row whose amax is 0 (all zeros) or not finite gets ``s = 1`` (torchao
clamps the zero amax to 1e-12 instead: the same zeros). The quantized value is
``clip(x * s, -FP8_MAX, FP8_MAX)`` cast to FP8 (round to nearest even), except that a
non-finite element becomes NaN (E4M3 has no inf; E5M2's is not used): an inf or NaN in an operand makes its
row of the product NaN, so the step's gradients are non-finite and it is skipped
exactly, as without FP8. Dequantized: ``q / s``.

Differences from torchao's recipes (``torchao/float8/config.py``,
``Float8LinearConfig.from_recipe_name``): torchao's ``rowwise`` casts the output gradient
to E4M3 too and rounds scales to powers of two by default; this recipe follows issue 43
(E5M2 output gradient, ``amax / 448`` by default, powers of two an option).

Where it runs: everywhere XLA runs FP8 ``dot_general`` (on CPU, emulated: the FP8
operands are converted and multiplied in float32). The dot's scales are applied to its
float32 result outside the ``dot_general``; whether XLA fuses them into a scaled FP8
GEMM on a GPU was not checked here.

Example:
  >>> import jax.numpy as jnp, jaxamp
  >>> x = jnp.array([[1.0, 2.0], [0.0, 0.0]])
  >>> w = jnp.array([[1.0], [0.5]])
  >>> q, s = jaxamp.rowwise.quantize(x, (1,), jaxamp.fp8.E4M3)
  >>> s[:, 0].tolist()  # 448 / 2 for the first row, 1 for the zero row
  [224.0, 1.0]
  >>> jaxamp.rowwise.rowwise_dot_general(x, w, (((1,), (0,)), ((), ()))).tolist()
  [[2.0], [0.0]]
  >>> jaxamp.get_policy('mixed_fp8_rowwise').fp8
  RowwiseScaling(power_of_two=False, wgrad_high_precision=False)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp import dtypes, scaled
from jaxamp.recipes import E4M3, E5M2

__all__ = ["EPS", "RowwiseFp8", "RowwiseScaling", "quantize", "row_scale",
           "rowwise_dot_general"]

_F32 = jnp.float32
EPS = 1e-12  # torchao's floor on an amax (torchao/float8/float8_utils.py)
# The state's rows: the last pass's largest amaxes (for inspection only).
INPUT, KERNEL, GRAD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class RowwiseScaling:
  """The rowwise FP8 recipe (``'mixed_fp8_rowwise'``; the module docstring has the rule).

  Args:
    power_of_two: round each scale down to a power of two (torchao's
      ``round_scales_to_power_of_2``): ``s = 2**floor(log2(448 / amax))``.
    wgrad_high_precision: run the weight-gradient matmul in the compute dtype instead of
      FP8 (torchao's ``rowwise_with_gw_hp``).

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> p = jaxamp.Policy(jnp.float32, jnp.bfloat16,
    ...                   fp8=jaxamp.RowwiseScaling(wgrad_high_precision=True))
    >>> p.fp8.power_of_two, p.fp8.wgrad_high_precision
    (False, True)
  """

  power_of_two: bool = False
  wgrad_high_precision: bool = False

  def __post_init__(self):
    for field in ("power_of_two", "wgrad_high_precision"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"RowwiseScaling.{field} must be a bool, got "
                         f"{getattr(self, field)!r}.")


def row_scale(x: jax.Array, axes: tuple[int, ...], dtype: Any,
              power_of_two: bool = False) -> jax.Array:
  """The multiplier of each row of ``x`` (reduced over ``axes``, kept as size-1
  dimensions): ``FP8_MAX / max(amax, 1e-12)``, rounded down to a power of two with
  ``power_of_two``; 1 where the amax is 0 or not finite. float32.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> x = jnp.array([[3.0, -1.0], [0.0, 0.0], [1.0, jnp.inf]])
    >>> jaxamp.rowwise.row_scale(x, (1,), jaxamp.fp8.E4M3, power_of_two=True)[:, 0].tolist()
    [128.0, 1.0, 1.0]
  """
  amax = jnp.max(jnp.abs(x.astype(_F32)), axis=axes, keepdims=True)
  s = dtypes.format_of(dtype).max / jnp.maximum(amax, EPS)
  if power_of_two:
    # 2**floor(log2(s)), exactly: s is a positive normal float32 (at most 448 / 1e-12,
    # at least 448 / float32's max), so clearing its mantissa bits rounds it down to a
    # power of two (XLA's exp2 and log2 are approximations on some backends).
    bits = lax.bitcast_convert_type(s.astype(_F32), jnp.uint32)
    s = lax.bitcast_convert_type(bits & jnp.uint32(0xFF800000), _F32)
  return jnp.where((amax > 0) & jnp.isfinite(amax), s, 1.0).astype(_F32)


def quantize(x: jax.Array, axes: tuple[int, ...], dtype: Any,
             power_of_two: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x`` quantized to ``dtype`` with one scale per row over ``axes``: ``(q, s)`` with
  ``q = clip(x * s)`` in ``dtype`` (non-finite elements NaN) and ``s`` the
  :func:`row_scale`; ``q / s`` dequantizes.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> q, s = jaxamp.rowwise.quantize(jnp.array([[1.0, 448.0]]), (1,), jaxamp.fp8.E4M3)
    >>> q.dtype, q.tolist(), s.tolist()
    (dtype(float8_e4m3fn), [[1.0, 448.0]], [[1.0]])
  """
  s = row_scale(x, axes, dtype, power_of_two)
  fp8_max = dtypes.format_of(dtype).max
  x32 = x.astype(_F32)
  scaled_x = jnp.clip(x32 * s, -fp8_max, fp8_max)
  return jnp.where(jnp.isfinite(x32), scaled_x, jnp.nan).astype(dtype), s


def _out_scale(s: jax.Array, contract: tuple[int, ...], batch: tuple[int, ...],
               lhs_side: bool, n_other: int) -> jax.Array:
  """An operand's ``[.., 1, ..]`` scale laid out as the dot_general result: batch
  dimensions, then the lhs's free ones, then the rhs's."""
  ndim = s.ndim
  free = [i for i in range(ndim) if i not in contract and i not in batch]
  kept = [i for i in range(ndim) if i not in contract]
  s = jnp.squeeze(s, axis=contract) if contract else s
  s = jnp.transpose(s, [kept.index(i) for i in list(batch) + free])
  ones = (1,) * n_other
  shape = s.shape[:len(batch)] + ((s.shape[len(batch):] + ones) if lhs_side
                                  else (ones + s.shape[len(batch):]))
  return s.reshape(shape)


def _scaled_dot(a, b, dims, a_dtype, b_dtype, power_of_two):
  """``dot_general(a, b, dims)`` on FP8 operands, each scaled per row along its own
  contraction: float32."""
  (ac, bc), (ab, bb) = dims
  qa, sa = quantize(a, ac, a_dtype, power_of_two)
  qb, sb = quantize(b, bc, b_dtype, power_of_two)
  acc = lax.dot_general(qa, qb, dims, preferred_element_type=_F32)
  n_a_free = a.ndim - len(ac) - len(ab)
  n_b_free = b.ndim - len(bc) - len(bb)
  # Divided one scale at a time (as q / s dequantizes): no product of two scales to
  # overflow or underflow float32.
  return acc / _out_scale(sa, ac, ab, True, n_b_free) / _out_scale(sb, bc, bb, False,
                                                                     n_a_free)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rowwise_dot(lhs, rhs, amaxes, dims, power_of_two, wgrad_hp):
  del amaxes
  return _scaled_dot(lhs, rhs, dims, E4M3, E4M3, power_of_two).astype(lhs.dtype)


def _rowwise_dot_fwd(lhs, rhs, amaxes, dims, power_of_two, wgrad_hp):
  out = _rowwise_dot(lhs, rhs, amaxes, dims, power_of_two, wgrad_hp)
  return out, (lhs, rhs)


def _rowwise_dot_bwd(dims, power_of_two, wgrad_hp, residuals, g):
  lhs, rhs = residuals
  (lc, rc), (lb, rb) = dims
  # Input gradient: g (E5M2) and the kernel (E4M3), each scaled along this matmul's
  # contraction (the kernel's free dimensions).
  d_lhs = scaled.transpose_lhs(
      g, lhs.ndim, rhs.ndim, dims,
      lambda g_, d: _scaled_dot(g_, rhs, d, E5M2, E4M3, power_of_two))
  # Weight gradient: the same with the operands' roles swapped (lax's rule).
  swapped = ((rc, lc), (rb, lb))
  if wgrad_hp:
    wdot = lambda g_, d: lax.dot_general(g_.astype(lhs.dtype), lhs, d,
                                         preferred_element_type=_F32)
  else:
    wdot = lambda g_, d: _scaled_dot(g_, lhs, d, E5M2, E4M3, power_of_two)
  d_rhs = scaled.transpose_lhs(g, rhs.ndim, lhs.ndim, swapped, wdot, swap_ans=True)
  amaxes = jnp.stack([scaled.amax(lhs), scaled.amax(rhs), scaled.amax(g)])
  return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), amaxes


_rowwise_dot.defvjp(_rowwise_dot_fwd, _rowwise_dot_bwd)


def rowwise_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                        precision: Any = None, preferred_element_type: Any = None, *,
                        state: jax.Array | None = None,
                        recipe: RowwiseScaling | None = None,
                        **kwargs: Any) -> jax.Array:
  """``lax.dot_general`` with rowwise-scaled FP8 operands (``lhs`` the input, ``rhs``
  the kernel): E4M3 forward, E5M2 output gradient, float32 accumulation, the result in
  ``preferred_element_type`` (None: ``lhs``'s dtype). ``precision`` is ignored.

  ``state``: the module's float32 ``[3]`` amaxes (under ``jax.grad`` their cotangent is
  this pass's largest input, kernel and output-gradient magnitudes); None: zeros.
  ``recipe``: a :class:`RowwiseScaling`; None: the default one. ``kwargs``:
  ``out_sharding`` (Flax layers pass it; must be None).
  """
  del precision
  scaled.refuse_extra_arguments(kwargs, "rowwise FP8 dot", "rowwise_dot_general")
  recipe = RowwiseScaling() if recipe is None else recipe
  state = jnp.zeros((3,), _F32) if state is None else state
  dtype = jnp.result_type(lhs) if preferred_element_type is None else preferred_element_type
  rhs = rhs.astype(lhs.dtype) if rhs.dtype != lhs.dtype else rhs
  out = _rowwise_dot(lhs, rhs, state, scaled.dims(dimension_numbers), recipe.power_of_two,
                     recipe.wgrad_high_precision)
  return out.astype(dtype)


class RowwiseFp8(scaled.ScaledFormat):
  """The :class:`jaxamp.scaled.ScaledFormat` of :class:`RowwiseScaling`. Its state per
  module, float32 ``[3]``, is the last pass's largest input, kernel and output-gradient
  magnitudes (for inspection: the scales are each pass's own)."""

  name = "FP8 rowwise"
  census_dtypes = dtypes.FP8

  def init_state(self, recipe: RowwiseScaling) -> jax.Array:
    return jnp.zeros((3,), _F32)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, state, recipe, **kwargs):
    return rowwise_dot_general(lhs, rhs, dimension_numbers, precision,
                               preferred_element_type, state=state, recipe=recipe, **kwargs)

  def update(self, state: jax.Array, cotangent: jax.Array,
             recipe: RowwiseScaling) -> jax.Array:
    return cotangent

  def stateless_warning(self, recipe: RowwiseScaling, what: str) -> str | None:
    return None  # current scaling: the same without state

  def product(self, role: str, a: jax.Array, b: jax.Array,
              recipe: RowwiseScaling) -> jax.Array:
    """One of the three matmuls (:meth:`jaxamp.scaled.ScaledFormat.product`): each
    operand per row along the contraction, E5M2 for the output gradient."""
    batch = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (a.ndim - 2,)), (batch, batch))
    if role == "wgrad" and recipe.wgrad_high_precision:
      return lax.dot_general(a, b, dims, preferred_element_type=_F32)
    types = {"fwd": (E4M3, E4M3), "dgrad": (E5M2, E4M3), "wgrad": (E4M3, E5M2)}[role]
    return _scaled_dot(a, b, dims, *types, recipe.power_of_two)

  def whatif(self, x: jax.Array, role: str, recipe: RowwiseScaling
             ) -> tuple[jax.Array, Any] | None:
    """The numerics monitor's what-if (:attr:`jaxamp.scaled.ScaledFormat.whatif`): each
    row scaled to its amax, E4M3 for an input, E5M2 for an output gradient; none in the
    weight-gradient product with ``wgrad_high_precision``."""
    if role.endswith("_wgrad") and recipe.wgrad_high_precision:
      return None
    dtype = E4M3 if role.startswith("input") else E5M2
    return x.astype(_F32) * row_scale(x, (x.ndim - 1,), dtype, recipe.power_of_two), dtype

  def describe(self, recipe: RowwiseScaling) -> str:
    """``'fp8 e4m3fn/e5m2 rowwise'``: E4M3 forward, E5M2 output gradient (``', pow2
    scales'``, ``', wgrad in compute dtype'`` with the options)."""
    return ("fp8 e4m3fn/e5m2 rowwise" + (", pow2 scales" if recipe.power_of_two else "")
            + (", wgrad in compute dtype" if recipe.wgrad_high_precision else ""))


ROWWISE = RowwiseFp8()
scaled.register(RowwiseScaling, ROWWISE, names={"rowwise": RowwiseScaling},
                policies={"mixed_fp8_rowwise": RowwiseScaling})
