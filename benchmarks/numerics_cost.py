"""What the numerics monitor costs: step time with ``numerics=None`` against
``numerics=jaxamp.Numerics(every=100)``, on the transformer LM (NNX) and the ResNet CNN
(Linen), under ``mixed_bfloat16``.

Both steps are compiled first; then rounds interleave them (the order alternating),
each round ``--calls`` steps then one ``block_until_ready``, so the 1-in-100 recording
step falls inside the rounds as in training. The ratio is the median of the per-round
ratios. ``numerics=None`` is the program without the monitor (the same lowered text as
a step made without the keyword; ``tests/test_numerics.py`` checks it). A third program,
``every=1``, records every step: its ratio to None is the recording step's own cost,
and ``1 + (that - 1) / 100`` what ``every=100`` costs when its plain steps cost what
None's do, a figure less exposed to a shared machine's noise than the direct ratio. Writes
``RESULTS.md`` and ``results.json`` into ``--out``, with the machine named.

    python benchmarks/numerics_cost.py --out benchmarks/numerics
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxamp  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks import report as report_lib  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks import models  # noqa: E402  pylint: disable=wrong-import-position
from examples.resnet import loss_fn as resnet_loss  # noqa: E402  pylint: disable=wrong-import-position


def _lm(numerics, small):
  cfg = (models.LMConfig(vocab=256, dim=64, heads=4, layers=2, seq_len=32, batch=8) if small
         else models.LMConfig(vocab=1024, dim=256, heads=4, layers=4, seq_len=128, batch=16))
  train = jaxamp.make_train_step(models.lm_loss, optax.adam(1e-3), policy="mixed_bfloat16",
                                 numerics=numerics)
  from flax import nnx  # pylint: disable=g-import-not-at-top

  state = train.init(models.GPT(cfg, rngs=nnx.Rngs(0)))
  return train, state, models.lm_batch(cfg)


def _cnn(numerics, small):
  cfg = (models.ResNetConfig((1, 1), 8, 10, 32, 8) if small
         else models.ResNetConfig((2, 2, 2), 32, 100, 64, 32))
  module = models.resnet_module(cfg)
  batch = models.image_batch(cfg)
  variables = module.init(jax.random.key(0), batch["image"][:1], train=False)
  train = jaxamp.make_train_step(resnet_loss, optax.sgd(0.1, momentum=0.9), has_aux=True,
                                 policy="mixed_bfloat16", numerics=numerics)
  image = jax.ShapeDtypeStruct(batch["image"].shape, jnp.float32)
  return train, train.init(module, variables, image, train=False), batch


def measure(make, rounds, calls, small):
  runs = {}
  for name, numerics in (("off", None), ("every=100", jaxamp.Numerics(every=100)),
                         ("every=1", jaxamp.Numerics(every=1))):
    train, state, batch = make(numerics, small)
    for _ in range(2):  # compile: step 0 records (every=100), step 1 is the plain program
      state, m = train.step(state, batch)
    jax.block_until_ready(m)
    runs[name] = [train, state, batch]
  times = {name: [] for name in runs}
  for r in range(rounds):
    order = list(runs) if r % 2 == 0 else list(reversed(runs))
    for name in order:
      train, state, batch = runs[name]
      start = time.perf_counter()
      for _ in range(calls):
        state, m = train.step(state, batch)
      jax.block_until_ready((state, m))
      times[name].append((time.perf_counter() - start) / calls)
      runs[name][1] = state
  ratios = [a / b for a, b in zip(times["every=100"], times["off"])]
  recording = statistics.median(a / b for a, b in zip(times["every=1"], times["off"]))
  quartiles = statistics.quantiles(ratios, n=4)
  return {"off_ms": 1e3 * statistics.median(times["off"]),
          "every100_ms": 1e3 * statistics.median(times["every=100"]),
          "ratio": statistics.median(ratios), "ratio_iqr": [quartiles[0], quartiles[2]],
          # every=1 records each step: the recording step's cost, and what one in 100
          # adds to the plain steps' time if the plain steps cost what numerics=None's do
          "recording_ratio": recording, "expected_every100": 1 + (recording - 1) / 100,
          "rounds": rounds, "calls": calls, "times": times}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None)
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--calls", type=int, default=100)
  p.add_argument("--small", action="store_true", help="tiny models (a smoke run)")
  args = p.parse_args(argv)
  info = report_lib.machine()
  info["command"] = "python benchmarks/numerics_cost.py " + " ".join(
      argv if argv is not None else sys.argv[1:])
  results = {"machine": info, "models": {}}
  lines = ["# Numerics monitor cost", "",
           f"Measured by `{info['command']}` on {info['date']}. Generated file: rerun the "
           "script rather than editing it.", "",
           report_lib.machine_line(info), "",
           f"Each round: {args.calls} steps of each program, interleaved, {args.rounds} rounds; "
           "ratio: the median of the per-round ratios (every=100 / None), with their "
           "interquartile range.", "",
           "**recording step**: every=1 against None (each step records); **expected**: "
           "1 + (recording - 1) / 100, what every=100 costs if its other steps cost what "
           "numerics=None's do (they run the same program: tests/test_numerics.py).", "",
           "| model | numerics=None (ms/step) | every=100 (ms/step) | ratio (median) | "
           "ratio IQR | recording step | expected |",
           "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
  for name, make in (("LM (NNX GPT)", _lm), ("CNN (Linen ResNet)", _cnn)):
    r = measure(make, args.rounds, args.calls, args.small)
    results["models"][name] = r
    lines.append(f"| {name} | {r['off_ms']:.2f} | {r['every100_ms']:.2f} | {r['ratio']:.3f} | "
                 f"{r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f} | "
                 f"{r['recording_ratio']:.2f} | {r['expected_every100']:.4f} |")
  text = "\n".join(lines)
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
      f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
