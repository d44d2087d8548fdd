"""jaxamp's benchmark harness: speed, memory and precision per policy, in one run.

Sections (``--only`` picks some):

- ``lm``: a GPT-style transformer LM (Flax NNX), ``resnet``: ResNet-50 (Flax Linen,
  BatchNorm) on synthetic ImageNet-shaped data, ``matmul``: one large square matmul.
  Each compares jaxamp's train step with a hand-written Flax step (``dtype`` set by hand
  on every layer, loss scaling written out) and Keras 3 on the JAX backend with the
  same architecture, under float32 (default matmul precision, TF32 on Ampere+ GPUs),
  float32 at ``precision=HIGHEST``, mixed_bfloat16 and mixed_float16. Per candidate:
  step time (median of interleaved rounds after warm-up), throughput, compile time,
  XLA's compiled memory figures, residual (activation) bytes, the share of forward +
  backward matmul FLOPs in half precision, achieved TFLOP/s and, on known GPUs, MFU.
- ``overhead``: jaxamp's ``train.step`` against the equivalent hand-written step (same
  model, same optax chain), through the calls a user makes; the ratio must be ≤ 1.03.
- ``compile``: what the first call costs (issue 12): trace, lowering and XLA compile time
  and XLA's temporary bytes of ``train.step`` against the hand-written step, for the LM
  at 2 and 48 layers (targets: time ≤ 1.15×, temp bytes ≤ 1.02×).

``--lower-only`` compiles and runs nothing: it lowers every candidate of the chosen
sections for CUDA (``--platform``) from abstract inputs, so the GPU configuration can be
checked on a machine without a GPU, and prints each program's matmul count and
half-precision share. It writes no files and exits non-zero if any candidate fails.

Writes ``RESULTS.md``, ``results.json`` and ``results.png`` into ``--out``.

    python benchmarks/run.py --size cpu                 # the committed CPU numbers
    python benchmarks/run.py --size gpu                 # full size, on a GPU
    python benchmarks/run.py --size cpu --only overhead
    python benchmarks/run.py --size smoke --out /tmp/b  # seconds: checks the harness runs
    python benchmarks/run.py --size gpu --lower-only    # on any machine: the GPU programs lower
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
import warnings
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
# Every candidate's state stays on the device while they take turns: let JAX's GPU
# allocator have more than its default 75 % (read when the backend starts).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # pylint: disable=g-import-not-at-top
import jaxamp  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top

from benchmarks import candidates, models, report  # pylint: disable=g-import-not-at-top
from benchmarks.measure import (  # pylint: disable=g-import-not-at-top
    Lowering, compile_costs, lower_for, measure, measure_sittings)

# The overhead comparison runs first: on a 2-core CPU its ratio drifted when it followed
# the ResNet-50 section (whose compiled programs and buffers it then shares the process
# with), while measured first or alone it agreed across runs.
SECTIONS = ("overhead", "eager", "compile", "lm", "resnet", "matmul")
# Command-line spellings of the implementations and policy labels.
IMPL_FLAGS = dict(zip(("jaxamp", "hand", "keras"), candidates.IMPLS))
POLICY_FLAGS = dict(zip(("float32", "float32-highest", "mixed_bfloat16", "mixed_float16"),
                        candidates.POLICIES))
OVERHEAD_LIMIT = 1.03
EAGER_LIMIT = 1.10  # issue 12: an eager policy-wrapped call / the hand-set model's
COMPILE_LIMITS = {"time": 1.15, "temp": 1.02}  # issue 12: jaxamp / hand-written


@dataclasses.dataclass(frozen=True)
class Size:
  """Model sizes and timing effort of one ``--size``."""

  lm: models.LMConfig
  resnet: models.ResNetConfig
  matmul: int
  warmup: int
  rounds: int
  steps: int
  overhead_rounds: int  # per sitting
  overhead_steps: int
  # Overhead and eager pairs are measured in this many sittings, each on fresh instances
  # (see measure.measure_sittings), their rounds pooled.
  overhead_sittings: int = 1
  resnet_policies: tuple[str, ...] = candidates.POLICIES
  # Policies the LM section adds for jaxamp (FP8: lowered and measured at --size gpu).
  lm_extra: tuple[str, ...] = ()
  compile_layers: tuple[int, ...] = (2, 48)
  compile_reps: int = 5
  compile_trace_reps: int = 4  # more repetitions timing the trace alone
  # The overhead section's other two models: the parameter-heavy MLP the trials used
  # (256-1024x3-10, batch 64) and a small ResNet (BatchNorm).
  mlp: models.MLPConfig = models.MLPConfig((256, 1024, 1024, 1024, 10), 64)
  overhead_resnet: models.ResNetConfig = models.ResNetConfig((1, 1, 1, 1), 16, 10, 32, 16)


SIZES = {
    # Seconds: every code path, tiny shapes. Numbers from it mean nothing.
    "smoke": Size(lm=models.LMConfig(vocab=64, dim=32, heads=2, layers=1, seq_len=16, batch=4),
                  resnet=models.ResNetConfig((1,), 4, 10, 16, 2), matmul=128,
                  warmup=1, rounds=2, steps=1, overhead_rounds=2, overhead_steps=1,
                  compile_layers=(1, 2), compile_reps=1, compile_trace_reps=0,
                  mlp=models.MLPConfig((16, 32, 4), 4),
                  overhead_resnet=models.ResNetConfig((1,), 4, 10, 16, 2)),
    # The committed CPU numbers: a few minutes on 2 cores. ResNet-50's depth at a quarter
    # of its width on 64x64 images; float32 HIGHEST is float32 on a CPU, so ResNet skips it.
    "cpu": Size(lm=models.LMConfig(vocab=256, dim=128, heads=4, layers=2, seq_len=128, batch=8),
                resnet=models.ResNetConfig((3, 4, 6, 3), 16, 1000, 64, 8), matmul=1024,
                warmup=2, rounds=7, steps=2, overhead_rounds=12, overhead_steps=3,
                overhead_sittings=5,
                resnet_policies=("float32", "mixed_bfloat16", "mixed_float16")),
    # Full size, for one GPU: GPT-2-small-shaped LM on 8k tokens, ResNet-50 at 224x224,
    # batch 256, as in the classic AMP tutorials.
    "gpu": Size(lm=models.LMConfig(vocab=32768, dim=768, heads=12, layers=12, seq_len=1024,
                                   batch=8),
                resnet=models.ResNetConfig((3, 4, 6, 3), 64, 1000, 224, 256), matmul=8192,
                warmup=5, rounds=7, steps=5, overhead_rounds=10, overhead_steps=5,
                overhead_sittings=2,
                lm_extra=candidates.FP8_POLICIES),
}


def _lm_section(size: Size, impls, policies, args) -> report.Section:
  cfg = size.lm
  policies = [*policies, *(p for p in size.lm_extra if p not in policies)]
  results = measure(candidates.lm_candidates(cfg, impls, policies), warmup=args.warmup,
                    rounds=args.rounds, steps=args.steps)
  return report.Section(
      "lm", "Transformer LM (Flax NNX)",
      f"GPT-style decoder (pre-norm, fused QKV, float32 softmax): vocab {cfg.vocab}, "
      f"dim {cfg.dim}, {cfg.heads} heads, {cfg.layers} layer{'s' * (cfg.layers != 1)}; batch {cfg.batch} × "
      f"{cfg.seq_len} tokens of random ids; AdamW with global-norm clipping.",
      results, "tokens/s")


def _resnet_section(size: Size, impls, policies, args) -> report.Section:
  cfg = size.resnet
  policies = [p for p in policies if p in size.resnet_policies]
  results = measure(candidates.resnet_candidates(cfg, impls, policies), warmup=args.warmup,
                    rounds=args.rounds, steps=args.steps)
  return report.Section(
      "resnet", f"{cfg.name} (Flax Linen, BatchNorm)",
      f"{cfg.name} v1.5 with {cfg.num_filters} base filters, {cfg.num_classes} classes, "
      f"on synthetic {cfg.image_size}×{cfg.image_size} images, batch {cfg.batch}; SGD with "
      "Nesterov momentum; BatchNorm statistics updated every step.",
      results, "images/s")


def _matmul_section(size: Size, policies, args) -> report.Section:
  n = size.matmul
  # mixed_bfloat16 brings both bfloat16 rows (inputs cast beforehand, autocast), etc.
  labels = [p for p in candidates.MATMUL_POLICIES
            if p in policies or f"mixed_{p}" in policies]
  results = measure(candidates.matmul_candidates(n, labels), warmup=args.warmup,
                    rounds=args.rounds, steps=args.steps)
  return report.Section(
      "matmul", f"Matmul {n}×{n} @ {n}×{n}",
      f"One `a @ b` of two {n}×{n} matrices ({2 * n**3 / 1e9:.3g} GFLOP). `jax.numpy` rows "
      "get inputs already in the dtype; `jaxamp.autocast` rows get float32 inputs and "
      "cast them (the result is in the half dtype; XLA chooses the accumulation type).",
      results)


def _overhead_section(size: Size, policies, args) -> report.Section:
  cfg = size.lm
  policies = [p for p in policies if p != "float32 HIGHEST"]
  impls = ("jaxamp", "hand-written Flax", candidates.HAND_SKIP)
  models_ = {  # name -> candidates of one policy
      "MLP": lambda p: candidates.mlp_candidates(size.mlp, impls, [p]),
      "LM": lambda p: candidates.lm_candidates(cfg, impls, [p]),
      size.overhead_resnet.name: lambda p: candidates.resnet_candidates(
          size.overhead_resnet, impls, [p]),
  }
  results = []
  # One model's policy at a time: only its two or three steps are live, so none pays for
  # the others' memory, and every round times them back to back.
  for name, make in models_.items():
    for policy in policies:
      measured = measure_sittings(
          functools.partial(make, policy), args.overhead_sittings,
          warmup=args.warmup, rounds=args.overhead_rounds, steps=args.overhead_steps,
          aot=False, inspect=False)
      results += [dataclasses.replace(m, policy=f"{name} · {m.policy}") for m in measured]
  notes = ["jaxamp's step always checks the gradients for inf/NaN and skips a non-finite "
           "step (bfloat16 and float32 included) and computes the gradient norm for its "
           "metrics; the hand-written steps do that only where float16 needs it. "
           "**hand-written + skip** (float32, bfloat16): the hand-written step with that "
           "exact skip written in (a float32 sum of squares of the gradients, the update "
           "under `lax.cond`), run in the same rounds: jaxamp's ratio to it is what its "
           "step costs beyond the skip."]
  if args.size == "smoke":
    notes.append("Smoke size: the model is too small for the ratio to mean anything.")
  if jax.default_backend() != "cpu":
    notes.append("The ≤ 1.03 requirement is stated for CPU; this run is on "
                 f"{jax.default_backend()}.")
  return report.Section(
      "overhead", "Overhead: jaxamp train step vs hand-written (issues 4, 12)",
      f"Three models: an MLP {'-'.join(map(str, size.mlp.dims))} (batch {size.mlp.batch}, "
      "Adam: the optimizer dominates), the transformer LM of the `lm` section (dim "
      f"{cfg.dim}, {cfg.layers} layers, batch {cfg.batch} × {cfg.seq_len}, AdamW) and "
      f"{size.overhead_resnet.name} (BatchNorm, {size.overhead_resnet.image_size}² images, "
      f"batch {size.overhead_resnet.batch}, SGD); `train.step(state, batch)` against "
      "`jax.jit(hand_step, donate_argnums=0)` with the same optax chain and the model's "
      "`dtype` set by hand; float16 scaling written with `jaxamp.scale_loss`, "
      "`jaxamp.dynamic_loss_scale` and `jaxamp.skip_nonfinite`. Each policy's pair is "
      "measured on its own, in interleaved rounds "
      f"({_sittings(args)}); the ratio is the median of the per-round ratios (the steps of a "
      "policy run next to each other in a round).",
      results, notes=notes)


def _sittings(args, unit: str = "steps") -> str:
  rounds = f"{args.overhead_rounds} × {args.overhead_steps} {unit}"
  if args.overhead_sittings == 1:
    return rounds
  return (f"{args.overhead_sittings} sittings of {rounds}, each on fresh instances, the "
          "rounds pooled")


def _load() -> str:
  """The machine's 1-minute load average, for the notes: other work on a small machine
  moves the timings (CPU-time clocks less than wall clocks, but not to zero)."""
  try:
    return f"{os.getloadavg()[0]:.1f}"
  except OSError:
    return "unknown"


def _load_note(start: str) -> str:
  return (f"Load average (1 min) at the start and end: {start} and {_load()} on "
          f"{os.cpu_count()} cores.")


def _eager_section(size: Size, policies, args) -> report.Section:
  cfg = size.lm
  load = _load()
  results = measure_sittings(
      lambda: candidates.eager_candidates(cfg, policies), args.overhead_sittings,
      warmup=args.warmup, rounds=args.overhead_rounds, steps=args.overhead_steps,
      aot=False, inspect=False, group=2)
  return report.Section(
      "eager", "Eager calls: policy-wrapped model vs hand-set (issue 12)",
      f"The transformer LM of the `lm` section (dim {cfg.dim}, {cfg.layers} layers, batch "
      f"{cfg.batch} × {cfg.seq_len}), forward pass only, called without `jit`: "
      "`jaxamp.nnx.with_policy(model, policy)(ids)` against the same model with `dtype` "
      "set by hand on every layer. Every op dispatches on its own, so the ratio is the "
      "wrapper's Python work per call over the model's. Interleaved rounds "
      f"({_sittings(args, 'calls')}), median of per-round ratios.",
      results, notes=[f"Target: ≤ {EAGER_LIMIT}.", _load_note(load)])


def _first_call_notes(results) -> list[str]:
  """What the median leaves out: a process's first trace of a jaxamp step also runs the
  wrapper's matmul census (a forward trace, once per model class, policy and input
  shapes; ``jax.clear_caches`` does not reset it), so repetition 1 costs more."""
  firsts = [f"{c.layers} layers · {c.policy}: {c.trace_s[0]:.2f} s (median "
            f"{c.median('trace_s'):.2f})" for c in results
            if c.impl == "jaxamp" and not c.error and len(c.trace_s) > 1]
  if not firsts:
    return []
  return ["jaxamp trace s of repetition 1, which also runs the once-per-process matmul "
          "census of `jaxamp.nnx.with_policy` (a forward trace, only where some module "
          "computes in half; the median of 3 or more leaves it out): "
          + "; ".join(firsts) + "."]


def _compile_section(size: Size, policies, args) -> report.Section:
  reps = getattr(args, "compile_reps", None) or size.compile_reps
  load = _load()
  results = []
  for layers in size.compile_layers:
    cfg = dataclasses.replace(size.lm, layers=layers)
    runs = [(policy, jaxamp.clip_by_global_norm) for policy in policies]
    if layers == max(size.compile_layers) and "float32" in policies:
      # The same chain with optax's clip: what a user who keeps it pays (a second norm).
      runs.append(("float32", optax.clip_by_global_norm))
    for policy, clip in runs:
      pair = candidates.lm_candidates(cfg, ("jaxamp", "hand-written Flax"), [policy],
                                      jaxamp_clip=clip)
      if clip is not jaxamp.clip_by_global_norm:
        for c in pair:
          c.policy = f"{policy}, jaxamp with optax's clip"
      print(f"  {layers} layers: {' and '.join(c.name for c in pair)}")
      results += compile_costs(pair, layers, reps, size.compile_trace_reps)
      for c in pair:
        c.state = None
  return report.Section(
      "compile", "First-call cost: trace, lower, compile (issue 12)",
      f"The transformer LM of the `lm` section (dim {size.lm.dim}, batch {size.lm.batch} × "
      f"{size.lm.seq_len}) at {' and '.join(map(str, size.compile_layers))} layers: "
      "`.trace(state, batch)`, `.lower()` and `.compile()` of jaxamp's `train.step` "
      "(`train.trace`: the state check and the trace of the step's own jitted function, "
      "what a first `train.step` call runs; its chain clips with "
      "`jaxamp.clip_by_global_norm`, which reuses the step's gradient norm, and the row "
      "marked *with optax's clip* keeps `optax.clip_by_global_norm`, which computes a "
      "second one; jaxamp defers Python's full garbage collections while it traces a "
      "step, a plain `jax.jit` does not) and of the hand-written "
      "`jax.jit(step, donate_argnums=0)`, in CPU seconds of the process "
      "(`time.process_time`, all threads; other load on the machine does not count), "
      "each from cold caches "
      f"(`jax.clear_caches()`, then `gc.collect()`), median of {reps}"
      + (f" (trace: of {reps + size.compile_trace_reps}, {size.compile_trace_reps} of them "
         "tracing only)" if size.compile_trace_reps else "")
      + ", the two steps taking turns in every repetition; XLA temp MiB from "
      "`compiled.memory_analysis()`. Ratios are jaxamp over hand-written; targets ≤ "
      f"{COMPILE_LIMITS['time']} for the first call (trace + lower + compile, the stages' "
      f"medians summed; each stage's ratio is shown too), ≤ {COMPILE_LIMITS['temp']} for "
      "temp bytes.",
      results, notes=_first_call_notes(results) + [_load_note(load)])


def _lower_only(size: Size, impls, args) -> list[Lowering]:
  """Lowers every candidate of the model sections for ``args.platform``, one at a time."""
  build = {"lm": lambda i, p: candidates.lm_candidates(size.lm, [i], [p]),
           "resnet": lambda i, p: candidates.resnet_candidates(size.resnet, [i], [p]),
           "matmul": lambda i, label: candidates.matmul_candidates(size.matmul, [label])}
  rows = []
  for key in [k for k in ("lm", "resnet", "matmul") if k in args.only]:
    print(f"[{key}] lowering for {args.platform}")
    if key == "matmul":
      pairs = [(None, label) for label in candidates.MATMUL_POLICIES]
    else:
      allowed = size.resnet_policies if key == "resnet" else candidates.POLICIES
      pairs = [(i, p) for p in args.policies if p in allowed for i in impls]
      if key == "lm":
        pairs += [(i, p) for p in size.lm_extra for i in impls]
    for impl, policy in pairs:
      for c in build[key](impl, policy):  # one at a time: full-size states are large
        low = lower_for(c, args.platform)
        c.state = None
        rows.append(low)
        half = "n/a" if low.half_share is None else f"{100 * low.half_share:.1f}%"
        fp8 = f", {100 * low.fp8_share:.1f}% FP8" if low.fp8_share else ""
        status = f"FAILED: {low.error}" if low.error else f"{low.ops} matmuls, {half} half{fp8}"
        print(f"  {c.name:<40} {low.lower_s:6.1f} s  {status}")
  return rows


def _notes(sections: list[report.Section]) -> None:
  if jax.default_backend() == "cpu":
    for s in sections:
      if s.key not in ("overhead", "eager", "compile"):
        s.notes.append("On CPU, XLA computes bfloat16 dots by converting to float32 and "
                       "float16 has no fast path, so mixed precision saves memory here, "
                       "not time; float32 HIGHEST equals float32.")


def _merge(path: pathlib.Path, info: dict[str, Any], sections: list[report.Section],
           seconds: int) -> tuple[list[report.Section], int]:
  """``sections`` plus the ones of ``path`` not re-measured, in the harness's order."""
  old_info, old = report.read_sections(path)
  if (old_info["device"], old_info["device_count"]) != (info["device"], info["device_count"]):
    raise SystemExit(f"--merge: {path} was measured on {old_info['device']} × "
                     f"{old_info['device_count']}, this run is on {info['device']} × "
                     f"{info['device_count']}; use another --out.")
  kept = sorted(set(old) - {s.key for s in sections})
  for key in kept:
    note = (f"Measured earlier, at git {old_info['git']} on {old_info['date'][:10]}, and kept "
            "by `--merge`.")
    if old_info["git"] != info["git"] and not any(n.startswith("Measured earlier")
                                                  for n in old[key].notes):
      old[key].notes.append(note)
  merged = {**old, **{s.key: s for s in sections}}
  print(f"--merge: kept {', '.join(kept) or 'nothing'} from {path}")
  previous = json.loads(path.read_text())["settings"].get("seconds", 0)
  return [merged[k] for k in SECTIONS if k in merged], seconds + previous


def _write(out: pathlib.Path, info: dict[str, Any], sections: list[report.Section],
           settings: dict[str, Any]) -> None:
  out.mkdir(parents=True, exist_ok=True)
  chart = "results.png" if report.write_chart(out / "results.png", sections, info) else None
  report.write_markdown(out / "RESULTS.md", info, sections, settings, chart,
                        OVERHEAD_LIMIT, COMPILE_LIMITS, EAGER_LIMIT)
  report.write_json(out / "results.json", info, sections, settings)
  print(f"wrote {out / 'RESULTS.md'} ({settings['seconds']} s)")


def _render(out: pathlib.Path) -> dict[str, Any]:
  """Redraws ``out``'s tables from its ``results.json``: the measurements are kept."""
  path = out / "results.json"
  if not path.exists():
    raise SystemExit(f"--render: no {path} to draw from; measure first.")
  info, found = report.read_sections(path)
  settings = json.loads(path.read_text())["settings"]
  sections = [found[k] for k in SECTIONS if k in found]
  _write(out, info, sections, settings)
  return {"machine": info, "settings": settings, "sections": found}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="\n".join(__doc__.splitlines()[1:]))
  default_size = "cpu" if jax.default_backend() == "cpu" else "gpu"
  parser.add_argument("--size", choices=tuple(SIZES), default=default_size,
                      help=f"model sizes and effort (default here: {default_size})")
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path(__file__).resolve().parent,
                      help="folder for RESULTS.md, results.json, results.png "
                           "(default: benchmarks/)")
  parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                      help="sections to run (default: all)")
  parser.add_argument("--impls", nargs="+", choices=tuple(IMPL_FLAGS),
                      default=list(IMPL_FLAGS),
                      help="implementations to compare: jaxamp, hand-written Flax, Keras 3 "
                           "(default: all)")
  parser.add_argument("--policies", nargs="+", choices=tuple(POLICY_FLAGS),
                      default=list(POLICY_FLAGS),
                      help="policies to compare; float32-highest is float32 under "
                           "jax.default_matmul_precision('highest') (default: all)")
  parser.add_argument("--no-keras", action="store_true", help="leave Keras 3 out")
  parser.add_argument("--warmup", type=int, help="warm-up steps per candidate")
  parser.add_argument("--rounds", type=int, help="interleaved timing rounds")
  parser.add_argument("--steps", type=int, help="steps per candidate per round")
  parser.add_argument("--overhead-rounds", type=int,
                      help="rounds per sitting of the overhead and eager sections")
  parser.add_argument("--overhead-sittings", type=int,
                      help="sittings (fresh instances each) of the overhead and eager sections")
  parser.add_argument("--overhead-steps", type=int, help="steps per round, overhead section")
  parser.add_argument("--compile-reps", type=int,
                      help="cold-cache repetitions per candidate, compile section")
  parser.add_argument("--merge", action="store_true",
                      help="keep the sections of --out/results.json that this run does not "
                           "measure (they must come from the same machine)")
  parser.add_argument("--render", action="store_true",
                      help="measure nothing: rewrite --out/RESULTS.md (and the chart) from "
                           "--out/results.json, after a change to how tables are drawn")
  parser.add_argument("--lower-only", action="store_true",
                      help="lower every candidate for --platform, compile and run nothing, "
                           "write no files")
  parser.add_argument("--platform", default="cuda",
                      help="platform --lower-only lowers for (default: cuda)")
  args = parser.parse_args(argv)

  size = SIZES[args.size]
  args.warmup = size.warmup if args.warmup is None else args.warmup
  args.rounds = size.rounds if args.rounds is None else args.rounds
  args.steps = size.steps if args.steps is None else args.steps
  args.overhead_rounds = args.overhead_rounds or size.overhead_rounds
  args.overhead_sittings = args.overhead_sittings or size.overhead_sittings
  args.overhead_steps = args.overhead_steps or size.overhead_steps
  args.compile_reps = args.compile_reps or size.compile_reps
  args.policies = [POLICY_FLAGS[p] for p in args.policies]
  impls = [IMPL_FLAGS[i] for i in args.impls if not (args.no_keras and i == "keras")]
  keras_note = "left out with --no-keras" if args.no_keras else None
  if "Keras 3" in impls:
    try:
      models.import_keras()
    except ImportError as e:
      keras_note = f"not measured: {e} (`pip install -e '.[benchmarks]'`)"
      print(f"Keras 3 {keras_note}")
      impls.remove("Keras 3")

  if args.lower_only:
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message=".*float16.*", category=RuntimeWarning)
      rows = _lower_only(size, impls, args)
    failed = [r for r in rows if r.error]
    print(f"lowered {len(rows) - len(failed)} of {len(rows)} candidates for {args.platform}")
    return {"lowered": rows, "failed": failed}

  if args.render:
    return _render(args.out)

  info = report.machine()
  print(f"{info['backend']} / {info['device']} × {info['device_count']}; {info['cpu']}, "
        f"{info['cpu_cores']} cores; jax {info['versions']['jax']}; size {args.size}")
  sections: list[report.Section] = []
  start = time.perf_counter()
  with warnings.catch_warnings():
    # jaxamp warns once that float16 is slow on a CPU: the tables say so.
    warnings.filterwarnings("ignore", message=".*float16.*", category=RuntimeWarning)
    for key in sorted(args.only, key=SECTIONS.index):
      print(f"[{key}]")
      if key == "lm":
        sections.append(_lm_section(size, impls, args.policies, args))
      elif key == "resnet":
        sections.append(_resnet_section(size, impls, args.policies, args))
      elif key == "matmul":
        sections.append(_matmul_section(size, args.policies, args))
      elif key == "eager":
        sections.append(_eager_section(
            size, [p for p in args.policies if p != "float32 HIGHEST"], args))
      elif key == "compile":
        sections.append(_compile_section(
            size, [p for p in args.policies if p != "float32 HIGHEST"], args))
      else:
        sections.append(_overhead_section(size, args.policies, args))
  _notes(sections)
  seconds = round(time.perf_counter() - start)
  if args.merge and (args.out / "results.json").exists():
    sections, seconds = _merge(args.out / "results.json", info, sections, seconds)

  settings = {"size": args.size, "warmup": args.warmup, "rounds": args.rounds,
              "steps": args.steps, "impls": impls, "policies": args.policies,
              "sizes": dataclasses.asdict(size), "keras": keras_note,
              "seconds": seconds}
  _write(args.out, info, sections, settings)
  return {"machine": info, "settings": settings, "sections": {s.key: s for s in sections}}


if __name__ == "__main__":
  sys.exit(1 if main().get("failed") else 0)
