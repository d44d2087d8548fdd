"""Bytes per parameter of a train state, and XLA's peak, per master-weights mode (issue 44).

For the benchmark LM (:class:`benchmarks.models.GPT`, the ``cpu`` size of
``benchmarks/run.py``; ``--size gpu`` the GPU one) trained with ``optax.adamw``, each
mode's train state is made with ``jax.eval_shape`` (nothing is allocated) and its arrays
counted by where they sit in the state:

- **params**: ``TrainState.params``;
- **master**: float32 master weights (``MasterWeightsState.master_params``);
- **compensation**: Kahan's buffers (``KahanState.compensation``);
- **optimizer**: every other optimizer-state array (Adam's moments, counts, the loss
  scale, a rounding key);
- **grads**: the gradient the step hands the optimizer, one per parameter in the dtype
  the backward pass makes it (the parameter's; ``grad_accum_steps`` > 1 would hold a
  float32 accumulator instead): not state, but the fourth term of the usual
  "16 bytes per parameter" count;

each over the number of parameters. Then the step is lowered and compiled (not run),
and XLA's ``memory_analysis()`` gives its **peak**: arguments + outputs + temporaries −
donated aliases where the backend reports no peak of its own (XLA:CPU), and the
activations make most of it at this size. ``--run N`` also times N steps (median).

    python benchmarks/memory_bytes.py --out benchmarks/memory_bytes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top
from flax import nnx  # pylint: disable=g-import-not-at-top

import jaxamp  # pylint: disable=g-import-not-at-top
from benchmarks import models, report  # pylint: disable=g-import-not-at-top

SIZES = {
    "smoke": models.LMConfig(vocab=64, dim=32, heads=2, layers=1, seq_len=16, batch=4),
    "cpu": models.LMConfig(vocab=256, dim=128, heads=4, layers=2, seq_len=128, batch=8),
    "gpu": models.LMConfig(vocab=32768, dim=768, heads=12, layers=12, seq_len=1024, batch=8),
}

# (row name, make_train_step keywords, the goal in bytes per parameter or None)
MODES: tuple[tuple[str, dict[str, Any], float | None], ...] = (
    ("mixed_bfloat16 (today)", dict(policy="mixed_bfloat16"), None),
    ("bfloat16, float32 master", dict(policy="bfloat16", master_weights=True), None),
    ("bfloat16 naive (no master)", dict(policy="bfloat16", master_weights=False), None),
    ("bfloat16 stochastic, bf16 opt state",
     dict(policy="bfloat16", master_weights="stochastic", opt_state_dtype=jnp.bfloat16), 8.5),
    ("bfloat16 kahan, bf16 opt state",
     dict(policy="bfloat16", master_weights="kahan", opt_state_dtype=jnp.bfloat16), 10.5),
    ("bfloat16 stochastic, f32 opt state",
     dict(policy="bfloat16", master_weights="stochastic"), None),
)


def _bytes(tree: Any) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
             if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key))


def _parts(state: jaxamp.TrainState) -> dict[str, int]:
  """The state's bytes by part (see the module docstring)."""
  opt = state.opt_state
  master = comp = 0
  if isinstance(opt, jaxamp.MasterWeightsState):
    master, opt = _bytes(opt.master_params), opt.inner_state
  elif isinstance(opt, jaxamp.RoundingState):
    if isinstance(opt.rounding, jaxamp.KahanState):
      comp = _bytes(opt.rounding.compensation)
      opt = opt.inner_state
  return {"params": _bytes(state.params), "master": master, "compensation": comp,
          "optimizer": _bytes(opt), "grads": _bytes(state.params),
          "other": _bytes((state.model_state, state.step, state.scaled))}


def measure(cfg: models.LMConfig, name: str, kwargs: dict[str, Any], goal: float | None,
            steps: int) -> dict[str, Any]:
  train = jaxamp.make_train_step(models.lm_loss, optax.adamw(3e-4, weight_decay=0.1), **kwargs)
  state = train.init(models.GPT(cfg, rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(state.params))
  parts = _parts(state)
  batch = models.lm_batch(cfg)
  mem = train.lower(state, batch).compile().memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
          - mem.alias_size_in_bytes)
  row = {"mode": name, "keywords": {k: str(v) for k, v in kwargs.items()}, "params": n,
         **{f"{k}_bytes": v for k, v in parts.items()},
         "per_param": {k: v / n for k, v in parts.items()},
         "total_per_param": sum(v for k, v in parts.items() if k != "other") / n,
         "goal": goal, "xla_args": mem.argument_size_in_bytes,
         "xla_temp": mem.temp_size_in_bytes, "xla_peak": peak, "ms_per_step": None}
  if steps:
    state, metrics = train.step(state, batch)
    jax.block_until_ready(metrics["loss"])
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      state, metrics = train.step(state, batch)
      jax.block_until_ready(metrics["loss"])
      times.append(time.perf_counter() - start)
    row["ms_per_step"] = 1e3 * float(np.median(times))
    row["loss"] = float(metrics["loss"])
  return row


def table(rows: list[dict[str, Any]]) -> str:
  head = ("| mode | params B/p | master | compensation | optimizer | grads | **total B/p** "
          "| goal | XLA args MiB | XLA peak MiB | ms/step |")
  lines = [head, "| --- " + "| ---: " * 10 + "|"]
  for r in rows:
    p = r["per_param"]
    goal = "—" if r["goal"] is None else (
        f"≤ {r['goal']}: {'yes' if r['total_per_param'] <= r['goal'] else 'NO'}")
    ms = "—" if r["ms_per_step"] is None else f"{r['ms_per_step']:.1f}"
    lines.append(
        f"| {r['mode']} | {p['params']:.2f} | {p['master']:.2f} | {p['compensation']:.2f} "
        f"| {p['optimizer']:.2f} | {p['grads']:.2f} | **{r['total_per_param']:.2f}** | {goal} "
        f"| {r['xla_args'] / 2**20:.2f} | {r['xla_peak'] / 2**20:.2f} | {ms} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
  parser.add_argument("--run", type=int, default=0, help="also time this many steps")
  parser.add_argument("--out", help="folder for RESULTS.md and results.json")
  args = parser.parse_args()
  cfg = SIZES[args.size]
  start = time.time()
  rows = [measure(cfg, name, kw, goal, args.run) for name, kw, goal in MODES]
  info = report.machine()
  info["command"] = "python benchmarks/memory_bytes.py " + " ".join(sys.argv[1:])
  text = f"""# Bytes per parameter of the train state, per master-weights mode (issue 44)

Measured by `{info['command']}` on {info['date']} ({time.time() - start:.0f} s). Generated file: rerun the script rather than editing it.

Machine: {info['backend']} / {info['device']} × {info['device_count']} ({info['cpu']}, {info['cpu_cores']} cores usable), Python {info['python']}, jax {info['versions']['jax']}, optax {info['versions']['optax']}, jaxamp git {info['git']}.

Model: the benchmark LM (`benchmarks.models.GPT`, size `{args.size}`: vocab {cfg.vocab}, dim {cfg.dim}, {cfg.layers} layers, batch {cfg.batch} × {cfg.seq_len}; {rows[0]['params']:,} parameters), `optax.adamw(3e-4, weight_decay=0.1)`, one device, the state donated.

- **B/p columns**: bytes per parameter, counted from the state's arrays (`jax.eval_shape` would give the same): params, float32 master weights, Kahan compensation, the rest of the optimizer state (Adam's moments and count, the loss-scale state, a rounding key), and the gradient the optimizer receives (one per parameter, in the dtype the backward pass makes it: not state). **total** is their sum (model state, the step counter and the like are not counted: {rows[0]['other_bytes']} bytes here).
- **XLA args / peak MiB**: `train.lower(state, batch).compile().memory_analysis()`: the step's arguments (state and batch), and its peak (arguments + outputs + temporaries − donated aliases: XLA:CPU reports no peak of its own). At this size the activations make most of the peak; the state's share is what the B/p columns count.
- **ms/step**: {'median of ' + str(args.run) + ' steps after one warm-up' if args.run else 'not run (`--run N` times N steps)'}.

{table(rows)}
"""
  print(text)
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULTS.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"machine": info, "size": args.size,
                                                  "rows": rows}, indent=1), encoding="utf-8")


if __name__ == "__main__":
  main()
