"""Stage three of the step: gradients and statistics combined across devices.

With a mesh, :func:`grads` runs the gradient stage per device inside ``jax.shard_map``
on that device's part of the batch, then

- data parallel (params replicated): sums the gradients with ``lax.psum`` in
  ``grad_reduce_dtype``;
- sharded (``param_sharding``): all-gathers each param slice in its compute dtype
  before the forward pass and reduce-scatters the gradients back to the params' layout;

each device's loss weighted by the loss scale over the number of devices, so the sum is
the mean and each device's backward pass carries the values one device's would for its
rows (a float16 one overflows no sooner; FP8 gradient amaxes are one device's);

and in both averages the loss, combines ``loss_fn``'s aux and combines each model-state
leaf by its reduction (BatchNorm statistics averaged, others as declared); the gradient
stage reduces the scaled formats' state over the devices after every micro-batch (FP8:
the amaxes' maximum). Every
device leaves with the same values. Without a mesh it is the gradient stage itself.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxamp import gather
from jaxamp import sharding as sharding_lib
from jaxamp.casting import at_least_float32, widen_floating
from jaxamp.train import layout
from jaxamp import numerics as numerics_lib
from jaxamp.train.gradients import Grads, loss_and_grads
from jaxamp.train.loss import combine_aux
from jaxamp.train.plan import Plan
from jaxamp.train.state import TrainState, is_key
from jaxamp.train.watch import Watch

__all__ = ["grads"]

P = jax.sharding.PartitionSpec


def grads(plan: Plan, state: TrainState, batch: Any, scale: jax.Array, rng: jax.Array,
          watch: Watch | None = None) -> Grads:
  """``loss_and_grads`` over the whole (global) batch, gradients in the params'
  layout; with ``watch``, the numerics records of the whole batch (every device's
  combined)."""
  if plan.mesh is None:
    return loss_and_grads(plan, state.params, state.model_state, batch, rng, scale,
                          state.scaled, watch=watch)
  if plan.sharded:
    return _sharded_grads(plan, state, batch, scale, rng, watch)
  return _data_parallel_grads(plan, state, batch, scale, rng, watch)


def _global(seen: Any, axes: Any) -> Any:
  """Inside ``shard_map``: each device's numerics records as the whole batch's."""
  return None if seen is None else jax.tree.map(
      lambda r: numerics_lib.reduce_over(r, axes), seen)


def _data_parallel_grads(plan: Plan, state: TrainState, batch: Any, scale: jax.Array,
                         rng: jax.Array, watch: Watch | None) -> Grads:
  axes = plan.options.sharding.batch_axes
  n = sharding_lib.axis_size(plan.mesh, axes)

  def local(params, model_state, batch, rng, scale, scaled):
    rng, keys = _per_device_keys(rng, model_state, axes)
    # The scaled state is reduced over the devices inside, after every micro-batch.
    changed: set[int] = set()
    grads, loss, aux, new_state, new_scaled, seen = loss_and_grads(
        plan, params, keys, batch, rng, scale / n, scaled, axes=axes, changed=changed,
        watch=watch)
    reduced = lambda g: plan.options.sharding.reduce_dtype(g.dtype)
    grads = jax.tree.map(lambda g: jax.lax.psum(g.astype(reduced(g)), axes).astype(g.dtype),
                         grads)
    return Grads(grads, *_reduce(plan, loss, aux, _shared_keys(new_state, model_state),
                                 model_state, changed), new_scaled, _global(seen, axes))

  sharded = jax.shard_map(local, mesh=plan.mesh,
                          in_specs=(P(), P(), P(axes), P(), P(), P()),
                          out_specs=P(), check_vma=False)
  return sharded(state.params, state.model_state, layout.put_batch(plan, batch), rng,
                 scale, state.scaled)


def _sharded_grads(plan: Plan, state: TrainState, batch: Any, scale: jax.Array,
                   rng: jax.Array, watch: Watch | None) -> Grads:
  axes = plan.options.sharding.batch_axes
  n = sharding_lib.axis_size(plan.mesh, axes)
  out_dtypes = [at_least_float32(p.dtype) if plan.widens else p.dtype
                for p in jax.tree.leaves(state.params)]

  def local(params, model_state, batch, rng, scale, scaled):
    rng, keys = _per_device_keys(rng, model_state, axes)
    if plan.layer_gather:
      # The slices go in; each read gathers its parameter and each gradient leaves its
      # read reduce-scattered (gather.gathered). Slices of half params are widened
      # first, so their gradients come back float32, as the whole-model path's do.
      inputs = widen_floating(params) if plan.widens else params
    else:
      inputs = gather.gather_all(plan.shards, plan.gather_dtypes, params, scaled)
    changed: set[int] = set()
    grads, loss, aux, new_state, new_scaled, seen = loss_and_grads(
        plan, inputs, keys, batch, rng, scale / n, scaled, keep_float32=True, axes=axes,
        changed=changed, watch=watch)
    if plan.layer_gather:
      grads = _reduce_replicated(plan, grads, out_dtypes)
    else:
      grads = gather.reduce_all(plan.shards, grads, out_dtypes)
    return Grads(grads, *_reduce(plan, loss, aux, _shared_keys(new_state, model_state),
                                 model_state, changed), new_scaled, _global(seen, axes))

  specs = plan.param_specs
  sharded = jax.shard_map(local, mesh=plan.mesh,
                          in_specs=(specs, P(), P(axes), P(), P(), P()),
                          out_specs=Grads(specs, P(), P(), P(), P(), P()), check_vma=False)
  return sharded(state.params, state.model_state, layout.put_batch(plan, batch), rng,
                 scale, state.scaled)


def _reduce_replicated(plan: Plan, grads: Any, dtypes: list[Any]) -> Any:
  """Under ``gather='layer'``: the gradients of replicated parameters (read as they are,
  not gathered) summed over the batch axes; the sharded ones left their reads reduced."""
  leaves, treedef = jax.tree.flatten(grads)
  return treedef.unflatten([
      (g if shard.sharded else gather.reduced(g, shard)).astype(dt)
      for g, shard, dt in zip(leaves, plan.shards, dtypes)])


def _reduce(plan: Plan, loss: jax.Array, aux: Any, model_state: Any, old_state: Any,
            changed: set[int]) -> tuple[Any, Any, Any]:
  """Inside shard_map: the loss averaged, the aux combined and each model-state leaf
  combined over the batch axes by its reduction (``Plan.state_reductions``)."""
  axes = plan.options.sharding.batch_axes
  return (jax.lax.pmean(loss, axes), combine_aux(aux, over_devices=axes),
          _combine_state(plan, model_state, old_state, changed))


def _combine_state(plan: Plan, new_state: Any, old_state: Any, changed: set[int]) -> Any:
  """Each device's model state after its part of the batch, combined into the state one
  device holding the whole batch would have; a leaf the step changed whose combination
  is not known is refused, naming it and the option that declares it."""
  axes = plan.options.sharding.batch_axes
  leaves, treedef = jax.tree.flatten(new_state)
  unknown = [name for i, (name, kind) in enumerate(plan.state_reductions)
             if kind is None and i in changed]
  if unknown:
    raise ValueError(
        f"Under a mesh each device updates the model state on its part of the batch, and "
        f"jaxamp does not know how to combine {', '.join(sorted(set(unknown)))} (only "
        "BatchNorm statistics, averaged, and RNG streams are known). Say how in "
        "jaxamp.ShardingConfig(model_state_reduction={'<path pattern>': kind}), kind one "
        "of 'mean' (a statistic averaged over the batch), 'sum' (the devices' changes "
        "added: a count of examples, a running sum), 'max' or 'min' (a running maximum "
        "or minimum), 'same' (every device makes the same change: a count of calls).")
  out = []
  for leaf, old, (_, kind) in zip(leaves, jax.tree.leaves(old_state), plan.state_reductions):
    if kind == "mean" and jnp.issubdtype(leaf.dtype, jnp.inexact):
      leaf = jax.lax.pmean(leaf, axes)
    elif kind == "sum":
      leaf = old + jax.lax.psum(leaf - old, axes)
    elif kind == "max":
      leaf = jax.lax.pmax(leaf, axes)
    elif kind == "min":
      leaf = jax.lax.pmin(leaf, axes)
    out.append(leaf)  # 'same', and unchanged leaves, as they are
  return treedef.unflatten(out)


def _per_device_keys(rng: jax.Array, model_state: Any, axes: Any) -> tuple[jax.Array, Any]:
  """Inside ``shard_map``: the step key and the key streams the model carries (NNX Rngs)
  with this device's index on ``axes`` folded in, so each device draws its own dropout
  masks. :func:`_shared_keys` hands the shared keys back afterwards."""
  index = jax.lax.axis_index(axes)
  keys = jax.tree.map(lambda x: jax.random.fold_in(x, index) if is_key(x) else x,
                      model_state)
  return None if rng is None else jax.random.fold_in(rng, index), keys


def _shared_keys(new_state: Any, model_state: Any) -> Any:
  """``new_state`` with the model's PRNG keys as they were before the per-device fold."""
  return jax.tree.map(lambda n, o: o if is_key(o) else n, new_state, model_state)
