"""What XLA gets and makes of jaxamp's train step, against the hand-written step.

The compile section (``run.py --only compile``) times the first call; this counts what
is compiled. For the candidates the compile and overhead sections build (the
transformer LM at 2 layers and ResNet-14, jaxamp's ``train.step`` against the
hand-written step, under float32, mixed_bfloat16 and mixed_float16), it traces each step
once from abstract inputs and counts:

- in the optimized CPU HLO (``traced.lower().compile().as_text()``): instructions (all,
  and outside fused computations), computations, fusions by kind, dots, convolutions,
  custom-calls, converts, conditionals, whiles, collectives, distinct matmul shapes, and
  what the conditional branches hold;
- in the StableHLO jaxamp hands XLA (``traced.lower().as_text()``): ops by kind, and
  what the ``stablehlo.case`` regions hold;
- in the StableHLO lowered for CUDA from this machine
  (``traced.lower(lowering_platforms=('cuda',))``): the same counts, the program
  XLA:GPU would receive (no GPU is needed to lower for one).

Under float32 (and partly mixed_bfloat16) it counts three more steps, to tell the
exact skip's share from the rest: the hand-written step with the overhead section's
skip (``lax.cond``), with that skip written as selects, and jaxamp's step made with
``skip_nonfinite=False``.

Writes ``HLO.md`` (tables, jaxamp over hand-written ratios, and findings drawn from
them and from ``gpu/results.json``'s compile times) and ``hlo.json`` (every count) into
``--out``; a few minutes on 2 CPU cores, most of it XLA compiling::

    python benchmarks/hlo_counts.py --out benchmarks/compile
    python benchmarks/hlo_counts.py --out benchmarks/compile --render  # HLO.md from hlo.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import pathlib
import re
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any
from unittest import mock

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

import jaxamp  # pylint: disable=g-import-not-at-top
from benchmarks import candidates, report  # pylint: disable=g-import-not-at-top
from benchmarks.measure import Candidate, abstract  # pylint: disable=g-import-not-at-top
from benchmarks.run import SIZES  # pylint: disable=g-import-not-at-top

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")


# --- optimized HLO text -----------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  text: str  # the whole line, ``ROOT`` dropped


@dataclasses.dataclass
class Computation:
  name: str
  entry: bool
  instructions: list[Instruction]

  def callees(self) -> dict[str, str]:
    """The computations this one calls, each with how (``fusion``, ``branch``, ...)."""
    out = {}
    for ins in self.instructions:
      for how, name in re.findall(
          r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)",
          ins.text):
        out[name] = "fusion" if how == "calls" and ins.opcode == "fusion" else how
      for group in re.findall(r"branch_computations=\{([^}]*)\}", ins.text):
        for name in group.split(","):
          out[name.strip().lstrip("%")] = "branch"
    return out


def _skip_type(rest: str) -> str:
  """``rest`` (``type opcode(operands), attributes``) after its result type."""
  if not rest.startswith("("):
    return rest.split(" ", 1)[1]
  depth = 0
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[i + 1:].lstrip()
  raise ValueError(f"unbalanced tuple type: {rest[:80]}")


def parse_hlo(text: str) -> dict[str, Computation]:
  """The computations of an HLO module's text, by name, in order."""
  comps: dict[str, Computation] = {}
  current = None
  for line in text.splitlines():
    if not line or line.startswith("HloModule"):
      continue
    if line[0] not in " }" and line.rstrip().endswith("{"):
      m = re.match(r"(ENTRY )?%?([\w.\-]+)", line)
      current = comps.setdefault(m.group(2), Computation(m.group(2), bool(m.group(1)), []))
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    s = line.strip()
    s = s[5:] if s.startswith("ROOT ") else s
    m = re.match(r"%?([\w.\-]+) = ", s)
    if not m:
      continue
    opcode = re.match(r"([\w\-]+)\(", _skip_type(s[m.end():])).group(1)
    current.instructions.append(Instruction(m.group(1), opcode, s))
  return comps


def _reachable(comps: dict[str, Computation], roots: Iterable[str]) -> set[str]:
  seen: set[str] = set()
  todo = list(roots)
  while todo:
    name = todo.pop()
    if name not in seen and name in comps:
      seen.add(name)
      todo += comps[name].callees()
  return seen


def _dot_signature(ins: Instruction) -> str:
  """A dot or convolution without names: result and operand shapes, dimensions, window."""
  text = re.sub(r"%[\w.\-]+", "", ins.text.split(" = ", 1)[1])
  text = re.sub(r"\{[0-9,]*\}(?=[ ,)])", "", text)  # layouts
  text = re.sub(r", (metadata|backend_config|frontend_attributes|operand_precision)=.*", "", text)
  return text


def _fusion_class(comps: dict[str, Computation], fusion: Instruction) -> str:
  """``'matmul'`` (holds a dot, convolution or custom-call), ``'reduction'`` (else
  holds a reduce), or ``'elementwise'``."""
  inside = _reachable(comps, re.findall(r"calls=%?([\w.\-]+)", fusion.text))
  ops = {i.opcode for n in inside for i in comps[n].instructions}
  if ops & {"dot", "convolution", "custom-call"}:
    return "matmul"
  return "reduction" if ops & {"reduce", "reduce-window"} else "elementwise"


def hlo_counts(text: str) -> dict[str, Any]:
  """Instruction counts of an optimized HLO module (``compiled.as_text()``).

  ``instructions``: every instruction of every computation, fused computations
  included; ``scheduled``: those outside fused computations and reducers (the entry,
  conditional branches, loop bodies: what XLA schedules, one kernel or buffer operation
  each); ``fusions``: fusion instructions there, by kind and by what they hold;
  ``dot``, ``convert`` and so on: anywhere, fused or not; ``branches``: each
  conditional branch (the larger one of jaxamp's skip is the update, ``'apply'``).
  """
  comps = parse_hlo(text)
  entry = next(c for c in comps.values() if c.entry)
  kinds: dict[str, str] = {entry.name: "entry"}
  for c in comps.values():
    for name, how in c.callees().items():
      kinds.setdefault(name, how)
  control = [n for n in comps if kinds.get(n) in ("entry", "branch", "body", "condition",
                                                   "true_computation", "false_computation")]
  ops = collections.Counter(i.opcode for c in comps.values() for i in c.instructions)
  scheduled = [i for n in control for i in comps[n].instructions]
  fusion_kinds, fusion_classes = collections.Counter(), collections.Counter()
  for i in scheduled:
    if i.opcode == "fusion":
      kind = re.search(r"kind=(k\w+)", i.text)
      fusion_kinds[kind.group(1) if kind else "?"] += 1
      fusion_classes[_fusion_class(comps, i)] += 1
  targets = collections.Counter(re.search(r'custom_call_target="([^"]*)"', i.text).group(1)
                                for c in comps.values() for i in c.instructions
                                if i.opcode == "custom-call")
  matmuls = {_dot_signature(i) for c in comps.values() for i in c.instructions
             if i.opcode in ("dot", "convolution")}
  branches = []
  for i in scheduled:
    if i.opcode != "conditional":
      continue
    names = [n.strip().lstrip("%") for g in re.findall(r"branch_computations=\{([^}]*)\}",
                                                        i.text) for n in g.split(",")]
    names += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", i.text)
    found = []
    for name in names:
      inside = _reachable(comps, [name])
      top = comps[name].instructions
      classes = collections.Counter(_fusion_class(comps, j) for j in top if j.opcode == "fusion")
      found.append({
          "instructions": sum(len(comps[n].instructions) for n in inside),
          "scheduled": len(top),
          "fusions": sum(classes.values()),
          **{f"fusions: {k}": classes[k] for k in ("matmul", "reduction", "elementwise")},
          "converts": sum(j.opcode == "convert" for n in inside for j in comps[n].instructions)})
    largest = max(range(len(found)), key=lambda k: found[k]["instructions"])
    for k, b in enumerate(found):
      b["role"] = "apply (the update)" if k == largest else "skip"
    branches += found
  in_branches = lambda key: sum(b[key] for b in branches)
  return {
      "instructions": sum(ops.values()),
      "scheduled": len(scheduled),
      "computations": len(comps),
      "fused computations": sum(k == "fusion" for k in kinds.values()),
      "fusions": sum(fusion_kinds.values()),
      **{f"fusion {k}": v for k, v in sorted(fusion_kinds.items())},
      **{f"fusions: {k}": fusion_classes[k] for k in ("matmul", "reduction", "elementwise")},
      "dot": ops["dot"],
      "convolution": ops["convolution"],
      "custom-call": ops["custom-call"],
      "custom-call targets": dict(targets),
      "distinct matmul shapes": len(matmuls),
      "matmul shapes": _digests(matmuls),
      "convert": ops["convert"],
      "conditional": ops["conditional"],
      "while": ops["while"],
      "collectives": sum(ops[c] for c in COLLECTIVES),
      "parameter": ops["parameter"],
      "get-tuple-element": ops["get-tuple-element"],
      "copy": ops["copy"],
      "reduce": ops["reduce"],
      "select": ops["select"],
      "in branches": in_branches("instructions"),
      "scheduled in branches": in_branches("scheduled"),
      "fusions in branches": in_branches("fusions"),
      "elementwise fusions in branches": in_branches("fusions: elementwise"),
      "reduction fusions in branches": in_branches("fusions: reduction"),
      "branches": branches,
      "opcodes": dict(ops.most_common()),
  }


# --- StableHLO text ---------------------------------------------------------------------------


_OP = re.compile(r'^\s*(?:%[\w#:]+(?:\s*,\s*%[\w#:]+)*\s*=\s*)?"?([a-z_]+\.[\w.]+|call|return)\b')


@dataclasses.dataclass
class _Function:
  ops: list[tuple[str, bool]] = dataclasses.field(default_factory=list)  # (op, in a case)
  calls: set[str] = dataclasses.field(default_factory=set)
  calls_in_case: set[str] = dataclasses.field(default_factory=set)


def _parse_stablehlo(text: str) -> dict[str, _Function]:
  """The module's functions: their ops, each marked if inside a ``case``/``if`` region,
  and the functions they call (from inside such a region, or anywhere)."""
  funcs: dict[str, _Function] = {}
  current, depth, case_depths = None, 0, []
  for line in text.splitlines():
    header = re.match(r"\s*func\.func (?:public |private )?@([\w.\-]+)", line)
    if header:
      current, depth, case_depths = funcs.setdefault(header.group(1), _Function()), 0, []
    else:
      op = _OP.match(line)
      if current is not None and op:
        inside = bool(case_depths)
        current.ops.append((op.group(1), inside))
        callee = re.search(r"\bcall @([\w.\-]+)", line)
        if callee:
          current.calls.add(callee.group(1))
          if inside:
            current.calls_in_case.add(callee.group(1))
        if op.group(1) in ("stablehlo.case", "stablehlo.if"):
          case_depths.append(depth)
    depth += line.count("{") - line.count("}")
    while case_depths and depth <= case_depths[-1]:
      case_depths.pop()
  return funcs


def _digests(signatures: Iterable[str]) -> list[str]:
  """Short digests of matmul signatures: enough to tell which two steps share."""
  return sorted(hashlib.sha1(s.encode()).hexdigest()[:12] for s in set(signatures))


def _signature(line: str) -> str:
  return re.sub(r"\s+", " ", re.sub(r"%[\w#:]+", "", line.split("=", 1)[-1])).strip()


def stablehlo_counts(text: str) -> dict[str, Any]:
  """Op counts of a lowered module (``lowered.as_text()``), ``return``s left out.

  ``in case``: ops inside ``stablehlo.case``/``if`` regions, and those of the functions
  called from there (and of what they call).
  """
  funcs = _parse_stablehlo(text)
  seen: set[str] = set()
  todo = [c for f in funcs.values() for c in f.calls_in_case]
  while todo:
    name = todo.pop()
    if name not in seen and name in funcs:
      seen.add(name)
      todo += funcs[name].calls

  def tally(ops: Iterable[str]) -> collections.Counter:
    return collections.Counter(o for o in ops if o not in ("return", "stablehlo.return"))

  all_ops = tally(o for f in funcs.values() for o, _ in f.ops)
  in_case = tally([o for f in funcs.values() for o, inside in f.ops if inside]
                  + [o for name in seen for o, _ in funcs[name].ops])
  matmuls = {_signature(line) for line in text.splitlines()
             if re.search(r"stablehlo\.(dot_general|convolution)\b", line)}
  custom = collections.Counter(re.findall(r"stablehlo\.custom_call @([\w.\-]+)", text))
  return {
      "ops": sum(all_ops.values()),
      "functions": len(funcs),
      "dot_general": all_ops["stablehlo.dot_general"],
      "convolution": all_ops["stablehlo.convolution"],
      "distinct matmul shapes": len(matmuls),
      "matmul shapes": _digests(matmuls),
      "convert": all_ops["stablehlo.convert"],
      "case/if": all_ops["stablehlo.case"] + all_ops["stablehlo.if"],
      "while": all_ops["stablehlo.while"],
      "custom_call": all_ops["stablehlo.custom_call"],
      "custom_call targets": dict(custom),
      "reduce": all_ops["stablehlo.reduce"],
      "select": all_ops["stablehlo.select"],
      "in case": sum(in_case.values()),
      "dot_general in case": in_case["stablehlo.dot_general"],
      "convert in case": in_case["stablehlo.convert"],
      "ops by name": dict(all_ops.most_common()),
      "in case by name": dict(in_case.most_common()),
  }


# --- the candidates -----------------------------------------------------------------------------

HAND = "hand-written Flax"
HAND_COND = candidates.HAND_SKIP  # the hand-written step with jaxamp's exact skip (lax.cond)
HAND_SELECT = "hand-written Flax + select skip"  # the same skip as selects, no cond
NO_SKIP = "jaxamp, skip_nonfinite=False"  # jaxamp's step without its skip (no cond)
VARIANT_POLICIES = ("float32",)  # where the select skip and jaxamp without a skip are counted


def _select_skip(finite_update: Any, grads: Any, old: Any) -> Any:
  """:func:`benchmarks.candidates._exact_skip` as selects: the update always computed,
  then each leaf of it or of ``old`` picked (bit-identical results, no conditional)."""
  total = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
  finite = jnp.isfinite(total)
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), finite_update(), old)


def _with_select_skip(c: Candidate) -> Candidate:
  step = c.step

  def selecting(state: Any, batch: Any) -> Any:
    with mock.patch.object(candidates, "_exact_skip", _select_skip):  # at trace time
      return step(state, batch)

  return dataclasses.replace(c, impl=HAND_SELECT, step=selecting)


def build(model: str, policy: str, size: Any) -> list[Candidate]:
  """jaxamp's and the hand-written step of ``model`` under ``policy``, as the compile
  (LM, fewest layers) and overhead (ResNet) sections build them; under float32 and
  bfloat16 also the hand-written step with the overhead section's exact skip
  (``lax.cond``), and under :data:`VARIANT_POLICIES` that skip written as selects and
  jaxamp's step made with ``skip_nonfinite=False``."""

  def made(impls: Sequence[str]) -> list[Candidate]:
    if model == "LM":
      cfg = dataclasses.replace(size.lm, layers=min(size.compile_layers))
      return candidates.lm_candidates(cfg, impls, [policy])
    return candidates.resnet_candidates(size.overhead_resnet, impls, [policy])

  built = made(("jaxamp", HAND, HAND_COND))
  if policy in VARIANT_POLICIES:
    built += [_with_select_skip(c) for c in built if c.impl == HAND_COND]
    unskipped = functools.partial(jaxamp.make_train_step, skip_nonfinite=False)
    with mock.patch.object(jaxamp, "make_train_step", unskipped):
      built += [dataclasses.replace(c, impl=NO_SKIP) for c in made(("jaxamp",))]
  return built


def count(c: Candidate) -> dict[str, Any]:
  """Every count of one candidate (see the module docstring), and its CPU seconds to
  trace and lower, and to compile (one repetition: the compile section times them)."""
  state, batch = abstract(c.state), abstract(c.batch)
  start = time.process_time()
  traced = c.traced(state, batch)
  lowered = traced.lower()
  lowered_at = time.process_time()
  compiled = lowered.compile()
  done = time.process_time()
  cpu_text = lowered.as_text()
  cuda_text = traced.lower(lowering_platforms=("cuda",)).as_text()
  return {"impl": c.impl, "policy": c.policy,
          "trace+lower s": lowered_at - start, "compile s": done - lowered_at,
          "hlo": hlo_counts(compiled.as_text()),
          "stablehlo": stablehlo_counts(cpu_text),
          "cuda": stablehlo_counts(cuda_text),
          "cuda same as cpu": _strip_platform(cuda_text) == _strip_platform(cpu_text)}


def _strip_platform(text: str) -> str:
  return re.sub(r"mhlo\.platform[^,}]*", "", text)


# --- tables -------------------------------------------------------------------------------------

# (label, key): the rows of the ratio tables.
HLO_ROWS = (
    ("instructions (all computations)", "instructions"),
    ("instructions outside fused computations", "scheduled"),
    ("computations", "computations"),
    ("fusions", "fusions"),
    ("fusions kLoop", "fusion kLoop"),
    ("fusions kInput", "fusion kInput"),
    ("fusions kOutput", "fusion kOutput"),
    ("fusions kCustom (CPU: dot/convolution fusions)", "fusion kCustom"),
    ("fusions holding a dot/convolution", "fusions: matmul"),
    ("fusions holding a reduce (none of those)", "fusions: reduction"),
    ("elementwise fusions (neither)", "fusions: elementwise"),
    ("dots", "dot"),
    ("convolutions", "convolution"),
    ("custom-calls", "custom-call"),
    ("distinct dot/convolution shapes", "distinct matmul shapes"),
    ("converts", "convert"),
    ("selects", "select"),
    ("reduces", "reduce"),
    ("copies", "copy"),
    ("get-tuple-elements", "get-tuple-element"),
    ("conditionals", "conditional"),
    ("whiles", "while"),
    ("collectives (all-reduce, ...)", "collectives"),
    ("instructions in conditional branches", "in branches"),
    ("fusions in conditional branches", "fusions in branches"),
)
STABLEHLO_ROWS = (
    ("ops", "ops"),
    ("functions", "functions"),
    ("dot_general", "dot_general"),
    ("convolution", "convolution"),
    ("distinct dot_general/convolution signatures", "distinct matmul shapes"),
    ("convert", "convert"),
    ("select", "select"),
    ("reduce", "reduce"),
    ("case/if", "case/if"),
    ("while", "while"),
    ("custom_call", "custom_call"),
    ("ops inside case regions", "in case"),
    ("converts inside case regions", "convert in case"),
)


def _row(rows: Sequence[dict[str, Any]], model: str, policy: str, impl: str
         ) -> dict[str, Any] | None:
  return next((r for r in rows if (r["model"], r["policy"], r["impl"]) == (model, policy, impl)),
              None)


def _pairs(rows: Sequence[dict[str, Any]], other: str = HAND
           ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
  """``(model · policy, jaxamp's row, the other's row)`` for each pair counted."""
  out = []
  for r in rows:
    if r["impl"] == "jaxamp":
      o = _row(rows, r["model"], r["policy"], other)
      if o is not None:
        out.append((f"{r['model']} · {r['policy']}", r, o))
  return out


def _cell(a: float, b: float) -> str:
  if not a and not b:
    return "0"
  ratio = f"{a / b:.2f}" if b else "—"
  if isinstance(a, int) and isinstance(b, int):
    return f"{a:,} / {b:,} ({ratio})"
  return f"{a:.2f} / {b:.2f} ({ratio})"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
  return lines + ["| " + " | ".join(row) + " |" for row in body]


def count_table(rows: Sequence[dict[str, Any]], level: str,
                spec: Sequence[tuple[str, str]]) -> list[str]:
  """Counts as ``jaxamp / hand-written (ratio)``, one column per model and policy; rows
  that are zero everywhere are left out."""
  pairs = _pairs(rows)
  body = []
  for label, key in spec:
    cells = [_cell(a[level].get(key, 0), b[level].get(key, 0)) for _, a, b in pairs]
    if any(c != "0" for c in cells):
      body.append([label, *cells])
  return _table(["jaxamp / hand-written (×)", *(name for name, _, _ in pairs)], body)


def skip_table(rows: Sequence[dict[str, Any]]) -> list[str]:
  """The four steps side by side: no skip, the exact skip as a cond or as selects, jaxamp."""
  impls = (HAND, HAND_COND, HAND_SELECT, NO_SKIP, "jaxamp")
  body = []
  for name, a, _ in _pairs(rows, HAND_COND):
    model, policy = a["model"], a["policy"]
    found = [_row(rows, model, policy, i) for i in impls]
    for label, get in (("instructions", lambda r: f"{r['hlo']['instructions']:,}"),
                       ("fusions", lambda r: f"{r['hlo']['fusions']:,}"),
                       ("instructions outside fused computations",
                        lambda r: f"{r['hlo']['scheduled']:,}"),
                       ("reduces", lambda r: f"{r['hlo']['reduce']:,}"),
                       ("XLA compile CPU s (one run)", lambda r: f"{r['compile s']:.1f}")):
      body.append([name, label, *(get(r) if r else "n/a" for r in found)])
  return _table(["model · policy", "count", "hand-written, no skip",
                 "hand-written + skip (lax.cond)", "hand-written + skip (selects)",
                 "jaxamp, skip_nonfinite=False", "jaxamp"],
                body)


def opcode_diff_table(rows: Sequence[dict[str, Any]], top: int = 10) -> list[str]:
  """The opcodes whose counts differ most between the two steps (all computations)."""
  body = []
  for name, a, b in _pairs(rows):
    ops_a, ops_b = a["hlo"]["opcodes"], b["hlo"]["opcodes"]
    diff = {op: ops_a.get(op, 0) - ops_b.get(op, 0) for op in set(ops_a) | set(ops_b)}
    largest = sorted((d for d in diff.items() if d[1]), key=lambda d: (-abs(d[1]), d[0]))[:top]
    body.append([name, f"{a['hlo']['instructions'] - b['hlo']['instructions']:+,}",
                 ", ".join(f"{op} {d:+,}" for op, d in largest)])
  return _table(["model · policy", "instructions, jaxamp − hand-written",
                 "largest differences by opcode"], body)


def branch_table(rows: Sequence[dict[str, Any]]) -> list[str]:
  """What jaxamp's skip conditional holds, and where the fusions are."""
  body = []
  for name, a, b in _pairs(rows):
    h, hb = a["hlo"], b["hlo"]
    for br in h["branches"]:
      body.append([name, br["role"], f"{br['instructions']:,}", f"{br['scheduled']:,}",
                   f"{br['fusions']:,}", f"{br['fusions: elementwise']:,}",
                   f"{br['fusions: reduction']:,}", f"{br['converts']:,}"])
    body.append([name, "outside the conditional", f"{h['instructions'] - h['in branches']:,}",
                 f"{h['scheduled'] - h['scheduled in branches']:,}",
                 f"{h['fusions'] - h['fusions in branches']:,}",
                 f"{h['fusions: elementwise'] - h['elementwise fusions in branches']:,}",
                 f"{h['fusions: reduction'] - h['reduction fusions in branches']:,}",
                 f"{h['convert'] - sum(x['converts'] for x in h['branches']):,}"])
    body.append([name, "hand-written step, all", f"{hb['instructions']:,}",
                 f"{hb['scheduled']:,}", f"{hb['fusions']:,}", f"{hb['fusions: elementwise']:,}",
                 f"{hb['fusions: reduction']:,}", f"{hb['convert']:,}"])
  return _table(["model · policy", "jaxamp: where", "instructions", "outside fused computations",
                 "fusions", "elementwise fusions", "reduce fusions", "converts"], body)


def shared_shapes_table(rows: Sequence[dict[str, Any]]) -> list[str]:
  """How many of one step's distinct matmul signatures the other has too."""
  body = []
  for name, a, b in _pairs(rows):
    sa, sb = set(a["cuda"]["matmul shapes"]), set(b["cuda"]["matmul shapes"])
    ha, hb = set(a["hlo"]["matmul shapes"]), set(b["hlo"]["matmul shapes"])
    body.append([name, f"{len(sa)}", f"{len(sb)}", f"{len(sa & sb)}",
                 f"{len(ha)}", f"{len(hb)}", f"{len(ha & hb)}"])
  return _table(["model · policy", "CUDA StableHLO: jaxamp", "hand-written", "in both",
                 "CPU HLO: jaxamp", "hand-written", "in both"], body)


def timing_table(rows: Sequence[dict[str, Any]]) -> list[str]:
  return _table(["model · policy", "trace + lower CPU s: jaxamp / hand-written (×)",
                 "XLA compile CPU s: jaxamp / hand-written (×)",
                 "CUDA StableHLO = CPU StableHLO"],
                [[name, _cell(a["trace+lower s"], b["trace+lower s"]),
                  _cell(a["compile s"], b["compile s"]),
                  "yes" if a["cuda same as cpu"] and b["cuda same as cpu"] else "no"]
                 for name, a, b in _pairs(rows)])


def gpu_order_table(path: pathlib.Path) -> list[str]:
  """The GPU compile seconds of ``path`` (a ``run.py`` results.json), in the order the
  harness compiled them within each section (one process per section run)."""
  if not path.exists():
    return []
  sections = json.loads(path.read_text())["sections"]
  body = []
  for key in ("lm", "resnet", "overhead"):
    if key not in sections:
      continue
    previous = None
    for n, r in enumerate(sections[key]["results"], 1):
      if r.get("compile_s") is None:
        continue
      first = r["policy"] != previous
      previous = r["policy"]
      body.append([key, str(n), r["policy"], r["impl"], f"{r['compile_s']:.1f}",
                   "yes" if first else ""])
  return _table(["section", "order compiled", "policy", "implementation", "compile s",
                 "first of its policy"], body)


# --- HLO.md -------------------------------------------------------------------------------------


def _span(values: Sequence[float]) -> str:
  lo, hi = min(values), max(values)
  return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def _ratios(rows: Sequence[dict[str, Any]], model: str, get: Any, other: str = HAND) -> str:
  pairs = [(a, b) for _, a, b in _pairs(rows, other) if a["model"] == model]
  return ", ".join(f"{a['policy']} {get(a) / get(b):.2f}" for a, b in pairs if get(b))


def findings(rows: Sequence[dict[str, Any]], gpu: pathlib.Path) -> list[str]:
  """The answers, each from the counts above (and the GPU results, where present)."""
  out = []
  pairs = _pairs(rows)
  models = list(dict.fromkeys(a["model"] for _, a, _ in pairs))
  h = lambda key: lambda r: r["hlo"][key]

  # 1. How much bigger.
  size = "; ".join(
      f"{m}: instructions {_ratios(rows, m, h('instructions'))}, fusions "
      f"{_ratios(rows, m, h('fusions'))}" for m in models)
  matmuls = "; ".join(
      f"{a['model']} {a['policy']}: {a['hlo']['dot']} dots and {a['hlo']['convolution']} "
      f"convolutions in both, {len(set(a['hlo']['matmul shapes']) & set(b['hlo']['matmul shapes']))}"
      f" of {a['hlo']['distinct matmul shapes']} distinct shapes shared"
      for _, a, b in pairs if a["policy"] == "float32")
  out.append(
      f"- **Size.** jaxamp / hand-written, optimized CPU HLO — {size}. The matmul work is "
      f"identical ({matmuls}; the same holds under every policy, table *Matmul "
      "signatures*). Under mixed_float16 jaxamp's program is the smaller one: the "
      "hand-written float16 step scales and skips with `jaxamp.dynamic_loss_scale` and "
      "`jaxamp.skip_nonfinite`, which check the gradients leaf by leaf and select every "
      "state leaf.")
  same = all(r["cuda same as cpu"] for r in rows)
  case = [(a, b) for _, a, b in pairs if a["policy"] == "float32"]
  out.append(
      "- **What XLA:GPU receives.** The StableHLO lowered for CUDA on this machine is "
      + ("the same text as the one lowered for CPU, for every candidate: these steps "
         "contain nothing platform-specific"
         + (" (no custom_call)" if not any(r["cuda"]["custom_call"] for r in rows) else "")
         + ", so XLA:GPU gets the program XLA:CPU compiles here. " if same else
         "not the same text as the CPU one for every candidate (see *timing*). ")
      + "Its op ratios: " + "; ".join(
          f"{m} {_ratios(rows, m, lambda r: r['cuda']['ops'])}" for m in models)
      + ". jaxamp's one `stablehlo.case` holds " + ", ".join(
          f"{a['cuda']['in case']:,} of its {a['cuda']['ops']:,} ops ({a['model']} float32)"
          for a, _ in case) + ".")

  # 2. Where the extra instructions are.
  for a, b in case:
    ha, hb = a["hlo"], b["hlo"]
    plain = _row(rows, a["model"], a["policy"], NO_SKIP)
    apply = next(x for x in ha["branches"] if x["role"].startswith("apply"))
    skip_text = ", ".join(f"{x['instructions']:,} instructions and {x['fusions']} fusions"
                          for x in ha["branches"] if x is not apply)
    base = hb if plain is None else plain["hlo"]  # what the conditional's plumbing adds to
    text = (f"- **{a['model']}, float32: {ha['instructions'] - hb['instructions']:+,} "
            f"instructions, {ha['fusions'] - hb['fusions']:+,} fusions.** ")
    if plain is not None:
      hp = plain["hlo"]
      reduce_why = (" (the hand-written SGD step computes no norm)"
                    if hp["reduce"] > hb["reduce"] else
                    " (none added: the chain's `jaxamp.clip_by_global_norm` reuses the step's "
                    "norm, and the hand-written chain's `optax.clip_by_global_norm` computes "
                    "the same one)")
      elementwise = hp["fusions: elementwise"] - hb["fusions: elementwise"]
      text += (
          f"Without its skip (`{NO_SKIP}`: no conditional; the norm is still computed, for "
          f"the metrics) jaxamp's step is {hp['instructions'] - hb['instructions']:+,} "
          f"instructions and {hp['fusions'] - hb['fusions']:+,} fusions from the "
          "hand-written one: the gradient norm and finite check, one float32 sum of squares "
          f"per gradient, {hp['reduce'] - hb['reduce']:+} reduces and "
          f"{hp['fusions: reduction'] - hb['fusions: reduction']:+} reduce fusions"
          f"{reduce_why}, and {elementwise:+} elementwise fusions"
          + (" (a gradient read by both the update and the sum of squares gets a kernel of "
             "its own instead of being computed inside the update's)" if elementwise > 5
             else "") + ". The conditional adds the rest, "
          f"{ha['instructions'] - hp['instructions']:+,} instructions and "
          f"{ha['fusions'] - hp['fusions']:+,} fusions. ")
    text += (
        f"(i) Its update branch holds the optimizer update once "
        f"({apply['instructions']:,} instructions, {apply['fusions']} fusions); the skip "
        f"branch holds {skip_text} (the state passed through, the skipped-step count): "
        "nothing is duplicated. "
        f"(ii) Its plumbing: {ha['get-tuple-element'] - base['get-tuple-element']:+,} "
        f"get-tuple-elements and {ha['parameter'] - base['parameter']:+,} parameters (the "
        "branches unpack the state leaves they take, the entry unpacks what they return): "
        "these make *instructions outside fused computations* "
        f"{ha['scheduled'] / hb['scheduled']:.2f}×, and none of them is a kernel. "
        "(iii) Kernels in a branch cannot take in producers outside it (the gradients): "
        f"jaxamp has {ha['fusions: elementwise']} elementwise fusions, "
        f"{ha['elementwise fusions in branches']} of them in the branches"
        + (f", {hp['fusions: elementwise']} without the conditional"
           if plain is not None else "")
        + f", the hand-written step {hb['fusions: elementwise']}. "
        f"(iv) Casts: {_n(ha['convert'], 'convert')} against {hb['convert']}.")
    out.append(text)
  mixed = [r for r in rows if r["policy"] != "float32"]
  converts = "; ".join(f"{m} {_ratios(mixed, m, h('convert'))}" for m in models)
  out.append(f"- **Casts** under the mixed policies (converts, jaxamp / hand-written): "
             f"{converts}. jaxamp casts each parameter once per read, as the hand-written "
             "model does; the apply branch's converts are the update's (the held "
             "half-precision gradients widened inside it).")

  # 3. The skip written other ways.
  cond_pairs = _pairs(rows, HAND_COND)
  if cond_pairs:
    sel = [(a, _row(rows, a["model"], a["policy"], HAND_SELECT), c) for _, a, c in cond_pairs]
    out.append(
        "- **jaxamp is the hand-written step plus the exact skip.** jaxamp / (hand-written "
        "+ the overhead section's exact skip, `lax.cond`): instructions " + "; ".join(
            f"{m} {_ratios(rows, m, h('instructions'), HAND_COND)}" for m in models)
        + "; fusions " + "; ".join(f"{m} {_ratios(rows, m, h('fusions'), HAND_COND)}"
                                   for m in models) + ". Where jaxamp is the smaller, the "
        "chain clips by global norm: the hand-written skip computes the norm for its "
        "verdict and optax's clip computes it again inside the branch, where XLA cannot "
        "share it (" + "; ".join(
            f"{a['model']} {a['policy']}: {c['hlo']['reduce'] - a['hlo']['reduce']:+} "
            "reduces" for _, a, c in cond_pairs if c["hlo"]["reduce"] != a["hlo"]["reduce"])
        + "); `jaxamp.clip_by_global_norm` reuses the step's.")
    out.append(
        "- **A select instead of the cond is no cheaper.** The same skip written as a "
        "`jnp.where` per state leaf (the update always computed, no conditional: "
        "bit-identical results) against the `lax.cond` version: " + "; ".join(
            f"{a['model']} {a['policy']}: {s['hlo']['instructions']:,} against "
            f"{c['hlo']['instructions']:,} instructions, {s['hlo']['fusions']} against "
            f"{c['hlo']['fusions']} fusions, XLA compile {s['compile s']:.1f} against "
            f"{c['compile s']:.1f} CPU s" for a, s, c in sel if s)
        + ". Without a conditional there are fewer kernels and no plumbing, but XLA "
        "copies the scalar verdict (one add per gradient leaf summing the squares, then "
        "is-finite) into every fusion that selects with it, one per state leaf, so the "
        "fused computations grow (an `optimization_barrier` on the verdict, or one reduce "
        "over the stacked sums, does not stop it: XLA:CPU counts the same).")

  # 4. What would cost GPU compile time.
  extra = "; ".join(
      f"{a['model']} {a['policy']} {a['hlo']['fusions'] - b['hlo']['fusions']:+} "
      f"({100 * (a['hlo']['fusions'] / b['hlo']['fusions'] - 1):+.0f} %)" for _, a, b in pairs)
  out.append(
      "- **What of this costs compile time on a GPU.** XLA:GPU autotunes each GEMM fusion "
      "(Triton tilings or cuBLAS algorithms) and each convolution (cuDNN algorithms): the "
      "same dots, convolutions and shapes in both steps, so the same autotuning work. Each "
      "other fusion becomes a kernel that LLVM and ptxas compile: jaxamp has "
      f"{extra} fusions (small elementwise update kernels and per-leaf reductions; "
      "XLA:GPU's horizontal fusion may merge some that XLA:CPU keeps apart). The "
      "conditional's branches are compiled once each; its cost at run time (the predicate "
      "read back to the host every step) is no compile cost. By the program alone, a "
      "GPU compile ratio near the CPU one is expected (XLA compile CPU s here: "
      + "; ".join(f"{m} {_ratios(rows, m, lambda r: r['compile s'])}" for m in models)
      + _compile_section_ratios(gpu.parent.parent / "compile" / "results.json")
      + "), not 1.6–2.8.")

  # 5. The GPU numbers.
  if gpu.exists():
    out += _gpu_findings(json.loads(gpu.read_text())["sections"], rows, gpu)
  out.append(
      "- **To confirm on a GPU** (none was available for this run): compile each step in "
      "a fresh process, or the hand-written step first; or compare both with "
      "`XLA_FLAGS=--xla_gpu_autotune_level=0` (no autotuning: what is left is the "
      "program's own cost); or give each compile an empty "
      "`--xla_gpu_per_fusion_autotune_cache_dir` and count the files it writes (one per "
      "fusion it autotuned). `run.py --only compile` takes turns and repeats, so on a GPU "
      "its first repetition pays the autotuning and the later ones show the program's "
      "own ratio.")
  return out


def _n(count: int, noun: str) -> str:
  return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _compile_section_ratios(path: pathlib.Path) -> str:
  """``'; the compile section's ...'``: its median XLA compile ratios, if measured."""
  if not path.exists():
    return ""
  results = json.loads(path.read_text())["sections"].get("compile", {}).get("results", [])
  got = {(r["layers"], r["policy"], r["impl"]): r["compile_s_median"] for r in results
         if not r.get("error")}
  ratios = [got[k] / got[(k[0], k[1], HAND)] for k in got
            if k[2] == "jaxamp" and (k[0], k[1], HAND) in got]
  if not ratios:
    return ""
  return (f"; the compile section's medians, `benchmarks/compile/RESULTS.md`: "
          f"{_span(ratios)}")


def _gpu_findings(sections: dict[str, Any], rows: Sequence[dict[str, Any]],
                  gpu: pathlib.Path) -> list[str]:
  """What the GPU results say about the order the harness compiled in."""
  firsts, others = [], []
  for key in ("lm", "resnet"):
    previous = None
    for r in sections.get(key, {}).get("results", []):
      if r.get("compile_s") is not None:
        (firsts if r["policy"] != previous else others).append((key, r))
        previous = r["policy"]
  if not firsts or not others:
    return []
  med = lambda found: sorted(r["compile_s"] for _, r in found)[len(found) // 2]
  listed = lambda found: ", ".join(f"{key} {r['impl']} {r['policy']} {r['compile_s']:.1f} s"
                                   for key, r in found)
  text = (
      "- **The GPU ratios are most likely an order effect.** In `run.py`'s `lm` and "
      "`resnet` sections `measure` compiles the candidates one after another in one "
      "process, jaxamp first under every policy, then the hand-written step, then Keras "
      "(table *GPU compile seconds*). XLA:GPU keeps autotuning results in a process-wide "
      "in-memory cache keyed by the device and the instruction's canonical HLO "
      "(`AutotunerUtil::Autotune` in XLA's `xla/service/gpu/autotuning/autotuner_util.cc`; "
      "`jax.clear_caches()` does not empty it), so a step compiled after jaxamp's finds "
      "every GEMM and convolution it shares with it tuned, and the hand-written step "
      f"shares all of them. In `benchmarks/{gpu.parent.name}/{gpu.name}` the first step "
      f"compiled under each policy took a median {med(firsts):.1f} s ({listed(firsts)}), "
      f"the {len(others)} compiled after one a median {med(others):.1f} s. Those data "
      "cannot tell the order from the author, as jaxamp always came first, but the rows "
      "that compiled first alone say autotuning dominates: float32 HIGHEST (jaxamp only, "
      "other algorithms to tune) took the longest.")
  over = sections.get("overhead", {}).get("results", [])
  resnet = [(a, b) for _, a, b in _pairs(rows) if a["model"] == "ResNet"]
  pairs = []
  for a, b in resnet:
    j = next((r for r in over if r["impl"] == "jaxamp" and r["policy"].endswith(
        f"· {a['policy']}") and r["policy"].startswith("ResNet")), None)
    hw = next((r for r in over if r["impl"] == HAND and j and r["policy"] == j["policy"]), None)
    if j and hw and hw["compile_s"]:
      pairs.append(f"{a['policy']} {j['compile_s']:.1f} against {hw['compile_s']:.1f} s "
                   f"({j['compile_s'] / hw['compile_s']:.1f}×; instructions "
                   f"{a['hlo']['instructions'] / b['hlo']['instructions']:.2f}×, fusions "
                   f"{a['hlo']['fusions'] / b['hlo']['fusions']:.2f}×)")
  if pairs:
    text += (" The overhead section's ResNet is the model and the two steps counted here "
             "(its GPU run is from an earlier commit): their first calls on the GPU "
             "(jaxamp's first in each pair; the median of two sittings, the second finding "
             "the first's autotuning) took " + "; ".join(pairs)
             + ", ratios no difference in program size explains.")
  return [text]


def markdown(info: dict[str, Any], settings: dict[str, Any], rows: Sequence[dict[str, Any]],
             tables: dict[str, list[str]], gpu: pathlib.Path) -> list[str]:
  v = info["versions"]
  lm, rn = settings["lm"], settings["resnet"]
  depth = 3 * sum(rn["stage_sizes"]) + 2
  lines = [
      "# What XLA compiles: jaxamp's train step against the hand-written step",
      "",
      f"Measured by `{info['command']}` on {info['date']} ({settings['seconds']} s in all). "
      "Generated file: rerun the script rather than editing it.",
      "",
      "## Machine",
      "",
      "|  |  |",
      "| --- | --- |",
      f"| backend / device | {info['backend']} / {info['device']} × {info['device_count']} |",
      f"| CPU | {info['cpu']}, {info['cpu_cores']} cores usable |",
      f"| jax / jaxlib | {v['jax']} / {v['jaxlib']} |",
      f"| flax / optax | {v['flax']} / {v['optax']} |",
      f"| jaxamp | {v.get('jax-mixed-precision', '?')}, git {info['git']} |",
      "",
      "## What is counted",
      "",
      f"- **LM**: the compile section's transformer LM at {lm['layers']} layers (dim "
      f"{lm['dim']}, {lm['heads']} heads, vocab {lm['vocab']}, batch {lm['batch']} × "
      f"{lm['seq_len']}), AdamW after clipping by global norm. **ResNet**: the overhead "
      f"section's ResNet-{depth} ({rn['num_filters']} base filters, {rn['image_size']}² "
      f"images, batch {rn['batch']}, BatchNorm), SGD with Nesterov momentum. Both built by "
      "`benchmarks/candidates.py` as the harness builds them: jaxamp's `train.step` "
      "(`train.trace(state, batch)`) against the hand-written `jax.jit(step, "
      "donate_argnums=0)`; under float32 and mixed_bfloat16 also the hand-written step "
      "with the overhead section's exact skip (`lax.cond`), and under "
      f"{' and '.join(VARIANT_POLICIES)} that skip written as selects and jaxamp's step "
      "made with `skip_nonfinite=False`.",
      "- **HLO**: `traced.lower().compile().as_text()` on XLA:CPU. *Instructions* counts "
      "every instruction of every computation, fused ones included; *outside fused "
      "computations*: the entry and the conditional branches (what is scheduled: fusions, "
      "copies, tuples, get-tuple-elements...). Fusions are counted there, by XLA's kind and "
      "by what they hold (a dot or convolution; else a reduce; else elementwise only); "
      "dots, converts, selects, reduces anywhere. *Distinct shapes*: dots and convolutions "
      "with names and layouts removed.",
      "- **StableHLO**: `traced.lower().as_text()` (CPU) and "
      "`traced.lower(lowering_platforms=('cuda',)).as_text()` (what XLA:GPU gets; lowered "
      "on this machine, nothing compiled for a GPU). *Inside case regions*: ops in the "
      "`stablehlo.case` regions and in the functions called from there.",
      "- Each cell is `jaxamp / hand-written (ratio)`. Compile seconds are one run each, CPU "
      "seconds of the process: the compile section (`RESULTS.md`) times them properly.",
      "",
      "## Findings",
      "",
      *findings(rows, gpu),
      "",
      "## Optimized CPU HLO",
      "",
      *tables["hlo"],
      "",
      "## Where jaxamp's instructions are",
      "",
      "jaxamp's program split at its one conditional (the exact skip), against the whole "
      "hand-written program.",
      "",
      *tables["branches"],
      "",
      "## Largest differences by opcode",
      "",
      *tables["opcodes"],
      "",
      "## The skip, written several ways",
      "",
      "The hand-written step without a skip, with jaxamp's exact skip written by hand as "
      "`benchmarks/candidates.py` does for the overhead section (a float32 sum of squares "
      "of the gradients, the update under `lax.cond`), with the same skip as selects (the "
      "update always computed, then `jnp.where(finite, new, old)` per leaf); jaxamp's step "
      "made with `skip_nonfinite=False` (no conditional; the gradient norm still computed "
      "for the metrics), and as the harness makes it.",
      "",
      *tables["skip"],
      "",
      "## StableHLO lowered for CUDA",
      "",
      *tables["cuda"],
      "",
      *(["The StableHLO lowered for CPU is the same text for every candidate (`hlo.json` "
         "keeps both counts)."] if all(r["cuda same as cpu"] for r in rows) else
        ["## StableHLO lowered for CPU", "", *tables["stablehlo"]]),
      "",
      "## Matmul signatures",
      "",
      "Distinct dot/convolution signatures (shapes, dtypes, dimension numbers, windows) "
      "of each step, and how many the two share: what XLA:GPU autotunes, and the keys its "
      "in-process autotuning cache would find.",
      "",
      *tables["shapes"],
      "",
      "## Trace, lower and compile seconds (one run)",
      "",
      *tables["timing"],
      "",
  ]
  if tables["gpu"]:
    gpu_info = json.loads(gpu.read_text())["machine"]
    lines += ["## GPU compile seconds, in the order compiled",
              "",
              f"From `benchmarks/{gpu.parent.name}/{gpu.name}` (measured by run.py on "
              f"{gpu_info['device']}, jax {gpu_info['versions']['jax']}): `compile s` of the "
              "`lm` and `resnet` sections (`.trace().lower().compile()`, wall time) and of "
              "the overhead section (the first `call`, the median of its sittings), in the "
              "order each section compiled its candidates in one process.",
              "",
              *tables["gpu"],
              ""]
  return lines


# --- the run ------------------------------------------------------------------------------------

GPU_RESULTS = pathlib.Path(__file__).resolve().parent / "gpu" / "results.json"


def run(models_: Sequence[str], policies: Sequence[str], size: Any,
        log: Any = print) -> list[dict[str, Any]]:
  """Counts every candidate of ``models_`` under ``policies``, one at a time."""
  rows = []
  for model in models_:
    for policy in policies:
      for c in build(model, policy, size):
        log(f"  {model} · {c.name}")
        row = {"model": model, **count(c)}
        c.state = None
        h = row["hlo"]
        log(f"    {h['instructions']:,} HLO instructions, {h['fusions']} fusions, "
            f"{h['in branches']:,} in conditional branches; {row['cuda']['ops']:,} "
            f"StableHLO ops for CUDA; XLA compile {row['compile s']:.1f} CPU s")
        rows.append(row)
  return rows


def write(out: pathlib.Path, info: dict[str, Any], settings: dict[str, Any],
          rows: list[dict[str, Any]], gpu: pathlib.Path = GPU_RESULTS) -> dict[str, Any]:
  """Prints the main tables and writes ``HLO.md`` and ``hlo.json`` into ``out``."""
  tables = {
      "hlo": count_table(rows, "hlo", HLO_ROWS),
      "stablehlo": count_table(rows, "stablehlo", STABLEHLO_ROWS),
      "cuda": count_table(rows, "cuda", STABLEHLO_ROWS),
      "opcodes": opcode_diff_table(rows),
      "branches": branch_table(rows),
      "skip": skip_table(rows),
      "shapes": shared_shapes_table(rows),
      "timing": timing_table(rows),
      "gpu": gpu_order_table(gpu),
  }
  for name in ("hlo", "cuda", "skip"):
    print("\n".join(tables[name]) + "\n")
  out.mkdir(parents=True, exist_ok=True)
  (out / "hlo.json").write_text(json.dumps(
      {"machine": info, "settings": settings, "rows": rows}, indent=1) + "\n")
  (out / "HLO.md").write_text("\n".join(markdown(info, settings, rows, tables, gpu)) + "\n")
  print(f"wrote {out / 'HLO.md'} and {out / 'hlo.json'} ({settings['seconds']} s)")
  return {"rows": rows, "tables": tables}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n".join(__doc__.splitlines()[1:]))
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path(__file__).resolve().parent / "compile",
                      help="folder for HLO.md and hlo.json (default: benchmarks/compile)")
  parser.add_argument("--models", nargs="+", choices=("LM", "ResNet"), default=["LM", "ResNet"])
  parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
  parser.add_argument("--size", choices=tuple(SIZES), default="cpu",
                      help="run.py's size whose compile-section LM (fewest layers) and "
                           "overhead-section ResNet are counted (default: cpu)")
  parser.add_argument("--render", action="store_true",
                      help="count nothing: rewrite --out/HLO.md from --out/hlo.json")
  args = parser.parse_args(argv)
  if args.render:
    saved = json.loads((args.out / "hlo.json").read_text())
    return write(args.out, saved["machine"], saved["settings"], saved["rows"])

  size = SIZES[args.size]
  info = report.machine()
  info["command"] = "python benchmarks/hlo_counts.py " + " ".join(
      sys.argv[1:] if argv is None else argv)
  start = time.perf_counter()
  with warnings.catch_warnings():
    # jaxamp warns once that float16 is slow on a CPU: nothing here runs.
    warnings.filterwarnings("ignore", message=".*float16.*", category=RuntimeWarning)
    rows = run(args.models, args.policies, size)
  settings = {"size": args.size,
              "lm": dataclasses.asdict(dataclasses.replace(size.lm,
                                                           layers=min(size.compile_layers))),
              "resnet": dataclasses.asdict(size.overhead_resnet),
              "seconds": round(time.perf_counter() - start)}
  return write(args.out, info, settings, rows)


if __name__ == "__main__":
  main()
