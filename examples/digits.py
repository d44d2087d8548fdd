"""Train a small CNN on scikit-learn's handwritten digits under several precision policies.

The digits ship with scikit-learn (1,797 8x8 images), so this runs offline. Each policy
trains the same Flax NNX model (Conv, BatchNorm, Dropout, Linear) from the same
initialization with ``jaxamp.make_train_step``; the final table compares held-out
accuracy, loss, speed and the loss-scale bookkeeping.

    python examples/digits.py                      # float32, mixed_bfloat16, mixed_float16
    python examples/digits.py --policy mixed_bfloat16 --epochs 5
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaxamp

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


class CNN(nnx.Module):
  """Two conv blocks (Conv -> BatchNorm -> ReLU -> avg-pool) and a two-layer head."""

  def __init__(self, rngs: nnx.Rngs, width: int = 32, dropout: float = 0.2):
    self.conv1 = nnx.Conv(1, width, (3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(width, rngs=rngs)
    self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs)
    self.bn2 = nnx.BatchNorm(2 * width, rngs=rngs)
    self.fc1 = nnx.Linear(2 * width * 2 * 2, 128, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.fc2 = nnx.Linear(128, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.avg_pool(jax.nn.relu(self.bn1(self.conv1(x))), (2, 2), (2, 2))
    x = nnx.avg_pool(jax.nn.relu(self.bn2(self.conv2(x))), (2, 2), (2, 2))
    x = x.reshape(x.shape[0], -1)
    return self.fc2(self.drop(jax.nn.relu(self.fc1(x))))


def loss_fn(model: CNN, batch: dict[str, jax.Array]):
  logits = model(batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def predict(model: CNN, batch: dict[str, jax.Array]) -> jax.Array:
  return jnp.argmax(model(batch["image"]), -1)


def load_data(seed: int):
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  return train_test_split(images, labels, test_size=0.2, random_state=seed, stratify=labels)


def train_one(policy: str, data, args) -> dict[str, float]:
  x_train, x_test, y_train, y_test = data
  steps_per_epoch = len(x_train) // args.batch_size
  schedule = optax.cosine_decay_schedule(args.lr, args.epochs * steps_per_epoch)
  train = jaxamp.make_train_step(loss_fn, optax.adamw(schedule, weight_decay=1e-4),
                                 policy=policy, has_aux=True, eval_fn=predict)
  state = train.init(CNN(nnx.Rngs(args.seed, dropout=args.seed + 1)))
  order = np.random.RandomState(args.seed)
  steps, timed_steps, timed_seconds = 0, 0, 0.0
  bar = tqdm(total=args.epochs * steps_per_epoch, desc=f"{policy:>15}", leave=True,
             disable=args.no_progress)
  for _ in range(args.epochs):
    perm = order.permutation(len(x_train))
    for i in range(steps_per_epoch):
      idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
      start = time.perf_counter()
      state, metrics = train.step(state, {"image": x_train[idx], "label": y_train[idx]})
      loss = float(metrics["loss"])  # waits for the step
      steps += 1
      if steps > 1:  # the first step compiles
        timed_steps += 1
        timed_seconds += time.perf_counter() - start
      bar.update()
      bar.set_postfix(loss=f"{loss:.3f}", scale=f"{float(metrics['loss_scale']):g}")
  bar.close()
  predictions = train.eval_step(state, {"image": x_test, "label": y_test})
  return {
      "accuracy": 100.0 * float(np.mean(np.asarray(predictions) == y_test)),
      "loss": loss,
      "steps_per_s": timed_steps / timed_seconds if timed_seconds else float("nan"),
      "skipped": int(metrics["skipped_steps"]),
      "scale": float(metrics["loss_scale"]),
  }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policy", choices=POLICIES + ("all",), default="all",
                      help="policy to train under (default: all three, one after another)")
  parser.add_argument("--epochs", type=int, default=30)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  args = parser.parse_args(argv)

  data = load_data(args.seed)
  print(f"digits: {len(data[0])} train / {len(data[1])} test images, "
        f"backend {jax.default_backend()}, jax {jax.__version__}")
  policies = POLICIES if args.policy == "all" else (args.policy,)
  results = {p: train_one(p, data, args) for p in policies}

  header = (f"{'policy':<16}{'test acc %':>11}{'final loss':>12}{'steps/s':>10}"
            f"{'skipped':>9}{'loss scale':>12}")
  print("\n" + header + "\n" + "-" * len(header))
  for p, r in results.items():
    print(f"{p:<16}{r['accuracy']:>11.2f}{r['loss']:>12.4f}{r['steps_per_s']:>10.1f}"
          f"{r['skipped']:>9d}{r['scale']:>12g}")
  if "float32" in results:
    for p, r in results.items():
      if p != "float32":
        gap = r["accuracy"] - results["float32"]["accuracy"]
        print(f"{p}: {gap:+.2f} accuracy points vs float32")
  return results


if __name__ == "__main__":
  main()
