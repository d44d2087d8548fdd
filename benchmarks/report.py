"""Writing what the harness measured: RESULTS.md, results.json and a PNG chart.

Nothing here makes up a number: every table cell comes from a :class:`Measurement`
or from the machine description; a cell the harness could not measure reads ``n/a``.
The only constants are the datasheet peak FLOP/s in :data:`PEAK_TFLOPS`, used for
model-FLOPs utilization on known GPUs and labelled as such.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from benchmarks.candidates import HAND_SKIP
from benchmarks.measure import CompileCost, Measurement

# Dense (no sparsity) peak TFLOP/s from NVIDIA's datasheets, by a substring of
# jax's device_kind; the first match wins, so the PCIe H100 comes before the SXM one.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756, "float16": 756, "tf32": 378, "float32": 51}),
    ("H100", {"bfloat16": 989, "float16": 989, "tf32": 495, "float32": 67}),
    ("H200", {"bfloat16": 989, "float16": 989, "tf32": 495, "float32": 67}),
    ("A100", {"bfloat16": 312, "float16": 312, "tf32": 156, "float32": 19.5}),
    ("L4", {"bfloat16": 121, "float16": 121, "tf32": 60, "float32": 30.3}),
    ("V100", {"float16": 125, "float32": 15.7}),
)


@dataclasses.dataclass
class Section:
  """One table: a model (or the overhead check) and its measurements."""

  key: str
  title: str
  description: str
  results: list[Any]  # Measurement; CompileCost for the 'compile' section
  throughput_unit: str | None = None  # 'tokens/s', 'images/s'; None: no column
  notes: list[str] = dataclasses.field(default_factory=list)


# --- the machine -------------------------------------------------------------------------


def _cpu_model() -> str:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _git_revision() -> str:
  if os.environ.get("JAXAMP_GIT_REVISION"):  # a copy of the tree without .git (benchmarks/gpu.sh)
    return os.environ["JAXAMP_GIT_REVISION"]
  root = pathlib.Path(__file__).resolve().parent.parent
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                         capture_output=True, text=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           check=True, capture_output=True, text=True, timeout=10).stdout
    return rev + (" (with uncommitted changes)" if dirty.strip() else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def machine() -> dict[str, Any]:
  """Where the numbers come from: devices, CPU, versions, date."""
  devices = jax.devices()
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:
    usable = os.cpu_count()
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "backend": jax.default_backend(),
      "device": devices[0].device_kind,
      "device_count": len(devices),
      "cpu": _cpu_model(),
      "cpu_cores": usable,
      "python": platform.python_version(),
      "platform": platform.platform(),
      "versions": {p: _version(p) for p in ("jax", "jaxlib", "flax", "optax", "keras", "numpy",
                                            "jax-mixed-precision")},
      "git": _git_revision(),
      "command": "python benchmarks/run.py " + " ".join(sys.argv[1:]),
  }


def machine_line(info: dict[str, Any], git: bool = True) -> str:
  """One sentence naming the machine of :func:`machine`'s ``info``: CPU, cores, backend,
  Python, package versions and (``git``) jaxamp's revision."""
  return (f"Machine: {info['cpu']}, {info['cpu_cores']} cores ({info['backend']}), Python "
          f"{info['python']}, " + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
          + (f", jaxamp git {info['git']}." if git else "."))


def peak_tflops(device_kind: str, policy: str) -> float | None:
  """The datasheet dense peak for the dtype ``policy`` computes in, or None."""
  if "fp8" in policy:
    key = "fp8"  # no datasheet figure listed: no MFU column for it
  elif policy.endswith("bfloat16"):
    key = "bfloat16"
  elif policy.endswith("float16"):
    key = "float16"
  elif policy.endswith("HIGHEST"):
    key = "float32"
  else:
    key = "tf32"  # float32 at the default precision: TF32 tensor cores where they exist
  for name, peaks in PEAK_TFLOPS:
    if name in device_kind:
      return peaks.get(key, peaks.get("float32") if key == "tf32" else None)
  return None


# --- formatting --------------------------------------------------------------------------------


_NA = "—"  # not applicable to this row; "n/a" is reserved for what could not be measured


def _fmt(x: float | None, digits: int = 2, scale: float = 1.0) -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "n/a"
  return f"{x * scale:,.{digits}f}"


def _mib(n: int | None) -> str:
  return "n/a" if n is None else f"{n / 2**20:,.1f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  align = ["---" if i < 2 else "---:" for i in range(len(header))]
  lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return lines


def _baseline(results: Sequence[Measurement], impl: str, policy: str) -> Measurement | None:
  for m in results:
    if m.impl == impl and m.policy == policy and m.round_step_s:
      return m
  return None


def model_table(section: Section, device_kind: str) -> list[str]:
  """The table of one model section (LM, ResNet or matmul)."""
  results = section.results
  base = _baseline(results, "jaxamp", "float32") or _baseline(results, "jax.numpy", "float32")
  peaks = any(peak_tflops(device_kind, m.policy) for m in results)
  header = ["implementation", "policy", "ms/step", "IQR %"]
  if section.throughput_unit:
    header.append(section.throughput_unit)
  has_hand = any(m.impl == "hand-written Flax" for m in results)
  header += ["× vs float32"] + (["× vs hand-written"] if has_hand else []) + ["compile s", "XLA peak MiB", "XLA temp MiB",
             "residuals MiB", "half-precision matmul FLOPs %", "matmul GFLOP/step",
             "achieved TFLOP/s"]
  if peaks:
    header.append("MFU %")
  rows = []
  for m in results:
    if m.error:
      continue
    hand = _baseline(results, "hand-written Flax", m.policy)
    speedup = base.step_s / m.step_s if base and m.round_step_s else None
    vs_hand = (m.step_s / hand.step_s if hand and m.impl == "jaxamp" and m.round_step_s
               else None)
    tflops = (m.matmul_flops / m.step_s / 1e12 if m.matmul_flops and m.round_step_s
              else None)
    row = [m.impl, m.policy, _fmt(m.step_s, 2, 1e3), _fmt(m.spread, 1, 100)]
    if section.throughput_unit:
      row.append(_fmt(m.throughput, 0))
    row += [_fmt(speedup, 2) if base else _NA] + (
        [_fmt(vs_hand, 3) if m.impl == "jaxamp" else _NA] if has_hand else []) + [
            _fmt(m.compile_s, 1),
            _mib(m.memory.get("peak")), _mib(m.memory.get("temp")), _mib(m.residual_bytes),
            _fmt(m.half_share, 1, 100),
            _fmt(None if m.matmul_flops is None else m.matmul_flops / 1e9, 3),
            _fmt(tflops, 3)]
    if peaks:
      peak = peak_tflops(device_kind, m.policy)
      row.append(_fmt(tflops / peak, 1, 100) if tflops and peak else _NA)
    rows.append(row)
  return _table(header, rows)


def paired_ratio(a: Measurement, b: Measurement, resamples: int = 2000
                 ) -> tuple[float, float, float]:
  """``a``'s step time over ``b``'s: the median of the per-round ratios (the two ran back
  to back in each round, so a slow spell hits both) and its 95 % bootstrap interval
  (seeded: the same rounds give the same interval). Rounds are resampled with
  replacement; where they came from several sittings (``round_sitting``), the sittings
  are resampled first and then the rounds within each, so an interval also says how
  much the sittings disagree.

  Example:
    >>> from benchmarks.measure import Measurement
    >>> m = lambda times: Measurement("x", "p", None, 0.0, {}, times)
    >>> paired_ratio(m([2.0, 2.2, 2.0]), m([2.0, 2.0, 2.0]))
    (1.0, 1.0, 1.1)
  """
  if a.round_sitting != b.round_sitting or len(a.round_step_s) != len(b.round_step_s):
    raise ValueError(f"paired_ratio: {a.impl} and {b.impl} were not timed in the same rounds")
  ratios = np.array([x / y for x, y in zip(a.round_step_s, b.round_step_s)])
  rng = np.random.default_rng(0)
  sitting = np.array(a.round_sitting or [0] * len(ratios))
  groups = [ratios[sitting == s] for s in np.unique(sitting)]
  medians = np.empty(resamples)
  for i in range(resamples):
    picked = [groups[g] for g in rng.integers(0, len(groups), len(groups))]
    medians[i] = np.median(np.concatenate([g[rng.integers(0, len(g), len(g))]
                                           for g in picked]))
  low, high = np.percentile(medians, [2.5, 97.5])
  return float(np.median(ratios)), float(low), float(high)


def overhead_table(section: Section, limit: float) -> tuple[list[str], list[tuple[str, float]]]:
  """jaxamp's ``train.step`` against the hand-written step, per policy; where the section
  has a hand-written step with jaxamp's exact skip too, jaxamp's ratio to that one."""
  rows, ratios = [], []
  with_skip = any(m.impl == HAND_SKIP for m in section.results)
  for policy in dict.fromkeys(m.policy for m in section.results):
    amp = _baseline(section.results, "jaxamp", policy)
    hand = _baseline(section.results, "hand-written Flax", policy)
    if amp is None or hand is None:
      continue
    ratio, low, high = paired_ratio(amp, hand)
    ratios.append((policy, ratio))
    row = [policy, _fmt(amp.step_s, 2, 1e3), _fmt(amp.spread, 1, 100),
           _fmt(hand.step_s, 2, 1e3), _fmt(hand.spread, 1, 100), f"{ratio:.3f}",
           f"{low:.3f}–{high:.3f}", "yes" if ratio <= limit else "**no**"]
    if with_skip:
      skip = _baseline(section.results, HAND_SKIP, policy)
      row += ([_fmt(skip.step_s, 2, 1e3), "{:.3f} ({:.3f}–{:.3f})".format(
          *paired_ratio(amp, skip))] if skip else [_NA, _NA])
    rows.append(row)
  header = ["policy", "jaxamp ms" if section.key == "eager" else "jaxamp train.step ms",
            "IQR %", "hand-written ms", "IQR %", "ratio", "95 % interval", f"≤ {limit}"]
  if with_skip:
    header += ["hand-written + skip ms", "ratio to it (95 %)"]
  return _table(header, rows), ratios


def compile_table(section: Section, limits: dict[str, float]) -> list[str]:
  """jaxamp's first-call costs over the hand-written step's, per layer count and policy."""
  rows = []
  pairs: dict[tuple[int, str], dict[str, CompileCost]] = {}
  for c in section.results:
    pairs.setdefault((c.layers, c.policy), {})[c.impl] = c
  for (layers, policy), pair in pairs.items():
    amp, hand = pair.get("jaxamp"), pair.get("hand-written Flax")
    if amp is None or hand is None or amp.error or hand.error:
      continue
    row = [str(layers), policy]
    # The first call's cost, what the target is on: the three stages' medians summed.
    total = [sum(c.median(what) for what in ("trace_s", "lower_s", "compile_s"))
             for c in (amp, hand)]
    row += [_fmt(total[0], 2), _fmt(total[1], 2), _fmt(total[0] / total[1], 2)]
    for what in ("trace_s", "lower_s", "compile_s"):
      a, h = amp.median(what), hand.median(what)
      row += [_fmt(a, 2), _fmt(h, 2), _fmt(a / h if h else None, 2)]
    # The repetitions pair up (each ran both steps, back to back): their ratios' range.
    per_rep = [x / y for x, y in zip(amp.compile_s, hand.compile_s) if y]
    row.append(f"{min(per_rep):.2f}–{max(per_rep):.2f}" if per_rep else "—")
    a, h = amp.memory.get("temp"), hand.memory.get("temp")
    row += [_mib(a), _mib(h), _fmt(a / h if a is not None and h else None, 3)]
    rows.append(row)
  header = ["layers", "policy", "first call s", "hand", f"× (≤ {limits['time']})",
            "trace s", "hand", "×", "lower s", "hand", "×",
            "XLA compile s", "hand", "×", "compile × per repetition",
            "XLA temp MiB", "hand",
            f"× (≤ {limits['temp']})"]
  return _table(header, rows)


def write_markdown(path: pathlib.Path, info: dict[str, Any], sections: Sequence[Section],
                   settings: dict[str, Any], chart: str | None, overhead_limit: float,
                   compile_limits: dict[str, float] | None = None,
                   eager_limit: float = 1.10) -> None:
  v = info["versions"]
  mfu = any(peak_tflops(info["device"], m.policy) for s in sections for m in s.results)
  lines = [
      "# jaxamp benchmark results",
      "",
      f"Measured by `{info['command']}` on {info['date']} (size `{settings['size']}`, "
      f"{settings['seconds']} s in all). "
      "Generated file: rerun the harness rather than editing it.",
      "",
      "## Machine",
      "",
      *_table(["", ""], [
          ["backend / device", f"{info['backend']} / {info['device']} × {info['device_count']}"],
          ["CPU", f"{info['cpu']}, {info['cpu_cores']} cores usable"],
          ["Python / OS", f"{info['python']} / {info['platform']}"],
          ["jax / jaxlib", f"{v['jax']} / {v['jaxlib']}"],
          ["flax / optax / keras", f"{v['flax']} / {v['optax']} / {v['keras']}"],
          ["jaxamp", f"{v.get('jax-mixed-precision', v.get('jaxamp'))}, git {info['git']}"],
      ]),
      "",
      "## How to read the tables",
      "",
      f"- **ms/step**: median over {settings['rounds']} interleaved rounds of "
      f"{settings['steps']} step(s) each, after {settings['warmup']} warm-up step(s); every "
      "round runs each candidate in a rotating order, so slow spells hit all alike. "
      "**IQR %**: interquartile range of the rounds over the median.",
      "- **× vs float32**: jaxamp float32's step time over this row's (higher is faster). "
      "**× vs hand-written**: jaxamp's step time over the hand-written Flax step's with the "
      "same policy (lower is better; 1.000 is no overhead). — : does not apply; n/a: could "
      "not be measured. **ratio** (overhead, eager): the median of per-round ratios of two "
      "steps run back to back; **95 % interval**: that median's bootstrap interval (over "
      "the sittings, each on fresh instances, and the rounds within them), how far this "
      "machine's noise and an instance's luck leave it uncertain.",
      "- **compile s**: `.trace(...).lower().compile()` of the step (`train.trace` for jaxamp, "
      "`jax.jit(step)` otherwise), tracing included. **XLA peak / "
      "temp MiB**: `compiled.memory_analysis()` (peak: live arguments, outputs and "
      "temporaries; the state is donated; where the backend's own peak is below its temp "
      "size, as on XLA:CPU, arguments + outputs + temporaries − donated aliases).",
      "- **residuals MiB**: what reverse mode saves between the forward and backward pass "
      "(activations, not parameters), from `jaxamp.precision_report`.",
      "- **half-precision matmul FLOPs %**: share of the forward + backward matmul and "
      "convolution FLOPs whose operands are float16/bfloat16 in the lowered program "
      "(`jaxamp.precision_report(loss, ..., backward=True)`). **achieved TFLOP/s**: those "
      "FLOPs over the step time." + (" **MFU %**: achieved over the datasheet dense peak for "
                                     "the policy's compute dtype (TF32 for float32; "
                                     "`benchmarks/report.py` lists the peaks)." if mfu else ""),
      "",
  ]
  if settings.get("keras"):
    lines += [f"Keras 3: {settings['keras']}.", ""]
  if chart:
    lines += [f"![step time and memory per policy]({chart})", ""]
  for s in sections:
    lines += _section_lines(s, info, eager_limit if s.key == "eager" else overhead_limit,
                            compile_limits)
  path.write_text("\n".join(lines).rstrip() + "\n")


def _section_lines(s: Section, info: dict[str, Any], overhead_limit: float,
                   compile_limits: dict[str, float] | None = None) -> list[str]:
  lines = [f"## {s.title}", "", s.description, ""]
  if s.key == "compile":
    lines += compile_table(s, compile_limits or {"time": 1.15, "temp": 1.02})
  elif s.key in ("overhead", "eager"):
    table, ratios = overhead_table(s, overhead_limit)
    lines += table
    if ratios:
      worst = max(ratios, key=lambda pr: pr[1])
      verdict = "meets" if worst[1] <= overhead_limit else "does NOT meet"
      lines += ["", f"Worst ratio {worst[1]:.3f} ({worst[0]}): {verdict} the "
                f"≤ {overhead_limit} requirement on this machine."]
  else:
    lines += model_table(s, info["device"])
  failed = [m for m in s.results if m.error]
  if failed and s.key == "compile":
    lines += ["", "Not measured:", ""]
    lines += [f"- {m.impl} / {m.policy} / {m.layers} layers: `{m.error}`" for m in failed]
  elif failed:
    lines += ["", "Not measured:", ""]
    lines += [f"- {m.impl} / {m.policy}: `{m.error}`" for m in failed]
  if s.notes:
    lines += [""] + [f"- {n}" for n in s.notes]
  return lines + [""]


def write_json(path: pathlib.Path, info: dict[str, Any], sections: Sequence[Section],
               settings: dict[str, Any]) -> None:
  data = {"machine": info, "settings": settings,
          "sections": {s.key: {"title": s.title, "description": s.description,
                               "throughput_unit": s.throughput_unit, "notes": s.notes,
                               "results": [m.to_dict() for m in s.results]}
                       for s in sections}}
  path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def read_sections(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, Section]]:
  """The machine and the sections of a ``results.json`` that :func:`write_json` wrote.

  ``run.py --merge`` uses it to re-run some sections and keep the others.
  """
  data = json.loads(path.read_text())
  sections = {}
  for key, s in data["sections"].items():
    kind = CompileCost if key == "compile" else Measurement
    names = {f.name for f in dataclasses.fields(kind)}
    results = [kind(**{k: v for k, v in r.items() if k in names}) for r in s["results"]]
    sections[key] = Section(key, s["title"], s["description"], results,
                            s.get("throughput_unit"), s.get("notes", []))
  return data["machine"], sections


_COLORS = {"jaxamp": "#1f77b4", "hand-written Flax": "#ff7f0e", "Keras 3": "#2ca02c",
           "jax.numpy": "#7f7f7f", "jaxamp.autocast": "#9467bd"}


def write_chart(path: pathlib.Path, sections: Sequence[Section], info: dict[str, Any]) -> bool:
  """Bars per section: step time relative to float32, and residual (activation) memory.

  Returns False (and writes nothing) when no section has a timed result.
  """
  shown = [s for s in sections if s.key not in ("overhead", "eager", "compile")
           and any(m.round_step_s for m in s.results)]
  if not shown:
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(len(shown), 2, figsize=(13, 3.6 * len(shown)), squeeze=False)
  for row, s in zip(axes, shown):
    timed = [m for m in s.results if m.round_step_s]
    base = (_baseline(timed, "jaxamp", "float32") or _baseline(timed, "jax.numpy", "float32")
            or timed[0])
    labels = [f"{m.policy}\n{m.impl}" for m in timed]
    colors = [_COLORS.get(m.impl, "#333333") for m in timed]
    speed = [base.step_s / m.step_s for m in timed]
    row[0].bar(range(len(timed)), speed, color=colors)
    row[0].axhline(1.0, color="black", linewidth=0.8)
    row[0].set_ylabel(f"speed vs {base.impl} {base.policy}")
    row[0].set_title(f"{s.title}: speed (higher is faster)", fontsize=10)
    # Activation memory is what a policy changes; parameters and optimizer state are
    # float32 under every mixed policy.
    saved = [(m.residual_bytes or 0) / 2**20 for m in timed]
    row[1].bar(range(len(timed)), saved, color=colors)
    row[1].set_ylabel("residuals MiB")
    row[1].set_title(f"{s.title}: activations saved for backward (lower is less)",
                     fontsize=10)
    for ax in row:
      ax.set_xticks(range(len(timed)))
      ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
  where = (f"{info['cpu']}, {info['cpu_cores']} cores" if info["backend"] == "cpu"
           else f"{info['device']} × {info['device_count']}")
  fig.suptitle(f"jaxamp benchmarks — {info['backend']}: {where}, {info['date']}", fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True
