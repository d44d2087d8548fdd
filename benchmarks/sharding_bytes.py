"""Sharded training: per-device state bytes and collective bytes per step.

Replicated (data parallel) against FSDP (``jaxamp.fsdp``), float32 against
``mixed_bfloat16`` and pure ``bfloat16`` (float32 master weights), and FSDP under
``mixed_fp8_current`` with its FP8 kernel gather on and off
(``ShardingConfig.fp8_gather``), for one model on a mesh of all devices. Per device: the
bytes of params and optimizer state (master weights included) the state holds, XLA's
memory analysis of the compiled step, and the collectives per step, both as jaxamp
lowered them (the dtypes it asked for) and as the backend compiled them.

On CPU, fake the devices::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python benchmarks/sharding_bytes.py --out benchmarks/sharding
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxamp
from jaxamp.sharding import collectives

WIDTHS = (256, 1024, 1024, 1024, 10)
BATCH = 64


class Mlp(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(WIDTHS, WIDTHS[1:])])

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = jax.nn.relu(layer(x))
    return self.layers[-1](x)


def loss_fn(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def local_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
             if hasattr(x, "addressable_shards"))


def by_op(found) -> dict[str, tuple[int, str]]:
  out: dict[str, list] = collections.defaultdict(lambda: [0, set()])
  for c in found:
    out[c.op][0] += c.bytes
    out[c.op][1].add(c.dtype)
  return {op: (b, "/".join(sorted(d))) for op, (b, d) in out.items()}


def measure(layout: str, policy: str, mesh, batch, reduce=jnp.float32,
            fp8_gather=True) -> dict:
  sharding = jaxamp.ShardingConfig(
      mesh=mesh, batch_axis="d", grad_reduce_dtype=reduce, fp8_gather=fp8_gather,
      param_sharding=jaxamp.fsdp("d") if layout == "fsdp" else None)
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy=policy, sharding=sharding)
  state = train.init(Mlp(nnx.Rngs(0)))
  lowered = train.lower(state, batch)
  compiled = lowered.compile()
  mem = compiled.memory_analysis()
  state, _ = train.step(state, batch)
  times = []
  for _ in range(5):
    t = time.perf_counter()
    state, metrics = train.step(state, batch)
    jax.block_until_ready(metrics["loss"])
    times.append(time.perf_counter() - t)
  return {
      "layout": layout, "policy": policy, "reduce": np.dtype(reduce).name,
      "fp8_gather": ("on" if fp8_gather else "off") if "fp8" in policy else "",
      "params": local_bytes(state.params), "opt": local_bytes(state.opt_state),
      "args": getattr(mem, "argument_size_in_bytes", None),
      "temp": getattr(mem, "temp_size_in_bytes", None),
      "lowered": by_op(collectives(lowered.as_text())),
      "compiled": by_op(collectives(compiled.as_text())),
      "ms": 1e3 * float(np.median(times)),
  }


def mib(b) -> str:
  return "n/a" if b is None else f"{b / 2**20:.2f}"


def table(rows, n) -> str:
  ops = ("all-gather", "reduce-scatter", "all-reduce")
  head = ("| layout | policy | grad_reduce_dtype | fp8_gather | params MiB | opt state MiB | params + opt MiB | XLA args MiB "
          "| XLA temp MiB | " + " | ".join(f"{op} (lowered)" for op in ops) + " | "
          + " | ".join(f"{op} (compiled)" for op in ops) + " | ms/step |")
  lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
  for r in rows:
    cells = [r["layout"], r["policy"], r["reduce"], r["fp8_gather"], mib(r["params"]), mib(r["opt"]),
             mib(r["params"] + r["opt"]), mib(r["args"]), mib(r["temp"])]
    for which in ("lowered", "compiled"):
      for op in ops:
        b, d = r[which].get(op, (0, ""))
        cells.append(f"{mib(b)} {d}".strip())
    cells.append(f"{r['ms']:.1f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="folder for RESULTS.md")
  args = parser.parse_args()
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",))
  rng = np.random.RandomState(0)
  batch = {"x": rng.randn(BATCH, WIDTHS[0]).astype(np.float32),
           "y": rng.randint(0, WIDTHS[-1], BATCH).astype(np.int32)}
  start = time.time()
  rows = [measure(layout, policy, mesh, batch) for layout in ("replicated", "fsdp")
          for policy in ("float32", "mixed_bfloat16", "bfloat16")]
  rows.append(measure("fsdp", "mixed_bfloat16", mesh, batch, reduce=jnp.bfloat16))
  rows += [measure("fsdp", "mixed_fp8_current", mesh, batch, fp8_gather=on)
           for on in (True, False)]
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
  except OSError:
    commit = "?"
  n_params = sum(a * b + b for a, b in zip(WIDTHS, WIDTHS[1:]))
  text = f"""# Sharded training: state and communication per device

Measured by `XLA_FLAGS=--xla_force_host_platform_device_count={n} python benchmarks/sharding_bytes.py --out benchmarks/sharding` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC ({time.time() - start:.0f} s). Generated file: rerun the script rather than editing it.

Machine: {jax.default_backend()} × {n} devices ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), Python {platform.python_version()}, jax {jax.__version__}, jaxamp git {commit}.

Model: MLP {'-'.join(map(str, WIDTHS))} ({n_params:,} params), Adam, batch {BATCH} split over a mesh of {n} devices (axis `d`). `replicated`: `make_train_step(sharding=jaxamp.ShardingConfig(mesh=mesh, batch_axis='d'))`; `fsdp`: plus `param_sharding=jaxamp.fsdp('d')` in the config (params of ≥ 4096 elements split over `d`; the biases stay replicated).

- **params / opt state MiB**: bytes one device holds (its shards), after a step. The optimizer state includes the loss-scale state and, for `bfloat16`, the float32 master weights.
- **XLA args / temp MiB**: `compiled.memory_analysis()` of the step on one device.
- **collective columns**: bytes of the arrays each kind of collective produces on one device per step, and their dtypes (an all-gather's result is the whole gathered parameter; a device receives (n-1)/n of it). *Lowered*: the program jaxamp hands to XLA, where the dtypes are the ones it chose: params gathered in the compute dtype, gradients reduced in `grad_reduce_dtype` (float32 but in the last row). *Compiled*: what XLA:CPU made of it. XLA:CPU promotes bfloat16 collectives to float32 (its `_promoted` reduction regions), so on CPU the compiled bytes of a bfloat16 gather are float32's; a GPU or TPU backend keeps bfloat16 (not measured here: no accelerator).
- **fp8_gather**: under `mixed_fp8_current`, `ShardingConfig(fp8_gather=...)`: on (the default), each FP8 layer's kernel is quantized to E4M3 on its slice with the whole kernel's scale (one scalar all-reduce of the amax: the all-reduce column's extra bytes) and gathered as `f8E4M3FN`, half the bytes of bfloat16; the FP8 matmul gets the same E4M3 values bit for bit (`jaxamp.fp8_gather`). The biases stay bfloat16. XLA:CPU compiles an E4M3 all-gather as a float16 one (the compiled column: it has no FP8 collectives), and the quantize and dequantize on each slice cost CPU time (the ms/step column, on 2 shared cores); whether GPU collectives move the E4M3 bytes as lowered is not measured here.
- **ms/step**: median of 5 steps; on fake CPU devices this says little about real devices.

{table(rows, n)}
"""
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "RESULTS.md"), "w", encoding="utf-8") as f:
      f.write(text)


if __name__ == "__main__":
  main()
