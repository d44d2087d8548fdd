"""Tests for jaxamp.train.gradients: the loss's gradients under the policies, micro-batch accumulation, RNG streams, what the batch carries."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp

from train_helpers import NNXNet, assert_trees_equal, counting_loss, init, leaves, loss_fn, make_batches, xent


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
                                 policy="float32", grad_accum_steps=2,
                                 memory=jaxamp.MemoryConfig(donate=False),
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


@pytest.mark.parametrize("dropout", [0.0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_linen_model_that_draws_no_key_gets_no_key_work(dropout):
  # The step's dropout key is folded from the base key, never split off and carried:
  # with no Dropout drawing it, XLA keeps no threefry hash (its xors) in the program.
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="mixed_bfloat16")
  state = init(train, "linen", dropout=dropout)
  compiled = train.trace(state, make_batches(1)[0]).lower().compile().as_text()
  assert (" xor(" in compiled) == bool(dropout)


@pytest.mark.slow
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
                                 policy="float32", grad_accum_steps=4,
                                 memory=jaxamp.MemoryConfig(donate=False))
  state = init(train, "nnx", batchnorm=False)
  batch = make_batches(1, size=32)[0]
  batch["x"][30, 3] = np.nan  # only the last micro-batch sees it
  new, metrics = train.step(state, batch)
  assert not bool(metrics["grads_finite"])
  assert_trees_equal(new.params, state.params)
  assert float(metrics["loss_scale"]) == 2.0
  assert int(metrics["skipped_steps"]) == 1


@pytest.mark.slow
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


@pytest.mark.slow
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
    dict(policy="mixed_bfloat16"), dict(policy="mixed_bfloat16", memory=jaxamp.MemoryConfig(half_residuals=False)),
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_grad_accumulation_keeps_half_gradient_dtypes():
  # bfloat16 params without master weights: Adam's moments are bfloat16 and must stay so.
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="bfloat16",
                                 memory=jaxamp.MemoryConfig(master_weights=False),
                                 grad_accum_steps=2)
  state = init(train, "nnx", batchnorm=False)
  before = [x.dtype for x in jax.tree.leaves(state.opt_state)]
  for b in make_batches(2):
    state, _ = train.step(state, b)
  assert [x.dtype for x in jax.tree.leaves(state.opt_state)] == before
  assert jnp.dtype(jnp.bfloat16) in before
  assert train.trace_count == 1


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
