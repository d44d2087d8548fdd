"""Sharded (FSDP) mixed-precision training, in one process or several.

The params, float32 Adam moments and loss scale live sharded over a ``'fsdp'`` mesh axis;
each step gathers each layer's params in bfloat16 where the layer runs (``--gather
model``: the whole model at the step's start) and reduce-scatters gradients in float32.

One process, 8 CPU devices::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python examples/sharded.py

Two processes on this machine, 2 CPU devices each (start both; process 0 coordinates)::

  export XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu
  python examples/sharded.py --processes 2 --process-id 0 --coordinator localhost:12355 &
  python examples/sharded.py --processes 2 --process-id 1 --coordinator localhost:12355

On several machines, run one process per machine with ``--coordinator`` naming process
0's host and a free port; on GPUs drop the flags (each process sees its GPUs).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax
from flax import nnx

import jaxamp

BATCH = 32


class Mlp(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(32, 256, rngs=rngs)
    self.norm = nnx.LayerNorm(256, rngs=rngs)
    self.l2 = nnx.Linear(256, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.norm(self.l1(x))))


def loss_fn(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def batches(steps: int):
  rng = np.random.RandomState(0)
  for _ in range(steps):
    yield {"x": rng.randn(BATCH, 32).astype(np.float32),
           "y": rng.randint(0, 8, BATCH).astype(np.int32)}


def run(steps: int = 3, policy: str = "mixed_bfloat16", sharded: bool = True,
        gather: str = "auto"):
  """Trains ``steps`` steps; returns the final params (as host arrays) and the losses."""
  sharding = None
  if sharded:
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    sharding = jaxamp.ShardingConfig(
        mesh=mesh, batch_axis="fsdp",
        param_sharding=jaxamp.fsdp("fsdp", min_size=1024, gather=gather))
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy=policy, sharding=sharding)
  state = train.init(Mlp(nnx.Rngs(0)))
  losses = []
  for batch in batches(steps):
    if sharded:
      # Each process feeds its rows of the global batch.
      n, i = jax.process_count(), jax.process_index()
      rows = slice(i * BATCH // n, (i + 1) * BATCH // n)
      data = jax.sharding.NamedSharding(mesh, jax.P("fsdp"))
      batch = {k: jax.make_array_from_process_local_data(data, v[rows])
               for k, v in batch.items()}
    state, metrics = train.step(state, batch)
    losses.append(float(metrics["loss"]))
  if sharded:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    params = [np.asarray(multihost_utils.process_allgather(p, tiled=True))
              for p in jax.tree.leaves(state.params)]
    layout = {jax.tree_util.keystr(k): str(v.sharding.spec)
              for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    where = "per layer" if train.plan.layer_gather else "whole model"
    print(f"process {jax.process_index()}/{jax.process_count()}, "
          f"{jax.device_count()} devices; gathered {where}; param layout: {layout}")
  else:
    params = [np.asarray(p) for p in jax.tree.leaves(state.params)]
  return params, losses


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--coordinator", default="localhost:12355")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--policy", default="mixed_bfloat16")
  parser.add_argument("--gather", default="auto", choices=jaxamp.sharding.GATHERS)
  parser.add_argument("--out", help="write the final params and losses to this .npz")
  args = parser.parse_args()
  if args.processes > 1:
    # CPU devices of several processes talk through gloo (GPUs ignore this setting).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                               process_id=args.process_id)
  params, losses = run(args.steps, args.policy, gather=args.gather)
  print("losses:", " ".join(f"{l:.6f}" for l in losses))
  if args.out:
    np.savez(args.out, *params, losses=np.asarray(losses))


if __name__ == "__main__":
  main()
