"""Tests for jaxamp.equinox and make_train_step on Equinox models and other pytrees."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

eqx = pytest.importorskip("equinox")

import jaxamp  # pylint: disable=g-import-not-at-top,wrong-import-position
import jaxamp.equinox as amp_eqx  # pylint: disable=g-import-not-at-top,wrong-import-position
from train_helpers import stepped  # pylint: disable=g-import-not-at-top,wrong-import-position

VOCAB, WIDTH, SEQ, LAYERS, STEPS = 16, 32, 8, 2, 10


class Block(eqx.Module):
  """Pre-norm transformer block of eqx.nn layers, on one sequence (seq, width)."""

  ln1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  ln2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.ln1 = eqx.nn.LayerNorm(WIDTH)
    self.attn = eqx.nn.MultiheadAttention(4, WIDTH, key=k1)
    self.ln2 = eqx.nn.LayerNorm(WIDTH)
    self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 4 * WIDTH, depth=1, activation=jax.nn.gelu, key=k2)

  def __call__(self, x):
    mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
    h = jax.vmap(self.ln1)(x)
    x = x + self.attn(h, h, h, mask=mask)
    return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class LM(eqx.Module):
  """A causal transformer LM: token ids (seq,) -> logits (seq, vocab)."""

  embed: eqx.nn.Embedding
  pos: jax.Array
  blocks: list
  ln: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, LAYERS + 3)
    self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
    self.pos = 0.02 * jax.random.normal(keys[1], (SEQ, WIDTH))
    self.blocks = [Block(k) for k in keys[3:]]
    self.ln = eqx.nn.LayerNorm(WIDTH)
    self.head = eqx.nn.Linear(WIDTH, VOCAB, key=keys[2])

  def __call__(self, ids):
    x = jax.vmap(self.embed)(ids) + self.pos[:ids.shape[0]]
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(jax.vmap(self.ln)(x))


def loss_fn(model, batch):
  # ``temp`` (ones) is where a test injects an inf.
  logits = jax.vmap(model)(batch["ids"][:, :-1]) * batch["temp"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


def make_batches(n, size=16, seed=0):
  """Sequences counting up mod VOCAB from a random start: learnable in a few steps."""
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(n):
    start = rng.randint(0, VOCAB, (size, 1))
    out.append({"ids": ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32),
                "temp": np.ones((size, 1, 1), np.float32)})
  return out


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(leaves(a), leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


_LM = []


def lm():
  """The test LM, made once (steps that take it do not donate)."""
  if not _LM:
    _LM.append(LM(jax.random.key(0)))
  return _LM[0]


def run(train, batches, model=None):
  return stepped(train, train.init(lm() if model is None else model), batches)


@pytest.fixture(scope="module")
def batches():
  return make_batches(STEPS)


@pytest.fixture(scope="module")
def runs(batches):
  """``{policy: (train, final state, history)}``: the LM trained STEPS steps."""
  out = {}
  for policy in ("float32", "mixed_bfloat16"):
    train = jaxamp.make_train_step(loss_fn, optax.adam(1e-2), policy=policy,
                                   memory=jaxamp.MemoryConfig(donate=False))
    out[policy] = (train, *run(train, batches))
  return out


# --- policies and the view ---------------------------------------------------------------


@pytest.mark.slow
def test_module_policies_put_norms_in_float32_and_the_rest_in_the_policy():
  rows = {path: (cls, p) for path, cls, p in
          amp_eqx.module_policies(lm(), "mixed_bfloat16")}
  assert rows[""][0] is LM and rows[""][1].name == "mixed_bfloat16"
  assert rows["blocks/0/attn/query_proj"][0] is eqx.nn.Linear
  assert rows["blocks/1/mlp/layers/0"][1].compute_dtype == jnp.bfloat16
  for norm in ("blocks/0/ln1", "blocks/1/ln2", "ln"):
    assert rows[norm][0] is eqx.nn.LayerNorm
    assert rows[norm][1].name == "params=float32,compute=float32,output=bfloat16"
  with jaxamp.policy_rules({"head": "float32", eqx.nn.MultiheadAttention: "float32"}):
    rows = {path: p.name for path, _, p in amp_eqx.module_policies(lm(), "mixed_bfloat16")}
  assert rows["head"] == rows["blocks/0/attn"] == rows["blocks/0/attn/key_proj"] == "float32"
  assert rows["blocks/0/mlp"] == "mixed_bfloat16"


def test_a_view_runs_each_module_under_its_policy_and_keeps_the_arrays():
  model = lm()
  amp = amp_eqx.with_policy(model, "mixed_bfloat16")
  assert isinstance(amp, LM) and isinstance(amp.blocks[0].attn, eqx.nn.MultiheadAttention)
  assert amp.head.weight is model.head.weight  # the same arrays, stored dtypes kept
  ids = jnp.arange(SEQ) % VOCAB
  out = lambda m: jax.eval_shape(m, ids).dtype
  assert out(amp) == jnp.bfloat16
  assert out(amp_eqx.with_policy(model, "mixed_bfloat16", float32_outputs=True)) == jnp.float32
  # The norms compute in float32: their statistics are float32 in the jaxpr.
  jaxpr = str(jax.make_jaxpr(amp.blocks[0])(jnp.ones((SEQ, WIDTH), jnp.bfloat16)))
  assert "rsqrt" in jaxpr and "bf16" in jaxpr
  grads = eqx.filter_eval_shape(
      eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(ids[None]).astype(jnp.float32))), amp)
  assert {x.dtype for x in jax.tree.leaves(grads)} == {np.dtype("float32")}
  plain = amp_eqx.unwrap(amp)
  assert type(plain) is LM and type(plain.head) is eqx.nn.Linear
  assert jax.tree.structure(plain) == jax.tree.structure(model)
  assert not amp_eqx.is_policy_view(plain) and amp_eqx.view_policy(amp).name == "mixed_bfloat16"


class ScanLM(eqx.Module):
  """Blocks stacked with filter_vmap and run in a lax.scan; the head tied to the embedding."""

  embed: eqx.nn.Embedding
  blocks: Block
  drop: eqx.nn.Dropout

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k1)
    self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, LAYERS))
    self.drop = eqx.nn.Dropout(0.1)

  def __call__(self, ids, key):
    x = self.drop(jax.vmap(self.embed)(ids), key=key)
    dynamic, static = eqx.partition(self.blocks, eqx.is_array)
    x, _ = jax.lax.scan(lambda x, d: (eqx.combine(d, static)(x), None), x, dynamic)
    return x @ self.embed.weight.T


@pytest.mark.slow
def test_scanned_layers_a_tied_head_and_dropout_keys_run_in_half_precision(fresh_warnings):
  amp = amp_eqx.with_policy(ScanLM(jax.random.key(0)), "mixed_bfloat16")
  ids = jnp.zeros((4, SEQ), jnp.int32)
  keys = jax.random.split(jax.random.key(1), 4)  # one per example, as a batch holds them

  def loss(model, ids, keys):
    return jnp.mean(jax.vmap(model)(ids, keys).astype(jnp.float32) ** 2)

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no module left in float32
    report = jaxamp.precision_report(loss, amp, ids, keys, backward=True)
  assert report.half_share == 1.0


def test_recomputed_norms_keep_half_precision_inputs_for_the_backward_pass():
  model = eqx.nn.Sequential([eqx.nn.Linear(64, 64, key=jax.random.key(0)),
                             eqx.nn.LayerNorm(64), eqx.nn.Linear(64, 64, key=jax.random.key(1))])
  loss = lambda m, x: jnp.sum(jax.vmap(m)(x).astype(jnp.float32))
  saved = [jaxamp.precision_report(
      loss, amp_eqx.with_policy(model, "mixed_bfloat16", recompute_norms=rc),
      jnp.ones((32, 64)), backward=True).residual_bytes for rc in (False, True)]
  assert saved[1] < 0.6 * saved[0]


def test_a_module_that_casts_to_float32_itself_is_named_in_a_warning(fresh_warnings):
  class Float32Head(eqx.Module):
    w: jax.Array

    def __call__(self, x):
      return x.astype(jnp.float32) @ self.w.astype(jnp.float32)

  class Net(eqx.Module):
    body: eqx.nn.Linear
    head: Float32Head

    def __call__(self, x):
      return self.head(self.body(x))

  net = Net(eqx.nn.Linear(4, 4, key=jax.random.key(0)), Float32Head(jnp.ones((4, 2))))
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(jax.vmap(m)(b) ** 2), optax.sgd(0.1),
                                 policy="mixed_bfloat16", memory=jaxamp.MemoryConfig(donate=False))
  state = train.init(net)
  with pytest.warns(RuntimeWarning, match=r"33\.3% of the matmul FLOPs of Net.*'head'"):
    train.step(state, jnp.ones((8, 4)))
  # A ruled float32 module is what was asked for: no warning.
  fresh_warnings.reset()
  with jaxamp.policy_rules({"head": "float32"}), warnings.catch_warnings():
    warnings.simplefilter("error")
    amp_eqx.with_policy(net, "mixed_bfloat16")(jnp.ones(4))


# --- the train step ----------------------------------------------------------------------


@pytest.mark.slow
def test_the_lm_trains_in_bfloat16_to_within_2_percent_of_float32(runs):
  losses = {p: float(history[-1][2]["loss"]) for p, (_, _, history) in runs.items()}
  first = float(runs["float32"][2][0][2]["loss"])
  assert losses["float32"] < 0.5 * first  # it learnt
  assert abs(losses["mixed_bfloat16"] - losses["float32"]) <= 0.02 * losses["float32"]
  train, state, _ = runs["mixed_bfloat16"]
  assert type(train.model(state)) is LM  # the user's classes, not the view's
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
  assert float(train.eval_step(state, make_batches(1, seed=1)[0])) < 0.5 * first


@pytest.mark.slow
def test_the_step_runs_over_99_percent_of_matmul_flops_in_half_precision(runs, batches):
  train, state, _ = runs["mixed_bfloat16"]
  step = jaxamp.precision_report(train.step_fn, state, batches[0])  # forward and backward
  assert step.half_share >= 0.99 and step.total_flops > 0
  # precision_report takes an Equinox model (its non-array leaves closed over).
  view = amp_eqx.with_policy(lm(), "mixed_bfloat16")
  report = jaxamp.precision_report(loss_fn, view, batches[0], backward=True)
  assert report.half_share >= 0.99 and report.total_flops == step.total_flops


@pytest.mark.slow
def test_an_injected_inf_is_skipped_exactly_and_resumes_bit_identically(batches, tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = optax.chain(jaxamp.dynamic_loss_scale(2.0**10, growth_interval=1000), optax.adam(1e-2))
  train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_float16",
                                 memory=jaxamp.MemoryConfig(donate=False))
  poisoned = dict(batches[2], temp=batches[2]["temp"].copy())
  poisoned["temp"][0, 0, 0] = np.inf
  _, hist_a = run(train, batches[:2] + [poisoned] + batches[3:5])
  state_b, hist_b = run(train, batches[:2] + batches[3:5])  # the same, without it

  before, after, metrics = hist_a[2]
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == 2.0**9
  assert_trees_equal(after.params, before.params)
  adam = lambda s: optax.tree_utils.tree_get(s.opt_state, "ScaleByAdamState")
  assert_trees_equal(adam(after), adam(before))
  assert int(hist_a[-1][2]["skipped_steps"]) == 1 and bool(hist_a[-1][2]["grads_finite"])

  # Orbax: the state saved after two steps, restored, runs the last two bit-identically.
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", hist_b[1][1])
  checkpointer.wait_until_finished()
  state = checkpointer.restore(tmp_path / "ckpt", jaxamp.abstract_state(hist_b[1][1]))
  for b in batches[3:5]:
    state, _ = train.step(state, b)
  assert_trees_equal(state.params, state_b.params)
  assert_trees_equal(state.opt_state, state_b.opt_state)


@pytest.mark.slow
def test_accumulation_and_a_mesh_with_fsdp_match_the_plain_step(runs, batches):
  # One device here; the step still runs the shard_map, the FSDP gather and the
  # reduce-scatter on the Equinox params pytree.
  mesh = jax.make_mesh((1,), ("data",))
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-2), policy="float32",
                                 grad_accum_steps=2,
                                 sharding=jaxamp.ShardingConfig(
                                     mesh=mesh, param_sharding=jaxamp.fsdp("data", min_size=64)),
                                 memory=jaxamp.MemoryConfig(donate=False))
  state, history = run(train, batches[:3])
  plain = runs["float32"][2][2][1]  # the unaccumulated step's state after 3 steps
  for x, y in zip(leaves(state.params), leaves(plain.params)):
    np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(float(history[0][2]["loss"]),
                             float(runs["float32"][2][0][2]["loss"]), rtol=1e-5)


def test_a_stateful_equinox_model_is_refused_with_the_reason():
  class WithBatchNorm(eqx.Module):
    linear: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

  model, _ = eqx.nn.make_with_state(WithBatchNorm)(
      eqx.nn.Linear(2, 2, key=jax.random.key(0)), eqx.nn.BatchNorm(2, "batch", mode="batch"))
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m.linear(b)), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"eqx.nn.State \(at bn/.*stateless"):
    train.init(model)
  with pytest.raises(ValueError, match="no variables or example inputs"):
    train.init(lm(), None, jnp.zeros(SEQ, jnp.int32))
  view = amp_eqx.with_policy(lm(), "mixed_float16")
  with pytest.raises(ValueError, match="wrapped with policy 'mixed_float16'"):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float32").init(view)


def test_a_plain_pytree_trains_and_its_arrays_reach_loss_fn_in_the_compute_dtype(fresh_warnings):
  params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2), "steps": jnp.zeros((), jnp.int32)}
  seen = []

  def loss(p, batch):
    seen.append((p["w"].dtype, p["steps"].dtype))
    return jnp.mean((batch.astype(p["w"].dtype) @ p["w"] + p["b"]).astype(jnp.float32) ** 2)

  train = jaxamp.make_train_step(loss, optax.sgd(0.01), policy="mixed_bfloat16")
  with pytest.warns(RuntimeWarning, match="dict holds no eqx.Module"):
    state = train.init(params)
  state, metrics = train.step(state, jnp.ones((8, 4)))
  assert seen[-1] == (jnp.bfloat16, jnp.int32)
  assert state.params["w"].dtype == jnp.float32 and state.params["steps"] is None
  assert float(train.model(state)["w"][0, 0]) < 1.0 and "steps" in train.model(state)


# --- inspection ----------------------------------------------------------------------------


def test_summary_lists_every_module_and_the_dtypes_its_matmuls_ran_in():
  s = jaxamp.summary(lm(), jnp.zeros(SEQ, jnp.int32), policy="mixed_bfloat16")
  rows = {r.path: r for r in s.rows}
  assert rows[""].cls == "LM" and rows[""].param_count == SEQ * WIDTH  # pos
  assert rows["embed"].param_count == VOCAB * WIDTH
  assert rows["blocks/0/attn/query_proj"].matmul_dtypes == "bfloat16"
  assert rows["blocks/0/ln1"].compute_dtype == "float32"
  assert rows["head"].matmul_flops == 2 * SEQ * WIDTH * VOCAB
  assert s.checked and s.mismatched == ()
  assert s.total_params == sum(x.size for x in jax.tree.leaves(
      eqx.filter(lm(), eqx.is_inexact_array)))
  unchecked = jaxamp.summary(lm(), policy="mixed_bfloat16")
  assert not unchecked.checked and len(unchecked.rows) == len(s.rows)


# --- FP8 -----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*runs FP8 matmuls upcast:RuntimeWarning")
@pytest.mark.parametrize("shape", [(4, 3), ("scalar", 3), (4, "scalar")])
def test_an_fp8_linear_runs_the_scaled_dot(shape):
  n_in, n_out = shape
  layer = eqx.nn.Linear(n_in, n_out, key=jax.random.key(0))
  x = jnp.linspace(-2.0, 2.0, 4) if n_in != "scalar" else jnp.asarray(0.7)
  out = amp_eqx.with_policy(layer, "mixed_fp8")(x)
  plain = amp_eqx.with_policy(layer, "mixed_bfloat16")(x)
  # Outside a train step: current scaling, input and kernel cast to bfloat16 first.
  x2 = jnp.reshape(x, (-1,)).astype(jnp.bfloat16)
  w = layer.weight.astype(jnp.bfloat16)
  expected = jaxamp.fp8.scaled_dot_general(x2, w, (((0,), (1,)), ((), ())))
  expected = expected + layer.bias.astype(jnp.bfloat16)
  expected = expected[0] if n_out == "scalar" else expected
  assert out.shape == plain.shape and out.dtype == plain.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
  view = amp_eqx.with_policy(layer, "mixed_fp8")
  lowered = jax.jit(lambda m, x: m(x)).lower(view, x).as_text()
  assert "f8E4M3FN" in lowered


def test_fp8_state_goes_to_every_linear_but_stacked_ones():
  policy = jaxamp.get_policy("mixed_fp8")
  rows = amp_eqx.module_policies(lm(), policy)
  linears = {path for path, cls, _ in rows if issubclass(cls, eqx.nn.Linear)}
  assert "head" in linears and "blocks/0/attn/query_proj" in linears
  assert {path for path, _, _ in amp_eqx.fp8_rows(lm(), rows)} >= linears
  assert set(jaxamp.fp8.init_state(amp_eqx.fp8_rows(lm(), rows))) == linears
  assert jaxamp.summary(lm(), policy="mixed_fp8").fp8_modules == tuple(
      r.path for r in jaxamp.summary(lm(), policy="mixed_fp8").rows if r.path in linears)
  scan = ScanLM(jax.random.key(0))
  scan_rows = amp_eqx.module_policies(scan, policy)
  stacked = {path for path, cls, _ in scan_rows if issubclass(cls, eqx.nn.Linear)}
  assert stacked and not jaxamp.fp8.init_state(amp_eqx.fp8_rows(scan, scan_rows))
