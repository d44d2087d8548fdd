"""Tests for jaxamp.train.update: the exact skip, the global norm, master weights, float16-param overflow, naming non-finite gradients."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp

from train_helpers import (NNXNet, assert_trees_equal, init, leaves, loss_fn, make_batches,
                           orbax_round_trip, stepped, xent)


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["dynamic", "default fixed"])
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_injected_inf_matches_control_run_bit_for_bit(api, scale):
  # Powers of two scale exactly in bfloat16/float32, so the two runs' different loss
  # scales cannot change a bit; only the skip could. "default fixed": the scale of 1
  # the step inserts for mixed_bfloat16.
  dynamic = scale == "dynamic"

  def run(batches):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    if dynamic:
      tx = optax.chain(jaxamp.dynamic_loss_scale(initial_scale=2.0**10,
                                                 growth_interval=1000), tx)
    train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_bfloat16",
                                   memory=jaxamp.MemoryConfig(donate=False))
    return stepped(train, init(train, api, dropout=0.2), batches)

  batches = make_batches(5)
  poisoned = dict(batches[2], x=batches[2]["x"].copy())
  poisoned["x"][0, 0] = np.inf
  state_a, hist_a = run(batches[:2] + [poisoned] + batches[3:])
  state_b, _ = run(batches[:2] + batches[3:])

  before, after, metrics = hist_a[2]
  assert not bool(metrics["grads_finite"])
  assert int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == (2.0**9 if dynamic else 1.0)
  assert_trees_equal(after.params, before.params)
  assert_trees_equal(after.model_state, before.model_state)
  inner_before = optax.tree_utils.tree_get(before.opt_state, "ScaleByAdamState")
  inner_after = optax.tree_utils.tree_get(after.opt_state, "ScaleByAdamState")
  assert_trees_equal(inner_after, inner_before)

  assert_trees_equal(state_a.params, state_b.params)
  assert_trees_equal(state_a.model_state, state_b.model_state)
  assert_trees_equal(optax.tree_utils.tree_get(state_a.opt_state, "ScaleByAdamState"),
                     optax.tree_utils.tree_get(state_b.opt_state, "ScaleByAdamState"))


def test_gradients_whose_norm_leaves_float32_skip_the_step():
  # Every element finite, the global norm past float32's range (~1.8e19): skipped like an
  # overflow (clipping would zero it, Adam's second moment would hold inf from then on).
  def loss(model, batch):
    return jnp.sum(model(batch["x"])) * batch["factor"]

  train = jaxamp.make_train_step(loss, optax.adam(1e-3), policy="float32",
                                 memory=jaxamp.MemoryConfig(donate=False))
  state = train.init(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  x = jnp.ones((8, 4))
  huge, metrics = train.step(state, {"x": x, "factor": jnp.float32(1e19)})
  grads = jax.grad(lambda w: jnp.sum(x @ w) * jnp.float32(1e19))(state.params["kernel"])
  assert bool(jnp.all(jnp.isfinite(grads)))  # the elements themselves are finite
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  assert np.isinf(float(metrics["grad_norm"]))
  assert_trees_equal(huge.params, state.params)
  assert_trees_equal(optax.tree_utils.tree_get(huge.opt_state, "ScaleByAdamState"),
                     optax.tree_utils.tree_get(state.opt_state, "ScaleByAdamState"))
  applied, metrics = train.step(huge, {"x": x, "factor": jnp.float32(1e17)})
  assert bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  assert np.isfinite(float(metrics["grad_norm"]))
  assert not np.array_equal(applied.params["kernel"], huge.params["kernel"])


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_skip_nonfinite_false_applies_every_update_like_optax(policy):
  # No skips (as in Keras, torch.amp without a scaler, a plain optax step): finite steps
  # match a hand-written optax step, a NaN step reaches the params, the metrics say so.
  good, bad = make_batches(3), make_batches(1)[0]
  bad["x"][0, 0] = np.nan
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-2), policy=policy,
                                 memory=jaxamp.MemoryConfig(donate=False),
                                 skip_nonfinite=False)
  state = init(train, "nnx", batchnorm=False)
  assert not train.skips_nonfinite
  assert "cond" not in [e.primitive.name for e in train.trace(state, good[0]).jaxpr.eqns]

  model = NNXNet(nnx.Rngs(0, dropout=1), batchnorm=False)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.adam(1e-2)
  compute = jnp.float32 if policy == "float32" else jnp.bfloat16

  @jax.jit
  def hand(params, opt_state, batch):
    def loss(p):
      cast = jax.tree.map(lambda a: a.astype(compute), p)
      logits = nnx.merge(graphdef, cast, rest)(batch["x"].astype(compute))
      return xent(logits.astype(jnp.float32), batch["y"])
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for batch in good:
    state, metrics = train.step(state, batch)
    params, opt_state = hand(params, opt_state, batch)
  tol = 1e-6 if policy == "float32" else 2e-2
  for a, b in zip(leaves(state.params), leaves(params)):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)

  new, metrics = train.step(state, bad)
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 0
  params, _ = hand(params, opt_state, bad)  # applied, NaNs where optax puts them
  assert any(np.isnan(x).any() for x in leaves(new.params))
  for a, b in zip(leaves(new.params), leaves(params)):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)  # NaN where NaN
  assert int(optax.tree_utils.tree_get(new.opt_state, "count")) == 4


def test_skipping_changes_no_finite_step():
  good, bad = make_batches(3), make_batches(1)[0]
  bad["x"][0, 0] = np.nan
  runs = {}
  for skip in (False, True):
    train = jaxamp.make_train_step(loss_fn, optax.adam(1e-2), policy="mixed_bfloat16",
                                   memory=jaxamp.MemoryConfig(donate=False), skip_nonfinite=skip)
    state = init(train, "nnx", batchnorm=False)
    for batch in good:
      state, _ = train.step(state, batch)
    runs[skip] = (train, state)
  train, state = runs[True]
  assert train.skips_nonfinite
  for a, b in zip(leaves(state.params), leaves(runs[False][1].params)):  # finite: same update
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # (XLA fuses them differently)
  new, metrics = train.step(state, bad)
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  assert_trees_equal(new.params, state.params)
  assert_trees_equal(optax.tree_utils.tree_get(new.opt_state, "ScaleByAdamState"),
                     optax.tree_utils.tree_get(state.opt_state, "ScaleByAdamState"))


@pytest.mark.parametrize("policy,tx,why", [
    ("mixed_float16", optax.sgd(0.1), "has a loss scale"),
    ("float32", optax.chain(jaxamp.dynamic_loss_scale(), optax.sgd(0.1)), "has a loss scale"),
    ("float32", optax.chain(jaxamp.no_loss_scale(), optax.sgd(0.1)), "has a loss scale"),
    ("params=float16,compute=bfloat16,output=float32", optax.sgd(0.1), "stored in float16"),
])
def test_skip_nonfinite_false_is_refused_where_float16_needs_skips(policy, tx, why):
  refused = jaxamp.make_train_step(loss_fn, tx, policy=policy, skip_nonfinite=False)
  with pytest.raises(ValueError, match=f"skip_nonfinite=False cannot be honoured: .*{why}"):
    init(refused, "nnx", batchnorm=False)


def test_skip_nonfinite_takes_a_bool():
  for wrong in ("yes", 1, 0.0, None):
    with pytest.raises(ValueError, match="skip_nonfinite must be True or False"):
      jaxamp.make_train_step(loss_fn, optax.sgd(0.1), skip_nonfinite=wrong)
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float32",
                                 skip_nonfinite=False)
  init(train, "nnx", batchnorm=False)
  assert not train.skips_nonfinite


@pytest.mark.slow
def test_grad_norm_is_norm_of_unscaled_gradients():
  batch = make_batches(1)[0]
  train = jaxamp.make_train_step(loss_fn, optax.chain(jaxamp.static_loss_scale(256.0),
                                                      optax.sgd(0.0)),
                                 policy="float32", memory=jaxamp.MemoryConfig(donate=False))
  state = init(train, "nnx", batchnorm=False)
  model = train.model(state)
  grads = nnx.grad(lambda m: loss_fn(m, batch))(model)
  _, metrics = train.step(state, batch)
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)),
                             rtol=1e-6)
  assert float(metrics["loss_scale"]) == 256.0


class NNXTied(nnx.Module):
  """l1 and l3 read once; l2 twice (its gradients are sums of two float32 cotangents)."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 16, rngs=rngs)
    self.l3 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.l3(self.l2(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x))))))


class LinenTied(nn.Module):
  def setup(self):
    self.l1, self.l2, self.l3 = nn.Dense(16), nn.Dense(16), nn.Dense(4)

  def __call__(self, x):
    return self.l3(self.l2(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x))))))


def _half_cond_operands(train, state, batch):
  """{shape: how many of the skip's cond operands of that shape are float16/bfloat16}."""
  cond, = [e for e in train.trace(state, batch).jaxpr.eqns if e.primitive.name == "cond"]
  counts = {}
  for v in cond.invars[1:]:
    if v.aval.dtype in (jnp.bfloat16, jnp.float16):
      counts[v.aval.shape] = counts.get(v.aval.shape, 0) + 1
  return counts


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "bfloat16"])
def test_the_skip_holds_gradients_as_narrow_as_computed_and_updates_bit_for_bit(
    api, policy, monkeypatch):
  # The exact skip's lax.cond holds a parameter's gradient in half precision where that
  # loses nothing (a float32 parameter read once in half precision; a half-precision
  # parameter with master weights) and widens it inside the branch: no float32 copy of
  # those gradients is written ahead of it. The steps are the same bits as holding every
  # gradient in float32 (the old program, patched back in), skips included, once XLA
  # rounds as the program says (without excess precision, the old program could keep a
  # float32 dot's bits past the bfloat16 rounding of a gradient, as the step without a
  # skip cannot).
  def run(patched):
    with monkeypatch.context() as m:
      if patched:
        m.setattr(jaxamp.train.update, "_held", lambda grad, opt_grad, found: (opt_grad, None))
      # SGD by a power of two: each update is its gradient's bits, however XLA fuses it.
      train = jaxamp.make_train_step(loss_fn, optax.sgd(2.0**-4), policy=policy,
                                     memory=jaxamp.MemoryConfig(donate=False))
      if api == "nnx":
        state = train.init(NNXTied(nnx.Rngs(0)))
      else:
        x = jnp.zeros((2, 8))
        state = train.init(LinenTied(), LinenTied().init(jax.random.key(0), x), x)
      batches = make_batches(4)
      batches[2]["x"][0, 0] = np.inf  # a skipped step
      held = _half_cond_operands(train, state, batches[0])
      step = train.trace(state, batches[0]).lower().compile(
          {"xla_allow_excess_precision": False})
      out = []
      for b in batches:
        state, metrics = step(state, b)
        out.append((state, bool(metrics["grads_finite"])))
      return held, out

  held, new = run(patched=False)
  old_held, old = run(patched=True)
  # Gradients held in half precision: new half operands beyond the old program's (which
  # has the bfloat16 parameters themselves, and no half gradient).
  grads_held = {k: n - old_held.get(k, 0) for k, n in held.items() if n > old_held.get(k, 0)}
  every = {(8, 16): 1, (16, 16): 1, (16, 4): 1, (16,): 2, (4,): 1}
  once = {(8, 16): 1, (16, 4): 1, (16,): 1, (4,): 1}  # all but NNX's l2, read twice
  # Linen casts a module's parameters once for all its calls (JAX sums l2's cotangents
  # in half precision either way); master weights get gradients computed in half.
  assert grads_held == (once if api == "nnx" and policy != "bfloat16" else every)
  assert [f for _, f in new] == [f for _, f in old] == [True, True, False, True]
  for (a, _), (b, _) in zip(new, old):
    assert_trees_equal((a.params, a.opt_state), (b.params, b.opt_state))
  assert_trees_equal(new[2][0].params, new[1][0].params)  # the skipped step


def test_master_weights_for_half_params():
  # A step of 1e-4 on weights near 1 vanishes in bfloat16 (spacing 2**-7) unless float32
  # master weights accumulate it.
  train = jaxamp.make_train_step(loss_fn, optax.sgd(1e-4), policy="bfloat16",
                                 memory=jaxamp.MemoryConfig(donate=False))
  state = init(train, "nnx", batchnorm=False)
  assert train.master_weights
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
  master0 = leaves(state.opt_state.master_params)
  assert all(x.dtype == np.float32 for x in master0)
  for b in make_batches(3):
    state, metrics = train.step(state, b)
  master = state.opt_state.master_params
  assert any(not np.array_equal(a, b) for a, b in zip(leaves(master), master0))
  assert_trees_equal(state.params, jax.tree.map(lambda m: m.astype(jnp.bfloat16), master))
  assert bool(metrics["grads_finite"])


def test_debug_nonfinite_names_the_overflowing_parameter():
  class TwoHeads(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(8, 4, rngs=rngs)
      self.b = nnx.Linear(8, 4, rngs=rngs)

  def loss(model, batch):  # linear in the outputs, so head a's gradient stays finite
    return jnp.mean(model.a(batch["x"])) + jnp.mean(model.b(batch["x2"]))

  train = jaxamp.make_train_step(loss, optax.sgd(0.1), policy="float32",
                                 debug=jaxamp.DebugConfig(nonfinite_grads=True))
  state = train.init(TwoHeads(nnx.Rngs(0)))
  x = np.ones((4, 8), np.float32)
  x2 = x.copy()
  x2[1, 2] = np.inf
  _, metrics = train.step(state, {"x": x, "x2": x2})
  bad = sorted(k for k, v in metrics["nonfinite_grads"].items() if bool(v))
  # d loss / d b.bias is 1/n (finite); only b.kernel meets x2's inf
  assert bad == ["b/kernel"]
  assert sorted(metrics["nonfinite_grads"]) == ["a/bias", "a/kernel", "b/bias", "b/kernel"]


def test_accumulated_gradients_reach_master_weights_unrounded():
  # Micro-batch gradients 1 and 2**-9 are exact in bfloat16; their mean 0.5 + 2**-10 is not
  # (bfloat16 rounds it to 0.5). The float32 master weights must get the exact mean.
  model = nnx.Linear(1, 1, use_bias=False, kernel_init=nnx.initializers.zeros,
                     rngs=nnx.Rngs(0))
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b["x"])), optax.sgd(1.0),
                                 policy="bfloat16", grad_accum_steps=2)
  state = train.init(model)
  state, _ = train.step(state, {"x": jnp.array([[1.0], [2.0**-9]])})
  assert train.master_weights
  assert float(state.opt_state.master_params["kernel"][0, 0]) == -(0.5 + 2.0**-10)
  assert state.params["kernel"].dtype == jnp.bfloat16


def test_master_weights_of_float32_params_are_copies():
  # The state must not hold one buffer twice, or the donating step fails.
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16",
                                 memory=jaxamp.MemoryConfig(master_weights=True))
  state = init(train, "nnx")
  for _ in range(2):
    state, metrics = train.step(state, make_batches(1)[0])
  assert bool(metrics["grads_finite"])
  assert_trees_equal(state.params, state.opt_state.master_params)


@pytest.mark.parametrize("master_weights", [True, False])
def test_a_float16_parameter_that_would_overflow_skips_the_step(master_weights):
  # Pure float16 params: a weight pushed past 65504 would be stored as inf and training
  # would go on (loss -inf). The step must be skipped like an overflowing one.
  model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0),
                     kernel_init=nnx.initializers.constant(60000.0))
  # Small activations (w/64 fits float16); the gradient of the weight is -c/64.
  train = jaxamp.make_train_step(lambda m, b: -jnp.mean(m(b["x"]) * b["c"]),
                                 optax.chain(jaxamp.no_loss_scale(), optax.sgd(1000.0)),
                                 policy="float16",
                                 memory=jaxamp.MemoryConfig(master_weights=master_weights,
                                                            donate=False))
  state = train.init(model)
  assert state.params["kernel"].dtype == jnp.float16
  x = jnp.full((4, 1), 1 / 64)
  state, metrics = train.step(state, {"x": x, "c": jnp.full((4, 1), 64.0)})  # +1000
  assert bool(metrics["params_finite"])
  assert float(state.params["kernel"][0, 0]) == float(np.float16(61000.0))
  before = state
  state, metrics = train.step(state, {"x": x, "c": jnp.full((4, 1), 512.0)})  # +8000: inf
  assert bool(metrics["grads_finite"]) and not bool(metrics["params_finite"])
  assert int(metrics["skipped_steps"]) == 1
  assert_trees_equal(state.params, before.params)
  is_ls = lambda x: isinstance(x, jaxamp.LossScaleState)
  rest = lambda s: [x for x in jax.tree.leaves(s.opt_state, is_leaf=is_ls) if not is_ls(x)]
  assert_trees_equal(rest(state), rest(before))  # master weights and moments too
  assert float(metrics["loss_scale"]) == float(jaxamp.get_loss_scale(before.opt_state))


# --- master_weights='stochastic' | 'kahan': half params without a float32 copy ----------


def _rounded_run(mode, batches, *, opt_state_dtype=jnp.bfloat16, lr=1e-2, **kw):
  train = jaxamp.make_train_step(loss_fn, optax.adamw(lr), policy="bfloat16",
                                 master_weights=mode, opt_state_dtype=opt_state_dtype,
                                 memory=jaxamp.MemoryConfig(donate=False), **kw)
  return train, stepped(train, init(train, "nnx", batchnorm=False), batches)


def _poisoned(batches, at):
  bad = dict(batches[at], x=batches[at]["x"].copy())
  bad["x"][0, 0] = np.inf
  return batches[:at] + [bad] + batches[at + 1:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_rounding_modes_store_half_state_and_skip_exactly(mode):
  # A skipped step keeps everything (the rounding key, the compensation, the bfloat16
  # moments); the run then goes on as if the poisoned batch had never come.
  batches = make_batches(3)
  train, (state, history) = _rounded_run(mode, _poisoned(batches, 1))
  assert train.master_weights == mode
  opt = state.opt_state
  assert isinstance(opt, jaxamp.RoundingState)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
  adam = optax.tree_utils.tree_get(opt, "ScaleByAdamState")
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(jnp.bfloat16)}
  assert adam.count.dtype == jnp.int32 and int(adam.count) == 2
  if mode == "stochastic":
    assert opt.rounding.key.dtype == jnp.uint32
  else:
    assert jax.tree.map(lambda c: c.dtype, opt.rounding.compensation) == jax.tree.map(
        lambda p: p.dtype, state.params)
  kept = lambda s: (s.params, s.opt_state.rounding,  # all but the loss scale's skip count
                    optax.tree_utils.tree_get(s.opt_state, "OptStateDtypeState"))
  before, after, metrics = history[1]
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  assert_trees_equal(kept(after), kept(before))
  _, (control, _) = _rounded_run(mode, batches[:1] + batches[2:])
  assert_trees_equal(kept(state), kept(control))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_rounding_modes_resume_from_a_host_copy_bit_identically(mode):
  batches = make_batches(4)
  train, (straight, _) = _rounded_run(mode, batches)
  _, (half, _) = _rounded_run(mode, batches[:2])
  # What a checkpoint holds: host arrays (keys as they are: orbax saves their data).
  host = jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                      else np.asarray(x), half)
  resumed, _ = stepped(train, host, batches[2:])
  assert_trees_equal(resumed, straight)


@pytest.mark.slow
def test_a_stochastic_rounding_state_resumes_from_orbax_bit_identically(tmp_path):
  batches = make_batches(3)
  train, (straight, _) = _rounded_run("stochastic", batches)
  _, (half, _) = _rounded_run("stochastic", batches[:2])
  restored = orbax_round_trip(half, tmp_path / "s")
  assert restored.opt_state.rounding.key.dtype == jnp.uint32
  resumed, _ = stepped(train, restored, batches[2:])
  assert_trees_equal(resumed, straight)


@pytest.mark.slow
def test_rounding_modes_keep_learning_where_plain_bfloat16_stalls():
  # sgd(1e-4), 20 steps of two micro-batches: each update is far below half a bfloat16
  # ulp of the weights, so plain bfloat16 (round to nearest, no master) never moves
  # them, where float32 master weights do. Kahan's compensated weights (p - c) follow
  # the master weights closely; stochastic rounding follows them on average (the
  # projection of its movement on theirs; one seed, so the test is deterministic).
  batches = make_batches(20)

  def moved(mode):
    train = jaxamp.make_train_step(loss_fn, optax.sgd(1e-4), policy="bfloat16",
                                   master_weights=mode, grad_accum_steps=2,
                                   memory=jaxamp.MemoryConfig(donate=False))
    state = train.init(NNXNet(nnx.Rngs(0), batchnorm=False))
    start = state.params["l1"]["kernel"].astype(jnp.float32)
    state, _ = stepped(train, state, batches)
    kernel = (state.opt_state.master_params if mode is True else state.params)["l1"]["kernel"]
    kernel = kernel.astype(jnp.float32)
    if mode == "kahan":
      kernel = kernel - state.opt_state.rounding.compensation["l1"]["kernel"].astype(jnp.float32)
    return np.asarray(kernel - start)

  master = moved(True)
  assert np.abs(master).max() > 0 and np.abs(moved(False)).max() == 0  # stalled
  kahan = moved("kahan")
  assert np.abs(kahan - master).max() < 0.02 * np.abs(master).max()
  projection = (moved("stochastic") * master).sum() / (master * master).sum()
  assert 0.5 < projection < 1.5, projection


@pytest.mark.slow
def test_kahan_compensation_is_sharded_like_the_params_under_fsdp():
  mesh = jax.make_mesh((1,), ("data",))
  train, (state, _) = _rounded_run(
      "kahan", make_batches(1), sharding=jaxamp.ShardingConfig(
          mesh=mesh, param_sharding=jaxamp.fsdp("data", min_size=1)))
  comp = state.opt_state.rounding.compensation
  for c, p in zip(jax.tree.leaves(comp), jax.tree.leaves(state.params)):
    assert c.sharding.spec == p.sharding.spec and c.dtype == p.dtype


@pytest.mark.slow
def test_stochastic_rounding_refuses_float16_params():
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float16",
                                 master_weights="stochastic")
  with pytest.raises(ValueError, match=r"master_weights='stochastic' rounds parameters to "
                     r"bfloat16, but NNXNet stores .*kernel.* in float16"):
    init(train, "nnx", batchnorm=False)


@pytest.mark.slow
@pytest.mark.parametrize("policy, mode", [("p=bf16,c=f16", "stochastic"),
                                          ("p=bf16,c=bf16,fp8=delayed", "kahan")])
def test_rounding_modes_train_under_loss_scaling_and_fp8(policy, mode):
  # float16 compute: a dynamic loss scale; FP8: the scaled formats' state beside the
  # rounding's. Both train with bfloat16 params and a bfloat16 optimizer state.
  train = jaxamp.make_train_step(loss_fn, optax.adamw(1e-3), policy=policy,
                                 master_weights=mode, opt_state_dtype=jnp.bfloat16,
                                 memory=jaxamp.MemoryConfig(donate=False))
  state = train.init(NNXNet(nnx.Rngs(0), batchnorm=False))
  state, history = stepped(train, state, make_batches(2))
  metrics = history[-1][2]
  assert bool(metrics["grads_finite"]) and np.isfinite(float(metrics["loss"]))
  assert float(metrics["loss_scale"]) == (2.0 ** 15 if "c=f16" in policy else 1.0)
  assert (state.fp8 is not None) == ("fp8" in policy)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(jnp.bfloat16)}
  assert not any(np.array_equal(a, b) for a, b in zip(leaves(state.params),
                                                      leaves(history[0][0].params)))
