"""The traced step, composed from its stages, and the traced eval step.

``step(plan, state, batch)`` is a pure function of the state and the batch (the plan is
fixed by ``init``); ``functools.partial(step, plan)`` is what ``TrainStep`` jits, and
what ``TrainStep.step_fn`` hands users who call it inside their own ``jax.jit`` or
``lax.scan``:

1. ``gradients``: ``loss_fn`` under the policies, the loss times the loss scale, its
   gradients (accumulated over micro-batches in at least float32);
2. ``devices``: with a mesh, the same per device and the results combined;
3. ``update``: unscaled, checked for inf/NaN, applied, or skipped exactly;
4. the new state and the metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp import adapters
from jaxamp import gather
from jaxamp import loss_scale as _ls
from jaxamp import scaled as scaled_lib
from jaxamp.casting import narrow_cotangents, widen_floating
from jaxamp.rules import path_name
from jaxamp.train import devices, layout, update, watch as watch_lib
from jaxamp.train.loss import F32, call_user
from jaxamp.train.plan import Plan, autocast_under_level, rules_in_force
from jaxamp.train.state import TrainState

__all__ = ["step", "eval_step"]

P = jax.sharding.PartitionSpec


def step(plan: Plan, state: TrainState, batch: Any, record: bool | None = None
         ) -> tuple[TrainState, dict[str, Any]]:
  """One training step: the new state and the metrics (``loss``, ``loss_scale``,
  ``grads_finite``, ``grad_norm``, ``skipped_steps``, with the numerics monitor
  ``numerics`` and ``numerics_recorded``, and the aux).

  With the monitor, ``record`` None chooses on the device (a ``lax.cond`` on the step
  counter: :func:`watch.every`); True is the recording step alone; False the step
  without the monitor, its metrics without ``numerics`` and ``numerics_recorded``
  (``TrainStep.step`` chooses on the host and adds them: :func:`watch.not_recorded`)."""
  with rules_in_force(plan):
    numerics = plan.options.debug.numerics
    if numerics is None or record is False:
      return _step(plan, state, batch, None)
    run = lambda w: _step(plan, state, batch, w)  # noqa: E731
    if record is None:
      return watch_lib.every(numerics, state.step, run)
    return watch_lib.recorded(run)


def _step(plan: Plan, state: TrainState, batch: Any, watch: watch_lib.Watch | None
          ) -> tuple[TrainState, dict[str, Any]]:
  options = plan.options
  scale = (jnp.ones([], F32) if plan.unit_scale
           else _ls.get_loss_scale(state.opt_state))
  rng = step_key(state) if plan.adapter.uses_rng else state.rng
  # Without accumulation (a float32 sum over micro-batches) or a mesh (a pmean), the
  # float32 gradient of a parameter read once in half precision is that read's
  # cotangent widened; narrow_cotangents finds those for the skip's cond.
  narrowable = (plan.narrow_reads and options.skip_nonfinite and plan.mesh is None
                and options.grad_accum_steps == 1)
  with narrow_cotangents() if narrowable else contextlib.nullcontext() as found:
    out = devices.grads(plan, state, batch, scale, rng, watch)
  new = update.apply_or_skip(plan, state, out.grads, out.loss, out.model_state, out.scaled,
                             scale, found)
  new_state = TrainState(params=new.params, opt_state=new.opt_state, step=state.step + 1,
                         model_state=new.model_state, rng=state.rng, scaled=new.scaled)
  metrics = _metrics(plan, state, new, out.grads, out.loss, out.aux)
  if watch is not None:
    metrics["numerics"] = watch_lib.report(watch, out.numerics, out.grads,
                                           options.policy.compute_dtype,
                                           options.debug.numerics.formats)
  return new_state, metrics


def _metrics(plan: Plan, state: TrainState, new: update.Applied, grads: Any,
             loss: jax.Array, aux: Any) -> dict[str, Any]:
  ls_state = optax.tree_utils.tree_get(new.opt_state, "LossScaleState")
  metrics: dict[str, Any] = {
      "loss": loss,
      "loss_scale": ls_state.scale,
      "grads_finite": new.grads_finite,
      "grad_norm": new.grad_norm,
      "skipped_steps": ls_state.overflow_steps,
  }
  if update.float16_leaves(state.params):
    metrics["params_finite"] = new.params_finite
  if plan.options.debug.nonfinite_grads:
    leaves = jax.tree_util.tree_flatten_with_path(
        grads, is_leaf=adapters.is_node)[0]
    metrics["nonfinite_grads"] = {
        path_name(path): jnp.logical_not(_ls.all_finite(g)) for path, g in leaves}
  if plan.options.has_aux:
    if isinstance(aux, Mapping) and not set(aux) & set(metrics):
      metrics.update(aux)
    else:
      metrics["aux"] = aux
  return metrics


def step_key(state: TrainState) -> jax.Array:
  """The key of Linen's ``'dropout'`` stream for this step: the base key folded with the
  number of steps applied so far (skipped ones do not count, so a skipped step leaves
  no trace, not even in later dropout masks). Folded, not split off a key carried in
  the state: a model that draws no key leaves the fold dead code XLA removes."""
  skipped = optax.tree_utils.tree_get(state.opt_state, "LossScaleState").overflow_steps
  return jax.random.fold_in(state.rng, state.step - skipped)


def eval_step(plan: Plan, state: TrainState, batch: Any, per_layer: bool = False) -> Any:
  """``eval_fn`` (default: ``loss_fn``) on the model in eval mode, under its policies;
  floating results in float32 (float64 ones as they are). Nothing is updated.

  With sharded params it runs as one program XLA partitions over the mesh (the batch
  split over the batch axes): ``per_layer``, each sharded parameter is gathered where a
  module reads it, in that module's compute dtype (:func:`gather.global_reads`), so one
  layer's parameters are gathered at a time, as in the step; else the whole model is
  gathered at the start, in the dtypes the step gathers it in."""
  options = plan.options
  params = state.params
  if plan.sharded and not per_layer:
    params = layout.gathered_for_eval(plan, params)
  shards = plan.shards if per_layer else None

  # Every array an argument, none closed over: under jax.sharding.auto_axes (below) a
  # closed-over array keeps its Explicit mesh, which the Auto one inside refuses to mix
  # with (Linen's dropout key, the scaled formats' state).
  def run(params, model_state, rng, scaled, batch):
    with scaled_lib.state_scope(scaled), gather.prefetching(per_layer and plan.prefetch):
      model, _ = plan.adapter.bind(params, model_state, rng, options.policy, train=False,
                                   float32_outputs=options.float32_outputs, shards=shards)
      return widen_floating(call_user(options.evaluate, model, batch))

  run = autocast_under_level(options, run, batch_argnum=4)
  args = (params, state.model_state, state.rng, state.scaled, batch)
  reads = gather.global_reads(plan.mesh) if per_layer else contextlib.nullcontext()
  with rules_in_force(plan), reads:
    if plan.mesh is not None and jax.sharding.AxisType.Explicit in plan.mesh.axis_types:
      run = _on_auto_axes(plan, run, args)
    return run(*args)


def _on_auto_axes(plan: Plan, fn: Callable[..., Any], args: tuple[Any, ...]
                  ) -> Callable[..., Any]:
  """``fn`` run with the mesh's axes Auto (``jax.sharding.auto_axes``): the model's code
  then needs no shardings of its own (under Explicit axes an embedding lookup of
  batch-sharded ids asks for its output's). Results whose leading dimension is the
  batch's come back split over the batch axes, the others replicated."""
  mesh, axes = plan.mesh, plan.options.sharding.batch_axes
  rows = {np.shape(x)[0] for x in jax.tree.leaves(args[-1]) if np.ndim(x)}
  replicated = jax.sharding.NamedSharding(mesh, P())
  shapes = jax.eval_shape(jax.sharding.auto_axes(fn, out_sharding=replicated), *args)
  specs = jax.tree.map(
      lambda x: jax.sharding.NamedSharding(mesh, P(axes)) if x.ndim and x.shape[0] in rows
      else replicated, shapes)
  return jax.sharding.auto_axes(fn, out_sharding=specs)
