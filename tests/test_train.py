"""Tests for jaxamp.train: exact skips, accumulation, data parallel, resume, no retracing."""

import itertools
import os
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp

POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NNXNet(nnx.Module):
  """Linear -> BatchNorm -> ReLU -> Dropout -> Linear."""

  def __init__(self, rngs, *, dropout=0.0, batchnorm=True):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs) if batchnorm else None
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    h = self.l1(x)
    if self.bn is not None:
      h = self.bn(h)
    return self.l2(self.drop(jax.nn.relu(h)))


class LinenNet(nn.Module):
  dropout: float = 0.0
  batchnorm: bool = True

  @nn.compact
  def __call__(self, x, train=True):
    h = nn.Dense(16)(x)
    if self.batchnorm:
      h = nn.BatchNorm(use_running_average=not train)(h)
    h = nn.Dropout(self.dropout, deterministic=not train)(jax.nn.relu(h))
    return nn.Dense(4)(h)


def xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def loss_fn(model, batch):
  return xent(model(batch["x"]), batch["y"])


def make_batches(n, size=16, seed=0):
  rng = np.random.RandomState(seed)
  return [{"x": rng.randn(size, 8).astype(np.float32),
           "y": rng.randint(0, 4, size).astype(np.int32)} for _ in range(n)]


def init(train, api, *, example_inputs=True, **kw):
  """``train.init`` of NNXNet or LinenNet (with the Linen module's example inputs)."""
  if api == "nnx":
    return train.init(NNXNet(nnx.Rngs(0, dropout=1), **kw))
  module = LinenNet(**kw)
  x = jnp.zeros((2, 8))
  variables = module.init(jax.random.key(0), x, train=False)
  if example_inputs:
    return train.init(module, variables, x, train=False)
  return train.init(module, variables)


def param_dtypes(params):
  """``{'norm': {...}, 'other': {...}}``: the dtypes of BatchNorm's and the rest's params."""
  out = {"norm": set(), "other": set()}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    out["norm" if "bn" in name or "BatchNorm" in name else "other"].add(jnp.dtype(leaf.dtype))
  return out


def leaves(tree):
  def host(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  return [host(x) for x in jax.tree.leaves(tree)]


def assert_trees_equal(a, b):
  la, lb = leaves(a), leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("policy", POLICIES)
def test_end_to_end_trains_with_batchnorm_and_dropout(api, policy):
  seen = []

  def spy_loss(model, batch):
    out = model(batch["x"])
    seen.append(out.dtype)
    return xent(out, batch["y"])

  train = jaxamp.make_train_step(spy_loss, optax.adam(1e-2), policy=policy)
  state = init(train, api, dropout=0.1)
  stats0 = leaves(state.model_state)
  batch = make_batches(1)[0]
  losses = []
  for _ in range(6):
    state, metrics = train.step(state, batch)
    losses.append(float(metrics["loss"]))
  assert seen == [jnp.float32]  # traced once; outputs handed over in float32
  assert losses[-1] < losses[0]
  assert metrics["loss"].dtype == jnp.float32
  assert int(metrics["skipped_steps"]) == 0 and bool(metrics["grads_finite"])
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  expected_scale = 2.0**15 if policy == "mixed_float16" else 1.0
  assert float(jaxamp.get_loss_scale(state.opt_state)) == expected_scale
  assert float(metrics["loss_scale"]) == expected_scale
  stats = [x for x in jax.tree.leaves(state.model_state)
           if jnp.issubdtype(x.dtype, jnp.floating)]
  assert stats and all(x.dtype == jnp.float32 for x in stats)  # BatchNorm stats stay f32
  changed = [not np.array_equal(a, b) for a, b in zip(leaves(state.model_state), stats0)
             if a.dtype == np.float32]
  assert any(changed)


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_mixed_matches_float32_within_tolerance(api):
  batches = make_batches(4)
  final = {}
  for policy in ("float32", "mixed_bfloat16"):
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.05), policy=policy)
    state = init(train, api, batchnorm=False)
    for b in batches:
      state, _ = train.step(state, b)
    final[policy] = leaves(state.params)
  # bfloat16 has an 8-bit mantissa: after 4 small SGD steps params agree to ~1e-2.
  for a, b in zip(final["float32"], final["mixed_bfloat16"]):
    np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)


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
    train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_bfloat16", donate=False)
    state = init(train, api, dropout=0.2)
    history = []
    for b in batches:
      before = state
      state, metrics = train.step(state, b)
      history.append((before, state, metrics))
    return state, history

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


def test_linen_dropout_draws_a_new_mask_each_step_from_a_base_key_that_stays():
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.0), policy="float32")
  batch = make_batches(1)[0]

  def losses():
    state = init(train, "linen", dropout=0.5, batchnorm=False)
    base = np.asarray(jax.random.key_data(state.rng))
    out = []
    for _ in range(3):  # a learning rate of 0: only the dropout mask moves the loss
      state, metrics = train.step(state, batch)
      out.append(float(metrics["loss"]))
    np.testing.assert_array_equal(jax.random.key_data(state.rng), base)
    return out

  first = losses()
  assert len(set(first)) == 3  # three steps, three masks
  assert losses() == first  # the same keys again from the same state


class DropPath(nn.Module):
  """Stochastic depth as Hugging Face's BEiT draws it: elements of a branch dropped with
  keys from a ``'droppath'`` stream; hands each mask it draws to ``record`` (a host
  callback)."""
  record: Any

  @nn.compact
  def __call__(self, x, train=True):
    h = nn.Dense(8)(x)
    if train:
      keep = jax.random.bernoulli(self.make_rng("droppath"), 0.5, h.shape)
      jax.debug.callback(lambda m: self.record(np.asarray(m)), keep)
      h = jnp.where(keep, h, 0.0)
    return nn.Dense(4)(h)


def test_linen_streams_other_than_dropout_are_drawn_per_step_and_micro_batch():
  """A Linen module drawing from a stream other than 'dropout' (BEiT's 'droppath') could
  not be trained. Named in rng_streams, it gets keys derived from the state as the
  dropout key is: the same from the same state, new each step and each micro-batch."""
  masks = []
  module, x = DropPath(masks.append), make_batches(1, size=16)[0]["x"]
  variables = module.init(jax.random.key(0), x, train=False)
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.0),
                                 policy="float32", grad_accum_steps=2, donate=False,
                                 rng_streams=("dropout", "droppath"))
  state = train.init(module, variables, x, train=False)

  def drawn(state):
    masks.clear()
    new, metrics = train.step(state, x)
    jax.effects_barrier()
    assert bool(metrics["grads_finite"]) and len(masks) == 2, len(masks)  # 2 micro-batches
    return new, [m.copy() for m in masks]

  next_state, first = drawn(state)
  assert not np.array_equal(*first)  # each micro-batch its own key
  np.testing.assert_array_equal(drawn(state)[1], first)  # the same from the same state
  later = drawn(next_state)[1]
  assert not any(np.array_equal(a, b) for a in later for b in first)  # a new step: new
  assert np.isfinite(float(train.eval_step(state, x)))


def test_a_linen_stream_not_given_is_named_with_the_fix_and_init_rngs_name_streams():
  module, x = DropPath(print), jnp.zeros((4, 8))
  variables = module.init(jax.random.key(0), x, train=False)
  loss = lambda m, b: jnp.mean(m(b) ** 2)
  train = jaxamp.make_train_step(loss, optax.sgd(0.1))
  state = train.init(module, variables, x, train=False)
  with pytest.raises(ValueError, match=r"stream 'droppath'.*rng_streams=\('dropout', "
                                       r"'droppath'\)"):
    train.trace(state, x)
  # Streams named in init's rngs= (but 'params') are given too.
  state = train.init(module, variables, x, train=True, rngs={
      "params": jax.random.key(0), "droppath": jax.random.key(1)})
  assert train.plan.adapter.rng_streams == ("dropout", "droppath")
  train.trace(state, x)
  with pytest.raises(ValueError, match="rng_streams must be a tuple of Linen RNG stream"):
    jaxamp.make_train_step(loss, optax.sgd(0.1), rng_streams="droppath")


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_linen_model_that_draws_no_key_gets_no_key_work(dropout):
  # The step's dropout key is folded from the base key, never split off and carried:
  # with no Dropout drawing it, XLA keeps no threefry hash (its xors) in the program.
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="mixed_bfloat16")
  state = init(train, "linen", dropout=dropout)
  compiled = train.trace(state, make_batches(1)[0]).lower().compile().as_text()
  assert (" xor(" in compiled) == bool(dropout)


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


def test_gradients_whose_norm_leaves_float32_skip_the_step():
  # Every element finite, the global norm past float32's range (~1.8e19): skipped like an
  # overflow (clipping would zero it, Adam's second moment would hold inf from then on).
  def loss(model, batch):
    return jnp.sum(model(batch["x"])) * batch["factor"]

  train = jaxamp.make_train_step(loss, optax.adam(1e-3), policy="float32", donate=False)
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
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-2), policy=policy, donate=False,
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
                                   donate=False, skip_nonfinite=skip)
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


def _skip_warnings(record):
  return [w for w in record if "train steps were all skipped" in str(w.message)]


def test_a_streak_of_skipped_steps_warns_once_per_streak():
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), donate=False, warn_skipped_steps=2)
  state = init(train, "nnx", batchnorm=False)
  good = make_batches(1)[0]
  bad = {"x": np.full_like(good["x"], np.nan), "y": good["y"]}
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for batch in [good, bad] * 4:  # every other step skipped: no streak
      state, _ = train.step(state, batch)
    assert not _skip_warnings(record)
    for _ in range(8):  # a streak: one warning, from the window of calls 9-10
      state, metrics = train.step(state, bad)
    (warning,) = _skip_warnings(record)
  assert warning.category is RuntimeWarning
  assert "last 2 train steps" in str(warning.message)
  assert "debug_nonfinite=True" in str(warning.message)
  assert int(metrics["skipped_steps"]) == 4 + 8
  jax.jit(train.step)(state, bad)  # inside a user's jit, metrics are tracers: not read


def test_the_skip_warning_watches_windows_of_100_calls_by_default():
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1))
  assert train._streaks.window == 100  # pylint: disable=protected-access


def test_the_skip_warning_names_float16_updates_when_the_gradients_were_finite():
  """Pure float16 without master weights, Adam's default eps (0 in float16): zero
  gradients give 0/0 updates, every step is skipped for its parameters, not its
  gradients, and the warning says so."""
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="float16",
                                 master_weights=False, warn_skipped_steps=2)
  state = init(train, "nnx", batchnorm=False)
  batch = make_batches(1)[0]
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for _ in range(6):
      state, metrics = train.step(state, batch)
    (warning,) = _skip_warnings(record)
  assert bool(metrics["grads_finite"]) and not bool(metrics["params_finite"])
  assert "gradients were finite" in str(warning.message)
  assert "master_weights=True" in str(warning.message)


def test_the_skip_warning_can_be_turned_off():
  good = make_batches(1)[0]
  bad = {"x": np.full_like(good["x"], np.nan), "y": good["y"]}
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), donate=False,
                                 warn_skipped_steps=None)
  state = init(train, "nnx", batchnorm=False)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for _ in range(400):
      state, metrics = train.step(state, bad)
  assert not _skip_warnings(record)
  assert int(metrics["skipped_steps"]) == 400
  for wrong in (0, -3, True, 2.5, "100"):
    with pytest.raises(ValueError, match="warn_skipped_steps must be a positive int"):
      jaxamp.make_train_step(loss_fn, optax.sgd(0.1), warn_skipped_steps=wrong)


def test_grad_accumulation_matches_one_big_batch():
  batch = make_batches(1, size=32)[0]
  results = {}
  for k in (1, 4):
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float32",
                                   grad_accum_steps=k)
    state = init(train, "nnx", batchnorm=False)
    for _ in range(3):
      state, metrics = train.step(state, batch)
    results[k] = (leaves(state.params), float(metrics["loss"]), float(metrics["grad_norm"]))
  for a, b in zip(results[1][0], results[4][0]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(results[1][1], results[4][1], rtol=1e-5)
  np.testing.assert_allclose(results[1][2], results[4][2], rtol=1e-5)


def test_grad_accumulation_skips_whole_step_when_one_micro_batch_overflows():
  train = jaxamp.make_train_step(loss_fn, optax.chain(jaxamp.dynamic_loss_scale(4.0),
                                                      optax.sgd(0.1)),
                                 policy="float32", grad_accum_steps=4, donate=False)
  state = init(train, "nnx", batchnorm=False)
  batch = make_batches(1, size=32)[0]
  batch["x"][30, 3] = np.nan  # only the last micro-batch sees it
  new, metrics = train.step(state, batch)
  assert not bool(metrics["grads_finite"])
  assert_trees_equal(new.params, state.params)
  assert float(metrics["loss_scale"]) == 2.0
  assert int(metrics["skipped_steps"]) == 1


def counting_loss(model, batch):
  """The loss, with a count, a flag and a mean of the batch as aux."""
  logits = model(batch["x"])
  right = logits.argmax(-1) == batch["y"]
  return xent(logits, batch["y"]), {"n_right": jnp.sum(right), "rows": jnp.int32(len(right)),
                                    "saw_3": jnp.any(batch["y"] == 3),
                                    "accuracy": jnp.mean(right.astype(jnp.float32))}


def test_grad_accumulation_combines_aux_as_the_whole_batch():
  batch = make_batches(1, size=16)[0]
  batch["y"][:] = np.where(batch["y"] == 3, 0, batch["y"])
  batch["y"][1] = 3  # only the first micro-batch has a 3
  aux = {}
  for k in (1, 2, 4):
    train = jaxamp.make_train_step(counting_loss, optax.sgd(0.0), policy="float32",
                                   has_aux=True, grad_accum_steps=k)
    _, metrics = train.step(init(train, "nnx", batchnorm=False), batch)
    aux[k] = {name: np.asarray(metrics[name]) for name in ("n_right", "rows", "saw_3",
                                                           "accuracy")}
  assert int(aux[1]["rows"]) == 16 and bool(aux[1]["saw_3"])
  for k in (2, 4):  # counts summed, flags or-ed, means averaged: the k=1 values
    assert {n: v.dtype for n, v in aux[k].items()} == {n: v.dtype for n, v in aux[1].items()}
    assert {n: aux[k][n].item() for n in ("n_right", "rows", "saw_3")} == {
        n: aux[1][n].item() for n in ("n_right", "rows", "saw_3")}
    np.testing.assert_allclose(aux[k]["accuracy"], aux[1]["accuracy"], rtol=1e-6)


def test_grad_accumulation_scales_each_micro_batch_so_float16_overflows_no_sooner():
  """Each micro-batch's loss is scaled by scale / k: its float16 gradients are the size of
  the k=1 step's. Scaled by the full scale, k=4 overflowed where k=1 did not."""
  class Wide(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.full((8, 4), 2.0, jnp.float32))

    def __call__(self, x):
      return x @ self.w[...]

  batch = {"x": np.full((16, 8), 2.0**-4, np.float32)}
  loss = lambda m, b: jnp.mean(m(b["x"]))  # over 16 x 4 outputs; d/dw = x / 4 = 2**-6
  # The output's cotangent is the scale over the outputs a loss averages: 2**20 / 64 =
  # 2**14 at k=1. Scaled by the full 2**20, a micro-batch of 4 rows would give 2**20 / 16,
  # past float16's 65504; by 2**20 / 4 it gives 2**14 again.
  for k in (1, 4):
    tx = optax.chain(jaxamp.dynamic_loss_scale(2.0**20), optax.sgd(2.0**-4))
    train = jaxamp.make_train_step(loss, tx, policy="mixed_float16", grad_accum_steps=k)
    state, metrics = train.step(train.init(Wide()), batch)
    assert bool(metrics["grads_finite"]), k
    np.testing.assert_array_equal(state.params["w"][...], np.full((8, 4), 2.0 - 2.0**-10))


def test_the_loss_reaches_reduce_on_plateau_as_optax_value():
  """optax.contrib.reduce_on_plateau reads the loss as the update's ``value``: the step
  passes its (unscaled) loss, so the plateau state follows the same losses as a plain
  optax loop fed them."""
  plateau = lambda: optax.chain(optax.sgd(0.5),
                                optax.contrib.reduce_on_plateau(patience=1, factor=0.5))
  train = jaxamp.make_train_step(loss_fn, plateau(), policy="mixed_float16")
  state = init(train, "nnx", batchnorm=False)
  tx = plateau()
  ref = tx.init(None)
  for batch in make_batches(4) * 2:  # the second pass sees the same losses: a plateau
    state, metrics = train.step(state, batch)
    _, ref = tx.update(None, ref, value=metrics["loss"])
  got = optax.tree_utils.tree_get(state.opt_state, "ReduceLROnPlateauState")
  want = optax.tree_utils.tree_get(ref, "ReduceLROnPlateauState")
  assert float(want.scale) < 1.0  # the plateau was found
  assert (float(got.scale), int(got.plateau_count), float(got.best_value)) == (
      float(want.scale), int(want.plateau_count), float(want.best_value))


def test_grad_accumulation_needs_divisible_batch():
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=3)
  state = init(train, "nnx", batchnorm=False)
  with pytest.raises(ValueError, match=r"grad_accum_steps=3 must divide the batch size 16 "
                                       r"of batch\['x'\] \(shape \[16, 8\]"):
    train.step(state, make_batches(1)[0])
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=4)
  state = init(train, "nnx", batchnorm=False)
  with pytest.raises(ValueError, match=r"batch size 6 of batch\['mask'\].*multiple of 4"):
    train.step(state, {**make_batches(1)[0], "mask": np.ones(6, bool)})


def test_grad_accumulation_gives_every_micro_batch_the_0d_leaves_unchanged():
  """A 0-d leaf of the batch (a weight, a temperature, a step count) raised IndexError
  under grad_accum_steps=2; it goes to every micro-batch as it is, the rest split."""
  seen = []

  def weighted(model, batch):
    seen.append({name: (jnp.shape(x), x.dtype) for name, x in batch.items()})
    return xent(model(batch["x"]), batch["y"]) * batch["w"], {"w": batch["w"],
                                                              "t": batch["t"]}

  train = jaxamp.make_train_step(weighted, optax.sgd(0.1), policy="float32", has_aux=True,
                                 grad_accum_steps=2)
  batch = {**make_batches(1)[0], "w": np.float32(0.5), "t": np.int32(3)}
  _, metrics = train.step(init(train, "nnx", batchnorm=False), batch)
  # aux over micro-batches: floats averaged (0.5 if each got 0.5), ints summed (2 x 3)
  assert (float(metrics["w"]), int(metrics["t"])) == (0.5, 6)
  assert seen == [{"x": ((8, 8), np.float32), "y": ((8,), np.int32), "w": ((), np.float32),
                   "t": ((), np.int32)}]


def passenger_batch():
  """A batch of 8 rows carrying what the step must pass through untouched: a typed PRNG
  key per row (Equinox dropout keys), a raw uint32 key, an int row index, a bool flag."""
  return {"x": make_batches(1, size=8)[0]["x"], "key": jax.random.split(jax.random.key(7), 8),
          "raw": jax.random.split(jax.random.PRNGKey(3), 8),
          "n": np.arange(8, dtype=np.int32), "flag": np.arange(8) % 2 == 0}


def passenger_loss(seen):
  """A loss drawing noise from the first row's typed key, recording the batch's dtypes (as
  traced) in ``seen`` and, in its aux, whether any row arrived changed (``bad``, or-ed
  over micro-batches) and the row indices' sum."""
  want = passenger_batch()
  table, raw = jax.random.key_data(want["key"]), jnp.asarray(want["raw"])

  def loss(model, batch):
    seen.append({name: x.dtype for name, x in batch.items()})
    n = batch["n"]
    bad = (jnp.any(jax.random.key_data(batch["key"]) != table[n])
           | jnp.any(batch["raw"] != raw[n]) | jnp.any(batch["flag"] != (n % 2 == 0)))
    noise = jax.random.normal(batch["key"][0], batch["x"].shape)  # as the loss
    return xent(model(batch["x"] + 0.1 * noise), n % 4), {"bad": bad, "n_sum": jnp.sum(n)}

  return loss


@pytest.mark.parametrize("kw", [
    dict(policy="mixed_bfloat16"), dict(policy="mixed_bfloat16", half_residuals=False),
    dict(policy="mixed_bfloat16", grad_accum_steps=2)], ids=str)
def test_keys_ints_and_bools_in_the_batch_reach_loss_fn_unchanged(kw):
  """A typed PRNG key in the batch crashed the default mixed step (the half_residuals
  policy asked NumPy whether key<fry> is floating); keys, raw uint32 keys, ints and
  bools reach loss_fn with their dtypes and values on the step (micro-batches split
  row-wise) and eval_step."""
  seen = []
  train = jaxamp.make_train_step(passenger_loss(seen), optax.sgd(0.1), has_aux=True, **kw)
  state = init(train, "nnx", batchnorm=False)
  state, metrics = train.step(state, passenger_batch())
  _, aux = train.eval_step(state, passenger_batch())
  assert bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 0
  for got in (metrics, aux):
    assert not bool(got["bad"]) and int(got["n_sum"]) == 28  # every row, once, unchanged
  want = {name: x.dtype for name, x in passenger_batch().items()}
  assert seen and all(s == want for s in seen), seen


def test_compiles_once_and_donates_buffers():
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="mixed_bfloat16")
  state = init(train, "nnx")
  old = state
  for b in make_batches(4):
    state, _ = train.step(state, b)
  assert train.trace_count == 1
  assert all(x.is_deleted() for x in jax.tree.leaves(old.params))
  assert int(state.step) == 4


@pytest.mark.parametrize("api", ["nnx", "linen"])
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


def test_grad_norm_is_norm_of_unscaled_gradients():
  batch = make_batches(1)[0]
  train = jaxamp.make_train_step(loss_fn, optax.chain(jaxamp.static_loss_scale(256.0),
                                                      optax.sgd(0.0)),
                                 policy="float32", donate=False)
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
                                     donate=False)
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


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("float32_outputs", [True, False])
def test_an_nnx_loss_fn_can_take_the_models_state(float32_outputs, policy):
  # The model loss_fn receives is an nnx.Module holding the model: nnx.state finds its
  # parameters (an L2 term), and a jax.jvp over nnx.split's state reaches them. Before,
  # with float32 outputs, the first raised and the second was silently 0. Under mixed
  # precision the jvp meets the reads that record half-precision cotangents (a
  # custom_vjp): step and lower make the step again with plain reads.
  x = make_batches(1)[0]["x"]

  def l2(model, batch):
    return sum(jnp.sum(p.astype(jnp.float32) ** 2)
               for p in jax.tree.leaves(nnx.state(model, nnx.Param)))

  def directional(model, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    f = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(batch["x"]).astype(jnp.float32))
    return jax.jvp(f, (params,), (jax.tree.map(jnp.ones_like, params),))[1]

  plain = NNXNet(nnx.Rngs(0, dropout=1), batchnorm=False)
  tol = 1e-5 if policy == "float32" else 2e-2  # bfloat16 matmuls in the directional one
  for fn in (l2, directional):
    make = lambda: jaxamp.make_train_step(fn, optax.sgd(0.0), policy=policy,
                                          float32_outputs=float32_outputs)
    train = make()
    _, metrics = train.step(init(train, "nnx", batchnorm=False), {"x": x})
    np.testing.assert_allclose(float(metrics["loss"]), float(fn(plain, {"x": x})),
                               rtol=tol)
    train = make()
    assert "stablehlo.case" in train.lower(init(train, "nnx", batchnorm=False),
                                           {"x": x}).as_text()  # the skip


def test_master_weights_for_half_params():
  # A step of 1e-4 on weights near 1 vanishes in bfloat16 (spacing 2**-7) unless float32
  # master weights accumulate it.
  train = jaxamp.make_train_step(loss_fn, optax.sgd(1e-4), policy="bfloat16", donate=False)
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
                                 debug_nonfinite=True)
  state = train.init(TwoHeads(nnx.Rngs(0)))
  x = np.ones((4, 8), np.float32)
  x2 = x.copy()
  x2[1, 2] = np.inf
  _, metrics = train.step(state, {"x": x, "x2": x2})
  bad = sorted(k for k, v in metrics["nonfinite_grads"].items() if bool(v))
  # d loss / d b.bias is 1/n (finite); only b.kernel meets x2's inf
  assert bad == ["b/kernel"]
  assert sorted(metrics["nonfinite_grads"]) == ["a/bias", "a/kernel", "b/bias", "b/kernel"]


def test_aux_metrics_and_eval_step():
  def loss_with_aux(model, batch):
    logits = model(batch["x"])
    acc = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return xent(logits, batch["y"]), {"accuracy": acc}

  def eval_fn(model, batch):
    return model(batch["x"])

  train = jaxamp.make_train_step(loss_with_aux, optax.sgd(0.1), policy="mixed_bfloat16",
                                 has_aux=True, eval_fn=eval_fn, donate=False)
  state = init(train, "nnx", dropout=0.5)
  batch = make_batches(1)[0]
  state, metrics = train.step(state, batch)
  assert 0.0 <= float(metrics["accuracy"]) <= 1.0
  out = train.eval_step(state, batch)
  assert out.dtype == jnp.float32
  # eval mode: deterministic dropout and running BatchNorm statistics
  np.testing.assert_array_equal(np.asarray(out), np.asarray(train.eval_step(state, batch)))
  ref = train.model(state)
  ref.eval()
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref(batch["x"])), atol=5e-2)


_MESH_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    import jax, numpy as np, optax
    import jaxamp
    from test_train import loss_fn, init, make_batches, leaves
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ('data',))
    batches = make_batches(3, size=32)
    # float32: only summation order differs. bfloat16: each device rounds its own partial
    # products, and Adam magnifies differences in near-zero gradients (bf16 spacing 2**-8).
    for policy, atol in [('float32', 1e-5), ('mixed_bfloat16', 2e-3)]:
      out = {{}}
      for name, kw in [('single', {{}}), ('mesh', dict(mesh=mesh))]:
        tx = optax.chain(jaxamp.dynamic_loss_scale(2.0**8), optax.adam(1e-2))
        train = jaxamp.make_train_step(loss_fn, tx, policy=policy, **kw)
        state = init(train, 'nnx', batchnorm=False)
        for b in batches:
          state, metrics = train.step(state, b)
        out[name] = (leaves(state.params), float(metrics['loss']), float(metrics['loss_scale']))
        if name == 'mesh':
          assert len(state.params['l1']['kernel'][...].sharding.device_set) == 8
          bad = dict(batches[0], x=batches[0]['x'].copy()); bad['x'][31, 0] = np.inf
          state2, m2 = train.step(state, bad)   # only the last device sees the inf
          assert not bool(m2['grads_finite'])
          assert float(m2['loss_scale']) == float(metrics['loss_scale']) / 2
          for a, b in zip(leaves(state2.params), out['mesh'][0]):
            np.testing.assert_array_equal(a, b)
      for a, b in zip(out['single'][0], out['mesh'][0]):
        np.testing.assert_allclose(a, b, rtol=atol, atol=atol)
      np.testing.assert_allclose(out['single'][1], out['mesh'][1], rtol=10 * atol)
      assert out['single'][2] == out['mesh'][2]

    # A batch committed in another layout (one device, replicated, split on its second
    # axis) is moved to the step's batch sharding, not refused: same step as from host.
    from jax.sharding import NamedSharding, PartitionSpec as P
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy='float32', mesh=mesh,
                                   donate=False)
    state = init(train, 'nnx', batchnorm=False)
    host = batches[0]
    want = leaves(train.step(state, host)[0].params)
    for put in (lambda x: jax.device_put(x, jax.devices()[5]),
                lambda x: jax.device_put(x, NamedSharding(mesh, P())),
                lambda x: jax.device_put(x, NamedSharding(mesh, P(None, 'data')))
                if x.ndim == 2 else jax.device_put(x, jax.devices()[1])):
      committed = {{k: put(v) for k, v in host.items()}}
      for a, b in zip(leaves(train.step(state, committed)[0].params), want):
        np.testing.assert_array_equal(a, b)
      train.eval_step(state, committed)

    # Aux over devices and micro-batches: counts summed, flags or-ed, as the whole batch's.
    from test_train import counting_loss
    b = dict(batches[0], y=np.where(batches[0]['y'] == 3, 0, batches[0]['y']))
    b['y'][5] = 3  # one device's first micro-batch
    auxes = []
    for kw in ({{}}, dict(mesh=mesh, grad_accum_steps=2)):
      train = jaxamp.make_train_step(counting_loss, optax.sgd(0.0), policy='float32',
                                     has_aux=True, **kw)
      _, m = train.step(init(train, 'nnx', batchnorm=False), b)
      auxes.append((int(m['n_right']), int(m['rows']), bool(m['saw_3']),
                    round(float(m['accuracy']), 6)))
    assert auxes[0] == auxes[1] and auxes[0][1:3] == (32, True), auxes

    # BatchNorm told the mesh axis normalizes with the whole batch's statistics: as one
    # device (each device's own statistics, without it). Shards of different means.
    from flax import nnx
    class SyncNet(nnx.Module):
      def __init__(self, axis_name):
        self.l1 = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(16, axis_name=axis_name, rngs=nnx.Rngs(0))
        self.l2 = nnx.Linear(16, 4, rngs=nnx.Rngs(1))
      def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))
    b = dict(batches[0], x=batches[0]['x'] + np.repeat(np.arange(8.0), 4)[:, None])
    got = {{}}
    for name, kw, axis in [('single', {{}}, None), ('synced', dict(mesh=mesh), 'data'),
                           ('local', dict(mesh=mesh), None)]:
      train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy='float32', **kw)
      state, _ = train.step(train.init(SyncNet(axis)), b)
      got[name] = leaves(state.params) + leaves(state.model_state)
    for a, c in zip(got['single'], got['synced']):
      np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)
    assert max(np.abs(a - c).max() for a, c in zip(got['single'], got['local'])) > 1e-2

    # NNX dropout: every device draws its own masks (one example per device here).
    import jax.numpy as jnp
    from flax import nnx
    class Drop(nnx.Module):
      def __init__(self):
        self.w = nnx.Param(jnp.zeros(16))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
      def __call__(self, x):
        return self.drop(x) @ self.w[...]
    train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b['x'])), optax.sgd(1.0),
                                   policy='float32', mesh=mesh)
    state, _ = train.step(train.init(Drop()), {{'x': np.ones((8, 16), np.float32)}})
    w = np.asarray(state.params['w'][...])
    # the mean of 8 devices' masks/keep: shared masks could only give 0 or 2
    assert set(np.round(-w, 4).tolist()) - {{0.0, 2.0}}, w

    # gradients averaged across devices in bfloat16
    for name, kw in [('single', {{}}), ('mesh', dict(mesh=mesh, grad_reduce_dtype=jnp.bfloat16))]:
      train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy='float32', **kw)
      state = init(train, 'nnx', batchnorm=False)
      if name == 'mesh':
        assert 'all-reduce' in train._programs.step_jit.lower(state, batches[0]).compile().as_text()
      for b in batches:
        state, metrics = train.step(state, b)
      out[name] = leaves(state.params)
    for a, b in zip(out['single'], out['mesh']):
      np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)  # bf16 sums: 8-bit mantissa
    print('MESH-OK')
""")


def _run_script(source, tmp_path, name, env=None):
  path = tmp_path / name
  path.write_text(source)
  full_env = dict(os.environ, **(env or {}))
  proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                        env=full_env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


@pytest.mark.slow
def test_data_parallel_on_8_devices_matches_single_device(tmp_path):
  script = _MESH_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
  out = _run_script(script, tmp_path, "mesh.py",
                    {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
                                  + os.environ.get("XLA_FLAGS", ""),  # conftest's, too
                     "JAX_PLATFORMS": "cpu"})
  assert "MESH-OK" in out


_RESUME_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    import jax, numpy as np, optax, orbax.checkpoint as ocp
    import jaxamp
    from test_train import loss_fn, init, make_batches, leaves
    mode, folder = sys.argv[1], sys.argv[2]
    batches = make_batches(5)
    checkpointer = ocp.StandardCheckpointer()
    for api in sys.argv[3:]:
      ckpt, out = f'{{folder}}/ckpt-{{api}}', f'{{folder}}/resumed-{{api}}.npz'
      tx = optax.chain(jaxamp.dynamic_loss_scale(2.0**4, growth_interval=2), optax.adam(1e-2))
      train = jaxamp.make_train_step(loss_fn, tx, policy='mixed_float16')
      state = init(train, api, dropout=0.2)
      if mode == 'first':
        for b in batches[:3]:
          state, _ = train.step(state, b)
        checkpointer.save(ckpt, state)
        checkpointer.wait_until_finished()
      else:
        state = checkpointer.restore(ckpt, jaxamp.abstract_state(state))
        for b in batches[3:]:
          state, _ = train.step(state, b)
        np.savez(out, *leaves(state.params), *leaves(state.model_state),
                 *leaves(state.opt_state),
                 scale=np.asarray(jaxamp.get_loss_scale(state.opt_state)))
""")


@pytest.fixture(scope="module")
def orbax_resumed(once_per_run):
  """Both APIs' runs, saved after 3 steps by one process and resumed for 2 more by a
  second, fresh one: two processes in all, once per test run (xdist workers included)."""
  def make(folder):
    path = folder / "resume.py"
    path.write_text(_RESUME_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    for mode in ("first", "second"):
      proc = subprocess.run([sys.executable, str(path), mode, str(folder), "nnx", "linen"],
                            capture_output=True, text=True, timeout=300)
      assert proc.returncode == 0, proc.stdout + proc.stderr

  return once_per_run("orbax_resume", make)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_orbax_resume_in_fresh_process_is_bit_identical(orbax_resumed, api):
  # Dropout on: NNX carries its RNG streams in model_state; a Linen step folds its key
  # from state.rng with the steps applied so far, which the checkpoint holds too.
  tx = optax.chain(jaxamp.dynamic_loss_scale(2.0**4, growth_interval=2), optax.adam(1e-2))
  train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_float16")
  state = init(train, api, dropout=0.2)
  for b in make_batches(5):
    state, _ = train.step(state, b)
  resumed = np.load(orbax_resumed / f"resumed-{api}.npz")
  expected = leaves(state.params) + leaves(state.model_state) + leaves(state.opt_state)
  for i, x in enumerate(expected):
    np.testing.assert_array_equal(resumed[f"arr_{i}"], x)
  # growth every 2 finite steps from 16: 5 steps -> 16 * 2 * 2
  assert float(resumed["scale"]) == float(jaxamp.get_loss_scale(state.opt_state)) == 64.0


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


def test_o1_computes_the_loss_against_float32_targets_in_float32():
  """O1 autocasts the whole loss: the batch is pinned, so ``pred - y`` runs in float32
  as under a mixed policy (it ran in bfloat16: a target of 1001 was 1000), while the
  matmul still runs in bfloat16."""
  loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  batch = {"x": jnp.ones((16, 8)), "y": jnp.full((16, 1), 1001.0)}
  level = jaxamp.opt_level("O1", half=jnp.bfloat16)
  train = jaxamp.make_train_step(loss, optax.sgd(0.0), opt_level=level)
  state = train.init(nnx.Linear(8, 1, rngs=nnx.Rngs(0)))
  text = train.lower(state, batch).as_text()
  subs = [line for line in text.splitlines() if "stablehlo.subtract" in line and "16x1x" in line]
  assert subs and all("16x1xf32" in line for line in subs), subs
  assert any("dot_general" in line and "bf16" in line for line in text.splitlines())


def test_a_float16_gradient_mean_without_loss_scale_warns():
  mesh = jax.make_mesh((1,), ("data",))
  for policy, warns in [("float32", True), ("mixed_bfloat16", True), ("mixed_float16", False)]:
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy=policy, mesh=mesh,
                                   grad_reduce_dtype=jnp.float16)
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      init(train, "nnx", batchnorm=False)
    found = [w for w in seen if "grad_reduce_dtype=float16" in str(w.message)]
    assert len(found) == warns, (policy, [str(w.message) for w in seen])


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


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="grad_accum_steps must be >= 1"):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=0)
  mesh = jax.make_mesh((1,), ("batch",))
  with pytest.raises(ValueError, match="batch_axis 'data' is not an axis of the mesh"):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), mesh=mesh)
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1))
  with pytest.raises(RuntimeError, match="init"):
    train.step(None, None)
  with pytest.raises(ValueError, match="init\\(module, variables\\)"):
    train.init(LinenNet())


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
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.05), opt_level=level, donate=False)
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
                                 master_weights=True)
  state = init(train, "nnx")
  for _ in range(2):
    state, metrics = train.step(state, make_batches(1)[0])
  assert bool(metrics["grads_finite"])
  assert_trees_equal(state.params, state.opt_state.master_params)


def test_opt_level_excludes_policy():
  with pytest.raises(ValueError, match="either policy= or opt_level="):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float32", opt_level="O1")


def test_float16_on_cpu_warns_once(monkeypatch, fresh_warnings):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with pytest.warns(RuntimeWarning, match="no fast float16 path"):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_float16")
  with pytest.warns(RuntimeWarning, match="no fast float16 path"):
    fresh_warnings.reset()
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), opt_level="O1")


def test_grad_reduce_dtype_must_be_floating():
  for bad in (jnp.int32, "nope"):
    with pytest.raises(ValueError, match="grad_reduce_dtype must be a floating dtype"):
      jaxamp.make_train_step(loss_fn, optax.sgd(0.1), grad_reduce_dtype=bad)
  # None, the default: float32, or float64 for float64 gradients.
  options = jaxamp.make_train_step(loss_fn, optax.sgd(0.1)).options
  assert options.grad_reduce_dtype is None
  assert options.reduce_dtype(jnp.bfloat16) == jnp.float32
  assert options.reduce_dtype(jnp.float64) == jnp.float64


def test_loss_scale_after_clipping_is_refused():
  tx = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.dynamic_loss_scale(), optax.sgd(0.1))
  train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_float16")
  with pytest.raises(ValueError, match="misplaced.*Put the loss scale first"):
    init(train, "nnx", batchnorm=False)
  nested = optax.chain(optax.chain(jaxamp.dynamic_loss_scale(4.0), optax.sgd(0.1)))
  train = jaxamp.make_train_step(loss_fn, nested, policy="mixed_float16")
  assert float(jaxamp.get_loss_scale(init(train, "nnx", batchnorm=False).opt_state)) == 4.0


def test_grad_accumulation_keeps_half_gradient_dtypes():
  # bfloat16 params without master weights: Adam's moments are bfloat16 and must stay so.
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="bfloat16",
                                 master_weights=False, grad_accum_steps=2)
  state = init(train, "nnx", batchnorm=False)
  before = [x.dtype for x in jax.tree.leaves(state.opt_state)]
  for b in make_batches(2):
    state, _ = train.step(state, b)
  assert [x.dtype for x in jax.tree.leaves(state.opt_state)] == before
  assert jnp.dtype(jnp.bfloat16) in before
  assert train.trace_count == 1


# --- misuse and injected faults: each trained wrongly in silence before ------------------


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


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_a_float16_state_resumes_correctly_under_a_bfloat16_step(skip_nonfinite):
  # Restoring a mixed_float16 checkpoint (scale 32768) into a mixed_bfloat16 step: the
  # loss is multiplied by the state's scale, so the update must divide by that scale.
  batch = make_batches(1)[0]
  f16 = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_float16")
  state, _ = f16.step(init(f16, "nnx", batchnorm=False), batch)
  assert float(jaxamp.get_loss_scale(state.opt_state)) == 2.0**15
  bf16 = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16",
                                donate=False, skip_nonfinite=skip_nonfinite)
  init(bf16, "nnx", batchnorm=False)
  with pytest.warns(RuntimeWarning, match="starts fresh at 1"):  # the scale bf16 uses
    resumed, metrics = bf16.step(state, batch)
  # Reference: the same state with the scale a bfloat16 run would have had (1).
  one = jax.tree.map(lambda x: x, state, is_leaf=lambda x: isinstance(x, jaxamp.LossScaleState))
  one = one._replace(opt_state=jax.tree.map(
      lambda x: x._replace(scale=jnp.ones_like(x.scale))
      if isinstance(x, jaxamp.LossScaleState) else x,
      state.opt_state, is_leaf=lambda x: isinstance(x, jaxamp.LossScaleState)))
  expected, _ = bf16.step(one, batch)
  assert_trees_equal(resumed.params, expected.params)  # not 32768x the update
  assert float(metrics["loss_scale"]) == 1.0  # the bfloat16 step's own rule from here on


RESUME_POLICIES = ["float32", "mixed_bfloat16", "mixed_float16", "mixed_fp8"]


def test_a_state_resumed_under_another_policy_gets_the_loss_scale_and_fp8_state_it_needs():
  """Each of 16 pairs: a state of policy A (its loss scale as a trained run leaves it)
  given to a step of policy B. Under a float16 B the dynamic scale starts fresh at 32768
  unless A was float16 too (then it is kept); other policies get their scale of 1; FP8
  state is made fresh or dropped; skipped_steps is kept; each change warns, naming B.
  The pairs run the fitting stage train.step runs first (no compile); one pair then
  runs through train.step."""
  from jaxamp.train import resume  # pylint: disable=g-import-not-at-top

  model = lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  trains = {p: jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy=p)
            for p in RESUME_POLICIES}
  fresh, restored = {}, {}
  is_scale = lambda x: isinstance(x, jaxamp.LossScaleState)
  for p, train in trains.items():
    state = train.init(model())
    fresh[p] = resume.fresh_of(train.plan, state)
    trained = lambda x: x._replace(scale=jnp.float32(1024.0 if p == "mixed_float16" else 1.0),
                                   growth_count=jnp.int32(5), overflow_steps=jnp.int32(3))
    restored[p] = state._replace(opt_state=jax.tree.map(
        lambda x: trained(x) if is_scale(x) else x, state.opt_state, is_leaf=is_scale))
  scale_of = lambda s: optax.tree_utils.tree_get(s.opt_state, "LossScaleState")
  for a, b in itertools.product(RESUME_POLICIES, RESUME_POLICIES):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      state = resume.fitted(fresh[b], restored[a])
    trains[b].check_state(state)  # fits B's step
    scales = b == "mixed_float16"
    new = scales != (a == "mixed_float16")  # the scale A left cannot serve B
    got = scale_of(state)
    want = ((32768.0 if scales else 1.0, 0) if new
            else (1024.0 if scales else 1.0, 5))
    assert (float(got.scale), int(got.growth_count), int(got.overflow_steps)) == (
        *want, 3), (a, b)
    assert (state.fp8 is not None) == (b == "mixed_fp8"), (a, b)
    if a == b:
      assert state is restored[a]
    messages = [str(w.message) for w in caught]
    assert len(messages) == new + ((a == "mixed_fp8") != (b == "mixed_fp8")), (a, b, messages)
    assert all(f"policy {b!r}" in m for m in messages), messages
    if new:
      assert any(f"fresh at {32768 if scales else 1}" in m for m in messages), messages
  # Through train.step: a bfloat16 state's first float16 step runs at 32768.
  f16 = trains["mixed_float16"]
  batch = make_batches(1, size=2)[0]
  with pytest.warns(RuntimeWarning, match="starts fresh at 32768"):
    state, metrics = f16.step(restored["mixed_bfloat16"], batch)
  assert float(metrics["loss_scale"]) == 32768.0 and int(metrics["skipped_steps"]) == 3


@pytest.mark.parametrize("master_weights", [True, False])
def test_a_float16_parameter_that_would_overflow_skips_the_step(master_weights):
  # Pure float16 params: a weight pushed past 65504 would be stored as inf and training
  # would go on (loss -inf). The step must be skipped like an overflowing one.
  model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0),
                     kernel_init=nnx.initializers.constant(60000.0))
  # Small activations (w/64 fits float16); the gradient of the weight is -c/64.
  train = jaxamp.make_train_step(lambda m, b: -jnp.mean(m(b["x"]) * b["c"]),
                                 optax.chain(jaxamp.no_loss_scale(), optax.sgd(1000.0)),
                                 policy="float16", master_weights=master_weights,
                                 donate=False)
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


def test_a_state_from_another_step_is_refused():
  adam = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="mixed_bfloat16")
  sgd = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16")
  half = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float16",
                                master_weights=False)
  batch = make_batches(1)[0]
  a, s, h = (init(t, "nnx", batchnorm=False) for t in (adam, sgd, half))
  with pytest.raises(ValueError, match="opt_state has another structure.*another optimizer"):
    sgd.step(a, batch)
  with pytest.raises(ValueError, match=r"params.*is float16\[.*this step's is float32"):
    sgd.step(h, batch)
  with pytest.raises(ValueError, match="not a jaxamp.TrainState"):
    sgd.eval_step((s.params, s.opt_state), batch)
  # init with another model rebinds the step: older states no longer run through it.
  old = s
  new = init(sgd, "nnx", batchnorm=True)
  with pytest.raises(ValueError, match="params has another structure.*another model"):
    sgd.step(old, batch)
  new, _ = sgd.step(new, batch)
  new, _ = sgd.step(new, batch)  # the step's own output passes (no check needed)


def test_a_state_laid_out_as_the_steps_own_skips_the_check(monkeypatch):
  """A state the step did not return, but with the structure, shapes, dtypes and
  placement of those it returns (the returned one with the user's own params), runs
  without the state check's tree walks; one that differs is still checked and refused."""
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16")
  batch = make_batches(1)[0]
  state, _ = train.step(init(train, "nnx", batchnorm=False), batch)
  checked, check = [], jaxamp.train.train_step.mismatch
  monkeypatch.setattr(jaxamp.train.train_step, "mismatch",
                      lambda s, e: checked.append(s) or check(s, e))
  ours = state._replace(params=jax.tree.map(lambda x: x * 2, state.params))
  state, _ = train.step(ours, batch)
  state, _ = train.step(state._replace(), batch)
  assert not checked and int(state.step) == 3
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.params)
  with pytest.raises(ValueError, match=r"params.*is bfloat16\[.*this step's is float32"):
    train.step(state._replace(params=half), batch)
  assert len(checked) == 1


def test_loss_fn_misuse_gets_a_clear_error_naming_the_fix():
  batch = make_batches(1)[0]
  with pytest.raises(TypeError, match=r"loss_fn must take \(model, batch\)"):
    jaxamp.make_train_step(lambda params: 0.0, optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"eval_fn must take \(model, batch\)"):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), eval_fn=lambda m, b, extra: 0.0)

  def step_with(fn, api="nnx", **kw):
    train = jaxamp.make_train_step(fn, optax.sgd(0.1), policy="mixed_bfloat16", **kw)
    return train.step(init(train, api, batchnorm=False), batch)

  def swapped(batch, model):
    return xent(model(batch["x"]), batch["y"])

  with pytest.raises(TypeError, match="indexed the model.*arguments swapped"):
    step_with(swapped)
  with pytest.raises(TypeError, match=r"(?s)not subscriptable.*calls loss_fn\(model, batch\)"):
    step_with(swapped, "linen")  # Linen's model is a function: the note explains
  with pytest.raises(TypeError, match=r"needs make_train_step\(..., has_aux=True\)"):
    step_with(lambda m, b: (loss_fn(m, b), {"acc": 1.0}))
  with pytest.raises(TypeError, match=r"has_aux=True, loss_fn must return \(loss, aux\)"):
    step_with(loss_fn, has_aux=True)
  with pytest.raises(TypeError, match="scalar float loss, got a dict"):
    step_with(lambda m, b: {"loss": loss_fn(m, b)})
  with pytest.raises(ValueError, match=r"scalar loss, got shape \(16,\).*mean"):
    step_with(lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
        m(b["x"]), b["y"]))


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
  train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_float16", donate=False)
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


@pytest.mark.parametrize("api,accum", [("nnx", 1), ("linen", 2)])
def test_full_garbage_collections_wait_while_a_step_is_traced_and_resume_after(api, accum):
  import gc
  import threading
  seen = []

  def loss(model, batch):
    seen.append(gc.get_threshold())
    if "fail" in batch:
      raise RuntimeError("the user's loss failed")
    return loss_fn(model, batch)

  found = gc.get_threshold()
  gc.set_threshold(found[0], found[1], 7)  # a user's own setting, put back after
  try:
    train = jaxamp.make_train_step(loss, optax.sgd(0.1), donate=False,
                                   grad_accum_steps=accum)
    state = init(train, api, batchnorm=False)
    batch, = make_batches(1)
    train.step(state, batch)
    assert seen[-1][:2] == found[:2] and seen[-1][2] >= 2**30  # deferred while tracing
    assert gc.get_threshold() == (found[0], found[1], 7)  # and put back
    with pytest.raises(RuntimeError, match="the user's loss failed"):
      train.trace(state, dict(batch, fail=np.zeros(len(batch["x"]))))
    assert gc.get_threshold() == (found[0], found[1], 7)  # put back on an error too
    # Threads tracing at once: the last one out puts the threshold back.
    errors = []

    def trace(n):
      try:
        train.trace(state, jax.tree.map(lambda x: np.concatenate([x] * n), batch))
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)

    threads = [threading.Thread(target=trace, args=(n,)) for n in (2, 4, 5)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert not errors and gc.get_threshold() == (found[0], found[1], 7)
  finally:
    gc.set_threshold(*found)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_step_fn_under_the_users_jit_and_scan_steps_as_train_step(api):
  """train.step_fn, the pure step, run inside the user's own jax.jit (and lax.scan over
  batches, an overflowing one included) gives the state and metrics train.step gives,
  bit for bit: the same skip, the same loss scale, the same BatchNorm statistics."""
  batches = make_batches(3)
  batches[1] = {"x": batches[1]["x"] * np.inf, "y": batches[1]["y"]}  # overflows
  eval_fn = (loss_fn if api == "nnx"
             else lambda model, batch: xent(model(batch["x"], train=False), batch["y"]))
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-2), policy="mixed_float16",
                                 donate=False, eval_fn=eval_fn)
  with pytest.raises(RuntimeError, match="init"):
    train.step_fn  # pylint: disable=pointless-statement
  state = init(train, api, dropout=0.1)
  expected, metrics = state, []
  for b in batches:
    expected, m = train.step(expected, b)
    metrics.append(m)
  assert [int(m["skipped_steps"]) for m in metrics] == [0, 1, 1]

  got = state
  jitted = jax.jit(train.step_fn)
  for b in batches:
    got, m = jitted(got, b)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
  # As docs/guides/train_step.md ("Your own jit or scan") runs it: donating the state.
  scanned, scan_metrics = jax.jit(lambda s, bs: jax.lax.scan(train.step_fn, s, bs),
                                  donate_argnums=0)(state, stacked)
  data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  for other in (got, scanned):
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(other)):
      np.testing.assert_array_equal(np.asarray(data(a)), np.asarray(data(b)))
  np.testing.assert_array_equal(scan_metrics["loss_scale"],
                                [float(m["loss_scale"]) for m in metrics])
  assert float(jax.jit(train.eval_step_fn)(expected, batches[0])) == float(
      train.eval_step(expected, batches[0]))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_model_kept_from_train_model_survives_the_donating_steps_after_it(api):
  """train.model(state) copies the arrays when the step donates: "the best so far" kept
  from it still runs after later steps consumed that state, and holds its values."""
  batches = make_batches(3)
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16")
  state = init(train, api, batchnorm=False)
  state, _ = train.step(state, batches[0])
  kept = train.model(state)
  shared = train.model(state, copy=False)
  kernel = np.asarray(jax.tree.leaves(state.params)[0])
  for b in batches[1:]:
    state, _ = train.step(state, b)
  if api == "nnx":
    kept(batches[0]["x"])  # runs: its arrays were not donated
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(nnx.state(kept, nnx.Param))[0]),
                                  kernel)
    assert any(x.is_deleted() for x in jax.tree.leaves(nnx.state(shared, nnx.Param)))
  else:
    module, variables = kept
    module.apply(variables, batches[0]["x"])
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(variables["params"])[0]), kernel)
    assert any(x.is_deleted() for x in jax.tree.leaves(shared[1]["params"]))


def _dots(text):
  """The element types of the StableHLO dot_generals' results in ``text``: 'f32'/'bf16'."""
  import re
  return re.findall(r"stablehlo\.dot_general.*->\s*tensor<[0-9x]*x?(f32|bf16|f16)>", text)


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_the_step_runs_under_the_rules_in_force_at_init_wherever_it_is_called(api):
  """policy_rules around make_train_step and init, the loop after the block (or in
  another thread, or eval after it): init stored the head float32, and the step must
  compute it in float32 too (it compiled with 0 float32 dots)."""
  import threading

  head = "l2" if api == "nnx" else "Dense_1"
  batch = make_batches(1)[0]
  with jaxamp.policy_rules({head: "float32"}):
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16",
                                   donate=False)
    state = init(train, api, batchnorm=False)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
  texts = {"step": train.lower(state, batch).as_text(),
           "eval": jax.jit(train.eval_step_fn).lower(state, batch).as_text()}
  thread = threading.Thread(target=lambda: texts.update(
      thread=jax.jit(train.step_fn).lower(state, batch).as_text()))
  thread.start()
  thread.join()
  for where, text in texts.items():
    dots = _dots(text)
    assert "f32" in dots and "bf16" in dots, (where, dots)


class Sowing(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    h = self.l1(x)
    self.sow(nnx.Intermediate, "features", h)
    return h


@pytest.mark.parametrize("accum", [1, 2])
def test_an_nnx_sow_without_pop_names_sow_and_the_fix(accum):
  """An NNX sow the loss does not pop gave internal cond / scan-carry / pytree-prefix
  errors naming neither sow, the model state, nor the fix."""
  batch = make_batches(1)[0]
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=accum)
  state = train.init(Sowing(nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"l1/features|features.*appeared.*nnx\.pop"):
    train.step(state, batch)

  def popping(model, batch):
    loss = loss_fn(model, batch)
    nnx.pop(model, nnx.Intermediate)
    return loss

  train = jaxamp.make_train_step(popping, optax.sgd(0.1), grad_accum_steps=accum)
  state, metrics = train.step(train.init(Sowing(nnx.Rngs(0))), batch)
  assert bool(metrics["grads_finite"])


def test_compiler_options_reach_the_steps_program():
  """make_train_step(..., compiler_options=) is jax.jit's: XLA reads them (an option it
  does not know is refused when the step compiles), for the step and the eval step."""
  batch = make_batches(1)[0]
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), donate=False,
                                 compiler_options={"xla_backend_optimization_level": 1})
  state = init(train, "nnx", batchnorm=False)
  state, metrics = train.step(state, batch)
  assert bool(metrics["grads_finite"])
  bad = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), donate=False,
                               compiler_options={"xla_no_such_option": True})
  state = init(bad, "nnx", batchnorm=False)
  for run in (bad.step, bad.eval_step):
    with pytest.raises(Exception, match="xla_no_such_option"):
      run(state, batch)


# --- a float64 policy trains in float64 throughout -------------------------------------------


def _f64_batches():
  rng = np.random.RandomState(0)
  return [{"x": rng.randn(8, 8), "y": rng.randn(8, 4)} for _ in range(3)]


def _f64_model(api):
  """``(model for train.init, its args, loss_fn, (params, value_and_grad of the loss))``:
  Linear -> LayerNorm -> ReLU -> Linear in float64, and the plain float64 gradient of
  its mean squared error."""
  mse = lambda out, y: jnp.mean((out - y) ** 2)
  f64 = dict(param_dtype=jnp.float64)
  if api == "nnx":
    class Net(nnx.Module):
      def __init__(self, rngs):
        self.l1, self.ln = nnx.Linear(8, 16, rngs=rngs, **f64), nnx.LayerNorm(16, rngs=rngs, **f64)
        self.l2 = nnx.Linear(16, 4, rngs=rngs, **f64)

      def __call__(self, x):
        return self.l2(jax.nn.relu(self.ln(self.l1(x))))

    graphdef, params = nnx.split(Net(nnx.Rngs(0)))
    return ((Net(nnx.Rngs(0)),), lambda m, b: mse(m(b["x"]), b["y"]),
            (params, jax.value_and_grad(
                lambda p, b: mse(nnx.merge(graphdef, p)(b["x"]), b["y"]))))
  if api == "linen":
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.LayerNorm(**f64)(nn.Dense(16, **f64)(x))
        return nn.Dense(4, **f64)(jax.nn.relu(h))

    x = jnp.zeros((2, 8), jnp.float64)
    variables = Net().init(jax.random.key(0), x)
    return ((Net(), variables, x), lambda m, b: mse(m(b["x"]), b["y"]),
            (variables["params"], jax.value_and_grad(
                lambda p, b: mse(Net().apply({"params": p}, b["x"]), b["y"]))))
  eqx = pytest.importorskip("equinox")
  k1, k2 = jax.random.split(jax.random.key(0))
  model = eqx.nn.Sequential([eqx.nn.Linear(8, 16, key=k1, dtype=jnp.float64),
                             eqx.nn.LayerNorm(16, dtype=jnp.float64),
                             eqx.nn.Lambda(jax.nn.relu),
                             eqx.nn.Linear(16, 4, key=k2, dtype=jnp.float64)])
  params, static = eqx.partition(model, eqx.is_inexact_array)
  loss = lambda m, b: mse(jax.vmap(m)(b["x"]), b["y"])
  return ((model,), loss, (params, jax.value_and_grad(
      lambda p, b: loss(eqx.combine(p, static), b))))


@pytest.mark.parametrize("api,accum", [("nnx", 1), ("nnx", 2), ("linen", 1), ("equinox", 1)])
def test_a_float64_policy_trains_as_plain_float64_adam(api, accum):
  """Every "in float32" default means at least float32: the LayerNorm, the outputs
  handed to the loss, the loss, the accumulation and the global norm stay float64, so
  three Adam steps are plain float64 Adam's, bit for bit (accumulated over two
  micro-batches: to float64 rounding, rtol 1e-12; float32 anywhere gave ~1e-6)."""
  with jax.enable_x64(True):
    args, loss, (params, value_and_grad) = _f64_model(api)
    tx = optax.adam(1e-2)

    @jax.jit
    def plain_step(params, opt_state, batch):
      loss, grads = value_and_grad(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    for batch in _f64_batches():
      params, opt_state, ref_loss = plain_step(params, opt_state, batch)

    train = jaxamp.make_train_step(loss, optax.adam(1e-2), policy="float64",
                                   grad_accum_steps=accum)
    state = train.init(*args)
    for batch in _f64_batches():
      state, metrics = train.step(state, batch)
    assert metrics["loss"].dtype == metrics["grad_norm"].dtype == jnp.float64
    got, want = leaves(state.params), leaves(params)
    assert [x.dtype for x in got] == [np.dtype(np.float64)] * len(want)
    if accum == 1:
      for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
      assert float(metrics["loss"]) == float(ref_loss)
    else:
      for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
