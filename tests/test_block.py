"""Block-scaled FP8 ('mixed_fp8_block', DeepSeek-V3's fine-grained quantization): the
quantization against a NumPy reference written from the rule (jaxamp/block.py's
docstring), bit for bit; the dot's forward and both gradients against NumPy products of
the dequantized operands, each tiled along its own contraction; the lowered program;
training under make_train_step.

The reference, per block of the last two dimensions, zero-padded to a multiple of the
block (amax over the block, float32): ``s = 448 / max(amax, 1e-12)``, rounded down to a
power of two with ``power_of_two``, ``s = 1`` where the amax is 0 or not finite; ``q =
clip(x * s, -448, 448)`` cast by ml_dtypes (round to nearest even), NaN where ``x`` is
not finite; dequantized ``q / s``.
"""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxamp
import train_helpers
from jaxamp import block

E4M3 = ml_dtypes.float8_e4m3fn
MAX = np.float32(448.0)
DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # FP8 on CPU: upcast
    yield


def ref_quantize(x, blk, power_of_two=False):
  """(q, s) of a 2-D ``x`` from the rule, in NumPy: s per block, q of x's shape."""
  x = np.asarray(x, np.float32)
  (r, c), (br, bc) = x.shape, blk
  xp = np.zeros((-(-r // br) * br, -(-c // bc) * bc), np.float32)
  xp[:r, :c] = x
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    amax = np.abs(xp.reshape(xp.shape[0] // br, br, xp.shape[1] // bc, bc)).max(axis=(1, 3))
    s = (MAX / np.maximum(amax, np.float32(1e-12))).astype(np.float32)
    if power_of_two:
      s = np.exp2(np.floor(np.log2(s))).astype(np.float32)
    s = np.where((amax > 0) & np.isfinite(amax), s, np.float32(1.0)).astype(np.float32)
    full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:r, :c]
    scaled = np.clip(x * full, -MAX, MAX)
    q = np.asarray(np.where(np.isfinite(x), scaled, np.nan), dtype=E4M3)
  return q, s


def deq(q, s, blk):
  full = np.repeat(np.repeat(s, blk[0], axis=0), blk[1], axis=1)[:q.shape[0], :q.shape[1]]
  return q.astype(np.float32) / full


def adversarial(rows=4, cols=384):
  """Tiles of 128 along each row (and 128x128 blocks of the whole), each a hard case."""
  rng = np.random.RandomState(0)
  x = rng.randn(rows, cols).astype(np.float32)
  x[0, :128] *= 1e-3
  x[0, 5] = 3e4  # one outlier in a tile: the rest of it lands in E4M3's subnormals
  x[0, 128:256] = 0.0  # an all-zero tile: scale 1
  x[1, :128] = rng.randn(128).astype(np.float32) * 1e-30  # amax below the 1e-12 floor
  x[1, 128:256] = rng.randn(128).astype(np.float32) * 2e-3  # subnormal magnitudes unscaled
  x[1, 300] = 2e-3 * 2.0 ** -20  # one tiny element beside O(1) ones: flushed to zero
  x[2, 130] = np.inf
  x[3, 260] = np.nan
  x[3, :128] = rng.randn(128).astype(np.float32) * 1e30  # huge: scale far below 1
  return x


@pytest.mark.parametrize("blk, power_of_two", [
    ((1, 128), False),  # main tier: < 12 CPU-seconds for this file's in all
    *(pytest.param(*p, marks=pytest.mark.slow) for p in [((128, 128), True),
                                                         ((1, 128), True),
                                                         ((128, 128), False),
                                                         ((128, 1), False)])])
def test_quantize_equals_the_numpy_rule_bit_for_bit(blk, power_of_two):
  rng = np.random.RandomState(1)
  quantize = jax.jit(block.quantize, static_argnums=(1, 2, 3))
  for x in (rng.randn(200, 300).astype(np.float32) * 5,  # neither dim divides 128
            adversarial(), adversarial(260, 384).T):
    q, s = quantize(jnp.asarray(x), blk, block.E4M3, power_of_two)
    want_q, want_s = ref_quantize(x, blk, power_of_two)
    assert q.dtype == E4M3 and q.shape == x.shape and s.shape == want_s.shape
    np.testing.assert_array_equal(np.asarray(s).view(np.uint32), want_s.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    d = np.asarray(jax.jit(block.dequantize, static_argnums=2)(q, s, blk))
    np.testing.assert_array_equal(d.view(np.uint32), deq(want_q, want_s, blk).view(np.uint32))
  if blk == (1, 128):  # the adversarial tiles' promised properties
    q, s = map(np.asarray, quantize(jnp.asarray(adversarial()), blk, block.E4M3, False))
    assert s.shape == (4, 3)
    assert s[0, 1] == 1.0 and s[2, 1] == 1.0 and s[3, 2] == 1.0  # zero, inf, NaN tiles
    assert s[0, 0] == np.float32(MAX / np.float32(3e4))  # the outlier sets its tile's scale
    assert s[1, 0] == np.float32(MAX / np.float32(1e-12))  # below the floor
    d = deq(q, s, blk)
    assert np.isnan(d[2, 130]) and np.isnan(d[3, 260])
    assert np.isfinite(np.delete(d, [130, 260], axis=1)).all()
    assert d[1, 300] == 0.0 and d[0, 128:256].tolist() == [0.0] * 128
    # Per tile: the outlier's tile loses its small values, the next tile keeps its own.
    assert np.count_nonzero(d[0, :128]) < 20 and np.count_nonzero(d[1, 128:256]) == 128


def _ref_dot(a, b, a_blk, b_blk):
  return (deq(*ref_quantize(a, a_blk), a_blk).astype(np.float64)
          @ deq(*ref_quantize(b, b_blk), b_blk).astype(np.float64))


def _close(got, want, a, b):
  """Within float32 accumulation of the FP8 products: 1e-5 of sum |a||b|."""
  bound = 1e-5 * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)) + 1e-30
  err = np.abs(np.asarray(got, np.float64) - want)
  assert np.all(err <= bound), float(np.max(err / bound))


@pytest.mark.slow
@pytest.mark.parametrize("m, k, n", [(6, 384, 256), (5, 200, 100)])
def test_forward_and_both_gradients_equal_the_numpy_reference(m, k, n):
  """(5, 200, 100): no dimension divides 128, so every operand is padded."""
  rng = np.random.RandomState(2)
  x = (rng.randn(m, k) * np.logspace(-3, 3, m)[:, None]).astype(np.float32)
  x[:, :64] *= 100.0  # the first tile of each row larger: per-tile scales matter
  w = (rng.randn(k, n) * 0.1).astype(np.float32)
  w[:128, :128] *= 1e3
  c = (rng.randn(m, n) * np.logspace(-4, 0, m)[:, None]).astype(np.float32)
  f = lambda x, w: block.block_dot_general(x, w, DIMS)

  @jax.jit
  def run(x, w, c):
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(c))

  y, gx, gw = run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(c))
  assert y.dtype == gx.dtype == gw.dtype == jnp.float32
  t, wb = (1, 128), (128, 128)
  _close(y, _ref_dot(x, w, t, wb), x, w)
  # dx = g @ w^T: g in 1x128 tiles along the outputs, w in its 128x128 blocks.
  _close(gx, _ref_dot(c, w.T, t, wb), c, w.T)
  # dw = x^T @ g: both in tiles of 128 along the batch (128x1 for g as [M, N]).
  _close(gw, _ref_dot(x.T, c, t, (128, 1)), x.T, c)
  # Tiling matters: per-tensor scales would give another result.
  per_tensor = _ref_dot(x, w, (m, k), (k, n))
  assert not np.allclose(np.asarray(y), per_tensor, rtol=1e-4, atol=0)
  # A non-finite input element makes its row of the product NaN, the others finite.
  bad = x.copy()
  bad[2, 7] = np.inf
  got = np.asarray(run(jnp.asarray(bad), jnp.asarray(w), jnp.asarray(c))[0])
  assert np.all(np.isnan(got[2])) and np.all(np.isfinite(np.delete(got, 2, axis=0)))


def test_lowered_program_has_e4m3_operands_and_tile_and_block_scales():
  x, w = jnp.ones((6, 384), jnp.bfloat16), jnp.ones((384, 256), jnp.bfloat16)
  f = lambda x, w: block.block_dot_general(x, w, DIMS)
  texts = [jax.jit(f).lower(x, w).as_text(),
           jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()]
  for text in texts:
    # The chunked operands: [M, K/128, 128] and [K/128, 128, N], E4M3.
    assert "tensor<6x3x128xf8E4M3FN>" in text and "tensor<3x128x256xf8E4M3FN>" in text
    assert "tensor<6x3xf32>" in text  # activations: [M, K/128]
    assert "tensor<3x2xf32>" in text  # weights: [K/128, N/128]
    assert "tensor<3x6x256xf32>" in text  # the float32 partial products, per chunk
    assert "tensor<6x256xbf16>" in text
  # The backward pass: g and the kernel as E4M3, x^T and g tiled along the batch.
  grad = jax.jit(jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(), (0, 1)))
  text = grad.lower(x, w).as_text()
  assert "tensor<6x2x128xf8E4M3FN>" in text  # g [M, N/128, 128] for dx
  assert "tensor<384x1x128xf8E4M3FN>" in text  # x^T [K, M/128 padded, 128] for dw


@pytest.mark.slow
def test_batch_and_multi_axis_contractions_tile_as_the_flattened_dot():
  """A DenseGeneral's two contracted axes are tiled as their flattening; an Einsum's
  batch dimension gets its own tiles, as a vmap of the 2-D dot."""
  dot = block.block_dot_general
  rng = np.random.RandomState(6)
  c = jnp.asarray(rng.randn(4, 5).astype(np.float32))
  x = jnp.asarray(rng.randn(4, 3, 100).astype(np.float32))
  w = jnp.asarray(rng.randn(3, 100, 5).astype(np.float32))
  f_nd = lambda x, w: jnp.sum(dot(x, w, (((1, 2), (0, 1)), ((), ()))) * c)
  f_2d = lambda x, w: jnp.sum(dot(x.reshape(4, 300), w.reshape(300, 5), DIMS) * c)
  for got, want in zip(jax.jit(jax.value_and_grad(f_nd, (0, 1)))(x, w),
                       jax.jit(jax.value_and_grad(f_2d, (0, 1)))(x, w)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b).reshape(np.shape(a)))
  a = jnp.asarray(rng.randn(2, 4, 130).astype(np.float32)) * jnp.asarray([[[1.0]], [[1e3]]])
  b = jnp.asarray(rng.randn(2, 130, 5).astype(np.float32))
  cb = jnp.stack([c, -c])
  f_b = lambda a, b: jnp.sum(dot(a, b, (((2,), (1,)), ((0,), (0,)))) * cb)
  f_v = lambda a, b: jnp.sum(jax.vmap(lambda a, b: dot(a, b, DIMS))(a, b) * cb)
  for got, want in zip(jax.jit(jax.value_and_grad(f_b, (0, 1)))(a, b),
                       jax.jit(jax.value_and_grad(f_v, (0, 1)))(a, b)):
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-6)


def test_policy_names_recipe_checks_and_describe():
  p = jaxamp.get_policy("mixed_fp8_block")
  assert p == jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, jaxamp.BlockScaling())
  assert p.name == "mixed_fp8_block"
  assert jaxamp.get_policy("p=f32,c=bf16,fp8=block") == p
  assert jaxamp.BlockScaling(weight_block=[64, 32]).weight_block == (64, 32)
  for bad, match in [(dict(act_block=0), "act_block"), (dict(act_block=True), "act_block"),
                     (dict(weight_block=(128,)), "weight_block"),
                     (dict(weight_block=(128, 0)), "weight_block"),
                     (dict(power_of_two=1), "bool")]:
    with pytest.raises(ValueError, match=match):
      jaxamp.BlockScaling(**bad)
  assert (jaxamp.scaled.describe(jaxamp.BlockScaling())
          == "fp8 e4m3fn, 1x128 act / 128x128 weight blocks")
  assert (jaxamp.scaled.describe(jaxamp.BlockScaling(64, (32, 16), True))
          == "fp8 e4m3fn, 1x64 act / 32x16 weight blocks, pow2 scales")


@pytest.mark.slow
def test_other_block_shapes_chunk_at_their_common_divisor():
  """1x64 tiles against 128x32 weight blocks: the contraction is chunked by 64, each
  chunk with its operands' own scales; the product equals the dequantized one."""
  rng = np.random.RandomState(7)
  x = (rng.randn(3, 256) * np.repeat([1.0, 1e2, 1e-2, 1.0], 64)).astype(np.float32)
  w = rng.randn(256, 64).astype(np.float32)
  recipe = jaxamp.BlockScaling(act_block=64, weight_block=(128, 32))
  y = jax.jit(lambda x, w: block.block_dot_general(x, w, DIMS, recipe=recipe))(x, w)
  _close(y, _ref_dot(x, w, (1, 64), (128, 32)), x, w)


@pytest.mark.parametrize("model_kind, against_bf16", [
    pytest.param("nnx", False, marks=pytest.mark.slow),
    pytest.param("nnx", True, marks=pytest.mark.slow),
    pytest.param("linen", True, marks=pytest.mark.slow),
])
def test_an_nnx_linear_and_a_linen_dense_train_and_skip_exactly(model_kind, against_bf16):
  """200 input features: a padded contraction (two tiles, the second 72 wide)."""
  train_helpers.check_scaled_recipe_trains_and_skips(
      "mixed_fp8_block", model_kind, against_bf16, features=200, seed=5)


@pytest.mark.slow
def test_precision_report_and_summary_name_each_matmuls_format():
  """Every scaled format's matmuls, forward and backward, carry its describe() text in
  the lowered program (the named scope scaled.dot_for opens): precision_report shows it
  per op and per format, summary per module."""
  recipes = [jaxamp.CurrentScaling(), jaxamp.RowwiseScaling(), jaxamp.BlockScaling()]
  want = ["fp8 e4m3fn/e5m2 per-tensor current", "fp8 e4m3fn/e5m2 rowwise",
          "fp8 e4m3fn, 1x128 act / 128x128 weight blocks"]
  x, w = jnp.ones((4, 128), jnp.bfloat16), jnp.ones((128, 8), jnp.bfloat16)
  for recipe, name in zip(recipes, want):
    assert jaxamp.scaled.describe(recipe) == name
    dot = jaxamp.scaled.dot_for(None, recipe, "Dense")
    r = jaxamp.precision_report(lambda x, w: dot(x, w, DIMS).astype(jnp.float32).sum(), x, w,
                                backward=True, argnums=(0, 1))
    assert len(r.ops) == 3 and all(op.is_fp8 and op.scaled_format == name for op in r.ops)
    assert r.flops_by_format == {name: r.total_flops} and name in str(r)
  plain = jaxamp.precision_report(lambda x, w: x @ w, x, w)
  assert plain.ops[0].scaled_format == "" and plain.flops_by_format == {}
  assert "format" not in str(plain)
  model = nnx.Sequential(nnx.Linear(128, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
  for s in (jaxamp.summary(model, policy="mixed_fp8_block"),  # from the policy
            jaxamp.summary(model, jnp.ones((2, 128)), policy="mixed_fp8_block")):  # traced
    formats = {r.path: r.scaled_format for r in s.rows}
    assert formats["layers/0"] == want[2] and not formats["layers/1"]
    assert want[2] in str(s)
