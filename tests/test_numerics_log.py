"""jaxamp.NumericsLog and jaxamp.suggest_policy: the host side of the numerics monitor."""

import csv

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import numerics


def record(**per_module):
  """``metrics['numerics']`` for per-module ``{kind: {stat: value}}`` (others 0; an
  ``input`` record only where given: the layers FP8 runs)."""
  out = {}
  for path, kinds in per_module.items():
    out[path] = {}
    for kind in ("activation", "cotangent", "grad") + (("input",) if "input" in kinds else ()):
      extra = {k for k in kinds.get(kind, {}) if k.endswith("_mixed_fp8_block")}
      stats = {k: 0.0 for k in (*numerics.STATS, *extra)}
      stats.update(amax=1.0, count=10.0)
      stats.update(kinds.get(kind, {}))
      out[path][kind] = {k: jnp.float32(v) for k, v in stats.items()}
  return out


def metrics(numerics_record, recorded=True, scale=2.0 ** 15, finite=True):
  return {"numerics": numerics_record, "numerics_recorded": jnp.bool_(recorded),
          "loss_scale": jnp.float32(scale), "grads_finite": jnp.bool_(finite), "loss": 1.0}


def sample_log():
  log = jaxamp.NumericsLog()
  log.add(0, metrics(record(
      ok={}, hot={"activation": {"amax": 7e4, "overflow": 0.25, "overflow_float16": 0.25}},
      cold={"grad": {"underflow": 0.5, "underflow_float16": 0.5,
                                  "underflow_float16_ls": 0.5, "amax": 1e-10}})))
  nan = jax.tree.map(lambda x: x * np.nan, record(ok={}, hot={}, cold={}))
  log.add(1, metrics(nan, recorded=False, scale=2.0 ** 14, finite=False))
  log.add(2, metrics(record(ok={}, hot={"activation": {"overflow": 0.5, "nonfinite": 3.0}},
                            cold={}, outlier={"input": {"underflow_e4m3": 0.2}},
                            # not a layer FP8 runs (no input record): not judged for FP8
                            norm={"activation": {"underflow_e4m3": 0.9},
                                  "cotangent": {"underflow_e5m2": 0.9}})))
  return log


def test_log_keeps_recorded_steps_and_every_loss_scale():
  log = sample_log()
  assert sorted(log.records) == [0, 2]
  assert log.loss_scale == [(0, 2.0 ** 15, False), (1, 2.0 ** 14, True), (2, 2.0 ** 15, False)]
  worst = log.worst()
  assert worst["hot"]["activation"]["overflow"] == 0.5  # the worst step's
  assert worst["hot"]["activation"]["amax"] == pytest.approx(7e4)
  assert worst["hot"]["activation"]["nonfinite"] == 3.0
  assert [r[0] for r in log.risk()][:2] == ["hot", "cold"]


def test_table_ranks_riskiest_first():
  lines = sample_log().table().splitlines()
  assert lines[0].split()[:2] == ["module", "kind"]
  assert lines[1].split()[:2] == ["hot", "activation"]
  assert lines[4].split()[:2] == ["cold", "activation"]
  assert "50.00%" in lines[1]


def test_risk_against_fp8_and_unknown_formats():
  log = sample_log()
  # hot: non-finite values; norm: 90 % of its activation, outlier: 20 % of its input.
  assert [r[0] for r in log.risk(against="e4m3")][:3] == ["hot", "norm", "outlier"]
  assert log.risk(against="e4m3")[1][1] == pytest.approx(0.9)
  assert log.table(against="float16").splitlines()[1].split()[:2] == ["hot", "activation"]
  with pytest.raises(ValueError, match=r"one this log recorded: \['bfloat16', 'e4m3'"):
    log.risk(against="mixed_mxfp8")


def test_to_csv_has_a_row_per_step_module_and_kind(tmp_path):
  path = tmp_path / "n.csv"
  sample_log().to_csv(str(path))
  rows = list(csv.DictReader(open(path)))
  assert len(rows) == 3 * 3 + 5 * 3 + 1  # step 2: outlier's input record
  hot = [r for r in rows if r["step"] == "2" and r["module"] == "hot" and r["kind"] == "activation"]
  assert float(hot[0]["overflow"]) == 0.5 and float(hot[0]["nonfinite"]) == 3.0


def test_add_refuses_metrics_without_numerics():
  with pytest.raises(ValueError, match="numerics=jaxamp.Numerics"):
    jaxamp.NumericsLog().add(0, {"loss": 1.0})


def test_suggest_policy_names_the_modules_and_why():
  log = sample_log()
  s = jaxamp.suggest_policy(log, "mixed_float16")
  assert s.rules == {"hot": "float32", "cold": "float32"}
  assert "float16's largest finite" in s.reasons["hot"]
  assert "smallest normal" in s.reasons["cold"]
  s = jaxamp.suggest_policy(log, "mixed_bfloat16")  # bfloat16 columns: all zero
  assert s.rules == {}
  s = jaxamp.suggest_policy(log, "mixed_fp8", safer="mixed_bfloat16")
  assert s.rules == {"outlier": "mixed_bfloat16"} and "E4M3" in s.reasons["outlier"]
  assert "input" in s.reasons["outlier"]
  assert jaxamp.suggest_policy(log, "float32").rules == {}
  with jaxamp.policy_rules(jaxamp.suggest_policy(log, "mixed_float16").rules):
    from flax import nnx
    assert jaxamp.resolve_policy(nnx.Linear, "hot", jaxamp.get_policy("mixed_float16")).name \
        == "float32"


def test_suggest_policy_reads_the_target_recipes_whatif():
  """A block-scaled target is judged by its own columns (Numerics(whatif=...)): the
  per-tensor outlier is fine per tile; a layer saturating under it is kept."""
  log = jaxamp.NumericsLog()
  log.add(0, metrics(record(
      outlier={"input": {"underflow_e4m3": 0.2, "underflow_mixed_fp8_block": 0.0,
                         "overflow_mixed_fp8_block": 0.0}},
      tiles={"input": {"underflow_mixed_fp8_block": 0.3, "overflow_mixed_fp8_block": 0.0}},
      grads={"input": {"underflow_mixed_fp8_block": 0.0},
             "cotangent": {"overflow_mixed_fp8_block": 0.01}})))
  s = jaxamp.suggest_policy(log, "mixed_fp8_block", safer="mixed_bfloat16")
  assert s.rules == {"tiles": "mixed_bfloat16", "grads": "mixed_bfloat16"}
  assert "mixed_fp8_block" in s.reasons["tiles"] and "saturate" in s.reasons["grads"]
  assert "outlier" in jaxamp.suggest_policy(log, "mixed_fp8", safer="mixed_bfloat16").rules
  with pytest.raises(ValueError, match=r"whatif=\('mixed_mxfp8',\)"):
    jaxamp.suggest_policy(log, "mixed_mxfp8")


def test_suggest_policy_refuses_bad_input():
  with pytest.raises(ValueError, match="recorded steps"):
    jaxamp.suggest_policy(jaxamp.NumericsLog(), "mixed_float16")
  with pytest.raises(ValueError, match="kinds must be among"):
    jaxamp.suggest_policy(sample_log(), "mixed_float16", kinds=("weights",))
  with pytest.raises(ValueError):
    jaxamp.suggest_policy(sample_log(), "mixed_float17")


@pytest.mark.slow
def test_plot_draws_the_logs_fractions_and_loss_scales(tmp_path):
  pytest.importorskip("matplotlib")
  path = tmp_path / "n.png"
  log = sample_log()
  fig = log.plot(str(path))
  assert path.read_bytes()[:4] == b"\x89PNG"
  under_ax, over_ax, scale_ax = fig.axes[:3]  # (the two colorbars come after)
  # Heat maps: module x recorded step, the worst kind's fraction (NaN where a module
  # has no record at that step).
  assert [t.get_text() for t in under_ax.get_yticklabels()] == list(log.modules)
  assert [t.get_text() for t in under_ax.get_xticklabels()] == ["0", "2"]
  expected = {"underflow": np.full((len(log.modules), 2), np.nan),
              "overflow": np.full((len(log.modules), 2), np.nan)}
  for j, step in enumerate((0, 2)):
    for i, m in enumerate(log.modules):
      for stat, grid in expected.items():
        vals = [k[stat] for k in log.records[step].get(m, {}).values()]
        if vals:
          grid[i, j] = max(vals)
  for ax, stat in ((under_ax, "underflow"), (over_ax, "overflow")):
    np.testing.assert_array_equal(np.asarray(ax.get_images()[0].get_array().filled(np.nan)),
                                  expected[stat])
  assert expected["overflow"][list(log.modules).index("hot")].tolist() == [0.25, 0.5]
  # The loss scale at every step, the skipped one marked.
  (line,) = scale_ax.get_lines()
  np.testing.assert_array_equal(line.get_xdata(), [0, 1, 2])
  np.testing.assert_array_equal(line.get_ydata(), [2.0 ** 15, 2.0 ** 14, 2.0 ** 15])
  np.testing.assert_array_equal(scale_ax.collections[0].get_offsets(), [[1, 2.0 ** 14]])


def needy_model():
  """An NNX model built to need a per-module plan under float16: ``big``'s activations
  exceed float16's range; ``tiny``'s gradients sit far below its normal range (its
  output enters the loss times 1e-9: below float16's smallest normal even after a loss
  scale of 2**15)."""
  from flax import nnx

  class M(nnx.Module):
    def __init__(self):
      self.big = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
      self.mid = nnx.Linear(16, 16, rngs=nnx.Rngs(1))
      self.out = nnx.Linear(16, 1, rngs=nnx.Rngs(2))
      self.tiny = nnx.Linear(16, 1, rngs=nnx.Rngs(3))
      self.big.kernel[...] = self.big.kernel[...] * 1e6

    def __call__(self, x):
      h = jnp.tanh(self.mid(self.big(x) * 1e-6))
      return self.out(h) + 1e-9 * self.tiny(h)

  return M()


@pytest.mark.slow
def test_suggested_plan_names_exactly_the_needy_layers_and_trains():
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)
  y = jnp.sin(x[:, :1])
  loss = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)

  def run(policy, rules=None, steps=30, log=None):
    with jaxamp.policy_rules(rules or {}):
      train = jaxamp.make_train_step(loss, optax.adam(1e-3), policy=policy,
                                     numerics=jaxamp.Numerics(every=10) if log is not None
                                     else None)
      state = train.init(needy_model())
      for i in range(steps):
        state, m = train.step(state, (x, y))
        if log is not None:
          log.add(i, m)
    return float(m["loss"]), int(m["skipped_steps"])

  log = jaxamp.NumericsLog()
  f32, _ = run("float32", log=log)
  plan = jaxamp.suggest_policy(log, "mixed_float16")
  assert set(plan.rules) == {"big", "tiny"}, plan.reasons
  uniform, skipped = run("mixed_float16")
  planned, _ = run("mixed_float16", plan.rules)
  assert skipped == 30  # big's activations overflow on every step: it never moves
  assert abs(planned - f32) <= 0.01 * f32


def sink_model():
  """An NNX model built to need a per-module plan under FP8: per token, ``a``, then the
  first position of each sequence marked with a massive activation (1e6, as a BOS
  token's), ``mix``, the first position dropped, the head ``out``. ``mix``'s input is
  outlier-heavy: scaled per tensor (or per row, tile or block along the tokens, as the
  weight-gradient product scales it) the other values fall below E4M3's normal range."""
  from flax import nnx

  class M(nnx.Module):
    def __init__(self):
      self.a = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
      self.mix = nnx.Linear(64, 64, rngs=nnx.Rngs(1))
      self.out = nnx.Linear(64, 4, rngs=nnx.Rngs(2))

    def __call__(self, x):
      h = jax.nn.relu(self.a(x)).at[:, 0].add(1e6)
      return self.out(jax.nn.relu(self.mix(h)[:, 1:]))

  return M()


def token_batch(seed, n=64):
  """``n`` sequences of 9 tokens of 16 features; 4 classes from three features, 20 %
  of the labels random (a loss floor well above FP8's rounding)."""
  rng = np.random.RandomState(seed)
  x = rng.standard_normal((n, 9, 16)).astype(np.float32)
  y = (x[:, 1:, 0] > 0) * 2 + (x[:, 1:, 1] * x[:, 1:, 2] > 0)
  y = np.where(rng.rand(n, 8) < 0.2, rng.randint(0, 4, (n, 8)), y)
  return jnp.asarray(x), jnp.asarray(y, jnp.int32)


@pytest.mark.slow
def test_suggested_fp8_plan_keeps_exactly_the_outlier_layer_and_trains():
  """Under 'mixed_fp8' the outlier-heavy layer ruins training (held-out loss 10 % and
  more behind float32); a log taken under mixed_bfloat16 names exactly that layer, for
  per-tensor FP8 and for every block- or row-scaled recipe (their what-if, which sees
  the weight-gradient product's layout); with the plan the run is within 1 % of
  float32's held-out loss (a fresh batch each step, 100 steps)."""
  loss = lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b[0]), b[1]).mean()
  batches = [token_batch(i) for i in range(100)]
  held_out = token_batch(10_000, 512)

  def run(policy, rules=None, log=None):
    numerics_ = (jaxamp.Numerics(every=20, whatif=numerics.whatif_policies())
                 if log is not None else None)
    with jaxamp.policy_rules(rules or {}):
      train = jaxamp.make_train_step(loss, optax.adam(3e-3), policy=policy,
                                     numerics=numerics_)
      state = train.init(sink_model())
      for i, b in enumerate(batches):
        state, m = train.step(state, b)
        if log is not None:
          log.add(i, m)
    return float(loss(train.model(state), held_out))  # float32, the plain model

  f32 = run("float32")
  log = jaxamp.NumericsLog()
  bf16 = run("mixed_bfloat16", log=log)
  plan = jaxamp.suggest_policy(log, "mixed_fp8", safer="mixed_bfloat16")
  assert plan.rules == {"mix": "mixed_bfloat16"}, plan.reasons
  assert "input" in plan.reasons["mix"] and "E4M3" in plan.reasons["mix"]
  for target in numerics.whatif_policies():
    assert jaxamp.suggest_policy(log, target, safer="mixed_bfloat16").rules == plan.rules
  uniform = run("mixed_fp8")
  planned = run("mixed_fp8", plan.rules)
  assert uniform > 1.1 * f32, (uniform, f32)
  assert abs(planned - f32) <= 0.01 * f32, (planned, f32, bf16)
