"""Tests for jaxamp.clipping: optax's rule, and the train step's norm reused only when valid."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp.clipping import GLOBAL_NORM, KnownNorm
from train_helpers import NNXNet, assert_trees_equal, init, leaves, loss_fn, make_batches

POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]


def _tree(seed, scale):
  rng = np.random.RandomState(seed)
  return {"w": jnp.asarray(rng.randn(5, 3) * scale, jnp.float32),
          "b": [jnp.asarray(rng.randn(3) * scale, jnp.float32)]}


@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
@pytest.mark.parametrize("max_norm", [0.5, 2.0])
def test_matches_optax_clip_by_global_norm(scale, max_norm):
  updates = _tree(0, scale)
  ours, _ = jaxamp.clip_by_global_norm(max_norm).update(updates, optax.EmptyState())
  theirs, _ = optax.clip_by_global_norm(max_norm).update(updates, optax.EmptyState())
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
  norm = float(optax.tree.norm(ours))
  # Left alone below max_norm (bit for bit), scaled to it above.
  if float(optax.tree.norm(updates)) < max_norm:
    assert_trees_equal(ours, updates)
  else:
    assert norm == pytest.approx(max_norm, rel=1e-6)


def test_non_floating_leaves_pass_and_inject_hyperparams_works():
  updates = {"w": jnp.array([30.0, 40.0]), "n": jnp.array([7], jnp.int32)}
  out, _ = jaxamp.clip_by_global_norm(5.0).update(updates, optax.EmptyState())
  np.testing.assert_allclose(out["w"], [3.0, 4.0], rtol=1e-6)
  assert out["n"].dtype == jnp.int32 and int(out["n"][0]) == 7
  tx = optax.inject_hyperparams(jaxamp.clip_by_global_norm)(max_norm=5.0)
  out, _ = tx.update({"w": jnp.array([30.0, 40.0])}, tx.init({"w": jnp.zeros(2)}))
  np.testing.assert_allclose(out["w"], [3.0, 4.0], rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -1.0, True, np.bool_(True), np.float32(-2.0),
                                 float("nan"), "1.0", None, jnp.ones(2)])
def test_bad_max_norm_is_named(bad):
  with pytest.raises(ValueError, match="max_norm must be a positive number"):
    jaxamp.clip_by_global_norm(bad)


@pytest.mark.parametrize("good", [2, 2.0, np.float32(2.0), np.int32(2), jnp.float32(2.0)])
def test_numpy_and_jax_scalars_are_accepted(good):
  out, _ = jaxamp.clip_by_global_norm(good).update({"w": jnp.array([30.0, 40.0])},
                                                   optax.EmptyState())
  np.testing.assert_allclose(out["w"], [1.2, 1.6], rtol=1e-6)


def test_a_known_norm_is_used_only_for_the_very_arrays_it_was_taken_of():
  updates = {"w": jnp.array([3.0, 4.0])}
  known = KnownNorm.of(updates, jnp.float32(100.0))  # a deliberately different norm
  clip = jaxamp.clip_by_global_norm(10.0)
  out, _ = clip.update(updates, optax.EmptyState(), **{GLOBAL_NORM: known})
  np.testing.assert_allclose(out["w"], [0.3, 0.4], rtol=1e-6)  # used: 10 / 100
  copy = {"w": jnp.array([3.0, 4.0])}  # equal values, other arrays: its own norm (5)
  out, _ = clip.update(copy, optax.EmptyState(), **{GLOBAL_NORM: known})
  np.testing.assert_allclose(out["w"], [3.0, 4.0])
  assert known.norm_of({"w": updates["w"], "extra": updates["w"]}) is None


def _train(policy, tx):
  train = jaxamp.make_train_step(loss_fn, tx, policy=policy,
                                 memory=jaxamp.MemoryConfig(donate=False))
  return train, train.init(NNXNet(nnx.Rngs(0), batchnorm=False))


def _run(policy, tx, steps=3):
  train, state = _train(policy, tx)
  norms = []
  for batch in make_batches(steps):
    state, metrics = train.step(state, batch)
    assert bool(metrics["grads_finite"])
    norms.append(float(metrics["grad_norm"]))
  return state, norms


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_in_the_step_the_shared_norm_gives_what_its_own_norm_gives(policy):
  # optax.scale(1.0) hands the clip other arrays of equal values: it takes its own norm.
  # Params equal to float32 rounding show the step's norm is the norm of exactly these
  # gradients (a norm of other arrays, scaled or unscaled, is off by far more). Not
  # bit-identical: the two norms are separate reductions, which XLA may vectorize in a
  # different order (one ulp apart on an AVX-512 CPU).
  max_norm = 0.05
  shared, norms = _run(policy, optax.chain(jaxamp.clip_by_global_norm(max_norm),
                                           optax.sgd(0.1)))
  own, _ = _run(policy, optax.chain(optax.scale(1.0), jaxamp.clip_by_global_norm(max_norm),
                                    optax.sgd(0.1)))
  assert min(norms) > max_norm  # every step clipped
  for a, b in zip(leaves(shared.params), leaves(own.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=4e-6, atol=0)
  reference, _ = _run(policy, optax.chain(optax.clip_by_global_norm(max_norm),
                                          optax.sgd(0.1)))
  for a, b in zip(leaves(shared.params), leaves(reference.params)):
    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.slow
def test_after_an_element_that_changes_the_updates_the_clip_takes_its_own_norm():
  # sgd(1.0) after the clip: the parameter change is the clipped update. Had the clip
  # reused the step's norm of the unscaled gradients, the change would have norm 3.
  train, state = _train("float32", optax.chain(optax.scale(3.0),
                                               jaxamp.clip_by_global_norm(1.0),
                                               optax.sgd(1.0)))
  new, metrics = train.step(state, make_batches(1)[0])
  assert 3.0 * float(metrics["grad_norm"]) > 1.0
  change = jax.tree.map(lambda a, b: a - b, new.params, state.params)
  assert float(optax.tree.norm(change)) == pytest.approx(1.0, rel=1e-5)


def _reductions(api, tx):
  train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_bfloat16",
                                 memory=jaxamp.MemoryConfig(donate=False))
  state = init(train, api, batchnorm=False)
  text = train.lower(state, make_batches(1)[0]).as_text()
  return len(re.findall(r"stablehlo\.reduce\b", text)), len(jax.tree.leaves(state.params))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_the_step_compiles_one_gradient_norm_not_two(api):
  ours, n_params = _reductions(api, optax.chain(jaxamp.clip_by_global_norm(1.0),
                                                optax.sgd(0.1)))
  theirs, _ = _reductions(api, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))
  none, _ = _reductions(api, optax.sgd(0.1))
  assert ours == none  # the step's own norm serves the clip
  assert theirs == none + n_params  # optax's clip: a second reduction per parameter
