"""FP8 policies: recipes against a NumPy reference, the state in the train step, lowering.

The reference recipe below is written from Transformer Engine's documented
``DelayedScaling`` rule, independently of :mod:`jaxamp.fp8`: every step records the
amax of the input, the kernel and the output gradient (newest first), and the next
step's scale is ``FP8_MAX / max(history) / 2**margin``, the old scale kept where that
amax is 0 or not finite. Quantization is emulated with ml_dtypes' float8 casts.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
import flax.linen as nn

import jaxamp
import nnx_models
from train_helpers import orbax_round_trip

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MAXES = np.array([448.0, 448.0, 57344.0], np.float32)


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    # FP8 on CPU runs upcast: known, warned once per process (tested below).
    warnings.filterwarnings("ignore", message=".*FP8.*", category=RuntimeWarning)
    warnings.filterwarnings("ignore", message=".*still run in float32.*")
    yield


def reference_recipe(amaxes, length, margin=0, algo="max"):
  """(history, scale) after each step, from the per-step amaxes ``[steps, 3]``."""
  history = np.zeros((3, length), np.float32)
  scale = np.ones(3, np.float32)
  out = []
  for a in amaxes:
    history = np.roll(history, 1, axis=1)
    history[:, 0] = a
    amax = history.max(axis=1) if algo == "max" else history[:, 0]
    with np.errstate(divide="ignore"):
      fresh = (MAXES / amax / np.float32(2.0 ** margin)).astype(np.float32)
    scale = np.where((amax > 0) & np.isfinite(amax), fresh, scale).astype(np.float32)
    out.append((history.copy(), scale.copy()))
  return out


def emulated_dot(x, k, sx, sk):
  """The FP8 forward product in NumPy: E4M3 operands, float32 sums, descaled."""
  q = lambda a, s: np.clip(a * s, -448, 448).astype(E4M3).astype(np.float32)
  return (q(x, sx) @ q(k, sk)).astype(np.float32) / (np.float32(sx) * np.float32(sk))


def _linear_step(recipe, **kwargs):
  model = nnx.Linear(8, 3, use_bias=False, rngs=nnx.Rngs(0))
  c = jnp.asarray(np.random.RandomState(1).randn(4, 3), jnp.float32)
  # loss = sum(y * c): the output gradient is exactly c.
  train = jaxamp.make_train_step(
      lambda m, b: jnp.sum(m(b["x"]) * c), optax.sgd(0.01),
      policy=jaxamp.Policy(jnp.float32, jnp.float32, fp8=recipe),
      eval_fn=lambda m, b: m(b["x"]), **kwargs)
  return train, train.init(model), np.asarray(c)


def _batches(steps):
  rng = np.random.RandomState(0)
  return [{"x": jnp.asarray(rng.randn(4, 8) * (1 + 3 * (t % 2)), jnp.float32)}
          for t in range(steps)]


# --- policies and bad input -------------------------------------------------------------


def test_fp8_policy_names():
  p = jaxamp.get_policy("mixed_fp8")
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32, jnp.bfloat16,
                                                              jnp.bfloat16)
  assert p.fp8 == jaxamp.DelayedScaling(1024, "max", 0) and p.name == "mixed_fp8"
  assert jaxamp.get_policy("mixed_fp8_current").fp8 == jaxamp.CurrentScaling()
  q = jaxamp.get_policy("p=f32,c=f16,fp8=delayed")
  assert q.name == "params=float32,compute=float16,output=float16,fp8=delayed"
  assert jaxamp.get_policy(q.name) == q and q != jaxamp.get_policy("mixed_float16")
  # float32 compute (the norm rule) means no FP8 either; a copy can drop it too
  assert jaxamp.float32_compute(p).fp8 is None
  assert p.with_compute_dtype(jnp.float32).fp8 == p.fp8
  assert p.with_fp8(None) == jaxamp.get_policy("mixed_bfloat16")


@pytest.mark.parametrize("spec", [jnp.float8_e4m3fn, "params=float32,compute=float8_e5m2"])
def test_fp8_param_dtype_points_at_the_fp8_mode(spec):
  with pytest.raises(ValueError, match="mixed_fp8") as e:
    jaxamp.get_policy(spec) if isinstance(spec, str) else jaxamp.Policy(jnp.float32, spec)
  assert "float8" in str(e.value) or "Unknown dtype" in str(e.value)


def test_bad_fp8_recipes():
  with pytest.raises(ValueError, match="DelayedScaling.*CurrentScaling.*'delayed'"):
    jaxamp.Policy(jnp.float32, jnp.bfloat16, fp8="hybrid")
  with pytest.raises(ValueError, match="fp8= takes 'delayed', 'current'"):
    jaxamp.get_policy("p=f32,c=bf16,fp8=hybrid")
  with pytest.raises(ValueError, match="amax_compute_algo.*'max', 'most_recent'"):
    jaxamp.DelayedScaling(amax_compute_algo="mean")
  with pytest.raises(ValueError, match="amax_history_len"):
    jaxamp.DelayedScaling(amax_history_len=0)


def test_fp8_on_cpu_warns_once(fresh_warnings):
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    jaxamp.make_train_step(lambda m, b: 0.0, optax.sgd(0.1), policy="mixed_fp8")
    jaxamp.make_train_step(lambda m, b: 0.0, optax.sgd(0.1), policy="mixed_fp8_current")
  fp8 = [w for w in seen if "FP8" in str(w.message)]
  assert len(fp8) == 1 and "compute capability >= 8.9" in str(fp8[0].message)


# --- numerics against the reference --------------------------------------------------------


@pytest.mark.slow
def test_delayed_scaling_matches_reference_every_step():
  """Margin 1, a history of 3 over 5 steps (entries fall out): the amax history and the
  scales after every step equal the reference's, and every forward product equals the
  FP8 emulation under the scales the state held before the step."""
  recipe = jaxamp.DelayedScaling(amax_history_len=3, margin=1)
  train, state, c = _linear_step(recipe)
  amaxes, seen, last = [], [], None
  for b in _batches(5):
    kernel = np.asarray(state.params["kernel"][...])
    x = np.asarray(b["x"])
    scale = np.asarray(state.fp8[""].scale)
    out = np.asarray(train.eval_step(state, b))  # the forward pass under this step's scales
    np.testing.assert_allclose(out, emulated_dot(x, kernel, scale[0], scale[1]), rtol=1e-6)
    last = out, x, kernel
    amaxes.append([np.abs(x).max(), np.abs(kernel).max(), np.abs(c).max()])
    state, metrics = train.step(state, b)
    assert bool(metrics["grads_finite"])
    seen.append((np.asarray(state.fp8[""].amax_history), np.asarray(state.fp8[""].scale)))
  ref = reference_recipe(np.asarray(amaxes, np.float32), 3, margin=1)
  for (h, s), (rh, rs) in zip(seen, ref):
    np.testing.assert_array_equal(h, rh)
    np.testing.assert_array_equal(s, rs)
  # The delayed scales are not the current ones: the emulation tells them apart.
  out, x, kernel = last
  current = MAXES[0] / np.abs(x).max(), MAXES[0] / np.abs(kernel).max()
  assert not np.allclose(out, emulated_dot(x, kernel, *current), rtol=1e-6)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_scales_matches_reference(algo):
  amaxes = np.float32([[2.0, 0.5, 0.0], [8.0, 0.25, 3.0], [1.0, np.inf, 1.0], [0.5, 4.0, 2.0]])
  recipe = jaxamp.DelayedScaling(amax_history_len=2, amax_compute_algo=algo, margin=2)
  meta = jaxamp.fp8.init_meta(recipe)
  for a, (rh, rs) in zip(amaxes, reference_recipe(amaxes, 2, 2, algo)):
    history = jnp.roll(meta.amax_history, 1, axis=1).at[:, 0].set(a)
    meta = jaxamp.fp8.update_scales(jaxamp.Fp8Meta(history, meta.scale), recipe)
    np.testing.assert_array_equal(np.asarray(meta.amax_history), rh)
    np.testing.assert_array_equal(np.asarray(meta.scale), rs)


def test_current_scaling_uses_this_steps_amax():
  train, state, c = _linear_step(jaxamp.CurrentScaling())
  b = _batches(2)[1]
  x, kernel = np.asarray(b["x"]), np.asarray(state.params["kernel"][...])
  out = np.asarray(train.eval_step(state, b))
  np.testing.assert_allclose(
      out, emulated_dot(x, kernel, MAXES[0] / np.abs(x).max(), MAXES[0] / np.abs(kernel).max()),
      rtol=1e-6)
  state, _ = train.step(state, b)
  np.testing.assert_array_equal(np.asarray(state.fp8[""].amax_history)[:, 0],
                                np.float32([np.abs(x).max(), np.abs(kernel).max(),
                                            np.abs(c).max()]))


# --- the state in the train step -----------------------------------------------------------


def test_overflow_step_keeps_fp8_state_bit_identical():
  train, state, _ = _linear_step(jaxamp.DelayedScaling(amax_history_len=4))
  for b in _batches(2):
    state, _ = train.step(state, b)
  before = jax.tree.map(np.asarray, (state.fp8, state.params))
  # NaN, not inf: quantization clips an inf input to 448 (and records amax inf)
  bad = {"x": _batches(1)[0]["x"].at[0, 0].set(jnp.nan)}
  state, metrics = train.step(state, bad)
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  after = jax.tree.map(np.asarray, (state.fp8, state.params))
  jax.tree.map(np.testing.assert_array_equal, after, before)
  # and the next finite step moves it again
  state, _ = train.step(state, _batches(1)[0])
  assert not np.array_equal(np.asarray(state.fp8[""].amax_history), before[0][""].amax_history)


@pytest.mark.slow
def test_float16_compute_overflowing_gradient_skips_as_mixed_float16():
  """FP8 with float16 compute: a loss-scaled output gradient past float16's range (inf)
  must not come out of the E5M2 cast clipped to 57344 and finite. The steps skip and the
  loss scale backs off exactly as under 'mixed_float16'; a skipped step leaves the FP8
  state as it was, and no history ever holds inf."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(4, 8) * 0.1, jnp.float32)  # kernel gradients stay in range
  c = rng.randn(4, 3).astype(np.float32)
  c = jnp.asarray(c / np.abs(c).max() * 8)  # output gradient 8 * scale: inf above 4096
  runs = {}
  for policy in ("mixed_float16", "p=f32,c=f16,fp8=delayed", "p=f32,c=f16,fp8=current"):
    train = jaxamp.make_train_step(lambda m, b: jnp.sum(m(b) * c), optax.sgd(1e-3),
                                   policy=policy)
    state = train.init(nnx.Linear(8, 3, use_bias=False, rngs=nnx.Rngs(0)))
    kernel0 = np.asarray(state.params["kernel"][...])
    fp8_0 = jax.tree.map(np.asarray, state.fp8)  # copies: the step donates the state
    seen = []
    for _ in range(4):
      state, metrics = train.step(state, x)
      seen.append((bool(metrics["grads_finite"]), float(metrics["loss_scale"])))
      if not seen[-1][0] and fp8_0 is not None:  # skipped: the state as it was
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.fp8),
                     fp8_0)
    runs[policy] = seen, np.asarray(state.params["kernel"][...]) - kernel0
    if state.fp8 is not None:
      history = np.asarray(state.fp8[""].amax_history)
      assert np.isfinite(history).all() and history[2, 0] == 8 * 4096, history
  expected = [(False, 16384.0), (False, 8192.0), (False, 4096.0), (True, 4096.0)]
  for policy, (seen, update) in runs.items():
    assert seen == expected, (policy, seen)
    # the one applied update is the true one, up to FP8 rounding (not ~0.43x of it)
    ref = runs["mixed_float16"][1]
    assert np.linalg.norm(update - ref) < 0.1 * np.linalg.norm(ref), policy


@pytest.mark.slow
def test_nonfinite_amax_is_recorded_as_what_the_dot_used():
  """An input holding inf is clipped to 448 by the E4M3 cast (as in Transformer Engine);
  its history records the largest value the dot used (448 / scale), not inf, which
  would freeze that scale for the history's length."""
  meta = jaxamp.fp8.Fp8Meta(jnp.zeros((3, 2)), jnp.float32([2.0, 4.0, 8.0]))
  x = jnp.ones((2, 4)).at[0, 0].set(jnp.inf)
  w = jnp.full((4, 3), 0.5)

  def f(x, w, history):
    m = jaxamp.fp8.Fp8Meta(history, meta.scale)
    return jnp.sum(jaxamp.fp8.scaled_dot_general(
        x, w, (((1,), (0,)), ((), ())), meta=m, recipe=jaxamp.DelayedScaling()))

  history = jax.grad(f, argnums=2)(x, w, meta.amax_history)
  np.testing.assert_array_equal(np.asarray(history[:, 0]), [224.0, 0.5, 1.0])


def test_fp8_state_is_not_in_the_optimizer_and_round_trips_orbax(tmp_path):
  train, state, _ = _linear_step(jaxamp.DelayedScaling(amax_history_len=4), )
  state, _ = train.step(state, _batches(1)[0])
  assert set(state.fp8) == {""}
  shapes = {x.shape for x in jax.tree.leaves(state.opt_state)}
  assert (3, 4) not in shapes and (3,) not in shapes
  restored = orbax_round_trip(state, tmp_path / "s")
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.fp8),
               jax.tree.map(np.asarray, state.fp8))
  assert isinstance(restored.fp8[""], jaxamp.Fp8Meta) or restored.fp8[""] is not None


def test_grad_accumulation_records_each_micro_batch():
  train, state, _ = _linear_step(jaxamp.DelayedScaling(amax_history_len=4), grad_accum_steps=2)
  b = {"x": jnp.concatenate([b["x"] for b in _batches(2)])}
  state, _ = train.step(state, b)
  history = np.asarray(state.fp8[""].amax_history)
  halves = np.asarray(b["x"]).reshape(2, 4, 8)
  np.testing.assert_array_equal(history[0, :2], [np.abs(halves[1]).max(),
                                                 np.abs(halves[0]).max()])


def _mlp():
  return nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu,
                        nnx.Linear(16, 4, rngs=nnx.Rngs(1)))


def test_rule_keeps_a_module_out_of_fp8_and_lowering_carries_fp8():
  with jaxamp.policy_rules({"layers/2": "mixed_bfloat16"}):
    train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.adam(1e-3),
                                   policy="mixed_fp8")
    state = train.init(_mlp())
    assert set(state.fp8) == {"layers/0"}
    text = train.lower(state, jnp.ones((4, 8)), platforms=("cuda",)).as_text()
  dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
  fp8 = [l for l in dots if "f8E4M3FN" in l]
  # layers/0: forward E4M3 x E4M3, kernel gradient E5M2 x E4M3 (its input is the batch:
  # no input gradient)
  assert len(fp8) == 2 and sum("f8E5M2" in l for l in fp8) == 1
  # layers/2 (the rule): bfloat16 forward, input and kernel gradients
  bf16 = [l for l in dots if "f8E" not in l]
  assert len(bf16) == 3 and all(l.count("xbf16>") >= 2 for l in bf16)
  s = jaxamp.summary(_mlp(), jnp.ones((4, 8)), policy="mixed_fp8")
  assert s.fp8_modules == ("layers/0", "layers/2") and not s.mismatched
  assert "fp8/bfloat16" in s.table()


def test_precision_report_counts_fp8_flops():
  amp = jaxamp.nnx.with_policy(_mlp(), "mixed_fp8")
  r = jaxamp.precision_report(lambda x: amp(x).astype(jnp.float32).sum(), jnp.ones((4, 8)))
  assert r.fp8_flops == r.total_flops == 2 * 4 * 8 * 16 + 2 * 4 * 16 * 4
  assert r.fp8_share == 1.0 and r.half_flops == 0 and "FP8 share: 100.0%" in str(r)
  assert {(op.lhs_dtype, op.rhs_dtype) for op in r.ops} == {("float8_e4m3fn", "float8_e4m3fn")}


def test_module_run_twice_is_refused():
  class Twice(nnx.Module):
    def __init__(self):
      self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.lin(self.lin(x))

  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy="mixed_fp8")
  state = train.init(Twice())
  with pytest.raises(ValueError, match="'lin' ran twice.*set_policy"):
    train.step(state, jnp.ones((2, 4)))


@pytest.mark.slow
def test_linen_dense_state_and_lowering():
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4, name="head")(nn.LayerNorm()(nn.relu(nn.Dense(16)(x))))

  x = jnp.ones((4, 8))
  variables = M().init(jax.random.key(0), x)
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy=jaxamp.get_policy("mixed_fp8").with_fp8(
                                     jaxamp.DelayedScaling(amax_history_len=8)))
  with pytest.raises(ValueError, match="example inputs"):
    train.init(M(), variables)
  # FP8 asked for by a rule only: the same (without the inputs it would get no state).
  with jaxamp.policy_rules({"head": "mixed_fp8"}):
    ruled = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                   policy="mixed_bfloat16")
    with pytest.raises(ValueError, match="example inputs"):
      ruled.init(M(), variables)
  state = train.init(M(), variables, x)
  assert set(state.fp8) == {"Dense_0", "head"}
  state, _ = train.step(state, x)
  history = np.asarray(state.fp8["Dense_0"].amax_history)
  assert history[0, 0] == 1.0 and history[1, 0] > 0 and history[2, 0] > 0
  assert not history[:, 1:].any()
  text = train.lower(state, x, platforms=("cuda",)).as_text()
  assert "f8E4M3FN" in text and "f8E5M2" in text


@pytest.mark.slow
def test_small_transformer_trains_close_to_bfloat16():
  """A 1-layer transformer LM (attention projections and MLP in FP8) on a fixed batch:
  after 15 Adam steps its loss is within 3% of the bfloat16 run's."""
  tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)
  batch = (tokens, jnp.roll(tokens, -1, axis=1))

  def loss_fn(model, batch):
    logp = jax.nn.log_softmax(model(batch[0]))
    return -jnp.mean(jnp.take_along_axis(logp, batch[1][..., None], -1))

  losses = {}
  for policy in ("mixed_bfloat16", jaxamp.get_policy("mixed_fp8").with_fp8(
      jaxamp.DelayedScaling(amax_history_len=16))):
    train = jaxamp.make_train_step(loss_fn, optax.adam(3e-3), policy=policy)
    state = train.init(nnx_models.TransformerLM(layers=1, rngs=nnx.Rngs(0)))
    first = None
    for _ in range(15):
      state, metrics = train.step(state, batch)
      first = float(metrics["loss"]) if first is None else first
    losses[train.policy.name] = (first, float(metrics["loss"]))
    if train.policy.fp8 is not None:
      assert set(state.fp8) >= {"blocks/0/attn/query", "blocks/0/mlp/up", "head"}
  (b0, b1), (f0, f1) = losses.values()
  assert b1 < 0.8 * b0 and f1 < 0.8 * f0  # both learn
  assert abs(f1 - b1) / b1 < 0.03, losses


def test_unsupported_combinations_are_refused():
  with pytest.raises(ValueError, match="autocast does not run FP8"):
    jaxamp.autocast(lambda x: x @ x, "mixed_fp8")


# --- with a mesh ----------------------------------------------------------------------------

_MESH_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import re
import warnings
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import jaxamp

assert jax.device_count() == 4
rng = np.random.RandomState(0)
# The largest input row is the last one: on the last device, not on device 0.
x = rng.randn(8, 8).astype(np.float32) * np.linspace(1, 4, 8, dtype=np.float32)[:, None]
c = rng.randn(8, 3).astype(np.float32) * np.linspace(1, 3, 8, dtype=np.float32)[:, None]
batch = {{"x": jnp.asarray(x), "c": jnp.asarray(c)}}
policy = jaxamp.Policy(jnp.float32, jnp.float32, fp8=jaxamp.DelayedScaling(amax_history_len=4))

def run(divide, batch=batch, **kw):
  # loss = sum(y * c) / divide: the output gradient is c / divide, row by row.
  train = jaxamp.make_train_step(lambda m, b: jnp.sum(m(b["x"]) * b["c"]) / divide,
                                 optax.sgd(0.01), policy=policy, **kw)
  state = train.init(nnx.Linear(8, 3, use_bias=False, rngs=nnx.Rngs(0)))
  for _ in range(2):
    state, _ = train.step(state, batch)
  return state

# With grad_accum_steps=2 device d's micro-batches are rows 2d and 2d+1. Device 0's
# first row is small, its second large, the other devices' first rows large: a device
# rescaling from its own amaxes between micro-batches would clip its second.
x2 = x * np.float32([0.001, 3, 3, 1, 3, 1, 3, 1])[:, None]
accum = {{"x": jnp.asarray(x2), "c": jnp.asarray(c)}}
# One device whose micro-batches hold the same rows (loss and gradient sums are
# order-free).
order = [0, 2, 4, 6, 1, 3, 5, 7]
accum_one = {{"x": jnp.asarray(x2[order]), "c": jnp.asarray(c[order])}}

# Data parallel: each device's loss is its shard's sum, and the step averages the
# gradients over 4 devices: one device dividing by 4 takes the same steps.
singles = {{1: run(4.0), 2: run(4.0, accum_one, grad_accum_steps=2)}}
mesh = jax.make_mesh((4,), ("data",))
fsdp = jaxamp.fsdp("data", min_size=1)
for name, k, param_sharding in [("replicated", 1, None), ("fsdp", 1, fsdp),
                                ("replicated-accum", 2, None), ("fsdp-accum", 2, fsdp)]:
  single, x = singles[k], np.asarray((batch, accum)[k - 1]["x"])
  state = run(1.0, (batch, accum)[k - 1], grad_accum_steps=k,
              sharding=jaxamp.ShardingConfig(mesh=mesh, param_sharding=param_sharding))
  meta, ref = state.fp8[""], single.fp8[""]
  hist, ref_hist = np.asarray(meta.amax_history), np.asarray(ref.amax_history)
  # input and kernel amaxes: the whole (micro-)batch's, on every device (maxed across
  # them after each micro-batch)
  np.testing.assert_array_equal(hist[:2], ref_hist[:2])
  newest = np.abs(x.reshape(4, k, -1)[:, -1]).max()  # each device's last micro-batch
  assert hist[0, 0] == newest, (name, hist, newest)
  # the gradient amax: the single device's, exactly (each device's loss is weighted by
  # one over the device count, so its backward pass carries one device's values)
  np.testing.assert_array_equal(hist[2], ref_hist[2])
  np.testing.assert_array_equal(np.asarray(meta.scale), np.asarray(ref.scale))
  # one state on every device
  for shard in meta.amax_history.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), hist)
  np.testing.assert_allclose(np.asarray(state.params["kernel"]),
                             np.asarray(single.params["kernel"]), rtol=1e-5, atol=1e-6)
  print(name, "ok")
print("FP8-MESH-OK")
"""


@pytest.mark.slow
def test_fp8_with_a_mesh_maxes_amaxes_across_devices(tmp_path):
  """Data parallel and FSDP on 4 CPU devices: the amaxes are the whole batch's (each
  device's maxed over the mesh), every device holds the same FP8 state, and the steps
  equal one device's."""
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "fp8_mesh.py"
  script.write_text(_MESH_SCRIPT.format(root=root))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4 "
                       "--xla_backend_optimization_level=0")
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "FP8-MESH-OK" in proc.stdout


# --- einsum, repeated and transformed layers -------------------------------------------------


@pytest.mark.parametrize("spec,kshape", [("btd,dnh->btnh", (8, 2, 3)),
                                         ("bd,dh->hb", (8, 5))])  # kernel first in the dot
@pytest.mark.slow
def test_scaled_einsum_matches_an_emulated_product_with_rows_in_place(spec, kshape):
  rng = np.random.RandomState(0)
  x = (rng.randn(4, 8) if spec.startswith("bd") else rng.randn(4, 3, 8)).astype(np.float32)
  k = (rng.randn(*kshape) * 0.1).astype(np.float32)
  meta = jaxamp.fp8.init_meta(jaxamp.CurrentScaling())
  seen = []

  def dot(a, b, *args, **kwargs):
    seen.append((a.shape, b.shape))
    return jaxamp.fp8.scaled_dot_general(a, b, *args, meta=meta, **kwargs)

  def f(x, k, history):
    m = jaxamp.fp8.Fp8Meta(history, meta.scale)
    out = jaxamp.fp8.scaled_einsum(
        spec, x, k, dot_general=lambda a, b, *args, **kw: jaxamp.fp8.scaled_dot_general(
            a, b, *args, meta=m, recipe=jaxamp.CurrentScaling(), **kw))
    return jnp.sum(out)

  y = jaxamp.fp8.scaled_einsum(spec, jnp.asarray(x), jnp.asarray(k), dot_general=dot)
  assert seen[0][0] == x.shape and seen[0][1] == k.shape  # the input first, always
  sx, sk = 448 / np.abs(x).max(), 448 / np.abs(k).max()
  q = lambda a, s: np.clip(a * s, -448, 448).astype(E4M3).astype(np.float32) / np.float32(s)
  np.testing.assert_allclose(np.asarray(y), np.einsum(spec, q(x, sx), q(k, sk)),
                             rtol=1e-5, atol=1e-5)
  # the history's cotangent: rows input, kernel, gradient
  new = jax.grad(f, argnums=2)(jnp.asarray(x), jnp.asarray(k), meta.amax_history)
  np.testing.assert_array_equal(np.asarray(new[:, 0]), [np.abs(x).max(), np.abs(k).max(), 1.0])


@pytest.mark.slow
def test_nnx_einsum_runs_fp8_with_its_state():
  class Proj(nnx.Module):
    def __init__(self):
      self.qkv = nnx.Einsum("btd,dnh->btnh", (8, 2, 4), (2, 4), rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.qkv(x).reshape(x.shape[0], x.shape[1], -1)

  x = jnp.asarray(np.random.RandomState(0).randn(2, 3, 8), jnp.float32)
  policy = jaxamp.get_policy("mixed_fp8").with_fp8(jaxamp.DelayedScaling(amax_history_len=4))
  train = jaxamp.make_train_step(lambda m, b: jnp.sum(m(b) ** 2), optax.sgd(0.01),
                                 policy=policy)
  model = Proj()
  kernel = np.asarray(model.qkv.kernel[...])
  state = train.init(model)
  assert set(state.fp8) == {"qkv"}
  assert jaxamp.summary(Proj(), x, policy=policy).fp8_modules == ("qkv",)
  state, metrics = train.step(state, x)
  history = np.asarray(state.fp8["qkv"].amax_history)
  bf16 = lambda a: np.abs(np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)).max()
  assert history[0, 0] == bf16(x) and history[1, 0] == bf16(kernel)  # compute dtype first
  assert history[2, 0] > 0 and np.isfinite(float(metrics["loss"]))
  text = train.lower(state, x, platforms=("cuda",)).as_text()
  assert "f8E4M3FN" in text and "f8E5M2" in text


def test_linen_module_run_twice_is_refused():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      d = nn.Dense(8, name="shared")
      return d(nn.relu(d(x)))

  x = jnp.ones((2, 8))
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy="mixed_fp8")
  state = train.init(Twice(), Twice().init(jax.random.key(0), x), x)
  with pytest.raises(ValueError, match="'shared' ran twice.*set_policy"):
    train.step(state, x)


@pytest.mark.slow
def test_layers_inside_scan_fall_back_to_current_scaling_with_a_warning(fresh_warnings):
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8), jnp.float32)
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy="mixed_fp8")
  stack = _linen_scan_stack()
  state = train.init(stack, stack.init(jax.random.key(0), x), x)
  # the scanned layer's state is made, but this scan does not lift 'jaxamp_fp8'
  assert set(state.fp8) == {"head", "blocks/inner"}
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, metrics = train.step(state, x)
  msgs = [str(w.message) for w in seen if "current scaling" in str(w.message)]
  assert len(msgs) == 1 and "blocks/inner" in msgs[0], msgs
  assert np.isfinite(float(metrics["loss"]))
  assert np.asarray(state.fp8["head"].amax_history)[:, 0].all()
  text = train.lower(state, x, platforms=("cuda",)).as_text()
  assert text.count("f8E4M3FN") > 0


@pytest.mark.slow
def test_nnx_layers_inside_scan_keep_a_stacked_delayed_state(fresh_warnings):
  """Stacked NNX layers run by nnx.scan get one delayed-scaling state per layer
  (tests/test_fp8_stacked.py checks it against the unrolled model), and no warning."""
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8), jnp.float32)
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy="mixed_fp8")
  state = train.init(_NNXScanStack())
  assert set(state.fp8) == {"blocks", "head"}
  assert state.fp8["blocks"].amax_history.shape == (2, 3, 1024)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, metrics = train.step(state, x)
  assert not [w for w in seen if "current scaling" in str(w.message)]
  assert np.isfinite(float(metrics["loss"])) and all(
      np.asarray(m.amax_history)[..., 0].all() for m in state.fp8.values())
  text = train.lower(state, x, platforms=("cuda",)).as_text()
  assert text.count("f8E4M3FN") >= 2  # the scanned layers' dots too


@pytest.mark.slow
def test_nnx_layers_with_state_give_no_current_scaling_warning(fresh_warnings):
  """The float32-matmul census the first step traces on a copy of the model (whose
  modules have no state) must not warn that the FP8 layers lack state: they have it."""
  model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(16, 2, rngs=nnx.Rngs(1)))
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8), jnp.float32)
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                 policy="mixed_fp8")
  state = train.init(model)
  assert set(state.fp8) == {"layers/0", "layers/2"}
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, _ = train.step(state, x)
  assert not [w for w in seen if "delayed-scaling state" in str(w.message)]
  assert all(np.asarray(m.amax_history)[:, 0].all() for m in state.fp8.values())


def _linen_scan_stack():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.relu(nn.Dense(8, name="inner")(x)), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                  length=2)(name="blocks")(x, None)[0]
      return nn.Dense(2, name="head")(x)

  return Stack()


_NNXScanStack = nnx_models.scan_stack  # two stacked Linear blocks under nnx.scan, a head


@pytest.mark.slow
def test_fallback_to_current_scaling_warns_with_the_head_out_of_fp8(fresh_warnings):
  """The one FP8 layer in an ``nn.scan`` that does not slice the ``'jaxamp_fp8'``
  collection and the head ruled out: no FP8 state is used, and still the promised
  warning, naming the layer. (Scans that slice it, nn.remat, and NNX stacks:
  tests/test_fp8_stacked.py.)"""
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8), jnp.float32)
  model, layer = _linen_scan_stack(), "Dense blocks/inner"
  with jaxamp.policy_rules({"head": "mixed_bfloat16"}):
    train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                   policy="mixed_fp8")
    state = train.init(model, model.init(jax.random.key(0), x), x)
    assert set(state.fp8) == {"blocks/inner"}  # made, not read: the scan does not lift it
    unused = jax.tree.map(np.asarray, state.fp8)
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      state, metrics = train.step(state, x)
  msgs = [str(w.message) for w in seen if "current scaling" in str(w.message)]
  assert len(msgs) == 1 and f"FP8 {layer} has no delayed-scaling state" in msgs[0], msgs
  assert np.isfinite(float(metrics["loss"]))
  jax.tree.map(np.testing.assert_array_equal, state.fp8, unused)


@pytest.mark.slow
def test_nnx_remat_layers_keep_their_delayed_state(fresh_warnings):
  """Layers called through nnx.remat (copies of the modules, made inside it) read and
  move their own delayed-scaling state: the same histories and params as without
  remat, and no fallback warning."""

  class Block(nnx.Module):
    def __init__(self):
      self.lin = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return nnx.relu(self.lin(x))

  class Stack(nnx.Module):
    def __init__(self, remat):
      self.remat = remat
      self.block = Block()
      self.head = nnx.Linear(8, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
      call = lambda block, x: block(x)
      return self.head((nnx.remat(call) if self.remat else call)(self.block, x))

  policy = jaxamp.get_policy("mixed_fp8").with_fp8(jaxamp.DelayedScaling(amax_history_len=4))
  states = []
  for remat in (False, True):
    train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                   policy=policy)
    state = train.init(Stack(remat))
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      for b in _batches(2):
        state, _ = train.step(state, b["x"])
    assert not [w for w in seen if "current scaling" in str(w.message)]
    states.append(jax.tree.map(np.asarray, (state.fp8, state.params)))
  history = states[1][0]["block/lin"].amax_history
  assert history[:, :2].all() and not history[:, 2:].any()  # two steps recorded
  jax.tree.map(np.testing.assert_array_equal, states[1], states[0])


def test_eval_step_may_call_an_fp8_model_twice():
  """eval updates no FP8 state: an eval_fn calling the model twice (two views
  averaged) runs, each call under the state's scales."""
  recipe = jaxamp.DelayedScaling(amax_history_len=4)
  train, state, _ = _linear_step(recipe)
  twice = jaxamp.make_train_step(
      lambda m, b: jnp.sum(m(b["x"])), optax.sgd(0.01),
      policy=jaxamp.Policy(jnp.float32, jnp.float32, fp8=recipe),
      eval_fn=lambda m, b: (m(b["x"]) + m(2 * b["x"])) / 2)
  twice.init(nnx.Linear(8, 3, use_bias=False, rngs=nnx.Rngs(0)))  # the same structure
  b = _batches(1)[0]
  state, _ = train.step(state, b)
  kernel, scale = np.asarray(state.params["kernel"][...]), np.asarray(state.fp8[""].scale)
  x = np.asarray(b["x"])
  expected = (emulated_dot(x, kernel, scale[0], scale[1]) +
              emulated_dot(2 * x, kernel, scale[0], scale[1])) / 2
  np.testing.assert_allclose(np.asarray(twice.eval_step(state, b)), expected, rtol=1e-6)


class _OwnDot(nn.Module):
  """A layer FP8 cannot hook: it calls lax.dot_general itself (as GPT-2's FlaxConv1D)."""

  features: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    y = jax.lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())))
    # A product of two activations (attention-like, batched): compute dtype by design.
    return y + jnp.einsum("btd,bsd->bts", y, y) @ y


class _Partly(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="head")(_OwnDot(16, name="proj")(x))


def test_fp8_names_the_matmuls_it_cannot_reach_with_their_share(fresh_warnings):
  """One layer runs FP8, another computes its matmul itself: init names that one, by
  class and path, with its share of the matmul FLOPs (not only when no layer runs FP8),
  and leaves out the FP8 layer and the products of two activations."""
  x = jnp.ones((2, 3, 8))
  variables = _Partly().init(jax.random.key(0), x)
  loss = lambda m, b: jnp.mean(m(b).astype(jnp.float32) ** 2)
  train = jaxamp.make_train_step(loss, optax.sgd(0.1), policy="mixed_fp8")
  with pytest.warns(RuntimeWarning) as seen:
    state = train.init(_Partly(), variables, x)
  assert set(state.fp8) == {"head"}  # the Dense runs FP8, with state
  found = [str(w.message) for w in seen if "without FP8" in str(w.message)]
  assert len(found) == 1, [str(w.message) for w in seen]
  own, pair, head = 2 * 6 * 8 * 16, 2 * 2 * 9 * 16 + 2 * 2 * 9 * 16, 2 * 6 * 16 * 4
  share = 100 * own / (own + pair + head)
  assert re.search(rf"under policy 'mixed_fp8', {share:.1f}% of the matmul FLOPs of _Partly "
                   rf"run without FP8.*: _OwnDot \({share:.1f}%: 'proj'\)\. FP8 hooks only",
                   found[0]), found[0]
  assert "head" not in found[0].split("FP8 hooks")[0]
  assert seen[[str(w.message) for w in seen].index(found[0])].filename == __file__
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", "jaxamp: policy 'mixed_fp8' runs FP8 matmuls, but XLA")
    train.init(_Partly(), variables, x)  # once per model class, policy and modules
  # Kept out of FP8 by a rule: nothing left to say.
  with jaxamp.policy_rules({_OwnDot: "mixed_bfloat16"}):
    ruled = jaxamp.make_train_step(loss, optax.sgd(0.1), policy="mixed_fp8")
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      warnings.filterwarnings("ignore", "jaxamp: policy 'mixed_fp8' runs FP8 matmuls, but XLA")
      assert set(ruled.init(_Partly(), variables, x).fp8) == {"head"}
  # With no layer FP8 can hook, the warning says so.
  with pytest.warns(RuntimeWarning, match="_OwnDot has no layer that runs FP8"):
    train.init(_OwnDot(16), _OwnDot(16).init(jax.random.key(0), x), x)


def test_unreached_matmuls_reads_an_nnx_census():
  """The same reading of an NNX census: a module of its own computing ``x @ w`` is named,
  the Linear (FP8) and the attention scores (two activations) are not."""

  class OwnDot(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))

    def __call__(self, x):
      return x @ self.w[...].astype(x.dtype)

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
      self.own = OwnDot(rngs)
      self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
      return self.head(self.own(self.attn(x)))

  model = Model(nnx.Rngs(0))
  ops, names, policies = jaxamp.nnx.with_policy(model, "mixed_fp8").matmul_census(
      jnp.ones((2, 3, 8)))
  classes = {path: cls for path, cls, _ in jaxamp.nnx.module_policies(model, "mixed_fp8")}
  found = jaxamp.fp8.unreached_matmuls(ops, names, policies, classes)
  assert found == {"own": ("OwnDot", 2 * 6 * 8 * 8)}
  with jaxamp.policy_rules({"own": "mixed_bfloat16"}):
    ops, names, policies = jaxamp.nnx.with_policy(model, "mixed_fp8").matmul_census(
        jnp.ones((2, 3, 8)))
  assert jaxamp.fp8.unreached_matmuls(ops, names, policies, classes) == {}


def test_an_nnx_model_names_the_matmuls_fp8_cannot_reach_on_its_first_step(fresh_warnings):
  """NNX init has no example inputs to take a census from; the first step's check names
  a module computing its own matmul (x @ w) under an FP8 policy, with its FLOP share."""
  import warnings

  class Raw(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))

    def __call__(self, x):
      return x @ self.w[...]

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.raw, self.head = Raw(rngs), nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
      return self.head(self.raw(x))

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # FP8 on CPU
    train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
                                   policy="mixed_fp8")
  state = train.init(Net(nnx.Rngs(0)))
  with pytest.warns(RuntimeWarning, match=r"66\.7% of the matmul FLOPs of Net run without "
                    r"FP8.*Raw \(66\.7%: 'raw'\)"):
    state, _ = train.step(state, jnp.ones((4, 8)))
  assert list(state.fp8) == ["head"]


def _loop_dots(text):
  """The ``dot_general`` lines a lowered program runs inside its ``stablehlo.while`` loops,
  following the functions the loop bodies call."""
  import re  # pylint: disable=g-import-not-at-top

  funcs = dict(re.findall(r"func\.func (?:public|private) @([\w.]+)\((.*?)(?=\n  func\.func|\Z)",
                          text, re.S))
  lines, seen = [], set()

  def walk(body):
    for line in body.splitlines():
      if "dot_general" in line:
        lines.append(line)
      for name in re.findall(r"call @([\w.]+)", line):
        if name not in seen and name in funcs:
          seen.add(name)
          walk(funcs[name])

  # a while op's regions run from its line to the line closing them at its indentation
  all_lines = text.splitlines()
  for i, line in enumerate(all_lines):
    if "stablehlo.while" in line:
      indent = len(line) - len(line.lstrip())
      j = i + 1
      while not (all_lines[j].startswith(" " * indent + "}")
                 and not all_lines[j].lstrip().startswith("} do {")):
        j += 1
      walk("\n".join(all_lines[i + 1:j]))
  return lines


@pytest.mark.slow
@pytest.mark.parametrize("make", [_linen_scan_stack, _NNXScanStack], ids=["linen", "nnx"])
def test_scanned_layers_run_fp8_with_current_scaling_without_a_warning(make, fresh_warnings):
  """A 2-layer scanned MLP under 'mixed_fp8_current': the scan body's dots have FP8
  operands (E4M3 forward, E5M2 output gradient), it trains, and no fallback warning
  (current scaling keeps no state to fall back from). Under 'mixed_fp8' both keep a
  stacked delayed state (Linen's where the scan slices 'jaxamp_fp8'; this one does not,
  and warns: tests/test_fp8_stacked.py)."""
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8), jnp.float32)
  model = make()
  train = jaxamp.make_train_step(lambda m, b: jnp.mean((m(b) - 1.0) ** 2), optax.sgd(0.1),
                                 policy="mixed_fp8_current")
  args = (model, model.init(jax.random.key(0), x), x) if isinstance(model, nn.Module) else (
      model,)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*XLA on CPU.*")
    warnings.simplefilter("error")
    state = train.init(*args)
    losses = []
    for _ in range(3):
      state, metrics = train.step(state, x)
      losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  text = train.lower(state, x, platforms=("cuda",)).as_text()
  dots = _loop_dots(text)
  assert any(line.count("f8E4M3FN>") == 2 for line in dots), dots  # forward, in the loop
  assert any("f8E5M2" in line for line in dots), dots  # backward, in the loop
  assert len(dots) == 3 and all("xf8E" in line for line in dots), dots  # none unreached
