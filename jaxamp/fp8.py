"""FP8 matmuls: recipes, their functional state, and the scaled FP8 dot.

An FP8 policy (``'mixed_fp8'``, ``'mixed_fp8_current'``, or any :class:`jaxamp.Policy`
with ``fp8=``) runs the matmuls of NNX ``Linear``/``LinearGeneral``/``Einsum`` (attention
projections included), ``Conv``/``ConvTranspose``, Linen ``Dense``/``DenseGeneral``/
``Conv``/``ConvTranspose`` and Equinox ``Linear``/``Conv``/``ConvTranspose`` layers in FP8
and everything else in its compute dtype (bfloat16 for the named ones): norms, softmax,
attention scores, the loss stay as under ``'mixed_bfloat16'``. The recipe is the "hybrid" one of
Transformer Engine and flax: inputs and kernels quantized to E4M3 (max 448), the
output gradient to E5M2 (max 57344), one scale per tensor, products accumulated in
float32 and returned in the compute dtype.

- :class:`DelayedScaling` (the default; Transformer Engine's and flax's defaults:
  history of 1024 amaxes, ``'max'`` over it, margin 0): each tensor is quantized with
  a scale computed from the amaxes of earlier steps.
- :class:`CurrentScaling`: each tensor is scaled by its own amax, computed in the step.

State: :class:`Fp8Meta` per FP8 module, an amax history ``[3, L]`` (input, kernel,
output gradient) and the three scales, in ``TrainState.fp8``, not among the parameters:
the optimizer never sees it and a skipped step keeps it. Outside
:func:`jaxamp.make_train_step` there is no state to read: FP8 modules then use current
scaling. The FP8 guide (``docs/guides/fp8.md``) has the scale rule and the limits.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import jaxamp
  >>> x = jnp.ones((4, 8)) * 3.0
  >>> w = jnp.ones((8, 2)) * 0.5
  >>> y = jaxamp.fp8.scaled_dot_general(x, w, (((1,), (0,)), ((), ())))
  >>> y.dtype, round(float(y[0, 0]), 4)
  (dtype('float32'), 12.0)
  >>> text = jax.jit(lambda x, w: jaxamp.fp8.scaled_dot_general(
  ...     x, w, (((1,), (0,)), ((), ())))).trace(x, w).lower(
  ...     lowering_platforms=('cuda',)).as_text()
  >>> 'f8E4M3FN' in text
  True
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp import _warn_once, dtypes, fp8_conv, fp8_gather, fp8_stacked, scaled
from jaxamp.recipes import (E4M3, E5M2, CurrentScaling, DelayedScaling,  # re-exported
                            Fp8Recipe, check_recipe)

__all__ = [
    "E4M3",
    "E5M2",
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Meta",
    "Fp8Recipe",
    "PerTensorFp8",
    "init_meta",
    "scaled_conv_general_dilated",
    "scaled_dot_general",
    "update_scales",
]

_F32 = jnp.float32
# Rows of an Fp8Meta: what each amax and scale is for.
INPUT, KERNEL, GRAD = 0, 1, 2
_MAX = (dtypes.format_of(E4M3).max, dtypes.format_of(E4M3).max, dtypes.format_of(E5M2).max)


class Fp8Meta(NamedTuple):
  """The FP8 state of one module: amax histories and scales.

  Attributes:
    amax_history: float32 ``[3, L]``: the amaxes of the input, the kernel and the output
      gradient (rows), the newest in column 0.
    scale: float32 ``[3]``: what each tensor is multiplied by before the cast to FP8
      in the next step (delayed scaling); ``FP8_MAX / amax / 2**margin``.
  """

  amax_history: jax.Array
  scale: jax.Array


def init_meta(recipe: Fp8Recipe) -> Fp8Meta:
  """A fresh :class:`Fp8Meta`: zero history, unit scales.

  Example:
    >>> import jaxamp
    >>> meta = jaxamp.fp8.init_meta(jaxamp.DelayedScaling(amax_history_len=4))
    >>> meta.amax_history.shape, meta.scale.tolist()
    ((3, 4), [1.0, 1.0, 1.0])
  """
  return Fp8Meta(jnp.zeros((3, recipe.history_len), _F32), jnp.ones((3,), _F32))


def update_scales(meta: Fp8Meta, recipe: Fp8Recipe) -> Fp8Meta:
  """``meta`` with scales recomputed from its history (Transformer Engine's rule).

  ``scale = FP8_MAX / amax / 2**margin`` where ``amax`` is the history's max (or its
  newest entry, ``'most_recent'``); the old scale stays where that amax is 0 or not
  finite.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> meta = jaxamp.fp8.Fp8Meta(jnp.array([[2.0], [0.0], [1.0]]), jnp.ones(3))
    >>> jaxamp.fp8.update_scales(meta, jaxamp.DelayedScaling()).scale.tolist()
    [224.0, 1.0, 57344.0]
  """
  history = meta.amax_history
  if isinstance(recipe, DelayedScaling) and recipe.amax_compute_algo == "max":
    amax = jnp.max(history, axis=1)
  else:
    amax = history[:, 0]
  fresh = jnp.asarray(_MAX, _F32) / amax / (2.0 ** recipe.margin)
  ok = jnp.logical_and(amax > 0, jnp.isfinite(amax))
  return Fp8Meta(history, jnp.where(ok, fresh, meta.scale))


def _current_scale(amax: jax.Array, fp8_max: float, margin: int) -> jax.Array:
  fresh = fp8_max / amax / (2.0 ** margin)
  return jnp.where(jnp.logical_and(amax > 0, jnp.isfinite(amax)), fresh, 1.0).astype(_F32)


def quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """``x * scale`` clipped to ``dtype``'s range and cast to ``dtype`` (computed in float32).

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> jaxamp.fp8.quantize(jnp.array([1000.0, 0.5]), jaxamp.fp8.E4M3, 1.0).tolist()
    [448.0, 0.5]
  """
  fp8_max = dtypes.format_of(dtype).max
  return jnp.clip(x.astype(_F32) * scale, -fp8_max, fp8_max).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_dot(lhs, rhs, history, scale, dims, delayed, margin):
  return _fp8_dot_fwd(lhs, rhs, history, scale, dims, delayed, margin)[0]


def _fp8_dot_fwd(lhs, rhs, history, scale, dims, delayed, margin):
  a_lhs, a_rhs = scaled.amax(lhs), scaled.amax(rhs)
  if delayed:
    s_lhs, s_rhs = scale[INPUT], scale[KERNEL]
  else:
    s_lhs, s_rhs = _current_scale(a_lhs, _MAX[INPUT], margin), _current_scale(
        a_rhs, _MAX[KERNEL], margin)
  q_lhs, q_rhs = quantize(lhs, E4M3, s_lhs), quantize(rhs, E4M3, s_rhs)
  # FP8 operands straight into the dot ("direct" quantization, as flax's
  # Fp8DirectDotGeneralOp): nothing for XLA to pattern-match and silently miss.
  out = lax.dot_general(q_lhs, q_rhs, dims, preferred_element_type=_F32)
  # An input holding inf or NaN must not come out finite, clipped to 448 by the E4M3
  # cast (with current scaling its scale would also be each device's own): the NaN
  # makes the step non-finite, so it is skipped exactly, as without FP8.
  nonfinite = jnp.where(jnp.isfinite(a_lhs) & jnp.isfinite(a_rhs), 0.0, jnp.nan)
  out = (out / (s_lhs * s_rhs) + nonfinite.astype(_F32)).astype(lhs.dtype)
  # Zero-size arrays carry the input dtypes to the backward pass.
  residuals = (q_lhs, q_rhs, s_lhs, s_rhs, history, scale, a_lhs, a_rhs,
               jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
  return out, residuals


def _fp8_dot_bwd(dims, delayed, margin, residuals, g):
  from jaxamp._flax_compat import (  # pylint: disable=g-import-not-at-top
      dot_general_transpose_lhs, dot_general_transpose_rhs)

  q_lhs, q_rhs, s_lhs, s_rhs, history, scale, a_lhs, a_rhs, lhs_like, rhs_like = residuals
  a_g = scaled.amax(g)
  s_g = scale[GRAD] if delayed else _current_scale(a_g, _MAX[GRAD], margin)
  q_g = quantize(g, E5M2, s_g)
  d_lhs = dot_general_transpose_lhs(q_g, q_lhs, q_rhs, dimension_numbers=dims,
                                    precision=None, preferred_element_type=_F32)
  d_rhs = dot_general_transpose_rhs(q_g, q_lhs, q_rhs, dimension_numbers=dims,
                                    precision=None, preferred_element_type=_F32)
  # An output gradient holding inf or NaN (a loss-scaled float16 backward pass that
  # overflowed) must not come out finite, clipped to 57344 by the E5M2 cast: its NaN
  # makes the step non-finite, so the loss scale backs off and the step is skipped,
  # as without FP8.
  overflow = jnp.where(jnp.isfinite(a_g), 0.0, jnp.nan).astype(_F32)
  d_lhs = (d_lhs / (s_g * s_rhs) + overflow).astype(lhs_like.dtype)
  d_rhs = (d_rhs / (s_g * s_lhs) + overflow).astype(rhs_like.dtype)
  # The new history leaves as the history's "gradient"; the train step takes it as is.
  # A non-finite amax is recorded as the largest value the dot used (FP8_MAX / scale):
  # an inf in the history would freeze that scale for as many steps as it holds.
  amaxes = jnp.stack([a_lhs, a_rhs, a_g])
  used = jnp.asarray(_MAX, _F32) / jnp.stack([s_lhs, s_rhs, s_g])
  amaxes = jnp.where(jnp.isfinite(amaxes), amaxes, used)
  new_history = jnp.roll(history, 1, axis=1).at[:, 0].set(amaxes)
  return d_lhs, d_rhs, new_history, jnp.zeros_like(scale)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def scaled_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                       precision: Any = None, preferred_element_type: Any = None, *,
                       meta: Fp8Meta | None = None, recipe: Fp8Recipe | None = None,
                       **kwargs: Any) -> jax.Array:
  """``lax.dot_general`` with FP8 operands: E4M3 forward, E5M2 output gradient.

  Products are accumulated in float32 and returned in ``preferred_element_type``, else
  in ``lhs``'s dtype. ``precision`` is ignored (FP8 has one).

  Args:
    lhs: the input.
    rhs: the kernel.
    dimension_numbers: as for ``lax.dot_general``.
    precision: ignored.
    preferred_element_type: the result dtype; None: ``lhs``'s.
    meta: the module's :class:`Fp8Meta` (delayed scaling reads its scales; under
      ``jax.grad`` the history's cotangent is the new history). None: current scaling.
    recipe: :class:`DelayedScaling` or :class:`CurrentScaling`; None: current scaling.
    **kwargs: ``out_sharding`` (Flax layers pass it; must be None).

  Returns:
    The product.
  """
  del precision
  scaled.refuse_extra_arguments(kwargs, "FP8 dot", "scaled_dot_general")
  recipe = CurrentScaling() if recipe is None else recipe
  delayed = isinstance(recipe, DelayedScaling) and meta is not None
  if meta is None:
    meta = init_meta(CurrentScaling())
  dtype = jnp.result_type(lhs) if preferred_element_type is None else preferred_element_type
  out = _fp8_dot(lhs, rhs.astype(lhs.dtype) if rhs.dtype != lhs.dtype else rhs,
                 meta.amax_history, meta.scale, scaled.dims(dimension_numbers), delayed,
                 recipe.margin)
  return out.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_conv(lhs, rhs, history, scale, params, delayed, margin):
  return _fp8_conv_fwd(lhs, rhs, history, scale, params, delayed, margin)[0]


def _fp8_conv_fwd(lhs, rhs, history, scale, params, delayed, margin):
  # As _fp8_dot_fwd: E4M3 operands straight into the convolution, float32 accumulation.
  a_lhs, a_rhs = scaled.amax(lhs), scaled.amax(rhs)
  if delayed:
    s_lhs, s_rhs = scale[INPUT], scale[KERNEL]
  else:
    s_lhs, s_rhs = _current_scale(a_lhs, _MAX[INPUT], margin), _current_scale(
        a_rhs, _MAX[KERNEL], margin)
  q_lhs, q_rhs = quantize(lhs, E4M3, s_lhs), quantize(rhs, E4M3, s_rhs)
  out = fp8_conv.conv(q_lhs, q_rhs, params)
  nonfinite = jnp.where(jnp.isfinite(a_lhs) & jnp.isfinite(a_rhs), 0.0, jnp.nan)
  out = (out / (s_lhs * s_rhs) + nonfinite.astype(_F32)).astype(lhs.dtype)
  residuals = (q_lhs, q_rhs, s_lhs, s_rhs, history, scale, a_lhs, a_rhs,
               jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
  return out, residuals


def _fp8_conv_bwd(params, delayed, margin, residuals, g):
  q_lhs, q_rhs, s_lhs, s_rhs, history, scale, a_lhs, a_rhs, lhs_like, rhs_like = residuals
  a_g = scaled.amax(g)
  s_g = scale[GRAD] if delayed else _current_scale(a_g, _MAX[GRAD], margin)
  q_g = quantize(g, E5M2, s_g)
  # The transposed convolutions on the FP8 values widened to bfloat16 (exact), float32
  # accumulation: jaxamp.fp8_conv.
  d_lhs, d_rhs = fp8_conv.conv_grads(q_g, q_lhs, q_rhs, params)
  overflow = jnp.where(jnp.isfinite(a_g), 0.0, jnp.nan).astype(_F32)
  d_lhs = (d_lhs / (s_g * s_rhs) + overflow).astype(lhs_like.dtype)
  d_rhs = (d_rhs / (s_g * s_lhs) + overflow).astype(rhs_like.dtype)
  amaxes = jnp.stack([a_lhs, a_rhs, a_g])
  used = jnp.asarray(_MAX, _F32) / jnp.stack([s_lhs, s_rhs, s_g])
  amaxes = jnp.where(jnp.isfinite(amaxes), amaxes, used)
  new_history = jnp.roll(history, 1, axis=1).at[:, 0].set(amaxes)
  return d_lhs, d_rhs, new_history, jnp.zeros_like(scale)


_fp8_conv.defvjp(_fp8_conv_fwd, _fp8_conv_bwd)


def scaled_conv_general_dilated(
    lhs: jax.Array, rhs: jax.Array, window_strides: Sequence[int], padding: Any,
    lhs_dilation: Sequence[int] | None = None, rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None, feature_group_count: int = 1,
    batch_group_count: int = 1, precision: Any = None, preferred_element_type: Any = None,
    *, meta: Fp8Meta | None = None, recipe: Fp8Recipe | None = None,
    **kwargs: Any) -> jax.Array:
  """``lax.conv_general_dilated`` with FP8 operands: E4M3 input and kernel (one scale
  each), E5M2 output gradient, float32 accumulation; as :func:`scaled_dot_general`.

  The backward convolutions are lax's two transposes of this one (any strides,
  dilations, padding, feature or batch groups: :mod:`jaxamp.fp8_conv`), run on the FP8
  values widened to bfloat16 (exact): the products of the FP8 values, accumulated in
  float32.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> x, k = jnp.full((1, 5, 2), 3.0), jnp.full((3, 2, 4), 0.5)  # NWC, WIO
    >>> y = jaxamp.fp8.scaled_conv_general_dilated(
    ...     x, k, (1,), 'VALID', dimension_numbers=('NWC', 'WIO', 'NWC'))
    >>> y.shape, round(float(y[0, 0, 0]), 4)
    ((1, 3, 4), 9.0)
  """
  del precision
  scaled.refuse_extra_arguments(kwargs, "FP8 convolution", "scaled_conv_general_dilated")
  recipe = CurrentScaling() if recipe is None else recipe
  delayed = isinstance(recipe, DelayedScaling) and meta is not None
  if meta is None:
    meta = init_meta(CurrentScaling())
  dtype = jnp.result_type(lhs) if preferred_element_type is None else preferred_element_type
  params = fp8_conv.conv_params(lhs.shape, rhs.shape, window_strides, padding, lhs_dilation,
                                rhs_dilation, dimension_numbers, feature_group_count,
                                batch_group_count)
  out = _fp8_conv(lhs, rhs.astype(lhs.dtype) if rhs.dtype != lhs.dtype else rhs,
                  meta.amax_history, meta.scale, params, delayed, recipe.margin)
  return out.astype(dtype)


# --- the format: how the train step runs and updates it (jaxamp.scaled's protocol) ----


class PerTensorFp8(scaled.ScaledFormat):
  """FP8 with one scale per tensor (:class:`DelayedScaling`, :class:`CurrentScaling`):
  the :class:`jaxamp.scaled.ScaledFormat` the train step runs them through. Its state is
  an :class:`Fp8Meta` per module."""

  name = "FP8"
  census_dtypes = dtypes.FP8

  def init_state(self, recipe: Fp8Recipe) -> Fp8Meta:
    return init_meta(recipe)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, state, recipe, **kwargs):
    return scaled_dot_general(lhs, rhs, dimension_numbers, precision,
                              preferred_element_type, meta=state, recipe=recipe, **kwargs)

  def conv_general_dilated(self, lhs, rhs, window_strides, padding, lhs_dilation=None,
                           rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                           batch_group_count=1, precision=None, preferred_element_type=None,
                           *, state, recipe, **kwargs):
    return scaled_conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
        feature_group_count, batch_group_count, precision, preferred_element_type,
        meta=state, recipe=recipe, **kwargs)

  def reduce(self, cotangent: Fp8Meta, recipe: Fp8Recipe, axes: Any) -> Fp8Meta:
    # Transformer Engine's amax all-reduce: the newest amaxes maxed over the devices, so
    # every device quantizes the next pass (micro-batch or step) with the same scales,
    # those of the whole batch.
    history = cotangent.amax_history
    return cotangent._replace(amax_history=history.at[:, 0].set(
        lax.pmax(history[:, 0], axes)))

  def update(self, state: Fp8Meta, cotangent: Fp8Meta, recipe: Fp8Recipe) -> Fp8Meta:
    # The cotangent is the rolled history with this pass's amaxes in front, summed over
    # the times the matmul ran: only its newest column is taken (the rest is the old
    # history rolled). A body run n times (a module shared into an nnx.scan) then
    # records the sum of its n amaxes, a bound on their max.
    newest = cotangent.amax_history[:, 0]
    history = jnp.roll(state.amax_history, 1, axis=1).at[:, 0].set(newest)
    return update_scales(Fp8Meta(history, state.scale), recipe)

  def product(self, role: str, a: jax.Array, b: jax.Array, recipe: Fp8Recipe) -> jax.Array:
    """One of the three matmuls (:meth:`jaxamp.scaled.ScaledFormat.product`) with
    current scaling, one scale per operand, E5M2 for the output gradient."""
    if isinstance(recipe, DelayedScaling):
      raise ValueError("a per-matmul recipe takes jaxamp.CurrentScaling(), not "
                       "DelayedScaling: delayed scales need a state per matmul.")
    batch = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (a.ndim - 2,)), (batch, batch))
    types = {"fwd": (E4M3, E4M3), "dgrad": (E5M2, E4M3), "wgrad": (E4M3, E5M2)}[role]
    amaxes = (scaled.amax(a), scaled.amax(b))
    sa, sb = (_current_scale(m, dtypes.format_of(t).max, recipe.margin)
              for m, t in zip(amaxes, types))
    out = lax.dot_general(quantize(a, types[0], sa), quantize(b, types[1], sb), dims,
                          preferred_element_type=_F32)
    # A non-finite operand makes the product NaN (the exact skip), as the dot's own rule.
    nonfinite = jnp.where(jnp.isfinite(amaxes[0]) & jnp.isfinite(amaxes[1]), 0.0, jnp.nan)
    return out / (sa * sb) + nonfinite.astype(_F32)

  def gather_quantized(self, x, axes, gather, recipe, state=None):
    """FSDP's kernel gather in E4M3 (:mod:`jaxamp.fp8_gather`), with delayed scaling's
    kernel scale from the module's ``state`` (None without one)."""
    if not isinstance(recipe, DelayedScaling):
      scale_of = lambda a: _current_scale(a, _MAX[KERNEL], recipe.margin)
    elif state is None:
      return None
    else:
      scale_of = lambda a: state.scale[KERNEL]
    return fp8_gather.gather_e4m3(x, axes, gather, scale_of, quantize)

  def describe(self, recipe: Fp8Recipe) -> str:
    """``'fp8 e4m3fn/e5m2 per-tensor delayed'`` (or ``current``)."""
    kind = "delayed" if isinstance(recipe, DelayedScaling) else "current"
    return f"fp8 e4m3fn/e5m2 per-tensor {kind}"

  def stateless_warning(self, recipe: Fp8Recipe, what: str) -> str | None:
    if not isinstance(recipe, DelayedScaling):
      return None  # current scaling keeps no scale: it runs the same without state
    return (f"jaxamp: the FP8 {what} has no delayed-scaling state in this train step (a "
            "layer inside a scan/vmap transform that does not slice its state, or one "
            "created during the call): it runs with current scaling (each tensor scaled by "
            "its own amax). In Linen's nn.scan, add 'jaxamp_fp8': 0 to variable_axes; in "
            "nnx.scan, slice all of the layer's state. Or keep it out of FP8 with a "
            "jaxamp.set_policy rule to silence this.")


PER_TENSOR = PerTensorFp8()
scaled.register(DelayedScaling, PER_TENSOR, names={"delayed": DelayedScaling})
scaled.register(CurrentScaling, PER_TENSOR, names={"current": CurrentScaling})

# The state scope lives in jaxamp.scaled; these names stay for code that used them here.
state_scope = scaled.state_scope
suspended = scaled.suspended
dot_for = scaled.dot_for
name_modules = scaled.name_modules

# The attribute naming an NNX module's state key. A static attribute travels in the
# graphdef, so the copies nnx.remat and nnx.scan make inside them keep it (their ids
# are not the ones name_modules saw).
_PATH_ATTR = "_jaxamp_fp8_path"


def name_nnx_modules(model: Any, path_name: Callable[[Any], str]) -> None:
  """Tells the running scope (if any) the path of each module of an NNX ``model``.

  ``model`` must be the step's own copy (``nnx.merge``'s): its FP8 layers are labelled
  with their paths.
  """
  if scaled.current() is None:
    return
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jaxamp._flax_compat import set_attr_unchecked  # pylint: disable=g-import-not-at-top

  named = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      named[id(node)] = path_name(path)
      if isinstance(node, nnx_classes()):
        set_attr_unchecked(node, _PATH_ATTR, named[id(node)])
  scaled.name_modules(named)


def scaled_einsum(subscripts: str, lhs: jax.Array, rhs: jax.Array, *, precision: Any = None,
                  preferred_element_type: Any = None, out_sharding: Any = None,
                  dot_general: Callable[..., Any] = scaled_dot_general) -> jax.Array:
  """The two-operand einsum ``subscripts`` of ``lhs`` (the input) and ``rhs`` (the kernel)
  as one ``dot_general(lhs, rhs, ...)`` (an FP8 dot): what ``nnx.Einsum`` gets as
  ``einsum_op`` under an FP8 policy.

  The dot always gets the input first and the kernel second (``jnp.einsum`` may swap
  them), so an FP8 state's rows stay what they say. Indices found in one operand only
  and not in the output are summed first. A spec with a repeated index within one
  operand (a diagonal) runs as ``jnp.einsum`` in the compute dtype.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> x, k = jnp.ones((2, 3, 4)), jnp.full((4, 5), 0.5)
    >>> jaxamp.fp8.scaled_einsum('btd,dh->bth', x, k).shape
    (2, 3, 5)
  """
  import opt_einsum  # pylint: disable=g-import-not-at-top  (a jax dependency)

  if out_sharding is not None:
    raise NotImplementedError("jaxamp's FP8 einsum takes no out_sharding; shard its inputs.")
  inputs, out, _ = opt_einsum.parser.parse_einsum_input((subscripts.replace(" ", ""),
                                                          lhs, rhs))
  a, b = inputs.split(",")
  if len(set(a)) < len(a) or len(set(b)) < len(b) or len(set(out)) < len(out):
    return jnp.einsum(subscripts, lhs, rhs, precision=precision,
                      preferred_element_type=preferred_element_type)

  def only(x, names, other):  # sum indices nothing else has
    gone = [i for i, n in enumerate(names) if n not in other and n not in out]
    return (jnp.sum(x, axis=tuple(gone)) if gone else x,
            "".join(n for n in names if n not in gone and (n in other or n in out)))

  lhs, a = only(lhs, a, b)
  rhs, b = only(rhs, b, a)
  batch = [n for n in a if n in b and n in out]
  contract = [n for n in a if n in b and n not in out]
  dims = ((tuple(a.index(n) for n in contract), tuple(b.index(n) for n in contract)),
          (tuple(a.index(n) for n in batch), tuple(b.index(n) for n in batch)))
  y = dot_general(lhs, rhs, dims, precision, preferred_element_type)
  names = "".join(batch) + "".join(n for n in a if n not in b) + "".join(
      n for n in b if n not in a)
  return jnp.transpose(y, tuple(names.index(n) for n in out)) if names != out else y


def merge_state(old: Mapping[str, Fp8Meta], cotangent: Mapping[str, Fp8Meta],
                used: set[str], recipes: Mapping[str, Fp8Recipe],
                axes: Any = None) -> dict[str, Fp8Meta]:
  """:func:`jaxamp.scaled.merge_state`: the state after a forward and backward pass."""
  return scaled.merge_state(old, cotangent, used, recipes, axes)


# --- which modules run in FP8 -------------------------------------------------------------


def nnx_classes() -> tuple[type, ...]:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv, nnx.ConvTranspose)


def linen_classes() -> tuple[type, ...]:
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  return (nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose)


def _flax_convs() -> tuple[type, ...]:
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return (nnx.Conv, nn.Conv, *_conv_transposes())


def _conv_transposes() -> tuple[type, ...]:
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return (nnx.ConvTranspose, nn.ConvTranspose)


# Each registered model library's FP8 layer classes (jaxamp.adapters.register hooks
# them here: fp8 sits below the libraries and names none of them itself).
_hooked: list[Callable[[], tuple[type, ...]]] = []


def hook_classes(classes: Callable[[], tuple[type, ...]]) -> None:
  """Registers a function giving layer classes whose matmul runs FP8 (called each time:
  a library imported later adds its classes then)."""
  _hooked.append(classes)


# Which of those are convolution layers (they run FP8 where the format runs convolutions).
_hooked_convs: list[Callable[[], tuple[type, ...]]] = [_flax_convs]


def hook_conv_classes(classes: Callable[[], tuple[type, ...]]) -> None:
  """Registers a function giving the convolution layer classes among those of
  :func:`hook_classes`: they run FP8 only where the policy's format runs convolutions
  (:func:`jaxamp.scaled.runs_conv`)."""
  _hooked_convs.append(classes)


def is_conv(cls: type) -> bool:
  """Whether ``cls`` is a convolution layer FP8 hooks."""
  return any(issubclass(cls, classes()) for classes in _hooked_convs)


# Layers of libraries jaxamp never imports, known by (module, class name); the Linen
# wrapper runs their calls as jaxamp.hf_layers writes them.
NAMED_LAYERS = frozenset({("transformers.models.gpt2.modeling_flax_gpt2", "FlaxConv1D")})


def named_layer(cls: type) -> bool:
  """Whether ``cls`` is (a subclass of) a layer of :data:`NAMED_LAYERS`."""
  return any((c.__module__, c.__name__) in NAMED_LAYERS for c in cls.__mro__)


def hooks(cls: type) -> bool:
  """Whether FP8 hooks the matmul of a module of class ``cls`` (under an FP8 policy)."""
  return named_layer(cls) or any(issubclass(cls, classes()) for classes in _hooked)


def kernel_read(cls: type) -> str:
  """How a module of class ``cls`` reads its kernel
  (:meth:`jaxamp.scaled.ScaledFormat.gathers_read`): ``'conv'``, ``'einsum'`` (NNX's
  Einsum) or ``'matrix'``."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if is_conv(cls):
    return "conv"
  return "einsum" if issubclass(cls, nnx.Einsum) else "matrix"


def runs_fp8(cls: type, policy: Any) -> bool:
  """Whether a module of class ``cls`` under ``policy`` runs its matmul in FP8."""
  if getattr(policy, "fp8", None) is None or not hooks(cls):
    return False
  return not is_conv(cls) or scaled.runs_conv(policy.fp8)


_HOOKED = ("NNX Linear, LinearGeneral, Einsum, Conv, ConvTranspose, Linen Dense, DenseGeneral, "
           "Conv, ConvTranspose, Hugging Face FlaxConv1D and Equinox Linear, Conv, ConvTranspose")


def unreached_matmuls(ops: Sequence[Any], modules: Sequence[str],
                      policies: Mapping[str, Any],
                      classes: Mapping[str, type] | None = None) -> dict[str, tuple[str, int]]:
  """The modules whose policy asks for FP8 but whose own layer matmuls ran without it.

  A layer matmul is a ``dot_general`` without batch dimensions (an input times a kernel);
  products of two activations (attention scores and values, batched per example and
  head) stay in the compute dtype under FP8 by design, and are not counted, nor are
  convolutions (a convolution layer FP8 cannot run is named by :func:`warn_if_unused`). Layers FP8 hooks (``classes`` says which)
  are skipped: a matmul of theirs without FP8 runs the user's own ``dot_general``.

  Args:
    ops: a :func:`jaxamp.census.module_matmuls` census.
    modules: the module path of each scope number.
    policies: each module's resolved policy, by path.
    classes: each module's class, by path, where known.

  Returns:
    ``{path: (class name, FLOPs)}``: FLOPs of the module's own matmuls that ran in
    neither FP8 dtype.

  Example:
    >>> import jaxamp
    >>> from jaxamp.census import ModuleMatmul
    >>> ops = [ModuleMatmul(0, 'dot_general', 'bfloat16', 'bfloat16', 96),
    ...        ModuleMatmul(0, 'dot_general', 'bfloat16', 'bfloat16', 32, batched=True)]
    >>> jaxamp.fp8.unreached_matmuls(ops, ['proj'], {'proj': jaxamp.get_policy('mixed_fp8')})
    {'proj': ('?', 96)}
  """
  from jaxamp.census import FP8_DTYPES  # pylint: disable=g-import-not-at-top

  counted = FP8_DTYPES | scaled.operand_dtypes()
  classes = classes or {}
  found: dict[str, tuple[str, int]] = {}
  for op in ops:
    if (op.module is None or op.kind != "dot_general" or op.batched
        or op.lhs_dtype in counted or op.rhs_dtype in counted):
      continue
    path = modules[op.module]
    policy = policies.get(path)
    cls = classes.get(path)
    if getattr(policy, "fp8", None) is None or (cls is not None and runs_fp8(cls, policy)):
      continue
    name = cls.__name__ if cls is not None else "?"
    found[path] = (name, found.get(path, (name, 0))[1] + op.flops)
  return found


def _unreached_message(model: str, policy: str, found: Mapping[str, tuple[str, int]],
                       total: int) -> str:
  by_class: dict[str, list[str]] = {}
  flops: dict[str, int] = {}
  for path, (cls, n) in found.items():
    by_class.setdefault(cls, []).append(repr(path or "(model)"))
    flops[cls] = flops.get(cls, 0) + n
  share = lambda n: f"{100 * n / max(total, 1):.1f}%"
  parts = []
  for cls in sorted(flops, key=lambda c: -flops[c]):
    paths = by_class[cls]
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    parts.append(f"{cls} ({share(flops[cls])}: {shown})")
  return (
      f"jaxamp: under policy {policy!r}, {share(sum(flops.values()))} of the matmul FLOPs "
      f"of {model} run without FP8, in modules whose policy asks for FP8 but which compute "
      f"their matmuls themselves (lax.dot_general, jnp.dot, @): {'; '.join(parts)}. FP8 "
      f"hooks only {_HOOKED} layers; these matmuls run in the compute dtype. Rewrite them with "
      f"those layers, or keep them out of FP8 with jaxamp.set_policy(<class or path>, "
      f"'mixed_bfloat16') to silence this.")


def warn_if_unused(plan: Any, model: str, policy: str | None = None,
                   census: Callable[[], tuple[Sequence[Any], Sequence[str]] | None]
                   | None = None, stacklevel: int = 4) -> None:
  """One RuntimeWarning where ``plan``'s rows ask for FP8 but matmuls cannot run it.

  With no layer FP8 can hook (Hugging Face GPT-2 without its LM head), it says so: the
  policy would silently give no FP8 at all. Otherwise, with ``census`` (a function
  returning ``(ops, modules)``, :func:`jaxamp.census.module_matmuls` and the module path
  of each scope number, or None where no census can be taken), it names the modules
  whose policy asks for FP8 but whose own matmuls ran without it
  (:func:`unreached_matmuls`; GPT-2's ``FlaxConv1D`` calls ``lax.dot_general``
  itself), with their share of the matmul FLOPs: once per model class, policy and set
  of modules.

  Args:
    plan: ``(path, class, policy)`` per module.
    model: the model's class name.
    policy: the model-level policy's name.
    census: called only when some layer runs FP8.
    stacklevel: as for ``warnings.warn`` called where this is called (the default points
      at the caller of ``TrainStep.init``).
  """
  if not any(getattr(p, "fp8", None) is not None for _, _, p in plan):
    return
  convs = [(path, p) for path, cls, p in plan
           if getattr(p, "fp8", None) is not None and is_conv(cls) and not runs_fp8(cls, p)]
  if convs:
    names = sorted({scaled.format_of(p.fp8).name for _, p in convs})
    paths = [repr(path or "(model)") for path, _ in convs]
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    _warn_once.warn_once(
        ("fp8.unreached_conv", model, tuple(paths)),
        f"jaxamp: the convolution layers {shown} of {model} run in the compute dtype, not "
        f"in {'/'.join(names)}: that format declines convolutions "
        "(ScaledFormat.runs_convolutions is False); the built-in FP8 recipes run them. Keep "
        "them out of it with jaxamp.set_policy(<class or path>, 'mixed_bfloat16') to "
        "silence this.", RuntimeWarning, stacklevel=stacklevel)
  if not any(runs_fp8(cls, p) for _, cls, p in plan):
    classes = sorted({cls.__name__ for _, cls, _ in plan})
    warnings.warn(
        f"jaxamp: {model} has no layer that runs FP8 (FP8 hooks {_HOOKED}); its modules "
        f"are {', '.join(classes[:12])}{' ...' if len(classes) > 12 else ''}. Every matmul "
        "runs in the compute dtype.", RuntimeWarning, stacklevel=stacklevel)
    return
  taken = census() if census is not None else None
  if taken is None:
    return
  ops, modules = taken
  found = unreached_matmuls(ops, modules, {path: p for path, _, p in plan},
                            {path: cls for path, cls, _ in plan})
  if found:
    if policy is None:
      policy = next((p.name for path, _, p in plan if path == ""), "?")
    _warn_once.warn_once(("fp8.unreached", model, policy, tuple(sorted(found))),
                         _unreached_message(model, policy, found, sum(op.flops for op in ops)),
                         RuntimeWarning, stacklevel=stacklevel)


def init_state(plan: Any) -> dict[str, Fp8Meta]:
  """The FP8 state for ``(path, class, policy)`` rows (``module_policies``' result)."""
  return {path: scaled.format_of(policy.fp8).init_state(policy.fp8)
          for path, cls, policy in plan if runs_fp8(cls, policy)}


def recipes_of(plan: Any) -> dict[str, Fp8Recipe]:
  return {path: policy.fp8 for path, cls, policy in plan if runs_fp8(cls, policy)}


def nnx_fields(module: Any, policy: Any) -> dict[str, Any]:
  """The attributes an NNX module gets under ``policy``: its FP8 ``dot_general`` (Linear,
  LinearGeneral), ``einsum_op`` (Einsum) or ``conv_general_dilated`` (Conv, where the
  format runs convolutions); none for other modules and policies."""
  if getattr(policy, "fp8", None) is None or not isinstance(module, nnx_classes()):
    return {}
  if isinstance(module, _conv_transposes()):
    return {}  # jaxamp.fp8_conv_transpose runs it
  if isinstance(module, _flax_convs()) and not scaled.runs_conv(policy.fp8):
    return {}  # no convolution in the format
  path, what = nnx_where(module)
  path, own = fp8_stacked.nnx_reads(module, path, policy.fp8)  # a stacked layer's slice
  from flax import nnx  # pylint: disable=g-import-not-at-top

  attrs = vars(module)
  if isinstance(module, nnx.Conv):
    if attrs.get("conv_general_dilated") is not lax.conv_general_dilated:
      return {}  # the user's own convolution: theirs to keep
    return {"conv_general_dilated": scaled.conv_for(path, policy.fp8, what, own)}
  if isinstance(module, nnx.Einsum):
    if attrs.get("einsum_op") is not jnp.einsum:
      return {}  # the user's own op: theirs to keep
    return {"einsum_op": functools.partial(scaled_einsum,
                                           dot_general=scaled.dot_for(path, policy.fp8, what, own))}
  if attrs.get("dot_general_cls") is not None or attrs.get("dot_general") not in (
      None, lax.dot_general):
    return {}  # the user's own dot: theirs to keep
  return {"dot_general": scaled.dot_for(path, policy.fp8, what, own)}


def nnx_where(module: Any) -> tuple[str | None, str]:
  """An NNX FP8 layer's state key in the running scope (None outside one) and its name
  for messages."""
  path = None
  scope = scaled.current()
  if scope is not None:
    path = vars(module).get(_PATH_ATTR, scope.names.get(id(module)))
  return path, f"{type(module).__name__} {path or '(unnamed)'}"


def linen_fields(module: Any, path: tuple[str, ...], policy: Any,
                 lifted: bool = False) -> dict[str, Any]:
  """The fields a Linen module gets under ``policy``: ``dot_general`` for FP8 dense
  layers, ``conv_general_dilated`` for ``nn.Conv`` (where the format runs convolutions).

  ``lifted``: the module runs inside a lifted transform (``nn.scan``, ``nn.vmap``,
  ``nn.remat``): it reads its state (one slice of it, inside ``nn.scan``) from the
  variables the transform lifts (:func:`jaxamp.fp8_stacked.linen_state_of`), or runs
  without state where the transform does not lift them.
  """
  if getattr(policy, "fp8", None) is None or not isinstance(module, linen_classes()):
    return {}
  name, own = fp8_stacked.linen_reads(module, "/".join(path), policy.fp8, lifted)
  if isinstance(module, _conv_transposes()):
    return {}  # jaxamp.fp8_conv_transpose runs it
  if isinstance(module, _flax_convs()):
    if not scaled.runs_conv(policy.fp8) or module.conv_general_dilated_cls is not None or (
        module.conv_general_dilated is not None
        and not getattr(module.conv_general_dilated, "jaxamp_fp8", False)):
      return {}  # no convolution in the format, or the user's own
    return {"conv_general_dilated": scaled.conv_for(
        name, policy.fp8, f"{type(module).__name__} {'/'.join(path)}", own)}
  if module.dot_general_cls is not None or (
      module.dot_general is not None and not getattr(module.dot_general, "jaxamp_fp8", False)):
    return {}  # the user's own dot (a lifted clone inherits ours: it gets its own)
  return {"dot_general": scaled.dot_for(name, policy.fp8,
                                       f"{type(module).__name__} {'/'.join(path)}", own)}
