"""Per-device memory and step time of a sharded train step as the model deepens.

Two transformer LMs (:data:`CONFIGS`: the CPU benchmark LM, whose activations outweigh
its parameters, and a wider one on short sequences, whose parameters outweigh its
activations), each as :class:`benchmarks.models.GPT` (unrolled) and
:class:`benchmarks.models.ScanGPT` (blocks stacked and run by ``nnx.scan``), and the
same two in Flax Linen (:class:`benchmarks.models.LinenGPT`, ``nn.scan``), at several
depths, trained under ``mixed_bfloat16`` with Adam on a mesh of 8 devices, data
parallel (params replicated) and FSDP (``param_sharding=jaxamp.fsdp('fsdp', gather=...)``)
gathering the whole model at the step's start (``'model'``) or each parameter where a
module reads it (``'layer'``; without and with ``prefetch``, one module ahead; and
without the exact skip of non-finite steps). For the memory tables nothing runs: each
step is lowered and compiled, and per device it reads

- XLA's ``memory_analysis()`` of the compiled step: arguments, outputs, temporaries and
  the donated (aliased) bytes; **peak** is arguments + outputs + temporaries − aliased,
  what the step needs at once where the backend reports no peak of its own (XLA:CPU);
- the all-gathers of the lowered program (what jaxamp asked for, before XLA's passes),
  their number and dtypes;
- one block's parameters, gathered (in the dtype the step gathers them in), and the
  whole model's: what a step that gathers the whole model at its start holds at once.

**growth / layer** is the peak's increase per added layer since the next smaller depth;
a step that gathers each layer's parameters when it runs grows by about one layer's
gathered parameters plus its activations per layer, one that gathers the whole model by
a layer's gathered parameters more.

The time table runs ``train.step`` of the two FSDP layouts at ``--time-layers`` layers,
interleaved (``benchmarks.measure``), and gives per-layer's step time over whole-model's:
the median of the per-round ratios and its 95 % bootstrap interval. On CPU, fake the
devices (the script does, unless ``XLA_FLAGS`` already sets a count)::

    python benchmarks/fsdp_memory.py --out benchmarks/fsdp
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time
from typing import Any

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top
from flax import nnx  # pylint: disable=g-import-not-at-top

import jaxamp  # pylint: disable=g-import-not-at-top
from benchmarks import measure as measure_lib  # pylint: disable=g-import-not-at-top
from benchmarks import models, report  # pylint: disable=g-import-not-at-top
from jaxamp.sharding import collectives  # pylint: disable=g-import-not-at-top

POLICY = "mixed_bfloat16"
# The CPU benchmark LM, whose activations outweigh its parameters, and a wider one with
# short sequences, whose parameters outweigh its activations (FSDP's use case).
CONFIGS = {
    "benchmark LM": models.LMConfig(vocab=256, dim=128, heads=4, layers=2, seq_len=128,
                                    batch=8),
    "wide LM": models.LMConfig(vocab=256, dim=512, heads=8, layers=2, seq_len=32, batch=8),
}
SMOKE = {"smoke LM": models.LMConfig(64, 32, 2, 1, 16, 8)}
DEVICES = 8
# Data parallel; FSDP gathering the whole model at the step's start; FSDP gathering each
# parameter where a module reads it, its gathers after its own inputs (the default on
# CPU) or one module ahead (prefetch=True, the default on GPUs): jaxamp.fsdp's keywords.
# And the per-layer step without the exact skip of non-finite steps
# (make_train_step(skip_nonfinite=False)), which need not hold every gradient shard until
# the all-finite decision.
LAYOUTS = {"data parallel": None, "fsdp (model)": {"gather": "model"},
           "fsdp (layer)": {"gather": "layer", "prefetch": False},
           "fsdp (layer, prefetch)": {"gather": "layer", "prefetch": True},
           "fsdp (layer), no skip": {"gather": "layer", "prefetch": False, "skip": False}}
# Each kind: the model of a config, and whether it is a Linen module.
KINDS = {
    "unrolled": (lambda cfg: models.GPT(cfg, rngs=nnx.Rngs(0)), False),
    "scan-stacked": (lambda cfg: models.ScanGPT(cfg, rngs=nnx.Rngs(0)), False),
    "Linen, unrolled": (models.LinenGPT, True),
    "Linen, scan-stacked": (lambda cfg: models.LinenGPT(cfg, scan=True), True),
}
NOT_BLOCKS = ("tok", "pos", "ln", "head")  # every other top-level parameter is a block's


def _init(kind: str, cfg: models.LMConfig, train: Any) -> tuple[Any, Any]:
  """The model's parameters (a mapping by top-level name) and ``train.init``'s state."""
  make, linen = KINDS[kind]
  model = make(cfg)
  if linen:
    ids = models.lm_batch(cfg)["ids"]
    variables = jax.jit(model.init)(jax.random.key(0), ids)
    return variables["params"], train.init(model, variables, ids)
  return nnx.state(model, nnx.Param), train.init(model)


def _step(layout: str, mesh: jax.sharding.Mesh) -> Any:
  fsdp = dict(LAYOUTS[layout] or {})
  skip = fsdp.pop("skip", True)
  sharding = jaxamp.ShardingConfig(mesh=mesh, batch_axis="fsdp",
                                   param_sharding=jaxamp.fsdp("fsdp", **fsdp) if fsdp else None)
  return jaxamp.make_train_step(models.lm_loss, optax.adamw(3e-4), policy=POLICY,
                                skip_nonfinite=skip, sharding=sharding)


def _gathered_bytes(train: Any, params: Any) -> int | None:
  """The params' bytes in the dtypes the step gathers them in (float32 where a float32
  rule owns them, the compute dtype otherwise); None for a step that gathers none."""
  if train.plan.gather_dtypes is None:
    return None
  return sum(int(np.prod(x.shape)) * np.dtype(d).itemsize
             for x, d in zip(jax.tree.leaves(params), train.plan.gather_dtypes))


def _block_elements(params: Any, layers: int) -> float:
  """The parameter elements of one block."""
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  return sum(count(params[k]) for k in params if k not in NOT_BLOCKS) / layers


def measure(kind: str, layers: int, layout: str, mesh: jax.sharding.Mesh,
            cfg: models.LMConfig) -> dict[str, Any]:
  cfg = models.LMConfig(cfg.vocab, cfg.dim, cfg.heads, layers, cfg.seq_len, cfg.batch)
  train = _step(layout, mesh)
  params, state = _init(kind, cfg, train)
  batch = models.lm_batch(cfg)
  start = time.perf_counter()
  lowered = train.lower(state, batch)
  mem = lowered.compile().memory_analysis()
  gathers = [c for c in collectives(lowered.as_text()) if c.op == "all-gather"]
  evaluation = train.lower_eval(state, batch).compile().memory_analysis()
  whole = _gathered_bytes(train, state.params)
  block = _block_elements(params, layers)
  total = sum(x.size for x in jax.tree.leaves(state.params))
  row = {
      "kind": kind, "layers": layers, "layout": layout,
      "args": mem.argument_size_in_bytes, "out": mem.output_size_in_bytes,
      "temp": mem.temp_size_in_bytes, "alias": mem.alias_size_in_bytes,
      "all_gathers": len(gathers),
      "gather_dtypes": dict(collections.Counter(c.dtype for c in gathers)),
      "gathered_model": whole,
      "gathered_block": None if whole is None else whole * block / total,
      "block_grad_f32": 4 * block,
      "seconds": time.perf_counter() - start,
  }
  row["peak"] = _peak(mem)
  row["eval_peak"] = _peak(evaluation)
  return row


def _peak(mem: Any) -> int:
  """Per-device peak of a compiled program: arguments + outputs + temporaries − aliases."""
  return (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          - mem.alias_size_in_bytes)


def _candidate(kind: str, layout: str, mesh: jax.sharding.Mesh,
               cfg: models.LMConfig) -> measure_lib.Candidate:
  train = _step(layout, mesh)
  _, state = _init(kind, cfg, train)
  batch = jax.device_put(models.lm_batch(cfg), train.plan.batch_sharding())
  return measure_lib.Candidate("jaxamp", f"{kind}, {layout}", train.step, state, batch,
                               items=cfg.tokens, call=train.step, trace=train.trace)


def time_layouts(mesh: jax.sharding.Mesh, configs: dict[str, models.LMConfig], layers: int,
                 rounds: int) -> list[dict[str, Any]]:
  """Per-layer FSDP's step time over whole-model's, each model kind and config."""
  rows = []
  for title, cfg in configs.items():
    cfg = models.LMConfig(cfg.vocab, cfg.dim, cfg.heads, layers, cfg.seq_len, cfg.batch)
    for kind in KINDS:
      found = measure_lib.measure(
          [_candidate(kind, layout, mesh, cfg) for layout in ("fsdp (layer)", "fsdp (model)")],
          warmup=2, rounds=rounds, steps=3, aot=False, inspect=False, group=2)
      ratio, low, high = report.paired_ratio(*found)
      rows.append({"config": title, "kind": kind, "layers": layers,
                   "layer_ms": 1e3 * found[0].step_s, "model_ms": 1e3 * found[1].step_s,
                   "ratio": ratio, "low": low, "high": high})
  return rows


def _mib(b: float | None) -> str:
  return "—" if b is None else f"{b / 2**20:.2f}"


def _args_growth(rows: list[dict[str, Any]], kind: str, layout: str) -> float | None:
  """The arguments' growth per layer between the two deepest rows of ``kind, layout``."""
  mine = sorted((r for r in rows if r["kind"] == kind and r["layout"] == layout),
                key=lambda r: r["layers"])
  if len(mine) < 2:
    return None
  a, b = mine[-2], mine[-1]
  return (b["args"] - a["args"]) / (b["layers"] - a["layers"])


def time_markdown(rows: list[dict[str, Any]], devices: int) -> list[str]:
  lines = [
      "## Step time: per layer over whole model", "",
      f"`train.step` on {devices} CPU devices (one process, so the collectives are "
      "memory copies and the ratio weighs the extra work, not the network), interleaved "
      "rounds of 3 steps; the ratio is the median of the per-round ratios with its 95 % "
      "bootstrap interval.", "",
      "| model | kind | layers | per layer ms | whole model ms | ratio | 95 % interval |",
      "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
  for r in rows:
    lines.append(f"| {r['config']} | {r['kind']} | {r['layers']} | {r['layer_ms']:.1f} | "
                 f"{r['model_ms']:.1f} | {r['ratio']:.3f} | {r['low']:.3f}–{r['high']:.3f} |")
  return lines + [""]


def markdown(info: dict[str, Any], tables: dict[str, list[dict[str, Any]]],
             configs: dict[str, models.LMConfig]) -> str:
  lines = [
      "# Sharded train step: per-device memory and step time as the model deepens", "",
      f"Measured {info['date']} on {info['cpu']} ({info['cpu_cores']} cores, "
      f"{info['backend']} × {info['device_count']}), jax {info['versions']['jax']}, flax "
      f"{info['versions']['flax']}, git {info['git']}: `{info['command']}`.", "",
      f"`{POLICY}`, AdamW, mesh of {DEVICES} devices on axis `fsdp`, the batch split over "
      "them; layouts: data parallel, FSDP gathering the whole model at the step's start "
      "(`gather='model'`), FSDP gathering each parameter where a module reads it "
      "(`gather='layer'`), each module's gathers after its own inputs (`prefetch=False`, "
      "the default on CPU) or after the previous module's (`prefetch=True`, the default "
      "on GPUs: one module ahead), and without the exact skip of non-finite steps "
      "(`skip_nonfinite=False`: no gradient shard is held until the all-finite decision). "
      "Compiled, not run. Per device, in MiB: XLA's `memory_analysis()` of the step "
      "(**peak** = arguments + outputs + temporaries − donated aliases); **gathered "
      "model** / **block**: the parameters in the dtypes the step gathers them in; "
      "**growth / layer**: the peak's increase per added layer from the row above (same "
      "kind and layout); **block grad**: one block's gradient in float32, as a "
      "whole-model step holds it before the reduce-scatter. **all-gathers**: in the "
      "lowered program, with their dtypes (per layer: once in the forward pass and again "
      "in the backward pass where the backward pass needs the parameter; XLA:CPU then "
      "runs them in float32, which it promotes bfloat16 collectives to). **eval peak**: "
      "the same for `train.eval_step` (`train.lower_eval`), which gathers as the step "
      "does.", ""]
  for title, rows in tables.items():
    cfg = configs[title]
    lines += [
        f"## {title}: dim {cfg.dim}, {cfg.heads} heads, vocab {cfg.vocab}, batch "
        f"{cfg.batch} × {cfg.seq_len} tokens", "",
        "| kind | layers | layout | args | temp | out | aliased | peak | growth / layer "
        "| gathered model | gathered block | block grad | all-gathers | eval peak |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| --- | ---: |"]
    previous: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
      before = previous.get((r["kind"], r["layout"]))
      r["growth"] = (None if before is None else
                     (r["peak"] - before["peak"]) / (r["layers"] - before["layers"]))
      previous[(r["kind"], r["layout"])] = r
      dtypes = ", ".join(f"{n} {d}" for d, n in sorted(r["gather_dtypes"].items()))
      lines.append(
          f"| {r['kind']} | {r['layers']} | {r['layout']} | {_mib(r['args'])} | "
          f"{_mib(r['temp'])} | {_mib(r['out'])} | {_mib(r['alias'])} | "
          f"{_mib(r['peak'])} | {_mib(r['growth'])} | {_mib(r['gathered_model'])} | "
          f"{_mib(r['gathered_block'])} | {_mib(r['block_grad_f32'])} | "
          f"{r['all_gathers']}{' (' + dtypes + ')' if dtypes else ''} | "
          f"{_mib(r['eval_peak'])} |")
    lines.append("")
    deepest = max(r["layers"] for r in rows)
    for kind in KINDS:
      by = {r["layout"]: r for r in rows if r["kind"] == kind and r["layers"] == deepest}
      if len(by) == len(LAYOUTS):
        dp, whole, layer = by["data parallel"], by["fsdp (model)"], by["fsdp (layer)"]
        ahead, unskipped = by["fsdp (layer, prefetch)"], by["fsdp (layer), no skip"]
        lines.append(
            f"- {kind}, {deepest} layers: per-layer FSDP peak {_mib(layer['peak'])} MiB, "
            f"**{layer['peak'] / whole['peak']:.2f}×** whole-model FSDP's "
            f"({_mib(whole['peak'])} MiB) and {layer['peak'] / dp['peak']:.2f}× data "
            f"parallel's; it grows by {_mib(layer['growth'])} MiB per layer (whole-model: "
            f"{_mib(whole['growth'])}), of which the sharded arguments (params, Adam "
            f"moments) are {_mib(_args_growth(rows, kind, 'fsdp (layer)'))}; one block "
            f"gathered is {_mib(layer['gathered_block'])} MiB. Eval gathering per layer: "
            f"{_mib(layer['eval_peak'])} MiB, "
            f"**{layer['eval_peak'] / whole['eval_peak']:.2f}×** the whole model's "
            f"({_mib(whole['eval_peak'])} MiB). Prefetching one module ahead: peak "
            f"{_mib(ahead['peak'])} MiB ({ahead['peak'] / whole['peak']:.2f}×), growth "
            f"{_mib(ahead['growth'])} MiB per layer. Without the exact skip "
            f"(`skip_nonfinite=False`): peak {_mib(unskipped['peak'])} MiB "
            f"(**{unskipped['peak'] / whole['peak']:.2f}×**).")
    lines.append("")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "fsdp"))
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
  parser.add_argument("--size", choices=("cpu", "smoke"), default="cpu")
  parser.add_argument("--time-layers", type=int, default=4,
                      help="depth of the step-time table's models (0: no time table)")
  parser.add_argument("--rounds", type=int, default=9)
  args = parser.parse_args()
  if jax.device_count() < DEVICES:
    raise SystemExit(f"needs {DEVICES} devices, found {jax.device_count()}")
  mesh = jax.make_mesh((DEVICES,), ("fsdp",), devices=jax.devices()[:DEVICES])
  configs = CONFIGS if args.size == "cpu" else SMOKE
  info = report.machine()
  info["command"] = "python benchmarks/fsdp_memory.py " + " ".join(sys.argv[1:])
  tables: dict[str, list[dict[str, Any]]] = {}
  for title, cfg in configs.items():
    rows = tables.setdefault(title, [])
    for kind in KINDS:
      for layers in args.layers:
        for layout in LAYOUTS:
          row = measure(kind, layers, layout, mesh, cfg)
          rows.append(row)
          print(f"{title} {kind:19s} {layers:3d} {layout:14s} peak {_mib(row['peak']):>8s} "
                f"MiB  temp {_mib(row['temp']):>8s}  all-gathers {row['all_gathers']} "
                f"({row['seconds']:.0f} s)", flush=True)
  times = (time_layouts(mesh, configs, args.time_layers, args.rounds)
           if args.time_layers else [])
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"machine": info, "tables": tables, "times": times}, f, indent=1)
  with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
    f.write(markdown(info, tables, configs) + "\n".join(time_markdown(times, DEVICES)))
  print(f"wrote {args.out}/RESULTS.md")


if __name__ == "__main__":
  main()
