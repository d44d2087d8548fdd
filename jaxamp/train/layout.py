"""Where the train state and the batch live on a mesh.

Without ``param_sharding`` the state is replicated; with it, params and every
optimizer-state subtree shaped like them (moments, master weights) follow the params'
``PartitionSpec`` s and the rest is replicated. The batch is split over the batch axes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxamp.casting import is_floating_array
from jaxamp.train.plan import Plan
from jaxamp.train.state import TrainState, is_key

__all__ = ["place", "state_shardings", "laid_out", "put_batch", "gathered_for_eval"]


def place(tree: Any, shardings: Any) -> Any:
  """``jax.device_put(tree, shardings)``, also where a sharding spans other processes.

  There device_put refuses an array committed to one local device; every process holds
  the same value (same seed, same model), so each places its slices from a host copy.
  """

  def one(x: Any, sharding: Any) -> Any:
    if (not isinstance(x, jax.Array) or sharding.is_fully_addressable
        or not x.is_fully_addressable):
      return jax.device_put(x, sharding)
    if is_key(x):
      data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sharding)

  return jax.tree.map(one, tree, shardings)


def state_shardings(plan: Plan, state: TrainState) -> TrainState:
  """Where each leaf of ``state`` lives: params by their specs, optimizer-state subtrees
  shaped like the params (moments, master weights) likewise, the rest replicated."""
  repl = plan.replicated()
  named = lambda spec: jax.sharding.NamedSharding(plan.mesh, spec)
  param_def = jax.tree.structure(state.params)
  shapes = [np.shape(x) for x in jax.tree.leaves(state.params)]
  spec_leaves = param_def.flatten_up_to(plan.param_specs)

  def mirrors(x: Any) -> bool:
    try:
      return jax.tree.structure(x) == param_def
    except Exception:  # pylint: disable=broad-except
      return False

  def one(x: Any) -> Any:
    if not mirrors(x):
      return jax.tree.map(lambda _: repl, x)
    # Same structure; a leaf of another shape (a factored statistic) is replicated.
    leaves = [named(s) if np.shape(l) == shape else repl
              for l, s, shape in zip(jax.tree.leaves(x), spec_leaves, shapes)]
    return param_def.unflatten(leaves)

  return TrainState(params=one(state.params),
                    opt_state=jax.tree.map(one, state.opt_state, is_leaf=mirrors),
                    step=repl, model_state=jax.tree.map(lambda _: repl, state.model_state),
                    rng=repl, fp8=jax.tree.map(lambda _: repl, state.fp8))


def laid_out(plan: Plan, batch: Any) -> Any:
  """With a mesh, ``batch``'s arrays committed to another layout (one device, replicated,
  split on another axis) moved to the step's batch sharding, which the compiled step
  would otherwise refuse; host arrays and arrays already so laid out pass untouched."""
  if plan.mesh is None:
    return batch
  data = plan.batch_sharding()

  def one(x: Any) -> Any:
    if (isinstance(x, jax.Array) and x.committed
        and not x.sharding.is_equivalent_to(data, x.ndim)):
      return jax.device_put(x, data)
    return x
  return jax.tree.map(one, batch)


def _put(mesh: jax.sharding.Mesh, axes: Any) -> Any:
  """``jax.reshard`` on Explicit mesh axes, else a sharding constraint (Auto axes)."""
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  explicit = any(types[a] == jax.sharding.AxisType.Explicit for a in axes)
  return jax.reshard if explicit else jax.lax.with_sharding_constraint


def put_batch(plan: Plan, batch: Any) -> Any:
  """Inside the step: the batch constrained to its sharding over the batch axes."""
  data = plan.batch_sharding()
  put = _put(plan.mesh, plan.options.batch_axes)
  return jax.tree.map(lambda x: put(x, data), batch)


def gathered_for_eval(plan: Plan, params: Any) -> Any:
  """Inside eval: sharded params cast to their gather dtypes and replicated."""
  leaves, treedef = jax.tree.flatten(params)
  repl = plan.replicated()
  explicit = set(plan.mesh.axis_types) == {jax.sharding.AxisType.Explicit}
  put = jax.reshard if explicit else jax.lax.with_sharding_constraint
  return treedef.unflatten([put(x.astype(dt) if is_floating_array(x) else x, repl)
                            for x, dt in zip(leaves, plan.gather_dtypes)])
