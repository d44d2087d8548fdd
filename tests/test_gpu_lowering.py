"""What a GPU receives: the train step lowered for CUDA on a machine without one.

Lowering is shape-only and needs no device (``jit(...).trace(...).lower(
lowering_platforms=('cuda',))``), so these tests run on CPU and check the StableHLO a GPU
would compile: every matmul and convolution of the forward and backward pass has
half-precision operands, and none asks for a half-precision accumulator (XLA's GPU
backends accumulate half-precision dots in float32 when no algorithm is given).
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxamp
import linen_models
import nnx_models
from jaxamp import report as report_lib

# Heavier checks: the slow tier (pytest -m slow), which CI runs after the main suite.
pytestmark = pytest.mark.slow

HALF = {"mixed_bfloat16": "bfloat16", "mixed_float16": "float16", "O1": "float16"}


def _xent(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))


def _make(policy, loss_fn):
  kwargs = {"opt_level": policy} if policy.startswith("O") else {"policy": policy}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # float16 is slow on this CPU: known
    return jaxamp.make_train_step(loss_fn, optax.adam(1e-3), **kwargs)


# Lowering reads shapes only: the models get zeros instead of their random initial values,
# whose samplers take XLA:CPU seconds to compile per kernel shape.


def _zeros(tree):
  def fill(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jnp.zeros((*x.shape, 2), jnp.uint32))
    return jnp.zeros(x.shape, x.dtype)

  return jax.tree.map(fill, tree)


def _nnx_model(make):
  graphdef, state = nnx.split(nnx.eval_shape(make))
  return nnx.merge(graphdef, _zeros(state))


def _nnx_lm(policy):
  train = _make(policy, lambda model, batch: _xent(model(batch[0]), batch[1]))
  model = _nnx_model(lambda: nnx_models.TransformerLM(rngs=nnx.Rngs(0)))
  return train, train.init(model), nnx_models.lm_batch()


def _nnx_cnn(policy):
  train = _make(policy, lambda model, batch: _xent(model(batch[0]), batch[1]))
  model = _nnx_model(lambda: nnx_models.CNN(rngs=nnx.Rngs(0, dropout=1)))
  return train, train.init(model), nnx_models.image_batch()


def _linen_lm(policy):
  ids = linen_models.token_batch()
  train = _make(policy, lambda model, ids: linen_models.lm_loss(model(ids), ids))
  module = linen_models.TransformerLM()
  variables = _zeros(jax.eval_shape(module.init, jax.random.key(0), ids))
  return train, train.init(module, variables, ids), ids


def _linen_cnn(policy):
  images = linen_models.image_batch()
  labels = jnp.arange(images.shape[0]) % 10
  train = _make(policy, lambda model, batch: linen_models.classification_loss(
      model(batch[0], train=True), batch[1]))
  module = linen_models.CNN()
  init = lambda key, x: module.init(key, x, train=False)
  variables = _zeros(jax.eval_shape(init, jax.random.key(0), images))
  return train, train.init(module, variables, images, train=False), (images, labels)


def cuda_module(train: jaxamp.TrainStep, state, batch) -> str:
  """The StableHLO text of ``train.step`` lowered for CUDA (no GPU needed)."""
  # TrainStep has no public handle on its jitted step yet; see the benchmarks' lower-only mode.
  lowered = train.lower(state, batch, platforms=("cuda",))
  return report_lib._module_text(lowered)


@pytest.mark.parametrize("build", [_nnx_lm, _nnx_cnn, _linen_lm, _linen_cnn],
                         ids=["nnx_lm", "nnx_cnn", "linen_lm", "linen_cnn"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_every_matmul_of_the_step_is_half_precision_on_cuda(build, policy):
  train, state, batch = build(policy)
  text = cuda_module(train, state, batch)
  ops, _, _, _ = report_lib._parse_module(text)
  half = HALF[policy]
  # Forward and backward: two or three ops per forward matmul or convolution.
  assert len(ops) >= 8
  assert {(op.lhs_dtype, op.rhs_dtype) for op in ops} == {(half, half)}, [
      op for op in ops if not op.is_half]
  # The results are half precision, or float32 where attention asks for float32 logits;
  # no dot names an algorithm with a half-precision accumulator.
  assert {op.result_dtype for op in ops} <= {half, "float32"}
  assert "accumulation_type = bf16" not in text and "accumulation_type = f16" not in text
  # Parameters stay float32 in the state the step takes (mixed: float32 storage).
  assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


def test_o1_autocast_step_on_cuda():
  """O1: the float32 model through autocast; its dots ask for a float16 result, which
  XLA's GPU backends (cuBLAS, Triton) compute with a float32 accumulator."""
  train, state, batch = _nnx_lm("O1")
  ops, _, _, _ = report_lib._parse_module(cuda_module(train, state, batch))
  assert len(ops) >= 8 and all(op.is_half for op in ops)
  assert {op.result_dtype for op in ops} == {"float16"}
