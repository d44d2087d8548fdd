"""FP8 ConvTranspose layers (jaxamp.fp8_conv_transpose; jaxamp.fp8_conv.conv_transpose;
Equinox's in jaxamp.equinox): NNX, Linen and Equinox ConvTranspose under the per-tensor recipes against a float32 reference of the
dequantized operands, FP8 and bfloat16 operands in the lowered program, the precision
report, training with delayed-scaling state and the exact skip."""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp import fp8_conv
from tests.test_fp8_conv import (_quiet, _xent, declining_policy,  # noqa: F401  (fixtures)
                                  dequantized, trains_then_skips)

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
# FP8 with float32 compute: the layer's input is quantized as given.
F32_FP8 = jaxamp.Policy("float32", "float32", "float32", fp8=jaxamp.CurrentScaling())


# (input shape, kernel shape, lax.conv_transpose arguments); a transposed kernel is
# [*spatial, out, in]
_CASES = [
    ((2, 7, 3), (3, 4, 3), dict(strides=(2,), padding="SAME", transpose_kernel=True)),
    ((2, 5, 6, 3), (3, 2, 3, 4), dict(strides=(2, 1), padding="VALID", rhs_dilation=(1, 2))),
    ((2, 5, 6, 3), (3, 3, 4, 3), dict(strides=(3, 2), padding=((1, 2), (0, 1)),
                                      transpose_kernel=True,
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    ((1, 4, 6, 5), (2, 4, 3, 3), dict(strides=(2, 2), padding="SAME", rhs_dilation=(2, 1),
                                      dimension_numbers=("NCHW", "OIHW", "NCHW"))),
]


def test_conv_transpose_through_lax_convolution_is_lax_conv_transpose():
  """With lax's own convolution, bit for bit: the padding, kernel flip and layouts."""
  rng = np.random.RandomState(0)
  args = [(rng.randn(*xs).astype(np.float32), rng.randn(*ks).astype(np.float32))
          for xs, ks, _ in _CASES]

  @jax.jit
  def both(args):
    return [(fp8_conv.conv_transpose(jax.lax.conv_general_dilated, x, k, **kw),
             jax.lax.conv_transpose(x, k, **kw)) for (x, k), (_, _, kw) in zip(args, _CASES)]

  for got, want in both(args):
    assert got.shape == want.shape and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


def test_a_function_calling_lax_otherwise_is_refused():
  import numpy  # pylint: disable=import-outside-toplevel

  def layer(x):
    return numpy.asarray(x)

  with pytest.raises(TypeError, match="does not call jax.lax as `lax`"):
    fp8_conv.with_conv_transpose(layer, None)


_LAYER = dict(strides=(2, 1), kernel_dilation=(1, 2))


def _nnx_layer(padding, transpose_kernel):
  return nnx.ConvTranspose(3, 4, (3, 2), padding=padding, transpose_kernel=transpose_kernel,
                           rngs=nnx.Rngs(0), **_LAYER)


def _nnx_run(layer, x, r, policy):
  """(output, input gradient, kernel gradient) of sum(layer(x) * r), under policy."""
  def loss(m, x):
    m = m if policy is None else jaxamp.with_policy(m, policy)
    y = m(x)
    return jnp.sum(y * r), y

  @nnx.jit
  def run(layer, x):
    (_, y), (g_m, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
    return y, g_x, g_m.kernel[...]

  return run(layer, x)


@pytest.mark.parametrize("padding,transpose_kernel", [
    pytest.param("SAME", True, id="same-transposed-kernel", marks=pytest.mark.slow),
    pytest.param("CIRCULAR", False, id="circular", marks=pytest.mark.slow),
    pytest.param(((1, 2), (0, 1)), False, id="explicit", marks=pytest.mark.slow)])
def test_nnx_conv_transpose_matches_a_float32_reference_of_the_fp8_operands(
    padding, transpose_kernel):
  """Forward: the layer on the E4M3-rounded input and kernel (descaled); backward: its
  gradients for the E5M2-rounded output gradient. Within 1e-5 of the largest value."""
  rng = np.random.RandomState(0)
  layer = _nnx_layer(padding, transpose_kernel)
  x = rng.randn(2, 5, 6, 3).astype(np.float32)
  y_shape = jax.eval_shape(layer, x).shape
  r = rng.randn(*y_shape).astype(np.float32)
  y, g_x, g_k = _nnx_run(layer, x, r, F32_FP8)
  ref = _nnx_layer(padding, transpose_kernel)
  ref.kernel[...] = dequantized(layer.kernel[...], 448, E4M3)
  want = _nnx_run(ref, dequantized(x, 448, E4M3), dequantized(r, 57344, E5M2), None)
  assert y.dtype == jnp.float32 and y.shape == want[0].shape
  for got, ref_value in zip((y, g_x, g_k), want):
    np.testing.assert_allclose(got, ref_value, rtol=0, atol=1e-5 * np.abs(ref_value).max())
  plain = layer(x)
  assert not np.allclose(y, plain, rtol=0, atol=1e-6)  # it did round
  # against the float32 layer: E4M3 rounds by up to 2**-4 of a value
  assert np.linalg.norm(y - plain) / np.linalg.norm(plain) < 0.08


@pytest.mark.slow
def test_linen_conv_transpose_matches_a_float32_reference_of_the_fp8_operands():
  rng = np.random.RandomState(1)
  layer = nn.ConvTranspose(4, (3, 3), strides=(2, 2), padding="CIRCULAR", transpose_kernel=True)
  x = rng.randn(2, 4, 5, 3).astype(np.float32)
  v = layer.init(jax.random.key(0), x)
  r = rng.randn(*jax.eval_shape(lambda: layer.apply(v, x)).shape).astype(np.float32)

  @jax.jit
  def run_both(v, x, r, qv, qx, qr):
    return (run(jaxamp.with_policy(layer, F32_FP8).apply, v, x, r),
            run(layer.apply, qv, qx, qr), run(layer.apply, v, x, r))

  def run(apply, v, x, r):
    y, pull = jax.vjp(apply, v, x)
    g_v, g_x = pull(jnp.asarray(r))
    return y, g_x, g_v["params"]["kernel"]

  qv = {"params": {**v["params"], "kernel": dequantized(v["params"]["kernel"], 448, E4M3)}}
  got, want, plain = run_both(v, x, r, qv, dequantized(x, 448, E4M3),
                              dequantized(r, 57344, E5M2))
  for a, b in zip(got, want):
    assert a.dtype == jnp.float32 and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
  assert not np.allclose(got[0], plain[0], rtol=0, atol=1e-6)
  # against the float32 layer (E4M3 rounds by up to 2**-4, E5M2 by 2**-3): within 8 % and
  # 10 % normwise
  for a, b, tol in zip(got, plain, (0.08, 0.10, 0.10)):
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol


@pytest.mark.slow
@pytest.mark.parametrize("padding,mode", [("SAME", "CIRCULAR"), (((1, 2), (0, 1)), "ZEROS")])
def test_equinox_conv_transpose_matches_a_float32_reference_of_the_fp8_operands(padding, mode):
  """Under jax.vmap: the batch quantized as one tensor (one scale), as a Flax layer."""
  rng = np.random.RandomState(2)
  layer = eqx.nn.ConvTranspose2d(3, 4, (3, 2), stride=(2, 1), dilation=(1, 2), padding=padding,
                                 padding_mode=mode, key=jax.random.key(0))
  x = rng.randn(2, 3, 5, 6).astype(np.float32)

  def with_weight(w):
    return eqx.tree_at(lambda m: m.weight, layer, w)

  def run(policy, w, x, r):
    def f(w, x):
      m = with_weight(w)
      return jax.vmap(m if policy is None else jaxamp.with_policy(m, policy))(x)
    y, pull = jax.vjp(f, w, x)
    g_w, g_x = pull(jnp.asarray(r))
    return y, g_x, g_w

  w = layer.weight
  r = rng.randn(*jax.eval_shape(jax.vmap(layer), x).shape).astype(np.float32)
  got, want, plain = jax.jit(lambda w, x, r, qw, qx, qr: (
      run(F32_FP8, w, x, r), run(None, qw, qx, qr), run(None, w, x, r)))(
          w, x, r, dequantized(w, 448, E4M3), dequantized(x, 448, E4M3),
          dequantized(r, 57344, E5M2))
  for a, b in zip(got, want):
    assert a.dtype == jnp.float32 and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
  for a, b, tol in zip(got, plain, (0.08, 0.10, 0.10)):
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < tol


def _convs(text):
  return [c.split(":")[-1].strip() for c in text.splitlines() if "stablehlo.convolution" in c]


def test_lowered_fp8_forward_and_bfloat16_backward_convolutions_cuda():
  """NNX and Linen (Equinox's: in the training test, slow)."""
  x = jnp.ones((2, 5, 6, 3))
  nnx_layer = _nnx_layer("SAME", False)
  linen_layer = nn.ConvTranspose(4, (3, 2), **_LAYER)
  v = linen_layer.init(jax.random.key(0), x)
  amp = jaxamp.with_policy(linen_layer, "mixed_fp8")

  programs = {
      "nnx": jax.jit(nnx.grad(lambda m, x: jnp.sum(jaxamp.with_policy(m, "mixed_fp8")(x) ** 2),
                              argnums=(0, 1))).trace(nnx_layer, x),
      "linen": jax.jit(jax.grad(lambda v, x: jnp.sum(amp.apply(v, x) ** 2), (0, 1))).trace(v, x)}
  for name, traced in programs.items():
    convs = _convs(traced.lower(lowering_platforms=("cuda",)).as_text())
    assert len(convs) == 3, (name, convs)
    fwd = [c for c in convs if c.count("f8E4M3FN>") == 2]
    bwd = [c for c in convs if c.count("xbf16>") == 2 and c.endswith("f32>")]
    assert len(fwd) == 1 and fwd[0].endswith("xf32>") and len(bwd) == 2, (name, convs)


def test_precision_report_shows_the_fp8_convolution():
  layer = nn.ConvTranspose(4, (3, 3), strides=(2, 2))
  x = jnp.ones((2, 5, 6, 3))
  v = layer.init(jax.random.key(0), x)
  amp = jaxamp.with_policy(layer, "mixed_fp8_current")
  r = jaxamp.precision_report(lambda x: (amp.apply(v, x).astype(jnp.float32) ** 2).sum(), x,
                              backward=True)
  fwd, bwd = sorted(r.ops, key=lambda op: op.lhs_dtype != "float8_e4m3fn")
  assert (fwd.lhs_dtype, fwd.rhs_dtype) == ("float8_e4m3fn", "float8_e4m3fn")
  # the input gradient's convolution: the FP8 values widened to bfloat16
  assert (bwd.lhs_dtype, bwd.rhs_dtype) == ("bfloat16", "bfloat16")
  # 2 FLOPs per product: output [2, 10, 12, 4] times the 3x3x3 window (holes included:
  # the convolution runs on the stride-dilated input)
  assert r.fp8_flops == 2 * (2 * 10 * 12 * 4) * 3 * 3 * 3
  assert r.half_flops == r.total_flops - r.fp8_flops > 0
  assert "per-tensor current" in str(r)


class _NNXDecoder(nnx.Module):

  def __init__(self, rngs):
    self.up = nnx.ConvTranspose(3, 8, (3, 3), strides=(2, 2), rngs=rngs)
    self.out = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.up(x)).mean((1, 2)))


class _LinenDecoder(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.ConvTranspose(8, (3, 3), strides=(2, 2), padding="CIRCULAR")(x))
    return nn.Dense(4)(x.mean((1, 2)))


class _EqxDecoder(eqx.Module):
  up: eqx.nn.ConvTranspose2d
  out: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.up = eqx.nn.ConvTranspose2d(3, 8, 3, stride=2, padding="SAME", key=k1)
    self.out = eqx.nn.Linear(8, 4, key=k2)

  def __call__(self, x):  # one example, channels first
    return self.out(jax.nn.relu(self.up(x)).mean((1, 2)))


@pytest.mark.slow
@pytest.mark.parametrize("library", ["nnx", "linen", "equinox"])
def test_conv_transpose_layers_train_with_delayed_state_and_skip_a_nonfinite_batch(
    library, fresh_warnings):
  x = jnp.asarray(np.random.RandomState(0).randn(4, 6, 6, 3), jnp.float32)
  batch = (x, jnp.arange(4) % 4)
  train = jaxamp.make_train_step(lambda m, b: _xent(m(b[0]), b[1]), optax.adam(1e-2),
                                 policy="mixed_fp8")
  if library == "nnx":
    state, first, paths = train.init(_NNXDecoder(nnx.Rngs(0))), "up", {"up", "out"}
  elif library == "equinox":
    x = jnp.transpose(x, (0, 3, 1, 2))
    batch = (x, batch[1])
    train = jaxamp.make_train_step(lambda m, b: _xent(jax.vmap(m)(b[0]), b[1]),
                                   optax.adam(1e-2), policy="mixed_fp8")
    state, first, paths = train.init(_EqxDecoder(jax.random.key(0))), "up", {"up", "out"}
  else:
    model = _LinenDecoder()
    state = train.init(model, model.init(jax.random.key(0), x), x)
    first, paths = "ConvTranspose_0", {"ConvTranspose_0", "Dense_0"}
  assert set(state.fp8) == paths
  state, _ = trains_then_skips(train, state, batch, first)
  # the step's lowered program: the forward convolution with E4M3 operands, the kernel
  # gradient's with bfloat16 ones (the input needs none)
  convs = _convs(train.lower(state, batch, platforms=("cuda",)).as_text())
  assert sum(c.count("f8E4M3FN>") == 2 for c in convs) == 1, convs
  assert sum(c.count("xbf16>") == 2 and c.endswith("xf32>") for c in convs) == 1, convs


@pytest.mark.slow
@pytest.mark.parametrize("library", ["nnx", "linen"])
def test_a_subclass_with_its_own_call_runs_in_the_compute_dtype_with_a_warning(
    library, fresh_warnings):
  x = jnp.ones((2, 5, 5, 3))
  if library == "nnx":
    class Own(nnx.ConvTranspose):
      def __call__(self, x):
        return super().__call__(x) * 2

    layer = Own(3, 4, (3, 3), strides=(2, 2), rngs=nnx.Rngs(0))
    run = jaxamp.with_policy(layer, "mixed_fp8")
  else:
    class Own(nn.ConvTranspose):  # pylint: disable=function-redefined
      def __call__(self, x):
        return super().__call__(x) * 2

    layer = Own(4, (3, 3), strides=(2, 2))
    v = layer.init(jax.random.key(0), x)
    run = lambda x: jaxamp.with_policy(layer, "mixed_fp8").apply(v, x)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    text = jax.jit(run).lower(x).as_text()
  msgs = [str(w.message) for w in seen if "overrides ConvTranspose.__call__" in str(w.message)]
  assert len(msgs) == 1 and "Own" in msgs[0] and "compute dtype" in msgs[0], msgs
  convs = _convs(text)
  assert len(convs) == 1 and "f8E4M3FN" not in convs[0] and "bf16" in convs[0], convs


@pytest.mark.slow
def test_a_format_declining_convolutions_leaves_conv_transpose_in_the_compute_dtype(
    fresh_warnings, declining_policy):
  x = jnp.ones((2, 6, 6, 3))
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy=declining_policy)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state = train.init(_NNXDecoder(nnx.Rngs(0)))
  msgs = [str(w.message) for w in seen if "convolution layers" in str(w.message)]
  assert len(msgs) == 1 and "'up'" in msgs[0], msgs
  assert "up" not in (state.fp8 or {})
  convs = _convs(train.lower(state, x).as_text())
  assert convs and all("f8E4M3FN" not in c and "bf16" in c for c in convs), convs
