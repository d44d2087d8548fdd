"""A functional, compiled train-step factory for mixed precision.

:func:`make_train_step` returns a :class:`TrainStep` whose ``step`` is one XLA program
that runs the model under its per-module policies, scales the loss, accumulates
micro-batch gradients in float32 (float64 ones in float64), reduces them across devices,
unscales, checks them for inf/NaN everywhere at once and, on an overflow, skips the
whole update exactly: parameters, every optimizer-state leaf and the model state
(BatchNorm statistics, RNG counters) stay bit-identical while the loss scale backs off.

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxamp
  >>> from flax import nnx
  >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  >>> def loss_fn(model, batch):
  ...   return jnp.mean((model(batch['x']) - batch['y']) ** 2)
  >>> train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy='mixed_bfloat16')
  >>> state = train.init(model)
  >>> batch = {'x': jnp.ones((8, 4)), 'y': jnp.zeros((8, 2))}
  >>> state, metrics = train.step(state, batch)
  >>> metrics['loss'].dtype, state.params['kernel'].dtype, int(metrics['skipped_steps'])
  (dtype('float32'), dtype('float32'), 0)

The package is the step in stages (``docs/architecture.md`` has the map):
``state`` (the train state and its checks), ``config`` (the grouped options:
sharding, memory, debugging), ``plan`` (options and what ``init`` learns), ``init`` (the model read through its library, :mod:`jaxamp.adapters`),
``optimizer`` (loss scale and skip),
``gradients`` (loss, gradients, accumulation), ``devices`` (mesh reduction and FSDP),
``gather`` (where FSDP gathers), ``update`` (the exact skip and the apply), ``step``
(the stages composed), ``layout`` (shardings), ``monitor`` (skipped-step warnings),
``train_step`` (the holder).
"""

from jaxamp.train.config import DebugConfig, MemoryConfig, ShardingConfig
from jaxamp.train.state import MasterWeightsState, RoundingState, TrainState, abstract_state
from jaxamp.train.train_step import TrainStep, make_train_step

__all__ = ["DebugConfig", "MemoryConfig", "ShardingConfig", "TrainState", "MasterWeightsState",
           "RoundingState",            "TrainStep", "make_train_step", "abstract_state"]
