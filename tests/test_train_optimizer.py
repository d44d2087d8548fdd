"""Tests for jaxamp.train.optimizer: the loss-scale element, its place in the chain, what a skipped step traces."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

from train_helpers import assert_trees_equal, init, loss_fn, make_batches


def test_a_float16_gradient_mean_without_loss_scale_warns():
  mesh = jax.make_mesh((1,), ("data",))
  for policy, warns in [("float32", True), ("mixed_bfloat16", True), ("mixed_float16", False)]:
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy=policy,
                                   sharding=jaxamp.ShardingConfig(mesh=mesh,
                                                                  grad_reduce_dtype=jnp.float16))
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      init(train, "nnx", batchnorm=False)
    found = [w for w in seen if "grad_reduce_dtype=float16" in str(w.message)]
    assert len(found) == warns, (policy, [str(w.message) for w in seen])


def test_loss_scale_after_clipping_is_refused():
  tx = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.dynamic_loss_scale(), optax.sgd(0.1))
  train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_float16")
  with pytest.raises(ValueError, match="misplaced.*Put the loss scale first"):
    init(train, "nnx", batchnorm=False)
  nested = optax.chain(optax.chain(jaxamp.dynamic_loss_scale(4.0), optax.sgd(0.1)))
  train = jaxamp.make_train_step(loss_fn, nested, policy="mixed_float16")
  assert float(jaxamp.get_loss_scale(init(train, "nnx", batchnorm=False).opt_state)) == 4.0


# --- misuse and injected faults: each trained wrongly in silence before ------------------


@pytest.mark.slow
def test_multisteps_outside_the_loss_scale_skips_one_micro_batch_in_the_step():
  # The train step with optax.MultiSteps: an inf micro-batch backs the scale off once and
  # is dropped whole; the run ends bit-identical to one that never saw it (float32 and
  # power-of-two scales: scaling is exact).
  def run(batches):
    tx = optax.chain(jaxamp.dynamic_loss_scale(), optax.MultiSteps(optax.adam(1e-2), 2))
    train = jaxamp.make_train_step(loss_fn, tx, policy="float32")
    state = init(train, "nnx", batchnorm=False)
    scales = []
    for b in batches:
      state, metrics = train.step(state, b)
      scales.append(float(metrics["loss_scale"]))
    return state, scales

  good = make_batches(5)
  bad = dict(good[2], x=np.full_like(good[2]["x"], np.inf))
  state, scales = run(good[:2] + [bad] + good[2:])
  assert scales == [2.0**15, 2.0**15, 2.0**14, 2.0**14, 2.0**14, 2.0**14]
  control, _ = run(good)
  assert_trees_equal(state.params, control.params)
  with pytest.raises(ValueError, match="MultiSteps hands it"):
    init(jaxamp.make_train_step(
        loss_fn, optax.MultiSteps(optax.chain(jaxamp.dynamic_loss_scale(), optax.sgd(0.1)), 2),
        policy="mixed_float16"), "nnx", batchnorm=False)


@pytest.mark.parametrize("name", ["named_chain", "masked"])
def test_make_train_step_refuses_a_loss_scale_that_is_not_first(name):
  ls = jaxamp.dynamic_loss_scale()
  tx = {"named_chain": optax.named_chain(("clip", optax.clip_by_global_norm(1.0)),
                                         ("scale", ls), ("sgd", optax.sgd(0.1))),
        "masked": optax.masked(optax.chain(ls, optax.sgd(0.1)),
                               lambda p: jax.tree.map(lambda x: x.ndim > 1, p))}[name]
  with pytest.raises(ValueError, match="misplaced"):
    init(jaxamp.make_train_step(loss_fn, tx, policy="mixed_float16"), "nnx", batchnorm=False)


@pytest.mark.parametrize("wrap", ["named_chain", "inject_hyperparams", "skip_nonfinite"])
def test_wrapped_loss_scales_divide_exactly_once(wrap):
  # The step divides the gradients itself and tells the loss scale so (an optax extra
  # argument); every wrapper the placement check allows must pass that on, or the scale
  # would be divided out twice. Same parameters as a plain chain, bit for bit.
  ls = lambda: jaxamp.dynamic_loss_scale(initial_scale=2.0**10)
  tx = {"named_chain": lambda: optax.named_chain(("scale", ls()), ("sgd", optax.sgd(0.1))),
        "inject_hyperparams": lambda: optax.inject_hyperparams(
            lambda learning_rate: optax.chain(ls(), optax.sgd(learning_rate)))(
                learning_rate=0.1),
        "skip_nonfinite": lambda: jaxamp.skip_nonfinite(optax.chain(ls(), optax.sgd(0.1)))}
  batch = make_batches(1)[0]
  states = []
  for make in (tx[wrap], lambda: optax.chain(ls(), optax.sgd(0.1))):
    train = jaxamp.make_train_step(loss_fn, make(), policy="float32")
    states.append(train.step(init(train, "nnx", batchnorm=False), batch)[0])
  assert_trees_equal(states[0].params, states[1].params)


def _counting(tx, calls):
  """``tx`` whose update counts how often it is traced or run."""
  def update(updates, state, params=None, **extra):
    calls.append(1)
    return tx.update(updates, state, params)
  return optax.GradientTransformation(tx.init, update)


@pytest.mark.slow
@pytest.mark.parametrize("chain", ["inserted", "user", "named", "inject"])
def test_a_skipped_step_traces_only_the_loss_scale_rule(chain):
  # The skip branch of the step's lax.cond needs the loss scale's backed-off state only:
  # where that is all the optimizer's rule can do, the optimizer is traced once, not twice
  # (the second copy was dead code that cost trace time). inject_hyperparams keeps a count
  # of its own that a skipped update moves too: there the whole update is traced, and the
  # skip still matches a plain skip_nonfinite update step for step.
  calls = []
  sgd = _counting(optax.sgd(0.1), calls)
  ls = jaxamp.dynamic_loss_scale(initial_scale=8.0)
  tx = {"inserted": sgd, "user": optax.chain(ls, sgd),
        "named": optax.named_chain(("scale", ls), ("sgd", sgd)),
        "inject": optax.inject_hyperparams(
            lambda learning_rate: optax.chain(ls, _counting(optax.sgd(learning_rate), calls)))(
                learning_rate=0.1)}[chain]
  train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_float16",
                                 memory=jaxamp.MemoryConfig(donate=False))
  before = init(train, "nnx", batchnorm=False)
  calls.clear()
  good, = make_batches(1)
  bad = dict(good, x=np.full_like(good["x"], np.inf))
  state, metrics = train.step(before, bad)
  assert len(calls) == (2 if chain == "inject" else 1)
  assert not bool(metrics["grads_finite"])
  assert_trees_equal(state.params, before.params)
  # What skip_nonfinite's own update does on an overflow, as the reference.
  reference = jaxamp.skip_nonfinite(tx if chain != "inserted" else optax.chain(
      jaxamp.dynamic_loss_scale(), sgd))
  grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), before.params)
  _, expected = reference.update(grads, before.opt_state, before.params)
  assert_trees_equal(state.opt_state, expected)


def test_overflow_rule_is_the_loss_scale_update_on_an_overflow():
  ls = jaxamp.dynamic_loss_scale(initial_scale=64.0, backoff_factor=0.25, min_scale=8.0)
  for tx in (ls, optax.chain(ls, optax.adam(1e-3)), jaxamp.skip_nonfinite(
      optax.named_chain(("ls", ls), ("adam", optax.adam(1e-3))))):
    rule = jaxamp.loss_scale.overflow_rule(tx, {"w": jnp.ones(3)})
    state = ls.init(None)
    scales = []
    for _ in range(3):
      state = rule(state)
      scales.append(float(state.scale))
    assert scales == [16.0, 8.0, 8.0]
    assert int(state.overflow_steps) == 3 and int(state.growth_count) == 0
    assert not bool(state.finite)
  # Unknowable without the whole update: no loss scale, two, or one under a wrapper.
  params = {"w": jnp.ones(3)}
  assert jaxamp.loss_scale.overflow_rule(optax.sgd(0.1), params) is None
  assert jaxamp.loss_scale.overflow_rule(optax.chain(ls, ls), params) is None
  assert jaxamp.loss_scale.overflow_rule(optax.inject_hyperparams(
      lambda learning_rate: optax.chain(ls, optax.sgd(learning_rate)))(learning_rate=0.1),
      params) is None
