"""FP8 convolutions (jaxamp.fp8.scaled_conv_general_dilated and the conv layers it hooks:
NNX Conv, Linen Conv, Equinox Conv): FP8 operands in the lowered program, the forward
and backward passes against a float32 reference of the dequantized operands, training
with delayed-scaling state, the exact skip, and a format without a convolution."""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import conv_models
import jaxamp
from jaxamp import fp8_conv

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*XLA on CPU runs FP8.*", category=RuntimeWarning)
    warnings.filterwarnings("ignore", message=".*still run in float32.*")
    yield


def dequantized(a, fp8_max, dtype):
  """``a`` as the FP8 convolution sees it, in NumPy: scaled by its own amax (current
  scaling), cast to ``dtype`` and back, descaled."""
  a = np.asarray(a, np.float32)
  scale = np.float32(fp8_max) / np.float32(np.abs(a).max())
  return np.clip(a * scale, -fp8_max, fp8_max).astype(dtype).astype(np.float32) / scale


def ref_conv(x, w, kw):
  return jax.lax.conv_general_dilated(jnp.asarray(x), jnp.asarray(w), **kw,
                                      precision=jax.lax.Precision.HIGHEST)


# (input shape, kernel shape, conv arguments): 1-, 2- and 3-d, strides, dilations,
# explicit and named padding, grouped.
CASES = [
    ((2, 11, 4), (3, 4, 6), dict(window_strides=(2,), padding="SAME",
                                 dimension_numbers=("NWC", "WIO", "NWC"))),
    ((2, 9, 9, 4), (3, 3, 2, 6), dict(window_strides=(2, 1), padding=((1, 0), (2, 1)),
                                      rhs_dilation=(1, 2), feature_group_count=2,
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    ((1, 3, 5, 6, 4), (8, 3, 2, 3, 3), dict(window_strides=(1, 1, 2), padding=((0, 0), (1, 1), (0, 1)),
                                            lhs_dilation=(1, 2, 1),
                                            dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))),
]


@pytest.mark.parametrize("shapes", [
    pytest.param(CASES[0], id="1d", marks=pytest.mark.slow),
    pytest.param(CASES[1], id="2d-grouped-dilated"),
    pytest.param(CASES[2], id="3d-lhs-dilated", marks=pytest.mark.slow)])
def test_forward_and_backward_match_a_float32_reference_of_the_fp8_operands(shapes):
  """Forward: the convolution of the E4M3-rounded operands (descaled), float32 sums.
  Backward: lax's transposes of it applied to the E5M2-rounded output gradient. Within
  1e-5 of the largest value (float32 summation order only)."""
  xs, ws, kw = shapes
  rng = np.random.RandomState(0)
  x, w = rng.randn(*xs).astype(np.float32), rng.randn(*ws).astype(np.float32)
  g = rng.randn(*jax.eval_shape(lambda: ref_conv(x, w, kw)).shape).astype(np.float32)
  qx, qw, qg = (dequantized(x, 448, E4M3), dequantized(w, 448, E4M3),
                dequantized(g, 57344, E5M2))

  @jax.jit
  def both(x, w, g, qx, qw, qg):
    y, pull = jax.vjp(lambda x, w: jaxamp.fp8.scaled_conv_general_dilated(x, w, **kw), x, w)
    want, ref_pull = jax.vjp(lambda x, w: ref_conv(x, w, kw), qx, qw)
    plain, plain_pull = jax.vjp(lambda x, w: ref_conv(x, w, kw), x, w)
    return y, pull(g), want, ref_pull(qg), plain, plain_pull(g)

  y, got, want, grads, plain, plain_grads = both(x, w, g, qx, qw, qg)
  assert y.dtype == jnp.float32 and y.shape == want.shape
  np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())
  assert not np.allclose(y, plain, rtol=0, atol=1e-6)  # it did round
  for a, b in zip(got, grads):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
  # Against the float32 convolution: E4M3 rounds by up to 2**-4 of a value, E5M2 by 2**-3;
  # the normwise error of the sums stays within 8 % (forward) and 10 % (gradients);
  # measured: 4 % and 6 %.
  assert _relative_error(y, plain) < 0.08
  for a, b in zip(got, plain_grads):
    assert _relative_error(a, b) < 0.10


def _relative_error(a, b):
  return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def _convs(text):
  return [line for line in text.splitlines() if "stablehlo.convolution" in line]


def test_fp8_operands_in_the_lowered_program_cpu_and_cuda():
  x, w = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
  kw = dict(window_strides=(1, 1), padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"))
  f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(
      jaxamp.fp8.scaled_conv_general_dilated(x, w, **kw)), (0, 1)))
  for platforms in (None, ("cuda",)):
    lowered = f.trace(x, w).lower(lowering_platforms=platforms)
    convs = [c.split(":")[-1].strip() for c in _convs(lowered.as_text())]
    # forward: both operands E4M3, float32 result; the two transposes take the FP8
    # values widened to bfloat16 (not float32), float32 results.
    assert sorted(convs) == sorted([
        "(tensor<2x8x8x3xf8E4M3FN>, tensor<3x3x3x4xf8E4M3FN>) -> tensor<2x8x8x4xf32>",
        "(tensor<2x8x8x4xbf16>, tensor<3x3x3x4xbf16>) -> tensor<2x8x8x3xf32>",
        "(tensor<2x8x8x3xbf16>, tensor<2x8x8x4xbf16>) -> tensor<3x3x3x4xf32>"]), convs


def _lax_grads(g, lhs, rhs, p):
  """The backward pass before jaxamp.fp8_conv: lax's own transposes (jax.vjp) on the
  FP8 values widened to float32."""
  _, pull = jax.vjp(lambda a, b: fp8_conv.conv(a, b, p), lhs.astype(jnp.float32),
                    rhs.astype(jnp.float32))
  return pull(g.astype(jnp.float32))


def _grid_case(rng, strides, rhs_dil, lhs_dil, padding, groups, batch_groups, dn):
  """FP8 operands, an E5M2 output gradient and the ConvParams of one 2-d convolution."""
  sizes = dict(N=4, C=4, H=7, W=6)
  ksizes = dict(H=3, W=2, I=4 // groups, O=6)
  lhs = jnp.asarray(rng.randn(*[sizes[c] for c in dn[0]]), E4M3)
  rhs = jnp.asarray(rng.randn(*[ksizes[c] for c in dn[1]]), E4M3)
  p = fp8_conv.conv_params(lhs.shape, rhs.shape, strides, padding, lhs_dil, rhs_dil, dn,
                           groups, batch_groups)
  g = jnp.asarray(rng.randn(*jax.eval_shape(lambda a, b: fp8_conv.conv(a, b, p), lhs, rhs).shape), E5M2)
  return g, lhs, rhs, p


_NHWC, _NCHW = ("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW")
_GRID = [(s, rd, ld, pad, fg, bg, dn)
         for s in [(1, 1), (2, 1), (3, 2)] for rd in [(1, 1), (2, 1)] for ld in [(1, 1), (2, 1)]
         for pad in ["VALID", "SAME", ((1, 2), (0, 1))] for fg, bg in [(1, 1), (2, 1), (1, 2)]
         for dn in [_NHWC, _NCHW] if not (isinstance(pad, str) and ld != (1, 1))]
# A few cases covering each argument, for the main tier.
_FEW = [((2, 1), (2, 1), (1, 1), "SAME", 2, 1, _NHWC),
        ((3, 2), (1, 1), (2, 1), ((1, 2), (0, 1)), 1, 2, _NCHW),
        ((1, 1), (2, 1), (2, 1), ((1, 2), (0, 1)), 1, 1, _NHWC)]


def _check_grid(cases):
  rng = np.random.RandomState(0)
  args = [_grid_case(rng, *case) for case in cases]
  params = [a[3] for a in args]

  @jax.jit
  def both(arrays):  # one program for all cases: one compilation
    return [(fp8_conv.conv_grads(g, l, r, p), _lax_grads(g, l, r, p))
            for (g, l, r), p in zip(arrays, params)]

  zero = []  # cases whose windows read only the holes lhs dilation puts between inputs
  for case, (got, want) in zip(cases, both([a[:3] for a in args])):
    for a, b in zip(got, want):
      assert a.dtype == jnp.float32 and a.shape == b.shape, (case, a.shape, b.shape)
      np.testing.assert_array_equal(a, b, err_msg=str(case))
    zero += [case] if not np.abs(want[0]).max() else []
  assert len(zero) <= len(cases) // 10, zero


def test_backward_convolutions_equal_lax_transposes_bit_for_bit():
  """bfloat16 operands, float32 sums: the same products and sums as lax's transposes on
  float32 operands, bit for bit (XLA:CPU), with strides, both dilations, named and
  explicit padding, feature and batch groups, two layouts."""
  _check_grid(_FEW)


@pytest.mark.slow
def test_backward_convolutions_equal_lax_transposes_bit_for_bit_on_a_grid():
  _check_grid(_GRID)


def _np_conv_grads(g, x, w, strides, pads, lhs_dil, rhs_dil, groups):
  """Input and kernel gradients of a 2-d NHWC/HWIO convolution, in float64 NumPy, from
  its definition: out[n, i, j, o] = sum over (a, b, c) of
  xd[n, i*s0 + a*d0, j*s1 + b*d1, group(o)*C + c] * w[a, b, c, o], xd the input
  dilated (lhs_dil) and padded."""
  g, x, w = (np.asarray(a, np.float64) for a in (g, x, w))
  n, h, wd, cin = x.shape
  kh, kw, c, o = w.shape
  xd = np.zeros((n, (h - 1) * lhs_dil[0] + 1, (wd - 1) * lhs_dil[1] + 1, cin))
  xd[:, ::lhs_dil[0], ::lhs_dil[1]] = x
  xp = np.pad(xd, ((0, 0), pads[0], pads[1], (0, 0)))
  dxp, dw = np.zeros_like(xp), np.zeros_like(w)
  per = o // groups
  for i in range(g.shape[1]):
    for j in range(g.shape[2]):
      for a in range(kh):
        for b in range(kw):
          r, s = i * strides[0] + a * rhs_dil[0], j * strides[1] + b * rhs_dil[1]
          for grp in range(groups):
            cs, os = slice(grp * c, (grp + 1) * c), slice(grp * per, (grp + 1) * per)
            dw[a, b, :, os] += xp[:, r, s, cs].T @ g[:, i, j, os]
            dxp[:, r, s, cs] += g[:, i, j, os] @ w[a, b, :, os].T
  dxd = dxp[:, pads[0][0]:dxp.shape[1] - pads[0][1], pads[1][0]:dxp.shape[2] - pads[1][1]]
  return dxd[:, ::lhs_dil[0], ::lhs_dil[1]], dw


def test_backward_convolutions_match_a_float64_numpy_reference():
  """Within 1e-6 of the largest gradient (float32 summation order only)."""
  rng = np.random.RandomState(1)
  strides, pads, lhs_dil, rhs_dil, groups = (2, 1), ((1, 2), (0, 1)), (2, 1), (1, 2), 2
  x = jnp.asarray(rng.randn(3, 5, 6, 4), E4M3)
  w = jnp.asarray(rng.randn(2, 3, 2, 6), E4M3)
  p = fp8_conv.conv_params(x.shape, w.shape, strides, pads, lhs_dil, rhs_dil, _NHWC,
                           groups, 1)
  g = jnp.asarray(rng.randn(*jax.eval_shape(lambda a, b: fp8_conv.conv(a, b, p), x, w).shape), E5M2)
  got = jax.jit(fp8_conv.conv_grads, static_argnums=3)(g, x, w, p)
  want = _np_conv_grads(g, x, w, strides, pads, lhs_dil, rhs_dil, groups)
  for a, b in zip(got, want):
    assert a.dtype == jnp.float32 and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())


@pytest.mark.slow
def test_an_empty_output_gradient_gives_zero_gradients_as_lax():
  x, w = jnp.ones((0, 5, 2), E4M3), jnp.ones((3, 2, 4), E4M3)
  p = fp8_conv.conv_params(x.shape, w.shape, (1,), "VALID", None, None,
                           ("NWC", "WIO", "NWC"), 1, 1)
  g = jnp.ones((0, 3, 4), E5M2)
  for a, b in zip(fp8_conv.conv_grads(g, x, w, p), _lax_grads(g, x, w, p)):
    assert a.dtype == b.dtype == jnp.float32 and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def test_string_padding_with_lhs_dilation_is_refused_as_lax_refuses_it():
  with pytest.raises(ValueError, match=r"padding 'SAME' \(a string\) with lhs_dilation"):
    fp8_conv.conv_params((1, 5, 2), (3, 2, 4), (1,), "SAME", (2,), None,
                         ("NWC", "WIO", "NWC"), 1, 1)


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def trains_then_skips(train, state, batch, first):
  """Two steps with no warning (no fallback, no unreached-layer warning), after which the
  FP8 layer ``first``'s amax history holds the input's amax once per batch (Equinox under
  vmap too: the batch is one tensor), as the bfloat16 input the layer reads; then a NaN
  in the batch, which changes neither the parameters nor the FP8 state (the exact skip).
  Returns the state after the skipped step and the history after the two steps."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(2):
      state, metrics = train.step(state, batch)
  assert np.isfinite(float(metrics["loss"]))
  history = np.asarray(state.fp8[first].amax_history)
  amax = float(jnp.max(jnp.abs(batch[0].astype(jnp.bfloat16))))
  np.testing.assert_array_equal(history[0, :2], [amax, amax])
  assert (history[:, :2] > 0).all() and not history[:, 2:].any()
  before = jax.tree.map(np.asarray, (state.params, state.fp8))
  nan = batch[0].at[(0,) * batch[0].ndim].set(jnp.nan)
  state, metrics = train.step(state, (nan, batch[1]))
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (state.params, state.fp8)),
               before)
  return state, history


def _setup(library):
  """(train step, state, batch, path of the first conv, its input's amax)"""
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8, 8, 3), jnp.float32)
  y = jnp.arange(4) % 4
  if library == "nnx":
    train = jaxamp.make_train_step(lambda m, b: _xent(m(b[0]), b[1]), optax.adam(1e-2),
                                   policy="mixed_fp8")
    model = conv_models.NNXCNN(nnx.Rngs(0))
    return train, train.init(model), (x, y), "c1", ("c1", "c2", "out")
  if library == "linen":
    model = conv_models.LinenCNN()
    train = jaxamp.make_train_step(lambda m, b: _xent(m(b[0]), b[1]), optax.adam(1e-2),
                                   policy="mixed_fp8")
    state = train.init(model, model.init(jax.random.key(0), x), x)
    return train, state, (x, y), "Conv_0", ("Conv_0", "Conv_1", "Dense_0")
  x = jnp.transpose(x, (0, 3, 1, 2))
  train = jaxamp.make_train_step(lambda m, b: _xent(jax.vmap(m)(b[0]), b[1]),
                                 optax.adam(1e-2), policy="mixed_fp8")
  model = conv_models.EqxCNN(jax.random.key(0))
  return train, train.init(model), (x, y), "c1", ("c1", "c2", "out")


@pytest.mark.slow
@pytest.mark.parametrize("library", ["nnx", "linen", "equinox"])
def test_conv_layers_train_with_delayed_state_and_skip_a_nonfinite_batch(library,
                                                                        fresh_warnings):
  train, state, batch, first, paths = _setup(library)
  assert set(state.fp8) == set(paths)  # every conv and dense layer keeps its own state
  state, history = trains_then_skips(train, state, batch, first)
  scales = np.asarray(state.fp8[first].scale)  # the skip kept them
  np.testing.assert_allclose(scales, [448, 448, 57344] / history.max(axis=1), rtol=1e-6)
  convs = _convs(train.lower(state, batch, platforms=("cuda",)).as_text())
  assert sum(c.count("f8E4M3FN>") == 2 for c in convs) == 2, convs  # both forward convs


class _Declines(jaxamp.RowwiseScaling):
  """A recipe whose format declines convolutions (ScaledFormat.runs_convolutions)."""


class _DecliningFormat(type(jaxamp.scaled.format_of(jaxamp.RowwiseScaling()))):
  name = "no-conv rowwise"
  runs_convolutions = False


@pytest.fixture
def declining_policy():
  """A policy whose format (rowwise FP8 for dense layers) declines convolutions."""
  jaxamp.scaled.register(_Declines, _DecliningFormat())
  yield jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, fp8=_Declines())
  jaxamp.scaled.unregister(_Declines)


@pytest.mark.slow
def test_a_format_declining_convolutions_leaves_conv_layers_in_the_compute_dtype(
    fresh_warnings, declining_policy):
  """The conv layers run in bfloat16, get no state, and a warning names them; the dense
  layer still runs its format."""
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8, 8, 3), jnp.float32)
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy=declining_policy)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state = train.init(conv_models.NNXCNN(nnx.Rngs(0)))
  msgs = [str(w.message) for w in seen if "convolution layers" in str(w.message)]
  assert len(msgs) == 1 and "'c1', 'c2'" in msgs[0] and "compute dtype" in msgs[0], msgs
  assert "no-conv rowwise" in msgs[0] and "declines convolutions" in msgs[0], msgs
  assert "c1" not in (state.fp8 or {}) and "out" in state.fp8
  convs = _convs(train.lower(state, x).as_text())
  assert convs and all("f8E4M3FN" not in c and "bf16" in c for c in convs), convs
