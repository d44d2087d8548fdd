"""A scaled format per matmul (jaxamp.PerMatmulScaling): with one recipe for all three
matmuls the products are that recipe's own dot's (bit for bit for BlockScaling, to
float32 rounding for the others); None runs a matmul in the
compute dtype; mixed recipes train under make_train_step and skip a NaN batch exactly."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp import per_matmul

DIMS = (((1,), (0,)), ((), ()))


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # FP8 on CPU: upcast
    yield


def _value_and_grads(dot, x, w, c):
  @jax.jit
  def run(x, w, c):
    y, vjp = jax.vjp(dot, x, w)
    return (y, *vjp(c))
  return [np.asarray(a) for a in run(x, w, c)]


def _operands(m=6, k=200, n=130):
  rng = np.random.RandomState(0)
  x = jnp.asarray((rng.randn(m, k) * np.logspace(-2, 2, m)[:, None]).astype(np.float32))
  w = jnp.asarray((rng.randn(k, n) * 0.1).astype(np.float32))
  c = jnp.asarray(rng.randn(m, n).astype(np.float32))
  return x, w, c


def _bits(a):
  return a.view(np.uint32)


@pytest.mark.slow  # main tier: the checks only (the new tests' CPU-seconds budget)
def test_wgrad_none_runs_the_weight_gradient_in_the_compute_dtype():
  """fwd and dgrad block-scaled: the block dot's own output and input gradient; the
  weight gradient the float32 product x^T @ g."""
  x, w, c = _operands()
  blk = jaxamp.BlockScaling()
  recipe = jaxamp.PerMatmulScaling(fwd=blk, dgrad=blk, wgrad=None)
  y, gx, gw = _value_and_grads(
      lambda x, w: per_matmul.per_matmul_dot_general(x, w, DIMS, recipe=recipe), x, w, c)
  y0, gx0, gw0 = _value_and_grads(
      lambda x, w: jaxamp.block.block_dot_general(x, w, DIMS, recipe=blk), x, w, c)
  np.testing.assert_array_equal(_bits(y), _bits(y0))
  np.testing.assert_array_equal(_bits(gx), _bits(gx0))
  want = np.asarray(jax.jit(lambda x, c: jax.lax.dot_general(
      x.T, c, DIMS, preferred_element_type=jnp.float32))(x, c))
  np.testing.assert_array_equal(_bits(gw), _bits(want))
  assert not np.allclose(gw0, want, rtol=1e-4)  # the block wgrad differs: None did something


@pytest.mark.slow
@pytest.mark.parametrize("recipe, own", [
    (jaxamp.RowwiseScaling(), jaxamp.rowwise.rowwise_dot_general),
    (jaxamp.BlockScaling(act_block=64, weight_block=(128, 64)),
     jaxamp.block.block_dot_general),
    (jaxamp.CurrentScaling(), None),
])
def test_one_recipe_for_all_three_is_that_recipes_own_dot(recipe, own):
  x, w, c = _operands()
  composite = jaxamp.PerMatmulScaling(fwd=recipe, dgrad=recipe, wgrad=recipe)
  got = _value_and_grads(
      lambda x, w: per_matmul.per_matmul_dot_general(x, w, DIMS, recipe=composite), x, w, c)
  if own is None:  # per-tensor FP8's dot
    own = lambda x, w, d, recipe: jaxamp.fp8.scaled_dot_general(x, w, d, recipe=recipe)
  want = _value_and_grads(lambda x, w: own(x, w, DIMS, recipe=recipe), x, w, c)
  for a, b in zip(got, want):
    if isinstance(recipe, jaxamp.BlockScaling):  # the same functions, the same layout
      np.testing.assert_array_equal(_bits(a), _bits(b))
    else:
      # Rowwise and per-tensor dots lay their backward matmuls out as lax's transpose
      # rule does and divide by the scales in another order: float32 rounding apart.
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_recipes_are_checked_and_described():
  for bad in (jaxamp.DelayedScaling(), "current", 1.0,
              jaxamp.PerMatmulScaling(fwd=jaxamp.BlockScaling())):
    with pytest.raises(ValueError, match="PerMatmulScaling.dgrad must be None"):
      jaxamp.PerMatmulScaling(dgrad=bad)
  recipe = jaxamp.PerMatmulScaling(fwd=jaxamp.RowwiseScaling(), dgrad=jaxamp.CurrentScaling())
  assert jaxamp.scaled.describe(recipe) == ("fwd fp8 e4m3fn/e5m2 rowwise; dgrad fp8 "
                                            "e4m3fn/e5m2 per-tensor current; wgrad compute "
                                            "dtype")
  policy = jaxamp.Policy(jnp.float32, jnp.bfloat16, fp8=recipe)
  assert policy.fp8 == recipe and hash(policy) == hash(
      jaxamp.Policy(jnp.float32, jnp.bfloat16, fp8=recipe))


@pytest.mark.slow
def test_a_mixed_recipe_trains_and_skips_a_nan_batch_exactly():
  recipe = jaxamp.PerMatmulScaling(fwd=jaxamp.BlockScaling(), dgrad=jaxamp.RowwiseScaling(),
                                   wgrad=None)
  policy = jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, recipe)
  rng = np.random.RandomState(1)
  c = rng.randn(8, 4).astype(np.float32)
  train = jaxamp.make_train_step(
      lambda m, b: jnp.mean((m(b["x"]).astype(jnp.float32) - c) ** 2), optax.sgd(0.1),
      policy=policy)
  state = train.init(nnx.Sequential(nnx.Linear(200, 16, rngs=nnx.Rngs(0)),
                                    nnx.Linear(16, 4, rngs=nnx.Rngs(1))))
  first = [np.asarray(p) for p in jax.tree.leaves(state.params)]
  xs = [rng.randn(8, 200).astype(np.float32) for _ in range(3)]
  xs[2][1, 5] = np.nan
  losses = []
  for x in xs[:2]:
    state, metrics = train.step(state, {"x": jnp.asarray(x)})
    assert bool(metrics["grads_finite"])
    losses.append(float(metrics["loss"]))
  params = [np.asarray(p) for p in jax.tree.leaves(state.params)]
  assert all(not np.array_equal(a, b) for a, b in zip(params, first))
  assert losses[1] < losses[0]
  kept = {k: np.asarray(v) for k, v in state.scaled.items()}
  assert sorted(kept) == ["layers/0", "layers/1"]
  state, metrics = train.step(state, {"x": jnp.asarray(xs[2])})
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  for a, b in zip(jax.tree.leaves(state.params), params):
    np.testing.assert_array_equal(_bits(np.asarray(a)), _bits(b))
  for k, v in state.scaled.items():
    np.testing.assert_array_equal(np.asarray(v), kept[k])
