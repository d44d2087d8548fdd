"""ResNet-50 (Flax Linen, BatchNorm) on synthetic ImageNet-shaped data: images/s per policy.

As in the classic AMP tutorials (NVIDIA's and Apex's ImageNet examples run with
synthetic data), the data is one random batch that stays on the device, so the
numbers measure the training step alone. The model is an unmodified Linen ResNet v1.5
(``dtype`` left at None); jaxamp runs it under each policy, or under an Apex-style
optimization level:

    O0  float32
    O1  float32 model, matmuls and convolutions autocast to float16, dynamic loss scale
    O2  float16 model, BatchNorm in float32, float32 master weights, dynamic loss scale
    O3  float16 everything, no loss scaling (the "speed of light" baseline)

Defaults follow the backend: on a GPU, full size (224x224, batch 256, 64 base filters);
on a CPU, ResNet-50's depth at a quarter of its width on 64x64 images, batch 16, so it
finishes in a minute or two. Careful, interleaved measurements are in ``benchmarks/``.

    python examples/resnet.py                                  # float32, mixed_bfloat16, mixed_float16
    python examples/resnet.py --opt-level O0 O1 O2 O3
    python examples/resnet.py --policy mixed_bfloat16 --batch-size 128 --steps 50
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxamp

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "float16")
DEFAULT_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


class Bottleneck(nn.Module):
  """1x1 -> 3x3 (strided) -> 1x1 convolutions with BatchNorm, and a projected shortcut."""

  filters: int
  strides: tuple[int, int] = (1, 1)
  dtype: Any = None  # None: the layers' default, so jaxamp's policy decides
  train: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not self.train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype)
    y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
    y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(y)))
    y = norm(scale_init=nn.initializers.zeros_init())(conv(4 * self.filters, (1, 1))(y))
    if x.shape != y.shape:
      x = norm(name="norm_proj")(conv(4 * self.filters, (1, 1), self.strides,
                                      name="conv_proj")(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """ResNet v1.5 (stride on the 3x3 convolution); ``stage_sizes=(3, 4, 6, 3)`` is ResNet-50.

  ``dtype`` stays None here; ``benchmarks/`` sets it for its hand-written baseline.
  """

  stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
  num_filters: int = 64
  num_classes: int = 1000
  dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    x = nn.Conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                dtype=self.dtype, name="conv_init")(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                     dtype=self.dtype, name="bn_init")(x)
    x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
    for i, size in enumerate(self.stage_sizes):
      for j in range(size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = Bottleneck(self.num_filters * 2**i, strides, dtype=self.dtype, train=train)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


def loss_fn(model: Any, batch: dict[str, jax.Array]):
  logits = model(batch["image"], train=True)  # float32: the train step casts outputs
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}


def synthetic_batch(batch_size: int, image_size: int, num_classes: int,
                    seed: int = 0) -> dict[str, jax.Array]:
  """Random NHWC images and labels (the benchmarks use it too)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  shape = (batch_size, image_size, image_size, 3)
  return {"image": jax.random.normal(k1, shape, jnp.float32),
          "label": jax.random.randint(k2, (batch_size,), 0, num_classes)}


def build(name: str, model: ResNet, variables: Any, args):
  """(step function, initial state) for a policy or an opt level name."""
  tx = optax.sgd(args.lr, momentum=0.9, nesterov=True)
  if name in jaxamp.OPT_LEVELS:
    # O1 keeps the model float32 and autocasts the whole loss computation, so the backward
    # pass's matmuls run in the half dtype too; O2/O3 use module policies.
    level = jaxamp.opt_level(name, half=jnp.dtype(args.half))
    train = jaxamp.make_train_step(loss_fn, tx, opt_level=level, has_aux=True)
  else:
    train = jaxamp.make_train_step(loss_fn, tx, policy=name, has_aux=True)
  # The example input shows init which module owns each parameter, so each is stored in
  # its module's param dtype (under O2, BatchNorm's in float32, as in Apex).
  image = jax.ShapeDtypeStruct((args.batch_size, args.image_size, args.image_size, 3),
                               jnp.float32)
  return train.step, train.init(model, variables, image, train=False)


def run_one(name: str, model: ResNet, variables: Any, batch, args) -> dict[str, float]:
  step, state = build(name, model, variables, args)
  start = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start
  first_loss = float(metrics["loss"])
  for _ in range(args.warmup):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  return {"images_per_s": args.batch_size / step_s, "step_ms": 1e3 * step_s,
          "compile_s": compile_s, "first_loss": first_loss, "loss": float(metrics["loss"]),
          "skipped": int(metrics["skipped_steps"]), "scale": float(metrics["loss_scale"])}


def _stage_sizes(text: str) -> tuple[int, ...]:
  try:
    sizes = tuple(int(s) for s in text.split(","))
  except ValueError:
    sizes = ()
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(
        f"--stage-sizes takes positive integers separated by commas (3,4,6,3 is ResNet-50), "
        f"got {text!r}.")
  return sizes


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n".join(__doc__.splitlines()[1:]))
  on_gpu = jax.default_backend() != "cpu"
  choice = parser.add_mutually_exclusive_group()
  choice.add_argument("--policy", nargs="+", choices=POLICIES, metavar="POLICY",
                      help=f"policies to compare, from {', '.join(POLICIES)} "
                           f"(default: {' '.join(DEFAULT_POLICIES)})")
  choice.add_argument("--opt-level", nargs="+", choices=jaxamp.OPT_LEVELS, metavar="LEVEL",
                      help="Apex-style optimization levels (O0 O1 O2 O3) to compare instead")
  parser.add_argument("--half", choices=("float16", "bfloat16"), default="float16",
                      help="the half dtype of the opt levels (default float16, as Apex)")
  parser.add_argument("--batch-size", type=int, default=256 if on_gpu else 16,
                      help="default: 256 on a GPU, 16 on a CPU")
  parser.add_argument("--image-size", type=int, default=224 if on_gpu else 64,
                      help="default: 224 on a GPU, 64 on a CPU")
  parser.add_argument("--width", type=int, default=64 if on_gpu else 16,
                      help="base number of filters, 64 in ResNet-50 (default: 64 on a GPU, "
                           "16 on a CPU)")
  parser.add_argument("--stage-sizes", type=_stage_sizes, default=(3, 4, 6, 3),
                      help="bottleneck blocks per stage (default 3,4,6,3: ResNet-50)")
  parser.add_argument("--num-classes", type=int, default=1000)
  parser.add_argument("--steps", type=int, default=50 if on_gpu else 10,
                      help="timed steps per policy; images/s is from their median "
                           "(default: 50 on a GPU, 10 on a CPU)")
  parser.add_argument("--warmup", type=int, default=5 if on_gpu else 2,
                      help="untimed steps after the first (compiling) one")
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  names = args.opt_level or args.policy or DEFAULT_POLICIES
  model = ResNet(args.stage_sizes, args.width, args.num_classes)
  batch = synthetic_batch(args.batch_size, args.image_size, args.num_classes, args.seed)
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(args.seed),
                                                                  batch["image"])
  depth = 3 * sum(args.stage_sizes) + 2
  print(f"ResNet-{depth} ({args.width} base filters), batch {args.batch_size} of "
        f"{args.image_size}x{args.image_size} synthetic images; backend "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
  results = {}
  for name in names:
    # Each run gets its own copy: the step donates its state.
    results[name] = run_one(name, model, jax.tree.map(jnp.copy, variables), batch, args)
    r = results[name]
    print(f"  {name:<16} {r['images_per_s']:9.1f} images/s")

  header = (f"{'policy/level':<16}{'images/s':>10}{'ms/step':>9}{'compile s':>11}{'loss':>16}"
            f"{'skipped':>9}{'loss scale':>12}")
  print("\n" + header + "\n" + "-" * len(header))
  base = results[names[0]]["images_per_s"]
  for name, r in results.items():
    print(f"{name:<16}{r['images_per_s']:>10.1f}{r['step_ms']:>9.1f}{r['compile_s']:>11.1f}"
          f"{r['first_loss']:>8.3f}->{r['loss']:<6.3f}{r['skipped']:>9d}{r['scale']:>12g}")
  if len(results) > 1:
    print(", ".join(f"{name}: {r['images_per_s'] / base:.2f}x" for name, r in results.items())
          + f" the images/s of {names[0]}")
  return results


if __name__ == "__main__":
  main()
