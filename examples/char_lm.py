"""Train a small GPT on Python's own standard-library source, comparing precision policies.

The text is the ``.py`` files of the running interpreter's standard library, so it is
always there offline. Bytes are the tokens (vocabulary 256). The model is an unmodified
Flax NNX GPT (``nnx.MultiHeadAttention`` with a causal mask, pre-norm blocks, tied
input/output embeddings); each policy trains it from the same initialization on the
same batches with ``jaxamp.make_train_step``. The table compares held-out loss (and
bits per byte), speed and the loss-scale bookkeeping; the PNG shows the loss curves
and the loss-scale trajectory.

    python examples/char_lm.py                       # float32, mixed_bfloat16, mixed_float16
    python examples/char_lm.py --policy mixed_float16 --steps 600 --plot lm.png

float16 gets dynamic loss scaling. The scale grows after ``--growth-interval`` finite
steps: 100 here, so a run of a few hundred steps shows it grow and back off; the
library's default (torch's and Keras') is 2000.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jaxamp

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def load_corpus(max_bytes: int) -> np.ndarray:
  """The standard library's top-level ``.py`` files, in name order, as uint8 bytes."""
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(stdlib.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data[:max_bytes - total])
    total += len(chunks[-1])
    if total >= max_bytes:
      break
  if total == 0:
    raise FileNotFoundError(f"No .py files in the standard library folder {stdlib}.")
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
  """Byte-level GPT: token + position embeddings, blocks, LayerNorm, tied output layer."""

  def __init__(self, seq_len: int, dim: int, heads: int, layers: int, rngs: nnx.Rngs,
               vocab: int = 256):
    self.tok = nnx.Embed(vocab, dim, rngs=rngs)
    self.pos = nnx.Embed(seq_len, dim, rngs=rngs)
    self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
    self.ln = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))
    mask = nnx.make_causal_mask(ids, dtype=jnp.bool_)
    for block in self.blocks:
      x = block(x, mask)
    return self.tok.attend(self.ln(x))  # logits over the 256 byte values


def loss_fn(model: GPT, batch: dict[str, jax.Array]) -> jax.Array:
  logits = model(batch["ids"])  # float32: make_train_step hands outputs over in float32
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def sample_batch(data: np.ndarray, rng: np.random.RandomState, batch_size: int,
                 seq_len: int) -> dict[str, np.ndarray]:
  starts = rng.randint(0, len(data) - seq_len - 1, batch_size)
  windows = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)
  return {"ids": windows[:, :-1], "targets": windows[:, 1:]}


def make_optimizer(policy: str, args) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1),
                                                args.steps)
  # jaxamp.clip_by_global_norm: optax's rule, clipping with the norm the step computes anyway.
  tx = optax.chain(jaxamp.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  if jaxamp.get_policy(policy).compute_dtype == jnp.float16:
    # Our own loss-scale element, first in the chain: make_train_step uses it as is.
    tx = optax.chain(jaxamp.dynamic_loss_scale(growth_interval=args.growth_interval), tx)
  return tx


def train_one(policy: str, train_data: np.ndarray, val_batches: list, args) -> dict:
  train = jaxamp.make_train_step(loss_fn, make_optimizer(policy, args), policy=policy)
  state = train.init(GPT(args.seq_len, args.dim, args.heads, args.layers,
                         nnx.Rngs(args.seed)))
  rng = np.random.RandomState(args.seed)  # the same batches for every policy
  losses, scales, finite = [], [], []
  timed_steps, timed_seconds = 0, 0.0
  bar = tqdm(total=args.steps, desc=f"{policy:>15}", disable=args.no_progress)
  for step in range(args.steps):
    batch = sample_batch(train_data, rng, args.batch_size, args.seq_len)
    start = time.perf_counter()
    state, metrics = train.step(state, batch)
    loss = float(metrics["loss"])  # waits for the step
    if step > 0:  # the first step compiles
      timed_steps += 1
      timed_seconds += time.perf_counter() - start
    losses.append(loss)
    scales.append(float(metrics["loss_scale"]))
    finite.append(bool(metrics["grads_finite"]))
    bar.update()
    if step % 10 == 0:
      bar.set_postfix(loss=f"{loss:.3f}", scale=f"{scales[-1]:g}")
  bar.close()
  val_loss = float(np.mean([float(train.eval_step(state, b)) for b in val_batches]))
  tail = losses[-max(1, len(losses) // 10):]
  return {
      "losses": losses,
      "scales": scales,
      "finite": finite,
      "train_loss": float(np.mean(tail)),
      "val_loss": val_loss,
      "bits_per_byte": val_loss / math.log(2),
      "steps_per_s": timed_steps / timed_seconds if timed_seconds else float("nan"),
      "skipped": int(metrics["skipped_steps"]),
      "scale": scales[-1],
  }


def plot(results: dict[str, dict], path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(12, 4.2))
  for policy, r in results.items():
    losses = np.asarray(r["losses"])
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    line, = ax_loss.plot(np.arange(window - 1, len(losses)), smooth,
                         label=f"{policy} (val {r['val_loss']:.3f})")
    ax_loss.axhline(r["val_loss"], color=line.get_color(), linestyle=":", linewidth=1)
    ax_scale.step(np.arange(len(r["scales"])), r["scales"], where="post", label=policy,
                  color=line.get_color())
  ax_loss.set(xlabel="step", ylabel="train loss (nats/byte, smoothed)",
              title="Loss (dotted: held-out loss at the end)")
  ax_scale.set(xlabel="step", ylabel="loss scale", title="Loss scale")
  ax_scale.set_yscale("log", base=2)
  ax_loss.legend()
  ax_scale.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policy", choices=POLICIES + ("all",), default="all",
                      help="policy to train under (default: all three, one after another)")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--growth-interval", type=int, default=100,
                      help="finite float16 steps before the loss scale doubles")
  parser.add_argument("--corpus-bytes", type=int, default=2_000_000,
                      help="how much standard-library source to read")
  parser.add_argument("--val-batches", type=int, default=8)
  parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("char_lm.png"),
                      help="where the PNG of the loss curves and loss scales goes")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  args = parser.parse_args(argv)

  data = load_corpus(args.corpus_bytes)
  split = int(0.9 * len(data))
  train_data, val_data = data[:split], data[split:]
  val_rng = np.random.RandomState(args.seed + 1)
  val_batches = [sample_batch(val_data, val_rng, args.batch_size, args.seq_len)
                 for _ in range(args.val_batches)]
  print(f"standard-library source: {len(train_data):,} train / {len(val_data):,} held-out "
        f"bytes; backend {jax.default_backend()}, jax {jax.__version__}")
  policies = POLICIES if args.policy == "all" else (args.policy,)
  results = {p: train_one(p, train_data, val_batches, args) for p in policies}

  header = (f"{'policy':<16}{'train loss':>11}{'val loss':>10}{'bits/byte':>10}"
            f"{'steps/s':>9}{'skipped':>9}{'loss scale':>12}")
  print("\n" + header + "\n" + "-" * len(header))
  for p, r in results.items():
    print(f"{p:<16}{r['train_loss']:>11.4f}{r['val_loss']:>10.4f}{r['bits_per_byte']:>10.3f}"
          f"{r['steps_per_s']:>9.1f}{r['skipped']:>9d}{r['scale']:>12g}")
  if "float32" in results:
    for p, r in results.items():
      if p != "float32":
        gap = r["val_loss"] - results["float32"]["val_loss"]
        print(f"{p}: {gap:+.4f} held-out loss vs float32")
  plot(results, args.plot)
  print(f"plot: {args.plot}")
  return results


if __name__ == "__main__":
  main()
