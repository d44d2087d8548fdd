"""What bfloat16 storage without master weights costs in accuracy (issue 44).

``--model cnn`` (default): a small CNN (two 3x3 convolutions and a dense head, Flax NNX)
trains on scikit-learn's digits (8x8 images, 1437 train / 360 held out, a fixed
stratified split) with ``optax.adamw(lr)`` at batch 64, once per seed, as:

- ``mixed_bfloat16``: float32 params and moments (the reference);
- ``stochastic``: ``policy='bfloat16', master_weights='stochastic',
  opt_state_dtype=bfloat16`` (8 bytes per parameter);
- ``kahan``: ``policy='bfloat16', master_weights='kahan', opt_state_dtype=bfloat16``;
- ``naive bfloat16``: ``policy='bfloat16', master_weights=False`` (round to nearest, no
  master): the control, which stalls where updates fall under half a bfloat16 ulp.

The default learning rate (3e-5, 600 steps) is the setting where Adam's steps (about
``lr`` each) are below half an ulp of most weights, so the control falls behind; within
a seed every mode starts from the same weights and sees the same batches. The harness
reports the last 10 training losses' mean and the held-out loss and accuracy per mode
(mean over seeds, and the largest seed's difference from ``mixed_bfloat16``), and
plots the loss curves.

``--model lm``: ``examples/char_lm.py``'s byte-level GPT (Flax NNX, dim 128, 2 blocks,
sequence 64, batch 16) on the Python standard library's source (real text, offline),
``optax.adamw(lr)``; the held-out figure is the loss on 8 fixed batches of the last 10 %
of the text (no accuracy column). The default for it: ``--lr 1e-4 --steps 300``, under
half a bfloat16 ulp of the LayerNorm scales (1.0: ulp 2**-7) and of most weights.

    python benchmarks/memory_accuracy.py --out benchmarks/memory_accuracy
    python benchmarks/memory_accuracy.py --model lm --lr 1e-4 --steps 300 \
        --out benchmarks/memory_accuracy_lm
    python benchmarks/memory_accuracy.py --seeds 1 --steps 20 --out /tmp/acc  # checks it runs
"""

from __future__ import annotations

import argparse
import json
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
from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
from sklearn.model_selection import train_test_split  # pylint: disable=g-import-not-at-top

import jaxamp  # pylint: disable=g-import-not-at-top
from benchmarks import report  # pylint: disable=g-import-not-at-top

MODES: dict[str, dict[str, Any]] = {
    "mixed_bfloat16": dict(policy="mixed_bfloat16"),
    "stochastic": dict(policy="bfloat16", master_weights="stochastic",
                       opt_state_dtype=jnp.bfloat16),
    "kahan": dict(policy="bfloat16", master_weights="kahan", opt_state_dtype=jnp.bfloat16),
    "naive bfloat16": dict(policy="bfloat16", master_weights=False),
}


class CNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.c1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(16, 32, (3, 3), strides=(2, 2), rngs=rngs)
    self.head = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = nnx.relu(self.c2(nnx.relu(self.c1(x[..., None]))))
    return self.head(h.reshape(h.shape[0], -1))


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def loss_fn(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
  return xent(model(batch["x"]), batch["y"])


def eval_fn(model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  logits = model(batch["x"])
  return {"loss": xent(logits, batch["y"]),
          "accuracy": jnp.mean((logits.argmax(-1) == batch["y"]).astype(jnp.float32))}


def run_lm(mode: str, seed: int, steps: int, lr: float, data: Any) -> dict[str, Any]:
  """One char-LM run (``examples/char_lm.py``'s GPT and text)."""
  char_lm, train_text, val_batches = data
  train = jaxamp.make_train_step(char_lm.loss_fn, optax.adamw(lr), eval_fn=char_lm.loss_fn,
                                 seed=seed, **MODES[mode])
  state = train.init(char_lm.GPT(64, 128, 4, 2, nnx.Rngs(seed)))
  rng = np.random.RandomState(seed)
  losses = []
  for _ in range(steps):
    state, metrics = train.step(state, char_lm.sample_batch(train_text, rng, 16, 64))
    losses.append(float(metrics["loss"]))
  held = float(np.mean([float(train.eval_step(state, b)) for b in val_batches]))
  return {"mode": mode, "seed": seed, "losses": losses,
          "final_train": float(np.mean(losses[-10:])), "test_loss": held,
          "test_accuracy": float("nan")}


def lm_data() -> Any:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
  import char_lm  # pylint: disable=g-import-not-at-top
  text = char_lm.load_corpus(1_000_000)
  split = int(0.9 * len(text))
  vrng = np.random.RandomState(1234)
  return char_lm, text[:split], [char_lm.sample_batch(text[split:], vrng, 16, 64)
                                 for _ in range(8)]


def run(mode: str, seed: int, steps: int, lr: float, data: Any) -> dict[str, Any]:
  x_train, x_test, y_train, y_test = data
  train = jaxamp.make_train_step(loss_fn, optax.adamw(lr), eval_fn=eval_fn, seed=seed,
                                 **MODES[mode])
  state = train.init(CNN(nnx.Rngs(seed)))
  rng = np.random.default_rng(seed)
  losses = []
  for _ in range(steps):
    idx = rng.choice(len(x_train), 64, replace=False)
    state, metrics = train.step(state, {"x": x_train[idx], "y": y_train[idx]})
    losses.append(float(metrics["loss"]))
  held = train.eval_step(state, {"x": x_test, "y": y_test})
  return {"mode": mode, "seed": seed, "losses": losses,
          "final_train": float(np.mean(losses[-10:])), "test_loss": float(held["loss"]),
          "test_accuracy": float(held["accuracy"])}


def table(runs: list[dict[str, Any]]) -> str:
  by_mode: dict[str, list[dict[str, Any]]] = {}
  for r in runs:
    by_mode.setdefault(r["mode"], []).append(r)
  ref = {r["seed"]: r for r in by_mode["mixed_bfloat16"]}
  lines = ["| mode | final train loss | held-out loss | held-out accuracy | "
           "largest Δ train loss vs mixed_bfloat16 (relative) |",
           "| --- | ---: | ---: | ---: | ---: |"]
  for mode, rs in by_mode.items():
    rel = max(abs(r["final_train"] - ref[r["seed"]]["final_train"])
              / ref[r["seed"]]["final_train"] for r in rs)
    mean = lambda k: float(np.mean([r[k] for r in rs]))
    acc = mean("test_accuracy")  # NaN for the LM: no accuracy
    lines.append(f"| {mode} | {mean('final_train'):.4f} | {mean('test_loss'):.4f} "
                 f"| {'—' if np.isnan(acc) else f'{acc:.3f}'} | {100 * rel:.2f} % |")
  return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4))
  colors = dict(zip(MODES, ["black", "tab:blue", "tab:green", "tab:red"]))
  for r in runs:
    smooth = np.convolve(r["losses"], np.ones(10) / 10, mode="valid")
    ax.plot(smooth, color=colors[r["mode"]], alpha=0.7,
            label=r["mode"] if r["seed"] == runs[0]["seed"] else None)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (10-step mean)")
  ax.set_yscale("log")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--lr", type=float, default=3e-5)
  parser.add_argument("--model", choices=("cnn", "lm"), default="cnn")
  parser.add_argument("--out", help="folder for RESULTS.md, results.json and curves.png")
  args = parser.parse_args()
  if args.model == "lm":
    data, one = lm_data(), run_lm
  else:
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    data = train_test_split(x, digits.target.astype(np.int32), test_size=360,
                            stratify=digits.target, random_state=0)
    one = run
  start = time.time()
  runs = [one(mode, seed, args.steps, args.lr, data) for seed in range(args.seeds)
          for mode in MODES]
  info = report.machine()
  info["command"] = "python benchmarks/memory_accuracy.py " + " ".join(sys.argv[1:])
  setup = (f"`examples/char_lm.py`'s GPT (dim 128, 2 blocks) on the standard library's "
           f"source, `optax.adamw({args.lr})`, batch 16 x 64 bytes" if args.model == "lm"
           else f"A small CNN on scikit-learn's digits, `optax.adamw({args.lr})`, batch 64")
  title = "char LM" if args.model == "lm" else "digits CNN"
  text = f"""# Accuracy of bfloat16 storage without master weights (issue 44): {title}

Measured by `{info['command']}` on {info['date']} ({time.time() - start:.0f} s). Generated file: rerun the script rather than editing it.

Machine: {info['backend']} / {info['device']} ({info['cpu']}, {info['cpu_cores']} cores usable), jax {info['versions']['jax']}, optax {info['versions']['optax']}, jaxamp git {info['git']}.

{setup}, {args.steps} steps, {args.seeds} seeds (see the script's docstring). Means over seeds; the last column is the largest over seeds of the paired relative difference of the final training loss (last 10 steps' mean) from `mixed_bfloat16`'s.

{table(runs)}

![loss curves](curves.png)
"""
  print(text)
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULTS.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"machine": info, "args": vars(args),
                                                  "runs": runs}), encoding="utf-8")
    plot(runs, out / "curves.png")


if __name__ == "__main__":
  main()
