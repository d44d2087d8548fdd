"""Rowwise FP8 ('mixed_fp8_rowwise'): the quantization against a NumPy reference written
from the rule (torchao's rowwise recipe, jaxamp/rowwise.py's docstring), bit for bit; the
dot's forward and gradients against NumPy products of the dequantized operands; the
lowered program; training under make_train_step.

The reference, per row (amax over the contracted dimension, float32):
``s = FP8_MAX / max(amax, 1e-12)``, rounded down to a power of two with
``power_of_two`` (torchao: ``torch.exp2(torch.floor(torch.log2(scale)))``), ``s = 1``
where the amax is 0 or not finite; ``q = clip(x * s, -MAX, MAX)`` cast by ml_dtypes (round
to nearest even), NaN where ``x`` is not finite; dequantized ``q / s``.
"""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
import train_helpers
from jaxamp import rowwise

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
MAX = {E4M3: np.float32(448.0), E5M2: np.float32(57344.0)}
DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # FP8 on CPU: upcast
    yield


def ref_quantize(x, axis, dtype, power_of_two=False):
  """(q, s) from the rule, in NumPy."""
  x = np.asarray(x, np.float32)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    amax = np.max(np.abs(x), axis=axis, keepdims=True)
    s = (MAX[dtype] / np.maximum(amax, np.float32(1e-12))).astype(np.float32)
    if power_of_two:
      s = np.exp2(np.floor(np.log2(s))).astype(np.float32)
    s = np.where((amax > 0) & np.isfinite(amax), s, np.float32(1.0)).astype(np.float32)
    scaled = np.clip(x * s, -MAX[dtype], MAX[dtype])
    q = np.asarray(np.where(np.isfinite(x), scaled, np.nan), dtype=dtype)
  return q, s


def deq(q, s):
  return q.astype(np.float32) / s


def adversarial():
  rng = np.random.RandomState(0)
  x = rng.randn(8, 16).astype(np.float32)
  x[1] *= 1e-3
  x[1, 5] = 3e4  # one outlier: the rest of the row lands in E4M3's subnormals
  x[2] = 0.0  # an all-zero row: scale 1
  x[3] = rng.randn(16).astype(np.float32) * 1e-30  # amax below torchao's 1e-12 floor
  x[4] = rng.randn(16).astype(np.float32) * 2e-3  # E4M3-subnormal magnitudes unscaled
  x[5, 3] = np.inf
  x[6, 7] = np.nan
  x[7] = rng.randn(16).astype(np.float32) * 1e30  # large: scale far below 1
  return x


@pytest.mark.parametrize("power_of_two, dtype, axis", [
    (False, E4M3, 1), (True, E4M3, 1),
    *(pytest.param(*p, marks=pytest.mark.slow)  # main tier: < 10 CPU-seconds in all
      for p in [(True, E5M2, 1), (False, E5M2, 1), (False, E4M3, 0), (True, E5M2, 0)])])
def test_quantize_equals_the_numpy_rule_bit_for_bit(power_of_two, dtype, axis):
  for x in (np.random.RandomState(1).randn(8, 16).astype(np.float32) * 5, adversarial()):
    q, s = jax.jit(rowwise.quantize, static_argnums=(1, 2, 3))(jnp.asarray(x), (axis,),
                                                                 dtype, power_of_two)
    want_q, want_s = ref_quantize(x, axis, dtype, power_of_two)
    assert q.dtype == dtype and s.shape == want_s.shape
    np.testing.assert_array_equal(np.asarray(s).view(np.uint32), want_s.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    d = deq(np.asarray(q), np.asarray(s))
    np.testing.assert_array_equal(d.view(np.uint32), deq(want_q, want_s).view(np.uint32))
  if axis == 1:  # the adversarial rows' promised properties
    _, s = rowwise.quantize(jnp.asarray(adversarial()), (1,), dtype, power_of_two)
    s = np.asarray(s)[:, 0]
    assert s[2] == 1.0 and s[5] == 1.0 and s[6] == 1.0  # zero row, inf row, NaN row
    if power_of_two:
      assert np.all(np.log2(s) == np.round(np.log2(s)))
    d = deq(*map(np.asarray, rowwise.quantize(jnp.asarray(adversarial()), (1,), dtype,
                                              power_of_two)))
    assert np.isnan(d[5, 3]) and np.isnan(d[6, 7]) and np.all(np.isfinite(d[:5]))


@pytest.mark.parametrize("power_of_two", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_dot_is_the_product_of_the_dequantized_operands(power_of_two):
  rng = np.random.RandomState(2)
  x = (rng.randn(6, 16) * np.logspace(-3, 3, 6)[:, None]).astype(np.float32)
  w = (rng.randn(16, 5) * np.logspace(-2, 2, 5)[None, :]).astype(np.float32)
  for p2 in (power_of_two,):
    dot = jax.jit(lambda x, w, p2=p2: rowwise.rowwise_dot_general(
        x, w, DIMS, recipe=jaxamp.RowwiseScaling(power_of_two=p2)))
    got = np.asarray(dot(jnp.asarray(x), jnp.asarray(w)))
    want = (deq(*ref_quantize(x, 1, E4M3, p2)).astype(np.float64)
            @ deq(*ref_quantize(w, 0, E4M3, p2)).astype(np.float64))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
  # A non-finite input row comes out NaN (the exact skip needs it), the others finite.
  bad = x.copy()
  bad[2, 0] = np.inf
  got = np.asarray(dot(jnp.asarray(bad), jnp.asarray(w)))
  assert np.all(np.isnan(got[2])) and np.all(np.isfinite(np.delete(got, 2, axis=0)))


@pytest.mark.parametrize("wgrad_hp", [False, True])
def test_gradients_equal_the_numpy_reference(wgrad_hp):
  rng = np.random.RandomState(3)
  x = rng.randn(6, 16).astype(np.float32)
  w = (rng.randn(16, 5) * 0.1).astype(np.float32)
  c = (rng.randn(6, 5) * np.logspace(-4, 0, 6)[:, None]).astype(np.float32)
  recipe = jaxamp.RowwiseScaling(wgrad_high_precision=wgrad_hp)
  f = lambda x, w: jnp.sum(rowwise.rowwise_dot_general(x, w, DIMS, recipe=recipe) * c)
  gx, gw = map(np.asarray, jax.jit(jax.grad(f, (0, 1)))(jnp.asarray(x), jnp.asarray(w)))
  # dx = g @ w^T: g E5M2 per row (over the outputs), w E4M3 per input row.
  want_gx = (deq(*ref_quantize(c, 1, E5M2)).astype(np.float64)
             @ deq(*ref_quantize(w, 1, E4M3)).astype(np.float64).T)
  if wgrad_hp:
    want_gw = x.astype(np.float64).T @ c.astype(np.float64)
  else:  # dw = x^T @ g: both per column, along the batch
    want_gw = (deq(*ref_quantize(x, 0, E4M3)).astype(np.float64).T
               @ deq(*ref_quantize(c, 0, E5M2)).astype(np.float64))
  np.testing.assert_allclose(gx, want_gx, rtol=2e-6, atol=1e-12)
  np.testing.assert_allclose(gw, want_gw, rtol=2e-6, atol=1e-12)
  # The other mode differs: the option does something.
  if not wgrad_hp:
    assert not np.allclose(gw, x.T @ c, rtol=1e-4)


def test_the_lowered_program_has_e4m3_operands_and_per_row_scales():
  x, w = jnp.ones((6, 16), jnp.bfloat16), jnp.ones((16, 5), jnp.bfloat16)
  text = jax.jit(lambda x, w: rowwise.rowwise_dot_general(x, w, DIMS)).trace(
      x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert "tensor<6x16xf8E4M3FN>" in text and "tensor<16x5xf8E4M3FN>" in text
  assert "tensor<6x1xf32>" in text and "tensor<1x5xf32>" in text  # per row / per column
  assert "tensor<6x5xbf16>" in text


def test_policy_names():
  p = jaxamp.get_policy("mixed_fp8_rowwise")
  assert p == jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, jaxamp.RowwiseScaling())
  assert p.name == "mixed_fp8_rowwise"
  assert jaxamp.get_policy("p=f32,c=bf16,fp8=rowwise") == p
  with pytest.raises(ValueError, match="bool"):
    jaxamp.RowwiseScaling(power_of_two=1)


@pytest.mark.parametrize("model_kind, against_bf16", [
    ("nnx", False),
    pytest.param("nnx", True, marks=pytest.mark.slow),
    pytest.param("linen", True, marks=pytest.mark.slow),
])
def test_an_nnx_linear_and_a_linen_dense_train_and_skip_exactly(model_kind, against_bf16):
  train_helpers.check_scaled_recipe_trains_and_skips(
      "mixed_fp8_rowwise", model_kind, against_bf16, features=16, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("wgrad_hp", [False, True])
def test_batch_and_multi_axis_contractions_scale_per_row_as_the_2d_dot(wgrad_hp):
  """An Einsum's batch dimensions and a DenseGeneral's several contracted axes: the
  scales are per row of what is contracted, so the product and gradients are those of
  the 2-D dot on the reshaped (or per-batch) operands."""
  recipe = jaxamp.RowwiseScaling(wgrad_high_precision=wgrad_hp)
  dot = lambda a, b, d: rowwise.rowwise_dot_general(a, b, d, recipe=recipe)
  train_helpers.check_contractions_match_the_2d_dot(dot, (3, 6), 6, seed=6)


_MESH_SCRIPT = """
import sys, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter('ignore')
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import jaxamp
assert jax.device_count() == 4, jax.devices()
rng = np.random.RandomState(0)
x = rng.randn(16, 8).astype(np.float32) * np.repeat([1.0, 0.1, 10.0, 1.0], 4)[:, None]
c = rng.randn(16, 4).astype(np.float32)
rowwise = jaxamp.get_policy('mixed_fp8_rowwise')
out = {{}}
for key, policy in [('bf16', 'mixed_bfloat16'), ('fp8', rowwise),
                    ('hp', rowwise.with_fp8(jaxamp.RowwiseScaling(wgrad_high_precision=True)))]:
  for name, kw in [('one', {{}}),
                   ('mesh', dict(sharding=jaxamp.ShardingConfig(
                       mesh=jax.make_mesh((4,), ('data',)))))]:
    train = jaxamp.make_train_step(
        lambda m, b: jnp.mean((m(b['x']).astype(jnp.float32) - b['c']) ** 2),
        optax.sgd(0.1), policy=policy, **kw)
    state = train.init(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
    k0 = np.asarray(state.params['kernel'])
    state, metrics = train.step(state, {{'x': jnp.asarray(x), 'c': jnp.asarray(c)}})
    out[key, name] = (float(metrics['loss']), np.asarray(state.params['kernel']) - k0,
                      None if key == 'bf16' else np.asarray(state.scaled['']))
diff = {{k: float(np.abs(out[k, 'mesh'][1] - out[k, 'one'][1]).max())
        for k in ('bf16', 'fp8', 'hp')}}
size = float(np.abs(out['bf16', 'one'][1]).max())
print(diff, size)
for key in ('fp8', 'hp'):
  # The forward's scales are per row: the same whatever the split, so the loss is too,
  # to the order of the mean's sum (mixed_fp8_current's differs by FP8 rounding).
  np.testing.assert_allclose(out[key, 'mesh'][0], out[key, 'one'][0], rtol=1e-6)
  # The amaxes are maxed over the devices: one device's, for the whole batch.
  np.testing.assert_array_equal(out[key, 'mesh'][2], out[key, 'one'][2])
# The update: with the weight gradient in bfloat16, as far from one device's as
# mixed_bfloat16's is (summation order); in FP8 its column scales are each device's
# own (a quarter of the batch), E5M2's rounding (2 mantissa bits) on top.
assert diff['hp'] <= 1.5 * diff['bf16'] + 1e-6, diff
assert diff['fp8'] <= 0.1 * size, (diff, size)
print('MESH-OK')
"""


@pytest.mark.slow  # a subprocess with 4 CPU devices, as tests/test_scaled.py's
def test_on_a_mesh_the_loss_is_one_devices_and_the_update_close(tmp_path):
  import os
  from train_helpers import ROOT, run_script

  out = run_script(_MESH_SCRIPT.format(root=ROOT), tmp_path, "mesh.py",
                   {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                                 + os.environ.get("XLA_FLAGS", ""),
                    "JAX_PLATFORMS": "cpu"})
  assert "MESH-OK" in out, out
