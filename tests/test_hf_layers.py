"""FP8 on Hugging Face's FlaxConv1D (jaxamp.hf_layers), on a layer written as transformers'
(GPT-2 itself: tests/test_thirdparty.py, slow tier): delayed-scaling state, the FP8 product,
no unreached-matmul warning, FP8 operands in the lowered program."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*XLA on CPU runs FP8.*", category=RuntimeWarning)
    yield


def _fp8_dots(text):
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  return (sum(line.count("f8E4M3FN>") == 2 for line in dots),
          sum("f8E5M2" in line for line in dots))


class FlaxConv1D(nn.Module):
  """transformers' layer, as its source writes it (known by module and class name)."""
  features: int
  use_bias: bool = True
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, inputs):
    kernel = self.param("kernel", jax.nn.initializers.normal(0.02),
                        (self.features, inputs.shape[-1]))
    y = jax.lax.dot_general(jnp.asarray(inputs, self.dtype), jnp.asarray(kernel.T, self.dtype),
                            (((inputs.ndim - 1,), (0,)), ((), ())))
    return y + self.param("bias", jax.nn.initializers.zeros, (self.features,))


FlaxConv1D.__module__ = "transformers.models.gpt2.modeling_flax_gpt2"


class _MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return FlaxConv1D(4)(nn.gelu(FlaxConv1D(16)(x)))


@pytest.mark.slow
def test_a_flaxconv1d_runs_fp8_with_its_state_and_its_product(fresh_warnings):
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8), jnp.float32)
  model = _MLP()
  variables = model.init(jax.random.key(0), x)
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy="mixed_fp8")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = train.init(model, variables, x)
    state, metrics = train.step(state, x)
  assert set(state.fp8) == {"FlaxConv1D_0", "FlaxConv1D_1"}
  assert np.isfinite(float(metrics["loss"]))
  # the first layer applied (named second: built second): its bfloat16 input's amax
  assert float(state.fp8["FlaxConv1D_1"].amax_history[0, 0]) == float(
      jnp.abs(x.astype(jnp.bfloat16)).max())
  assert _fp8_dots(train.lower(state, x, platforms=("cuda",)).as_text()) == (2, 3)  # no input gradient for the batch


@pytest.mark.slow
def test_a_flaxconv1d_product_is_the_fp8_dot_of_its_input_and_kernel():
  """Outside a train step (current scaling): bit for bit the FP8 dot of the bfloat16 input
  and kernel (``[features, in]``, contracted on its last dimension), plus the bias."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(3, 5, 8), jnp.float32)
  layer = FlaxConv1D(6)
  variables = jax.tree.map(lambda a: a + jnp.float32(rng.rand()), layer.init(jax.random.key(0), x))
  bf = lambda a: a.astype(jnp.bfloat16)
  k, b = variables["params"]["kernel"], variables["params"]["bias"]
  got, want = jax.jit(lambda v, x: (
      jaxamp.with_policy(layer, "mixed_fp8").apply(v, x),
      jaxamp.fp8.scaled_dot_general(bf(x), bf(k), (((2,), (1,)), ((), ()))) + bf(b)))(
          variables, x)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  plain = jnp.einsum("btd,fd->btf", bf(x), bf(k)) + bf(b)
  assert not np.array_equal(np.asarray(got, np.float32), np.asarray(plain, np.float32))


@pytest.mark.slow
def test_flaxconv1d_layers_in_an_nn_scan_keep_per_layer_state_as_unrolled(fresh_warnings):
  """Two FlaxConv1D layers stacked by ``nn.scan`` (``'jaxamp_fp8'`` sliced with the
  params) keep one delayed state each: after two steps the stacked history equals that of
  the same layers applied one after another, bit for bit, with no warning."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.gelu(FlaxConv1D(8, name="c")(x)), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(Block, variable_axes={"params": 0, "jaxamp_fp8": 0},
                     split_rngs={"params": True}, length=2)(name="s")(x, None)[0]

  class Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = nn.gelu(FlaxConv1D(8, name=f"c{i}")(x))
      return x

  rng = np.random.RandomState(0)
  xs = [jnp.asarray(rng.randn(4, 8) * (1 + i), jnp.float32) for i in range(2)]
  variables = Scanned().init(jax.random.key(0), xs[0])
  stacked = variables["params"]["s"]["c"]
  unrolled = {"params": {f"c{i}": jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(2)}}
  states = []
  for model, v in ((Scanned(), variables), (Unrolled(), unrolled)):
    train = jaxamp.make_train_step(lambda m, b: jnp.mean((m(b) - 1.0) ** 2), optax.sgd(0.1),
                                   policy="mixed_fp8")
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      state = train.init(model, v, xs[0])
      for x in xs:
        state, _ = train.step(state, x)
    states.append(state.fp8)
  history = states[0]["s/c"].amax_history
  assert history.shape == (2, 3, 1024) and np.asarray(history)[:, :, :2].all()
  for i in range(2):
    np.testing.assert_array_equal(history[i], states[1][f"c{i}"].amax_history)
