"""jaxamp.skip: the verdict protocol, the loss-scale rule and the rule of a skipped step."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp import skip
from jaxamp.skip import LossScaleState, ScaleRule, Verdict

from train_helpers import init, make_batches


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _state(scale=64.0, count=0):
  return LossScaleState(jnp.float32(scale), jnp.int32(count), jnp.asarray(True), jnp.int32(0))


def test_verdict_round_trips_through_optax_extra_arguments():
  norm = skip.KnownNorm.of({"w": jnp.ones(2)}, jnp.float32(1.0))
  verdict = Verdict(finite=True, unscaled=True, norm=norm)
  args = verdict.extra_args()
  assert set(args) == {skip.GRADS_FINITE, skip.GRADS_UNSCALED, skip.GLOBAL_NORM}
  assert Verdict.read(args) == verdict
  assert Verdict.read({"value": 1.0}) == Verdict()  # nothing known: the defaults
  assert Verdict().extra_args() == {}
  assert Verdict.read({skip.GLOBAL_NORM: "not a KnownNorm"}).norm is None


@pytest.mark.parametrize("finite", [True, False])
def test_scale_rule_decides_a_known_verdict_as_the_traced_one(finite):
  rule = ScaleRule(2.0, 0.5, 3, 1.0, 2.0**24)
  known, traced = _state(), _state()
  for _ in range(7):  # across a growth (every 3rd finite step) or down to the floor
    known = rule.adjust(known, finite)
    traced = jax.jit(rule.adjust)(traced, jnp.asarray(finite))
    assert _bits(known) == _bits(traced)
  assert float(known.scale) == (256.0 if finite else 1.0)  # grown twice; floor 1
  assert int(known.overflow_steps) == (0 if finite else 7)


def test_the_loss_scales_use_the_rule():
  ls = jaxamp.dynamic_loss_scale(initial_scale=64.0, growth_interval=2, backoff_factor=0.25)
  rule = ScaleRule(2.0, 0.25, 2, 1.0, 2.0**24)
  state = expected = ls.init(None)
  for finite in (True, True, False, True, False, False):
    grads = {"w": jnp.array([1.0 if finite else jnp.inf])}
    _, state = ls.update(grads, state)
    expected = rule.adjust(expected, finite)
    assert _bits(state) == _bits(expected)


def _custom_loss_scale():
  """A loss scale jaxamp does not know: a quarter of the scale on every overflow."""

  def init_fn(params):
    del params
    return _state()

  def update_fn(updates, state, params=None, **extra_args):
    del params
    if Verdict.read(extra_args).finite is False:
      return updates, state._replace(scale=state.scale / 4, finite=jnp.asarray(False),
                                     overflow_steps=state.overflow_steps + 1)
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def test_overflow_rule_is_read_off_the_update_not_told_by_the_loss_scale():
  params = {"w": jnp.ones(1000)}
  tx = skip.skip_nonfinite(optax.chain(_custom_loss_scale(), optax.adam(1e-3)))
  rule = skip.overflow_rule(tx, params)
  after = rule(_state())
  assert float(after.scale) == 16.0 and int(after.overflow_steps) == 1
  # Only the loss scale's scalar operations: nothing of Adam's (1000-element) update.
  jaxpr = jax.make_jaxpr(rule)(_state()).jaxpr
  assert jaxpr.eqns and all(v.aval.shape == () for e in jaxpr.eqns for v in e.outvars)
  assert len(jaxpr.eqns) < 10, jaxpr


def test_no_overflow_rule_where_the_loss_scale_reads_the_gradients_on_a_skip():
  def init_fn(params):
    del params
    return _state()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return updates, state._replace(scale=optax.tree.norm(updates))

  tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  assert skip.overflow_rule(tx, {"w": jnp.ones(3)}) is None


def test_no_thread_local_state_in_the_skip():
  for module in (skip, jaxamp.loss_scale, jaxamp.clipping):
    assert not [name for name, value in vars(module).items()
                if isinstance(value, threading.local)], module.__name__


def test_skipped_for_params_counts_the_step_and_keeps_the_scale():
  old = (_state(scale=8.0, count=5), {"m": jnp.zeros(2)})
  new = (_state(scale=16.0, count=0), {"m": jnp.ones(2)})
  kept = skip.skipped_for_params(jnp.asarray(False), new, old)
  assert float(kept[0].scale) == 8.0 and int(kept[0].growth_count) == 0
  assert int(kept[0].overflow_steps) == 1 and not bool(kept[0].finite)
  assert _bits(kept[1]) == _bits(old[1])
  assert _bits(skip.skipped_for_params(jnp.asarray(True), new, old)) == _bits(new)


def test_a_type_error_in_loss_fn_is_raised_and_the_recording_reads_stay():
  # The step is made again with plain reads after a TypeError; where plain reads fail
  # too, the error is loss_fn's and the plan keeps its recording reads.
  def bad(model, batch):
    return jnp.mean(model(batch["x"])) + "oops"

  train = jaxamp.make_train_step(bad, optax.sgd(0.1), policy="mixed_bfloat16")
  state = init(train, "nnx", batchnorm=False)
  with pytest.raises(TypeError):
    train.step(state, make_batches(1)[0])
  assert train.plan.narrow_reads


@pytest.mark.parametrize("make", [
    lambda: jaxamp.dynamic_loss_scale(initial_scale=64.0, backoff_factor=0.25, min_scale=8.0),
    lambda: jaxamp.static_loss_scale(128.0),
    jaxamp.no_loss_scale,
])
def test_overflow_rule_is_the_loss_scales_own_update_bit_for_bit(make):
  ls = make()
  rule = skip.overflow_rule(skip.skip_nonfinite(optax.chain(ls, optax.adam(1e-3))),
                            {"w": jnp.ones(3)})
  flags = Verdict(finite=False, unscaled=True).extra_args()
  state = expected = ls.init(None)
  for _ in range(4):
    state = jax.jit(rule)(state)
    expected = ls.update({"w": jnp.ones(3)}, expected, **flags)[1]
    assert _bits(state) == _bits(expected)
  assert int(state.overflow_steps) == 4
