"""Smoke tests: each example's ``main`` and the benchmark harness, at tiny sizes.

They check what the runs report (loss-scale trajectories against the update rule,
which matmuls run in half precision, that the Keras and hand-written twins have the
same matmul FLOPs as the jaxamp model), never how fast anything is.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
import statistics
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

# Heavier checks: the slow tier (pytest -m slow), which CI runs after the main suite.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@functools.cache
def _load(name: str):
  """Imports ``examples/NAME.py`` (registered first: Linen's dataclasses look it up)."""
  path = ROOT / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(autouse=True)
def _quiet_float16():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*float16.*", category=RuntimeWarning)
    yield


@pytest.mark.parametrize("name,flag", [("char_lm", "--growth-interval"),
                                       ("resnet", "--opt-level"), ("digits", "--policy")])
def test_help(name, flag, capsys):
  with pytest.raises(SystemExit) as exit_info:
    _load(name).main(["--help"])
  assert exit_info.value.code == 0
  assert flag in capsys.readouterr().out


# --- char_lm ------------------------------------------------------------------------------


def test_char_lm_corpus_is_the_standard_library():
  char_lm = _load("char_lm")
  data = char_lm.load_corpus(3000)
  import sysconfig  # pylint: disable=g-import-not-at-top
  first = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
  expected = b"".join(p.read_bytes() for p in first[:5])[:3000]
  assert data.dtype == np.uint8 and data.tobytes() == expected


def test_char_lm_float16_run_follows_the_loss_scale_rule(tmp_path):
  char_lm = _load("char_lm")
  plot = tmp_path / "lm.png"
  steps, interval = 14, 3
  results = char_lm.main([
      "--policy", "mixed_float16", "--steps", str(steps), "--batch-size", "4",
      "--seq-len", "16", "--dim", "16", "--heads", "2", "--layers", "1",
      "--corpus-bytes", "20000", "--val-batches", "1", "--lr", "1e-2",
      "--growth-interval", str(interval), "--plot", str(plot), "--no-progress"])
  r = results["mixed_float16"]
  assert len(r["losses"]) == len(r["scales"]) == steps
  # Replay torch's GradScaler rule from Keras' initial scale on the recorded overflows.
  scale, count, expected = 2.0**15, 0, []
  for finite in r["finite"]:
    if finite:
      count += 1
      if count == interval:
        scale, count = scale * 2, 0
    else:
      scale, count = scale / 2, 0
    expected.append(scale)
  assert r["scales"] == expected
  assert r["skipped"] == r["finite"].count(False)
  assert max(r["scales"]) > 2.0**15  # the growth interval reached the optimizer
  assert np.mean(r["losses"][-3:]) < r["losses"][0]  # it learns (ln 256 = 5.55 at start)
  assert math.isfinite(r["val_loss"]) and r["val_loss"] < math.log(256)
  assert plot.read_bytes()[:8] == PNG_MAGIC


# --- resnet ---------------------------------------------------------------------------------

_TINY_RESNET = ["--stage-sizes", "1", "--width", "4", "--image-size", "16", "--batch-size",
                "2", "--num-classes", "10", "--steps", "2", "--warmup", "1"]


def test_resnet_autocast_opt_level_trains():
  results = _load("resnet").main(["--opt-level", "O1", *_TINY_RESNET])
  r = results["O1"]
  assert r["images_per_s"] > 0 and math.isfinite(r["loss"])
  assert r["loss"] < r["first_loss"]  # 4 steps on one batch: it fits
  assert r["scale"] == 2.0**15 and r["skipped"] == 0


@functools.cache
def _tiny_resnet():
  resnet = _load("resnet")
  model = resnet.ResNet((1,), 4, 10)
  args = type("Args", (), {"lr": 0.1, "half": "float16", "batch_size": 2, "image_size": 16,
                           "num_classes": 10, "seed": 0})()
  batch = resnet.synthetic_batch(args.batch_size, args.image_size, args.num_classes, args.seed)
  variables = jax.jit(lambda k, x: model.init(k, x, train=False))(jax.random.key(0),
                                                                  batch["image"])
  return model, args, batch, variables


@pytest.mark.parametrize("level,half_share,param_dtype,norm_dtype,master,scale", [
    ("O0", 0.0, jnp.float32, jnp.float32, False, 1.0),
    ("O1", 1.0, jnp.float32, jnp.float32, False, 2.0**15),
    ("O2", 1.0, jnp.float16, jnp.float32, True, 2.0**15),
    ("O3", 1.0, jnp.float16, jnp.float16, False, 1.0)])
def test_resnet_opt_level_steps(level, half_share, param_dtype, norm_dtype, master, scale):
  model, args, batch, variables = _tiny_resnet()
  step, state = _load("resnet").build(level, model, jax.tree.map(jnp.copy, variables), args)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # residuals of a whole step: n/a
    report = jaxamp.precision_report(step, state, batch)
  # Every convolution and the head's matmul, forward and backward: float16 or none.
  assert report.half_share == half_share
  dtypes = {"norm": set(), "other": set()}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    is_norm = any(k in jax.tree_util.keystr(path) for k in ("BatchNorm", "bn_init", "norm_proj"))
    dtypes["norm" if is_norm else "other"].add(np.dtype(leaf.dtype))
  assert dtypes == {"norm": {np.dtype(norm_dtype)}, "other": {np.dtype(param_dtype)}}
  assert isinstance(state.opt_state, jaxamp.MasterWeightsState) == master
  # Dynamic loss scaling exactly where Apex has it: O1 and O2.
  assert float(jaxamp.get_loss_scale(state.opt_state)) == scale


# --- the benchmark harness ----------------------------------------------------------------------


def _benchmarks():
  sys.path.insert(0, str(ROOT))
  try:
    import benchmarks.run  # pylint: disable=g-import-not-at-top
    return benchmarks
  finally:
    sys.path.remove(str(ROOT))


def test_benchmark_harness_smoke(tmp_path):
  out = _benchmarks().run.main([
      "--size", "smoke", "--out", str(tmp_path), "--policies", "mixed_float16",
      "--impls", "jaxamp", "--only", "lm", "matmul", "overhead", "eager", "--warmup", "1",
      "--rounds", "2", "--steps", "1"])
  (m,) = out["sections"]["lm"].results
  assert (m.impl, m.policy, m.error) == ("jaxamp", "mixed_float16", None)
  assert len(m.round_step_s) == 2 and all(t > 0 for t in m.round_step_s)
  assert m.memory["peak"] > 0 and m.compile_s > 0 and m.residual_bytes > 0
  assert m.half_share == 1.0

  matmul = {m.policy: m for m in out["sections"]["matmul"].results}
  assert list(matmul) == ["float16", "mixed_float16"]
  assert matmul["float16"].matmul_flops == 2 * 128**3
  assert matmul["float16"].half_share == matmul["mixed_float16"].half_share == 1.0

  overhead = out["sections"]["overhead"].results
  pairs = [(m.impl, m.policy) for m in overhead]
  models = [p.split(" · ")[0] for _, p in pairs[::2]]
  assert models[:2] == ["MLP", "LM"] and models[2].startswith("ResNet")  # three models
  assert pairs == [(impl, f"{model} · mixed_float16") for model in models
                   for impl in ("jaxamp", "hand-written Flax")]
  # One sitting at this size (pooled sittings: the test below), two rounds.
  assert all(m.round_sitting == [0, 0] and len(m.round_step_s) == 2 for m in overhead)
  eager = out["sections"]["eager"].results  # the LM forward without jit, one pair
  assert [(m.impl, m.policy, m.error) for m in eager] == [
      ("jaxamp", "mixed_float16", None), ("hand-written Flax", "mixed_float16", None)]
  assert all(m.round_sitting == [0, 0] and min(m.round_step_s) > 0 for m in eager)

  text = (tmp_path / "RESULTS.md").read_text()
  assert out["machine"]["cpu"] in text and f"jax / jaxlib | {jax.__version__}" in text
  lines = text.split("## Transformer LM")[1].split("\n## ")[0].splitlines()
  header = next(line for line in lines if line.startswith("| implementation"))
  row = next(line for line in lines if line.startswith("| jaxamp | mixed_float16 |"))
  cells = dict(zip(header.split(" | "), row.split(" | ")))
  # Every cell measured; the ratio to a float32 run that was not made does not apply.
  assert "n/a" not in cells.values() and cells["× vs float32"] == "—"
  assert cells["half-precision matmul FLOPs %"] == "100.0"
  assert "Worst ratio" in text and "| MLP · mixed_float16 |" in text.split("## Overhead")[1]
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["machine"]["backend"] == jax.default_backend()
  assert data["sections"]["lm"]["results"][0]["half_share"] == 1.0
  # What --merge keeps reads back as it was measured.
  info, kept = _benchmarks().report.read_sections(tmp_path / "results.json")
  assert info["device"] == out["machine"]["device"] and set(kept) == set(out["sections"])
  for key, section in out["sections"].items():
    assert [(m.round_step_s, m.round_sitting) for m in kept[key].results] == [
        (m.round_step_s, m.round_sitting) for m in section.results]
    assert kept[key].notes == section.notes
  assert (tmp_path / "results.png").read_bytes()[:8] == PNG_MAGIC
  # --render redraws the same tables from results.json, measuring nothing.
  (tmp_path / "RESULTS.md").write_text("stale")
  _benchmarks().run.main(["--render", "--out", str(tmp_path)])
  assert (tmp_path / "RESULTS.md").read_text() == text
  with pytest.raises(SystemExit, match="no .*results.json to draw from"):
    _benchmarks().run.main(["--render", "--out", str(tmp_path / "nothing")])


def test_benchmark_sittings_run_on_fresh_candidates_and_pool_their_rounds():
  """``measure_sittings``: each sitting builds its candidates afresh (a sitting consumes
  their states), measures them, and every candidate gets all sittings' rounds, each
  marked with its sitting; the tables say how many sittings were pooled."""
  bench = _benchmarks()
  made = []

  def make():
    step = lambda s, b: (s + b, jnp.sum(s))
    made.append([bench.measure.Candidate(impl, "p", step, jnp.zeros(3), jnp.ones(3))
                 for impl in ("a", "b")])
    return made[-1]

  found = bench.measure.measure_sittings(make, 3, warmup=1, rounds=2, steps=1,
                                         inspect=False, log=lambda _: None)
  assert len(made) == 3 and len({id(c) for cands in made for c in cands}) == 6
  assert [(m.impl, m.round_sitting) for m in found] == [
      (impl, [0, 0, 1, 1, 2, 2]) for impl in ("a", "b")]
  assert all(len(m.round_step_s) == 6 and min(m.round_step_s) > 0 for m in found)
  args = types.SimpleNamespace(overhead_rounds=2, overhead_steps=1, overhead_sittings=3)
  assert bench.run._sittings(args).startswith("3 sittings of 2 × 1 steps")
  assert bench.run._sittings(types.SimpleNamespace(**{**vars(args),
                                                      "overhead_sittings": 1})) == "2 × 1 steps"


def test_benchmark_lower_only_lowers_for_cuda(capsys):
  """``--lower-only``: the candidates lower for CUDA on this CPU, nothing compiles."""
  out = _benchmarks().run.main([
      "--size", "smoke", "--lower-only", "--only", "lm", "matmul", "--impls", "jaxamp",
      "hand", "--no-keras", "--policies", "float32", "mixed_float16"])
  rows = out["lowered"]
  assert not out["failed"] and {r.platform for r in rows} == {"cuda"}
  lm = {(r.impl, r.policy): r for r in rows if r.impl in ("jaxamp", "hand-written Flax")}
  assert set(lm) == {(i, p) for i in ("jaxamp", "hand-written Flax")
                     for p in ("float32", "mixed_float16")}
  assert len({r.ops for r in lm.values()}) == 1 and next(iter(lm.values())).ops > 0
  assert {p: r.half_share for (_, p), r in lm.items()} == {"float32": 0.0, "mixed_float16": 1.0}
  matmul = {r.policy: r.half_share for r in rows if r.impl.startswith(("jax.numpy", "jaxamp."))}
  assert matmul == {"float32": 0.0, "float32 HIGHEST": 0.0, "bfloat16": 1.0, "float16": 1.0,
                    "mixed_bfloat16": 1.0, "mixed_float16": 1.0}
  assert "lowered 10 of 10 candidates for cuda" in capsys.readouterr().out


def test_benchmark_fp8_candidate_lowers_for_cuda(capsys):
  """``--size gpu`` adds jaxamp's ``mixed_fp8`` LM; at smoke size its step lowers for CUDA
  with FP8 matmuls (the LM head and attention scores stay bfloat16: not Linear/FP8)."""
  bench = _benchmarks()
  assert bench.run.SIZES["gpu"].lm_extra == ("mixed_fp8",)
  size = dataclasses.replace(bench.run.SIZES["smoke"], lm_extra=("mixed_fp8",))
  args = types.SimpleNamespace(only=["lm"], policies=[], platform="cuda")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    # no hand-written FP8 step: only jaxamp's candidate is built
    rows = bench.run._lower_only(size, ["jaxamp", "hand-written Flax"], args)
  assert [(r.impl, r.policy, r.error) for r in rows] == [("jaxamp", "mixed_fp8", None)]
  assert rows[0].fp8_share > 0.5 and rows[0].fp8_share + rows[0].half_share == 1.0
  assert "% FP8" in capsys.readouterr().out


def test_benchmark_compile_section():
  """The first-call cost table: trace, lower, compile and temp bytes of both steps."""
  bench = _benchmarks()
  size = dataclasses.replace(bench.run.SIZES["smoke"], compile_layers=(1,), compile_reps=1)
  section = bench.run._compile_section(size, ["float32"], None)
  # At the deepest layer count float32 runs twice: jaxamp's chain clipping with
  # jaxamp.clip_by_global_norm, then with optax's.
  optax_row = "float32, jaxamp with optax's clip"
  assert [(c.impl, c.policy, c.layers) for c in section.results] == [
      ("jaxamp", "float32", 1), ("hand-written Flax", "float32", 1),
      ("jaxamp", optax_row, 1), ("hand-written Flax", optax_row, 1)]
  for c in section.results:
    assert c.error is None and min(c.trace_s + c.lower_s + c.compile_s) > 0
    assert c.memory["temp"] > 0
  row, second = bench.report.compile_table(section, bench.run.COMPILE_LIMITS)[2:]
  assert second.strip("| ").split(" | ")[:2] == ["1", optax_row]
  cells = row.strip("| ").split(" | ")
  amp, hand = section.results[:2]
  assert cells[:2] == ["1", "float32"]
  stages = ("trace_s", "lower_s", "compile_s")  # the first call: all three, summed
  first = [sum(c.median(w) for w in stages) for c in (amp, hand)]
  assert cells[2:5] == [f"{first[0]:,.2f}", f"{first[1]:,.2f}", f"{first[0] / first[1]:,.2f}"]
  assert cells[7] == f"{amp.median('trace_s') / hand.median('trace_s'):,.2f}"
  ratio = amp.compile_s[0] / hand.compile_s[0]  # one repetition: its range is one ratio
  assert cells[14] == f"{ratio:.2f}–{ratio:.2f}"
  assert cells[-1] == f"{amp.memory['temp'] / hand.memory['temp']:,.3f}"


@pytest.mark.parametrize("model", ["lm", "resnet"])
def test_benchmark_twins_agree(model):
  """jaxamp's, the hand-written and the Keras model are one architecture (the same matmul
  FLOPs, forward and backward), and all three compute every matmul in bfloat16."""
  bench = _benchmarks()
  try:
    bench.models.import_keras()
    impls = bench.candidates.IMPLS
  except ImportError:
    impls = ("jaxamp", "hand-written Flax")
  if model == "lm":
    cfg = bench.models.LMConfig(vocab=64, dim=32, heads=2, layers=1, seq_len=16, batch=4)
    found = bench.candidates.lm_candidates(cfg, impls, policies=("mixed_bfloat16",))
  else:
    cfg = bench.models.ResNetConfig((1,), 4, 10, 16, 2)
    found = bench.candidates.resnet_candidates(cfg, impls, policies=("mixed_bfloat16",))
  assert tuple(c.impl for c in found) == impls
  reports = [c.report() for c in found]  # lowering only: nothing compiles
  assert [r.half_share for r in reports] == [1.0] * len(impls)
  assert len({r.total_flops for r in reports}) == 1 and reports[0].total_flops > 0
  if "Keras 3" not in impls:
    pytest.skip("keras is not installed: checked jaxamp against the hand-written model only")


@pytest.mark.parametrize("model", ["mlp", "resnet"])
def test_benchmark_hand_written_skip_is_exact(model):
  """The overhead section's "hand-written + skip" step updates like the plain hand-written
  step on a finite batch and leaves its whole state (BatchNorm statistics included)
  bit-identical on a non-finite one; float16's hand-written step skips already, so the
  section builds no third step for it."""
  bench = _benchmarks()
  cands = bench.candidates
  impls = ("hand-written Flax", cands.HAND_SKIP)
  if model == "mlp":
    cfg = bench.models.MLPConfig((8, 16, 4), 4)
    build, image = cands.mlp_candidates, "x"
  else:
    cfg = bench.models.ResNetConfig((1,), 4, 10, 16, 2)
    build, image = cands.resnet_candidates, "image"
  assert [c.impl for c in build(cfg, impls, ["mixed_float16"])] == ["hand-written Flax"]
  plain, skip = build(cfg, impls, ["float32"])
  assert (plain.impl, skip.impl) == impls
  first, second = (jax.jit(c.step)(c.state, c.batch)[0] for c in (plain, skip))
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(first), jax.tree.leaves(skip.state)))  # it did update
  bad = dict(skip.batch, **{image: skip.batch[image].at[0].set(jnp.nan)})
  after, _ = jax.jit(skip.step)(skip.state, bad)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(skip.state), strict=True):
    np.testing.assert_array_equal(a, b)
  nan_plain, _ = jax.jit(plain.step)(plain.state, bad)  # the plain step takes the NaN
  assert not all(np.isfinite(x).all() for x in jax.tree.leaves(nan_plain))


def test_benchmark_paired_ratio_and_its_interval():
  """The overhead table's ratio is the median of per-round ratios, with a seeded 95 %
  bootstrap interval around it; jaxamp's ratio to the hand-written step with the skip
  gets its own column where the section measured one."""
  bench = _benchmarks()
  m = lambda impl, times: bench.measure.Measurement(impl, "MLP · float32", None, 0.0, {},
                                                    times)
  amp = m("jaxamp", [1.10, 1.00, 1.30, 1.05, 1.02])
  hand = m("hand-written Flax", [1.00, 1.00, 1.00, 1.00, 1.00])
  ratio, low, high = bench.report.paired_ratio(amp, hand)
  assert ratio == pytest.approx(1.05) and low <= 1.02 and 1.10 <= high <= 1.30
  assert bench.report.paired_ratio(amp, hand) == (ratio, low, high)  # seeded
  skip = m(bench.candidates.HAND_SKIP, [1.10, 1.00, 1.30, 1.05, 1.02])
  section = bench.report.Section("overhead", "t", "d", [amp, hand, skip])
  table, ratios = bench.report.overhead_table(section, 1.03)
  assert ratios == [("MLP · float32", pytest.approx(1.05))]
  cells = table[-1].strip("| ").split(" | ")
  assert cells[5:8] == ["1.050", f"{low:.3f}–{high:.3f}", "**no**"]
  assert cells[-1] == "1.000 (1.000–1.000)"  # the same times: no overhead beyond the skip
  section.results = [amp, hand]  # no such step measured: no such columns
  assert len(bench.report.overhead_table(section, 1.03)[0][-1].split(" | ")) == 8


def test_benchmark_paired_ratio_resamples_sittings_then_rounds():
  """Pooled sittings: the ratio is the median of all rounds; the interval resamples the
  sittings too, so two sittings that disagree widen it where one sitting's rounds would
  not; rounds from different sittings are never paired."""
  bench = _benchmarks()
  m = lambda times, sittings: bench.measure.Measurement("x", "p", None, 0.0, {}, times,
                                                        round_sitting=sittings)
  amp = [base + 0.001 * i for base in (1.00, 1.05, 1.10) for i in range(10)]
  hand = [1.0] * 30
  three = [s for s in range(3) for _ in range(10)]
  ratio, low, high = bench.report.paired_ratio(m(amp, three), m(hand, three))
  assert ratio == pytest.approx(statistics.median(amp))
  assert low < 1.01 and high > 1.10  # all three sittings' levels are plausible
  one = bench.report.paired_ratio(m(amp, []), m(hand, []))  # the same rounds, one sitting
  assert one[0] == ratio and one[1] > low + 0.02 and one[2] < high - 0.02
  with pytest.raises(ValueError, match="same rounds"):
    bench.report.paired_ratio(m(amp, three), m(hand, [0] * 30))


# --- the main job ---------------------------------------------------------------------------------


def test_digits_mixed_policies_reach_float32_accuracy():
  # The README's main job as it runs there (30 epochs, all three policies), in a process
  # of its own compiled as XLA's default does: it is mostly running, which the suite's
  # fast-compile level (tests/conftest.py) slows down 2x.
  import os
  import subprocess

  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=3",
             PYTHONPATH=str(ROOT))
  code = ("import json, sys; sys.path.insert(0, 'examples'); import digits; "
          "print('RESULTS', json.dumps(digits.main(['--no-progress'])))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
  results = json.loads(line[len("RESULTS "):])
  assert set(results) == {"float32", "mixed_bfloat16", "mixed_float16"}
  assert results["float32"]["accuracy"] > 95.0
  for policy in ("mixed_bfloat16", "mixed_float16"):
    assert results[policy]["accuracy"] >= results["float32"]["accuracy"] - 0.5, results
  assert results["mixed_float16"]["scale"] >= 2.0**15  # dynamic scaling was inserted
  assert results["mixed_bfloat16"]["scale"] == results["float32"]["scale"] == 1.0
  assert all(r["skipped"] == 0 for r in results.values())
