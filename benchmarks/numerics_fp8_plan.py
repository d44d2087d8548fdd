"""The numerics monitor's FP8 plan on a model nobody built for it: the digits CNN.

``examples/digits.py``'s CNN (two ``nnx.Conv`` + BatchNorm, two ``nnx.Linear``) is the
model whose held-out loss ``benchmarks/fp8/RESULTS.md`` found 10-16 % behind
``mixed_bfloat16`` under the per-tensor FP8 recipes. Per seed: a run under
``mixed_bfloat16`` with ``numerics=jaxamp.Numerics(every=50)`` (the reference, and the
log); ``jaxamp.suggest_policy(log, 'mixed_fp8', safer='mixed_bfloat16')``; then
``mixed_fp8`` uniform, with the plan, with the convolutions kept in bfloat16 (the rule
the FP8 guide suggests) and with both. Figure: the held-out loss after the last step,
as the mean over seeds of the paired gap to ``mixed_bfloat16``. Same data, batches,
optimizer (AdamW 3e-3, cosine decay) and steps as ``benchmarks/fp8_recipes.py``'s CNN.

    python benchmarks/numerics_fp8_plan.py --out benchmarks/numerics
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import warnings

import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import jaxamp  # noqa: E402  pylint: disable=wrong-import-position
from flax import nnx  # noqa: E402  pylint: disable=wrong-import-position

import digits  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks import report as report_lib  # noqa: E402  pylint: disable=wrong-import-position

REFERENCE = "mixed_bfloat16"


def _eval(model, batch):
  loss, aux = digits.loss_fn(model, batch)
  return loss, aux["accuracy"]


def run(data, seed: int, steps: int, policy: str, rules=None, log=None) -> float:
  """The held-out loss after ``steps`` steps under ``policy`` and ``rules``."""
  x_train, x_test, y_train, y_test = data
  numerics = jaxamp.Numerics(every=50) if log is not None else None
  with jaxamp.policy_rules(rules or {}):
    train = jaxamp.make_train_step(
        digits.loss_fn, optax.adamw(optax.cosine_decay_schedule(3e-3, steps), weight_decay=1e-4),
        policy=policy, has_aux=True, eval_fn=_eval, numerics=numerics)
    state = train.init(digits.CNN(nnx.Rngs(seed, dropout=seed + 1)))
    rng = np.random.RandomState(seed)
    for i in range(steps):
      idx = rng.randint(0, len(x_train), 64)
      state, metrics = train.step(state, {"image": x_train[idx], "label": y_train[idx]})
      if log is not None:
        log.add(i, metrics)
    loss, _ = train.eval_step(state, {"image": x_test, "label": y_test})
  return float(loss)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--steps", type=int, default=500)
  args = p.parse_args(argv)
  warnings.filterwarnings("ignore", message=".*XLA on CPU runs FP8.*")
  data = digits.load_data(0)
  rows = {k: [] for k in ("uniform", "plan", "convs in bf16", "plan + convs in bf16")}
  ref, plans = [], []
  for seed in range(args.seeds):
    log = jaxamp.NumericsLog()
    ref.append(run(data, seed, args.steps, REFERENCE, log=log))
    plan = jaxamp.suggest_policy(log, "mixed_fp8", safer=REFERENCE)
    plans.append({"rules": plan.rules, "reasons": plan.reasons})
    convs = {nnx.Conv: REFERENCE}
    for name, rules in (("uniform", {}), ("plan", plan.rules), ("convs in bf16", convs),
                        ("plan + convs in bf16", {**convs, **plan.rules})):
      rows[name].append(run(data, seed, args.steps, "mixed_fp8", rules))
    print(seed, ref[-1], {k: v[-1] for k, v in rows.items()}, plan.rules, flush=True)
  info = report_lib.machine()
  result = {"machine": info, "steps": args.steps, "reference": ref, "rows": rows,
            "plans": plans}
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_plan.json").write_text(json.dumps(result, indent=1, default=str))
    gap = lambda v: 100 * np.mean(np.array(v) / np.array(ref) - 1)  # noqa: E731
    lines = ["# The numerics monitor's FP8 plan on the digits CNN", "",
             f"Measured by `python benchmarks/numerics_fp8_plan.py --out {args.out}` "
             f"({args.seeds} seeds, {args.steps} steps). Generated file: rerun the script "
             "rather than editing it.", "", report_lib.machine_line(info), "",
             "Plans (`suggest_policy(log, 'mixed_fp8', safer='mixed_bfloat16')`, log "
             "under `mixed_bfloat16`, every 50th step):", ""]
    lines += [f"- seed {s}: `{p['rules']}`" + "".join(f" ({k}: {v})" for k, v in p["reasons"].items())
              for s, p in enumerate(plans)]
    lines += ["", "| `mixed_fp8` with | held-out loss per seed | gap to `mixed_bfloat16` (mean) |",
              "| --- | --- | ---: |",
              f"| (`mixed_bfloat16`) | {', '.join(f'{v:.4f}' for v in ref)} | |"]
    lines += [f"| {k} | {', '.join(f'{v:.4f}' for v in vals)} | {gap(vals):+.1f} % |"
              for k, vals in rows.items()]
    (out / "fp8_plan.md").write_text("\n".join(lines) + "\n")
  return result


if __name__ == "__main__":
  main()
