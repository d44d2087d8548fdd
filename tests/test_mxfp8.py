"""MXFP8 ('mixed_mxfp8'): the quantization against a NumPy reference written from the
OCP Microscaling Formats (MX) v1.0 rule and from the round-up rule (jax.nn's,
Transformer Engine's), bit for bit; against jax.nn's own quantizer; the dot's forward
and gradients against NumPy products of the dequantized blocks; the lowered program for
CPU and CUDA; training under make_train_step.

The reference, per block of 32 along the last axis (zero-padded to whole blocks),
``amax = max |x|`` in float64: ``e = floor(log2(amax)) - 8`` (OCP MX v1.0 section 6.3,
``emax_elem = 8`` for E4M3) or ``e = ceil(log2(amax / 448))`` (round up), clamped to
``[-127, 127]``; ``e = -127`` where ``amax = 0``; ``q = E4M3(clip(x / 2**e, -448, 448))``
cast by ml_dtypes (round to nearest even); a block with inf or NaN: NaN elements and the
NaN scale (E8M0 ``0xFF``). The scale is stored as E8M0 code ``e + 127``; dequantized
``q * 2**e``.
"""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import train_helpers
from jaxamp import mxfp8

E4M3, E8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu
DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # FP8 on CPU: upcast
    yield


def ref_quantize(x, rule):
  """(q, codes, e) from the rule, in NumPy: blocks of 32 along the last axis."""
  x = np.asarray(x, np.float32)
  k = x.shape[-1]
  pad = -k % 32
  xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).astype(np.float64)
  xb = xp.reshape(xp.shape[:-1] + (-1, 32))
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    amax = np.max(np.abs(xb), axis=-1)
    finite = np.isfinite(amax)
    safe = np.where(finite & (amax > 0), amax, 1.0)
    if rule == "ocp":
      e = np.floor(np.log2(safe)) - 8
    else:
      e = np.ceil(np.log2(safe / 448.0))
    e = np.clip(np.where(amax > 0, e, -127), -127, 127)
    e = np.where(finite, e, 0).astype(np.int64)
    scaled = np.clip(xb / np.exp2(e)[..., None], -448.0, 448.0)
    q = np.where(finite[..., None], scaled, np.nan).astype(E4M3)
  codes = np.where(finite, e + 127, 255).astype(np.uint8)
  return q.reshape(xp.shape)[..., :k], codes, np.where(finite, e, np.nan)


def ref_dequantize(q, e):
  """float32 q * 2**e, blocks of 32 along the last axis; NaN where e is NaN."""
  k = q.shape[-1]
  qp = np.pad(q.astype(np.float64), [(0, 0)] * (q.ndim - 1) + [(0, -k % 32)])
  out = qp.reshape(qp.shape[:-1] + (-1, 32)) * np.exp2(e)[..., None]
  return out.reshape(qp.shape)[..., :k].astype(np.float32)


def ref_mx(x, rule="round_up"):
  q, _, e = ref_quantize(x, rule)
  return ref_dequantize(q, e).astype(np.float64)


def assert_product(got, a, b):
  """``got`` equals ``a @ b`` (float64) to float32 accumulation: within ``K * 2**-24``
  of the sum of the products' magnitudes (Higham's bound for a sum of K terms)."""
  want = a @ b
  bound = a.shape[-1] * 2.0 ** -24 * (np.abs(a) @ np.abs(b)) + 1e-37
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape
  assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def adversarial():
  """Blocks of 32 (rows): an outlier, zeros, tiny and huge values, inf, NaN, amaxes at
  and beside the rules' boundaries; 40 columns, so the second block is padded."""
  rng = np.random.RandomState(0)
  x = rng.randn(16, 40).astype(np.float32)
  x[1, :32] *= 1e-3
  x[1, 5] = 3e4  # one outlier: the rest of its block lands in E4M3's subnormals
  x[2] = 0.0  # an all-zero row: both blocks get the smallest scale, 2**-127
  x[3] = (1 + rng.rand(40)) * np.float32(1e-36) * np.sign(rng.randn(40))  # e clamped at -127
  x[4] *= np.float32(2e-3 / 448)  # E4M3-subnormal magnitudes after scaling
  x[5, 3] = np.inf  # non-finite blocks: NaN, the other block of the row finite
  x[6, 35] = np.nan
  x[7] *= np.float32(1e36)  # large: scales near E8M0's top
  one_ulp = np.float32(1 + 2.0 ** -23)
  # amaxes at the rules' boundaries: 448 * 2**k (round-up's exact case), just above it,
  # 1.75 * 2**k, powers of two and just below them (the OCP rule's floor).
  for row, amax in zip(range(8, 16), [448.0, 448.0 * one_ulp, 1.75 * 2.0 ** -20,
                                      1.75 * 2.0 ** 20 * one_ulp, 2.0 ** 10,
                                      np.float32(2.0 ** 10) / one_ulp, 2.0 ** -100, 500.0]):
    x[row] = x[row] / np.abs(x[row]).max() * np.float32(amax) * 0.999
    x[row, 7] = np.float32(amax)
    x[row, 36] = -np.float32(amax)
  return x


def _check_bitwise(x, rule):
  q, s = jax.jit(mxfp8.quantize, static_argnums=1)(jnp.asarray(x), rule)
  want_q, want_codes, want_e = ref_quantize(x, rule)
  assert q.dtype == E4M3 and s.dtype == E8M0 and q.shape == x.shape
  assert s.shape == x.shape[:-1] + (-(-x.shape[-1] // 32),)
  np.testing.assert_array_equal(np.asarray(s).view(np.uint8), want_codes)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
  d = np.asarray(mxfp8.dequantize(q, s))
  np.testing.assert_array_equal(d.view(np.uint32), ref_dequantize(want_q, want_e).view(
      np.uint32))
  return np.asarray(s).view(np.uint8), d


@pytest.mark.parametrize("rule", ["round_up", "ocp"])
def test_quantize_equals_the_numpy_rule_bit_for_bit(rule):
  _check_bitwise(np.random.RandomState(1).randn(8, 96).astype(np.float32) * 5, rule)
  x = adversarial()
  codes, d = _check_bitwise(x, rule)
  # The adversarial rows' promised properties.
  assert list(codes[2]) == [0, 0]  # all zeros: the smallest scale, 2**-127
  assert codes[5, 0] == 255 and codes[6, 1] == 255 and codes[5, 1] != 255  # NaN scales
  assert np.all(np.isnan(d[5, :32])) and np.all(np.isnan(d[6, 32:]))
  assert np.all(np.isfinite(np.delete(d, [5, 6], axis=0)))
  assert codes[3, 0] == 0 and np.all(d[3] != 0)  # clamped at 2**-127, still read back
  # 448 * 2**k: both rules 2**k; one ulp above, round-up doubles the scale, OCP saturates.
  assert codes[8, 0] == 127 and d[8, 7] == 448.0
  assert codes[9, 0] == (128 if rule == "round_up" else 127)
  xb = np.pad(x, [(0, 0), (0, 24)]).reshape(16, 2, 32)
  amax = np.abs(xb).max(axis=-1)
  ok = np.isfinite(amax)
  if rule == "round_up":  # never saturates: every block's amax / scale <= 448
    assert np.all(amax[ok] <= 448.0 * np.exp2(codes[ok].astype(np.float64) - 127))
    assert d[15, 7] == 512.0  # 500 / 2 = 250 rounds to 256 in E4M3
  else:  # the block's largest element lands in [256, 512): above 448 it saturates
    ratio = amax[ok] / np.exp2(codes[ok].astype(np.float64) - 127)
    assert np.all((ratio >= 256) & (ratio < 512) | (codes[ok] == 0))
    assert d[9, 7] == 448.0 and d[15, 7] == 448.0


def test_the_round_up_rule_is_jax_nns_quantizer():
  """jax.nn.scaled_dot_general's own quantizer (jax/_src/cudnn/scaled_matmul_stablehlo.py)
  gives the same elements and scales. Not on an all-zero block: both give it the scale
  2**-127, but jax's divides the zeros by it in float32, where 2**-127 is a subnormal
  that XLA on CPU flushes to zero: 0 / 0, NaN elements (jax 0.10.2, CPU)."""
  from jax._src.cudnn import scaled_matmul_stablehlo as jax_mx

  x = (np.random.RandomState(2).randn(4, 6, 64) * np.logspace(-20, 20, 6)[:, None]).astype(
      np.float32)
  x[1, 1, 3] = 448.0 * 2 ** 5
  config = jax.nn.get_scaled_dot_general_config("mxfp8")
  q, s = jax.jit(lambda x: jax_mx.quantize(x, config))(jnp.asarray(x))
  got_q, got_s = jax.jit(mxfp8.quantize)(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got_s).view(np.uint8), np.asarray(s).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), np.asarray(q).view(np.uint8))


@pytest.mark.parametrize("rule, k", [  # main tier: <= 12 CPU-seconds in all
    ("round_up", 40), pytest.param("ocp", 64, marks=pytest.mark.slow)])
def test_the_dot_is_the_product_of_the_dequantized_blocks(rule, k):
  rng = np.random.RandomState(3)
  x = (rng.randn(6, k) * np.logspace(-3, 3, k)[None, :]).astype(np.float32)
  w = (rng.randn(k, 5) * np.logspace(-2, 2, 5)[None, :]).astype(np.float32)
  recipe = jaxamp.MXFP8Scaling(scale_rule=rule)
  dot = jax.jit(lambda x, w: mxfp8.mxfp8_dot_general(x, w, DIMS, recipe=recipe))
  got = np.asarray(dot(jnp.asarray(x), jnp.asarray(w)))
  # x in blocks along its rows, w along its columns (the contraction)
  assert got.dtype == np.float32
  assert_product(got, ref_mx(x, rule), ref_mx(w.T, rule).T)
  assert not np.allclose(got, x.astype(np.float64) @ w, rtol=1e-4)  # it does quantize
  # A non-finite input row comes out NaN (the exact skip needs it), the others finite.
  bad = x.copy()
  bad[2, k - 1] = np.inf
  got = np.asarray(dot(jnp.asarray(bad), jnp.asarray(w)))
  assert np.all(np.isnan(got[2])) and np.all(np.isfinite(np.delete(got, 2, axis=0)))
  # The compute dtype in, the compute dtype out.
  assert dot(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w)).dtype == jnp.bfloat16


@pytest.mark.slow
def test_gradients_equal_the_numpy_reference():
  rng = np.random.RandomState(4)
  x = rng.randn(48, 64).astype(np.float32)  # 48 rows: the weight gradient's blocks padded
  w = (rng.randn(64, 40) * 0.1).astype(np.float32)  # 40 outputs: the input gradient's
  c = (rng.randn(48, 40) * np.logspace(-4, 0, 48)[:, None]).astype(np.float32)
  f = lambda x, w: jnp.sum(mxfp8.mxfp8_dot_general(x, w, DIMS) * c)
  loss, (gx, gw) = jax.jit(jax.value_and_grad(f, (0, 1)))(jnp.asarray(x), jnp.asarray(w))
  # dx = g @ w^T: both in blocks along the outputs; dw = x^T @ g: along the batch.
  assert_product(gx, ref_mx(c), ref_mx(w).T)
  assert_product(gw, ref_mx(x.T), ref_mx(c.T).T)
  np.testing.assert_allclose(float(loss), np.sum((ref_mx(x) @ ref_mx(w.T).T) * c),
                             rtol=1e-5)
  # A non-finite input gives non-finite gradients: the step is skipped exactly.
  bad = x.copy()
  bad[0, 0] = np.nan
  grads = jax.jit(jax.grad(f, (0, 1)))(jnp.asarray(bad), jnp.asarray(w))
  assert not all(bool(jnp.isfinite(g).all()) for g in grads)


def test_the_lowered_program_has_e4m3_blocks_and_e8m0_scales():
  x, w = jnp.ones((6, 64), jnp.bfloat16), jnp.ones((64, 5), jnp.bfloat16)
  f = lambda x, w, r: jnp.sum(mxfp8.mxfp8_dot_general(x, w, DIMS, recipe=r))
  grad = lambda r: jax.jit(jax.value_and_grad(lambda x, w: f(x, w, r), (0, 1))).trace(x, w)
  for platform in ("cpu", "cuda"):
    text = grad(jaxamp.MXFP8Scaling()).lower(lowering_platforms=(platform,)).as_text()
    assert 'stablehlo.composite "xla.scaled_dot"' in text
    # forward: x [6, 64] in 2 blocks per row, the kernel as [5, 64] (along K)
    assert "tensor<6x64xf8E4M3FN>" in text and "tensor<6x2xf8E8M0FNU>" in text
    assert "tensor<5x64xf8E4M3FN>" in text and "tensor<5x2xf8E8M0FNU>" in text
    # input gradient: g [6, 5] padded to one block of 32; weight gradient: along the 6 rows
    assert "tensor<6x32xf8E4M3FN>" in text and "tensor<6x1xf8E8M0FNU>" in text
    assert "tensor<64x32xf8E4M3FN>" in text and "tensor<64x1xf8E8M0FNU>" in text
    assert "block_scaled_dot" not in text
  # cudnn=True: CUDA calls cuDNN's block-scaled GEMM (jax.nn.scaled_matmul's custom call)
  text = grad(jaxamp.MXFP8Scaling(cudnn=True)).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @__op$block_scaled_dot" in text
  assert "tensor<1x6x2xf8E8M0FNU>" in text and 'composite "xla.scaled_dot"' not in text
  text = grad(jaxamp.MXFP8Scaling(cudnn=True)).lower(lowering_platforms=("cpu",)).as_text()
  assert "block_scaled_dot" not in text and 'composite "xla.scaled_dot"' in text


def test_reports_count_each_block_scaled_product_once_as_fp8():
  """precision_report sees the lowered scaled_dot composite as one FP8 matmul with the
  format's name (not the bfloat16 dots of its emulating decomposition), its FLOPs those
  of the padded blocks it runs; summary's census sees the scaled_dot equation."""
  x, w = jnp.ones((4, 128), jnp.bfloat16), jnp.ones((128, 8), jnp.bfloat16)
  name = jaxamp.scaled.describe(jaxamp.MXFP8Scaling())
  dot = jaxamp.scaled.dot_for(None, jaxamp.MXFP8Scaling(), "Dense")
  r = jaxamp.precision_report(lambda x, w: dot(x, w, DIMS).astype(jnp.float32).sum(), x, w,
                              backward=True, argnums=(0, 1))
  shapes = sorted((op.lhs_shape, op.rhs_shape) for op in r.ops)
  # forward K=128; dgrad contracts the 8 outputs, wgrad the 4 rows: each padded to 32.
  assert shapes == [((4, 32), (128, 32)), ((4, 128), (8, 128)), ((8, 32), (128, 32))]
  assert all(op.is_fp8 and op.scaled_format == name for op in r.ops)
  assert r.total_flops == 2 * (4 * 8 * 128 + 4 * 128 * 32 + 8 * 128 * 32)
  model = nnx.Sequential(nnx.Linear(128, 8, rngs=nnx.Rngs(0)))
  rows = {row.path: row for row in jaxamp.summary(model, jnp.ones((2, 128)),
                                                  policy="mixed_mxfp8").rows}
  assert rows["layers/0"].scaled_format == name


def test_the_no_fast_path_warning_names_blackwell():
  from jaxamp import policy as policy_lib
  assert jaxamp.scaled.format_of(jaxamp.MXFP8Scaling()).min_compute_capability == 10.0
  assert "compute capability >= 10.0" in policy_lib._fast_path_missing(
      jaxamp.get_policy("mixed_mxfp8"))
  assert "compute capability >= 8.9" in policy_lib._fast_path_missing(
      jaxamp.get_policy("mixed_fp8_block"))


def test_policy_names_recipe_checks_and_describe():
  p = jaxamp.get_policy("mixed_mxfp8")
  assert p == jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, jaxamp.MXFP8Scaling())
  assert p.name == "mixed_mxfp8"
  assert jaxamp.get_policy("p=f32,c=bf16,fp8=mxfp8") == p
  with pytest.raises(ValueError, match="'round_up', 'ocp'"):
    jaxamp.MXFP8Scaling(scale_rule="floor")
  with pytest.raises(ValueError, match="bool"):
    jaxamp.MXFP8Scaling(cudnn=1)
  with pytest.raises(ValueError, match="scale_rule must be one of"):
    mxfp8.quantize(jnp.ones((2, 32)), "nearest")
  fmt = jaxamp.scaled.format_of(p.fp8)
  assert fmt.describe(jaxamp.MXFP8Scaling(scale_rule="ocp")) == (
      "mxfp8 e4m3fn, 1x32 blocks, e8m0 scales (ocp)")


@pytest.mark.parametrize("model_kind, against_bf16", [
    pytest.param("nnx", True, marks=pytest.mark.slow),
    pytest.param("linen", True, marks=pytest.mark.slow),
])
def test_an_nnx_linear_and_a_linen_dense_train_and_skip_exactly(model_kind, against_bf16):
  train_helpers.check_scaled_recipe_trains_and_skips(
      "mixed_mxfp8", model_kind, against_bf16, features=40, seed=6)


@pytest.mark.slow
def test_batch_and_multi_axis_contractions_block_as_the_2d_dot():
  """An Einsum's batch dimensions and a DenseGeneral's several contracted axes: the
  blocks run along the flattened contraction, so the product and gradients are those of
  the 2-D dot on the reshaped (or per-batch) operands."""
  dot = mxfp8.mxfp8_dot_general
  train_helpers.check_contractions_match_the_2d_dot(dot, (3, 24), 48, seed=7)


@pytest.mark.slow
def test_a_train_step_lowered_for_cuda_runs_its_products_block_scaled():
  """The whole step lowered for CUDA: the forward and weight-gradient products (the
  input's gradient is not needed) as jax.lax.scaled_dot composites, or with cudnn=True
  as cuDNN's block-scaled GEMM custom call."""
  for recipe, composites, cudnn_calls in [(jaxamp.MXFP8Scaling(), 2, 0),
                                          (jaxamp.MXFP8Scaling(cudnn=True), 0, 2)]:
    policy = jaxamp.get_policy("mixed_mxfp8").with_fp8(recipe)
    train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b["x"]).astype(jnp.float32) ** 2),
                                   optax.sgd(0.1), policy=policy)
    state = train.init(nnx.Linear(64, 32, rngs=nnx.Rngs(0)))
    text = train.lower(state, {"x": jnp.ones((16, 64))}, platforms=("cuda",)).as_text()
    assert text.count('stablehlo.composite "xla.scaled_dot"') == composites
    assert text.count("custom_call @__op$block_scaled_dot") == cudnn_calls
    assert "tensor<16x2xf8E8M0FNU>" in text  # the input's scales, [M, K / 32]
