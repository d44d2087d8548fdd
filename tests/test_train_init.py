"""Tests for jaxamp.train.init: reading the model once (stored dtypes, refusals, opt-level rules, unwrapping, donatable buffers)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp

from train_helpers import LinenNet, NNXNet, assert_trees_equal, init, leaves, loss_fn, make_batches, param_dtypes


@pytest.mark.slow
def test_an_nnx_state_holds_plain_dicts_and_no_key():
  # JAX flattens an nnx.State and each nnx.Variable with Python code on every jitted call
  # (benchmarks/dispatch): the state holds the nested dicts nnx.to_pure_dict makes, which
  # nnx.merge takes back, and no PRNG key (NNX models carry their streams).
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="mixed_bfloat16")
  model = NNXNet(nnx.Rngs(0, dropout=1), dropout=0.5)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  want = leaves((nnx.to_pure_dict(params), nnx.to_pure_dict(rest)))  # before donation
  state = train.init(model)
  assert state.rng is None
  nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, (nnx.State, nnx.Variable)))
  assert not [x for x in nodes if isinstance(x, (nnx.State, nnx.Variable))]
  assert type(state.params) is dict and type(state.model_state) is dict
  for got, expected in zip(leaves((state.params, state.model_state)), want, strict=True):
    np.testing.assert_array_equal(got, expected)
  assert jax.tree.structure(state.opt_state.inner_state[1][0].mu) == jax.tree.structure(
      state.params)  # Adam's moments mirror the dicts
  state, _ = train.step(state, make_batches(1)[0])
  assert state.rng is None and type(state.model_state) is dict
  assert_trees_equal(nnx.state(nnx.merge(graphdef, state.params, state.model_state)),
                     nnx.state(train.model(state)))
  # Params set from an nnx.State (as states held them before) are refused, naming the fix.
  fresh = nnx.state(NNXNet(nnx.Rngs(0, dropout=1), dropout=0.5), nnx.Param)
  with pytest.raises(ValueError, match=r"its params holds nnx.State.*nnx.to_pure_dict"):
    train.step(state._replace(params=fresh), make_batches(1)[0])


@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.slow
def test_the_model_given_to_init_stays_usable_unless_donated(api):
  """init copies the arrays the state would share with the model (the donating step
  would delete them): the model still runs, unchanged. With donate_model=True the state
  takes the model's own arrays, and the first step deletes them (no copy)."""
  x = make_batches(1)[0]["x"]
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16")
  if api == "nnx":
    model = NNXNet(nnx.Rngs(0), batchnorm=False)
    before = np.asarray(model(x))
    state, _ = train.step(train.init(model), make_batches(1)[0])
    np.testing.assert_array_equal(np.asarray(model(x)), before)
    # The opt-out: the state takes the model's arrays, which the first step deletes.
    donated = NNXNet(nnx.Rngs(1), batchnorm=False)
    arrays = jax.tree.leaves(nnx.state(donated))
    state, _ = train.step(train.init(donated, donate_model=True), make_batches(1)[0])
    assert all(a.is_deleted() for a in arrays)
  else:
    module = LinenNet(batchnorm=False)
    variables = module.init(jax.random.key(0), x[:2], train=False)
    before = np.asarray(module.apply(variables, x, train=False))
    state = train.init(module, variables, x[:2], train=False)
    state, _ = train.step(state, make_batches(1)[0])
    np.testing.assert_array_equal(np.asarray(module.apply(variables, x, train=False)), before)


class TwoFromOne(nnx.Module):
  """Two parameters, possibly made from one array (as nnx.Param(w) twice)."""

  def __init__(self, a, b):
    self.a, self.b = nnx.Param(a), nnx.Param(b)

  def __call__(self, x):
    return x @ self.a + jnp.tanh(x @ self.b)


def _trained(train, state, steps=2):
  for b in make_batches(steps):
    state, metrics = train.step(state, b)
    assert bool(metrics["grads_finite"])
  return state


@pytest.mark.slow
def test_two_params_from_one_array_train_apart_as_under_nnx_jit():
  """XLA refused to donate the one buffer twice; now each parameter gets its own
  buffer and its own updates, as under nnx.jit and as two separate arrays would."""
  w = jax.random.normal(jax.random.key(0), (8, 4))
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float32")
  want = _trained(train, train.init(TwoFromOne(jnp.copy(w), jnp.copy(w)), donate_model=True))
  got = _trained(train, train.init(TwoFromOne(w, w), donate_model=True))
  assert_trees_equal(got.params, want.params)
  assert not np.array_equal(got.params["a"], got.params["b"])

  @nnx.jit
  def plain(model, opt, batch):
    opt.update(model, nnx.grad(loss_fn)(model, batch))

  w = jax.random.normal(jax.random.key(0), (8, 4))  # the first was donated
  model = TwoFromOne(w, w)
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  for b in make_batches(2):
    plain(model, opt, b)
  np.testing.assert_allclose(got.params["a"], model.a[...], rtol=1e-6)
  np.testing.assert_allclose(got.params["b"], model.b[...], rtol=1e-6)


def averaged_params(decay=0.5, copy=False):
  """An optimizer element keeping an average of the parameters, initialised from them
  (``copy``: from copies of them)."""

  def init_fn(params):
    return jax.tree.map(jnp.copy, params) if copy else params

  def update_fn(updates, state, params=None):
    new = jax.tree.map(lambda a, p, u: decay * a + (1 - decay) * (p + u), state, params,
                       updates)
    return updates, new

  return optax.GradientTransformation(init_fn, update_fn)


def test_an_optimizer_state_holding_the_params_themselves_trains():
  made = lambda copy: jaxamp.make_train_step(
      loss_fn, optax.chain(optax.sgd(0.1), averaged_params(copy=copy)), policy="float32")
  got, want = [_trained(t, t.init(NNXNet(nnx.Rngs(0), batchnorm=False), donate_model=True))
               for t in (made(False), made(True))]
  assert_trees_equal(got, want)


def test_linen_variables_sharing_a_leaf_train():
  x = jnp.zeros((2, 8))
  variables = LinenNet(batchnorm=False).init(jax.random.key(0), x, train=False)
  bias = variables["params"]["Dense_0"]["bias"]
  shared = {**variables, "extra": {"bias_at_init": bias}}  # a param's array, twice
  apart = {**variables, "extra": {"bias_at_init": jnp.copy(bias)}}
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float32")
  # donate_model=True: only the state's own aliasing is copied.
  got, want = [_trained(train, train.init(LinenNet(batchnorm=False), v, x, train=False,
                                          donate_model=True))
               for v in (shared, jax.tree.map(jnp.copy, apart))]
  assert_trees_equal(got, want)


def test_a_model_without_floating_parameters_is_refused_at_init():
  class Fixed(nnx.Module):  # a buffer, no nnx.Param: nothing to train
    def __init__(self):
      self.table = nnx.Variable(jnp.eye(4))

    def __call__(self, x):
      return x @ self.table[...]

  class IntTable(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(4))
      self.table = nnx.Param(jnp.arange(4))

    def __call__(self, x):
      return x * self.w[...] * self.table[...]

  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b)), optax.sgd(0.1))
  with pytest.raises(ValueError, match="no parameters to train in Fixed.*nnx.Param"):
    train.init(Fixed())
  with pytest.raises(ValueError, match=r"IntTable that are not floating: table \(int32\)"):
    train.init(IntTable())


def test_a_parameter_past_float16s_range_is_refused_at_init_not_stored_as_inf():
  model = NNXNet(nnx.Rngs(0), batchnorm=False)
  model.l2.kernel[...] = model.l2.kernel[...].at[0, 0].set(1e5)
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float16")
  with pytest.raises(ValueError, match=r"inf: l2/kernel \(\|max\| 1e\+05, float16\)"):
    train.init(model)
  for policy in ("mixed_float16", "bfloat16"):  # float32 params, float32's range
    state = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy=policy).init(
        nnx.clone(model))
    assert np.isfinite(np.asarray(state.params["l2"]["kernel"][...], np.float32)).all()


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("level,param_dtype,norm_dtype,scale,half_share,master", [
    ("O0", jnp.float32, jnp.float32, 1.0, 0.0, False),
    ("O1", jnp.float32, jnp.float32, 2.0**15, 1.0, False),
    ("O2", jnp.float16, jnp.float32, 2.0**15, 1.0, True),  # Apex's keep_batchnorm_fp32
    ("O3", jnp.float16, jnp.float16, 1.0, 1.0, False),
])
def test_opt_levels_end_to_end(api, level, param_dtype, norm_dtype, scale, half_share,
                               master):
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.05), opt_level=level,
                                 memory=jaxamp.MemoryConfig(donate=False))
  state = init(train, api, dropout=0.1)
  batch = make_batches(1)[0]
  report = jaxamp.precision_report(train.step, state, batch)  # lowered only: fwd + bwd
  assert report.total_flops > 0
  assert report.half_share == pytest.approx(half_share, abs=1e-6)
  for _ in range(3):
    state, metrics = train.step(state, batch)
  assert param_dtypes(state.params) == {"norm": {jnp.dtype(norm_dtype)},
                                        "other": {jnp.dtype(param_dtype)}}
  assert float(metrics["loss_scale"]) == scale
  assert train.master_weights == master
  assert isinstance(state.opt_state, jaxamp.MasterWeightsState) == master
  assert bool(metrics["grads_finite"]) and np.isfinite(float(metrics["loss"]))


def test_linen_without_example_inputs_stores_every_param_in_the_model_dtype():
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.05), opt_level="O2")
  state = init(train, "linen", example_inputs=False)
  assert param_dtypes(state.params) == {"norm": {jnp.dtype(jnp.float16)},
                                        "other": {jnp.dtype(jnp.float16)}}
  state, metrics = train.step(state, make_batches(1)[0])
  assert bool(metrics["grads_finite"]) and train.master_weights


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_params_stored_in_each_modules_param_dtype(api):
  # A rule giving BatchNorm float32 params inside a bfloat16 model: init stores them so,
  # master weights switch on for the bfloat16 rest, and a step keeps every dtype.
  bn = nnx.BatchNorm if api == "nnx" else nn.BatchNorm
  with jaxamp.policy_rules({bn: "float32"}):
    train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="bfloat16")
    state = init(train, api)
    expected = {"norm": {jnp.dtype(jnp.float32)}, "other": {jnp.dtype(jnp.bfloat16)}}
    assert param_dtypes(state.params) == expected
    assert train.master_weights
    state, metrics = train.step(state, make_batches(1)[0])  # donates: no buffer held twice
    state, metrics = train.step(state, make_batches(1)[0])
  assert param_dtypes(state.params) == expected
  assert {x.dtype for x in jax.tree.leaves(state.opt_state.master_params)} == {
      jnp.dtype(jnp.float32)}
  assert bool(metrics["grads_finite"]) and np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_users_norm_rule_beats_the_opt_levels(api):
  bn = nnx.BatchNorm if api == "nnx" else nn.BatchNorm
  with jaxamp.policy_rules({bn: "float16"}):
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.05), opt_level="O2")
    state = init(train, api)
    assert param_dtypes(state.params)["norm"] == {jnp.dtype(jnp.float16)}
    state, metrics = train.step(state, make_batches(1)[0])
  assert param_dtypes(state.params)["norm"] == {jnp.dtype(jnp.float16)}
  assert bool(metrics["grads_finite"])


def test_policy_wrapped_models_are_unwrapped():
  model = NNXNet(nnx.Rngs(0))
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.05), opt_level="O2")
  state = train.init(jaxamp.nnx.with_policy(model, "float16"))
  assert param_dtypes(state.params) == {"norm": {jnp.dtype(jnp.float32)},
                                        "other": {jnp.dtype(jnp.float16)}}
  assert "module" not in jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(
      state.params)[0][0][0])
  state, metrics = train.step(state, make_batches(1)[0])
  assert bool(metrics["grads_finite"])
  other = jaxamp.make_train_step(loss_fn, optax.sgd(0.05), policy="mixed_bfloat16")
  with pytest.raises(ValueError, match="wrapped with policy 'float16'.*'mixed_bfloat16'"):
    other.init(jaxamp.nnx.with_policy(NNXNet(nnx.Rngs(0)), "float16"))
  linen = jaxamp.linen.with_policy(LinenNet(), "mixed_bfloat16")
  x = jnp.zeros((2, 8))
  state = other.init(linen, LinenNet().init(jax.random.key(0), x, train=False), x,
                     train=False)
  assert param_dtypes(state.params) == {"norm": {jnp.dtype(jnp.float32)},
                                        "other": {jnp.dtype(jnp.float32)}}


def test_opt_level_excludes_policy():
  with pytest.raises(ValueError, match="either policy= or opt_level="):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float32", opt_level="O1")


def test_a_state_holding_nnx_nodes_is_named_with_the_fix():
  # The step's state holds nnx.to_pure_dict trees; an nnx.State put in its place is
  # recognized through the adapter registry (adapters.is_node), and the fix named.
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1))
  state = train.init(model)
  with pytest.raises(ValueError, match=r"its params holds nnx.State or nnx.Variable nodes.*"
                     r"pass nnx.to_pure_dict\(...\) of it as params"):
    train.step(state._replace(params=nnx.state(model, nnx.Param)), jnp.ones((2, 4)))
