"""Where the train state and the batch live on a mesh.

Without ``param_sharding`` the state is replicated; with it, params and every
optimizer-state subtree shaped like them (moments, master weights) follow the params'
``PartitionSpec`` s and the rest is replicated. The batch is split over the batch axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxamp.casting import is_floating_array
from jaxamp.train.plan import Plan
from jaxamp.train.state import TrainState, is_key

__all__ = ["place", "placed_at_init", "laid_out_state", "shapes_laid_out", "signature", "state_shardings",
           "laid_out", "put_batch", "gathered_for_eval"]


def place(tree: Any, shardings: Any) -> Any:
  """``jax.device_put(tree, shardings)``, also where a sharding spans other processes.

  There device_put refuses an array committed to one local device; every process holds
  the same value (same seed, same model), so each places its slices from a host copy.
  An array already committed to its sharding is kept as it is.
  """

  def one(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.core.Tracer) or (
        isinstance(x, jax.Array) and x.committed
        and x.sharding.is_equivalent_to(sharding, x.ndim)):
      return x  # in place, or traced by an outer jit (which lays its inputs out)
    if (not isinstance(x, jax.Array) or sharding.is_fully_addressable
        or not x.is_fully_addressable):
      return jax.device_put(x, sharding)
    if is_key(x):
      data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sharding)

  return jax.tree.map(one, tree, shardings)


def placed_at_init(plan: Plan, state: TrainState) -> tuple[Plan, TrainState]:
  """``init``'s plan with the state's shardings (sharded params) and its state placed on
  them: replicated over the mesh without ``param_sharding``; without a mesh each array
  committed to the device it is on, as the step's own output is: an uncommitted input
  state and the committed state a step returns compile to two programs (the second
  step would compile the step again)."""
  if plan.sharded:
    plan = dataclasses.replace(plan, state_shardings=state_shardings(plan, state))
    return plan, place(state, plan.state_shardings)
  if plan.mesh is not None:
    return plan, jax.device_put(state, plan.replicated())
  return plan, jax.tree.map(
      lambda x: (jax.device_put(x, x.sharding)
                 if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                 and len(x.sharding.device_set) == 1 else x), state)


def laid_out_state(plan: Plan, state: TrainState) -> TrainState:
  """A state the step did not return, moved to the step's layout: sharded by the
  params' specs, replicated over the mesh, or (without a mesh) on one device.

  A state from a step of another layout (FSDP into a data-parallel or one-device step,
  another mesh, a host copy, the user's own ``device_put``) is moved, so it runs as the
  step's own state would, and a host copy does not cost a second compile.
  """
  if plan.mesh is None:
    # A Sharding, not a Device: device_put to a Device keeps an Explicit mesh axis in
    # the array's type, which the one-device program then refuses.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def one(x: Any) -> Any:
      if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
          and len(x.sharding.device_set) > 1):
        return jax.device_put(x, device)  # laid out over another step's devices
      return x
    return jax.tree.map(one, state)
  if plan.sharded:
    return place(state, plan.state_shardings)
  repl = plan.replicated()
  return place(state, jax.tree.map(lambda _: repl, state))


def shapes_laid_out(plan: Plan, state: Any) -> Any:
  """``state`` with each ``jax.ShapeDtypeStruct`` that names no sharding given the
  step's (the state of ``jax.eval_shape(train.init, model)``, say), so that lowering
  from shapes alone lays the state out as the step does; other leaves as they are."""
  if plan.mesh is None:
    return state
  shardings = plan.state_shardings if plan.sharded else jax.tree.map(
      lambda _: plan.replicated(), state)

  def one(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x

  return jax.tree.map(one, state, shardings)


def signature(tree: Any) -> list[Any] | None:
  """What the step sees of ``tree`` and where it lives: its structure, then each leaf's
  shape, dtype, placement and commitment; None where a leaf is not a concrete
  ``jax.Array`` (a host array, a tracer, a ``ShapeDtypeStruct``).

  Two trees with equal signatures pass the same state check and need the same moves, so
  a state whose signature is that of one the step returned needs neither (the step then
  costs a flatten and a few attribute reads instead of the check's tree walks).
  """
  leaves, treedef = jax.tree.flatten(tree)
  out: list[Any] = [treedef]
  for x in leaves:
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return None
    if isinstance(x.dtype, np.dtype):
      where = x.sharding
    elif x.ndim == 0 and not x.is_deleted():  # a scalar PRNG key: its devices place it,
      where = x.devices()  # for a fortieth of what reading its sharding costs
    else:
      return None
    out.append((x.shape, x.dtype, where, x.committed))
  return out


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
                    rng=jax.tree.map(lambda _: repl, state.rng),
                    scaled=jax.tree.map(lambda _: repl, state.scaled))


def laid_out(plan: Plan, batch: Any) -> Any:
  """With a mesh, ``batch`` on the step's batch sharding: host arrays and arrays
  committed to another layout (one device, replicated, split on another axis) are
  moved, which the compiled step would otherwise refuse or compile again for; arrays
  already so laid out pass untouched. Without a mesh, ``batch`` as it is.

  A 0-d leaf is refused under a mesh, naming it: the step splits every batch leaf over
  the batch axes along its first dimension."""
  if plan.mesh is None:
    return batch
  scalars = [jax.tree_util.keystr(path) for path, x in
             jax.tree_util.tree_flatten_with_path(batch)[0] if np.ndim(x) == 0]
  if scalars:
    names = ", ".join(f"batch{s}" for s in scalars[:4])
    raise ValueError(
        f"{names} {'is' if len(scalars) == 1 else 'are'} 0-d, but under a mesh the step "
        f"splits every batch leaf over the batch axes {plan.options.sharding.batch_axes} along its "
        "first dimension. Give each one value per example (jnp.full((batch_size,), "
        "value)), or close over it in loss_fn.")
  data = plan.batch_sharding()

  def one(x: Any) -> Any:
    if isinstance(x, jax.core.Tracer) or (
        isinstance(x, jax.Array) and x.committed
        and x.sharding.is_equivalent_to(data, x.ndim)):
      return x
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and np.ndim(x) >= 1:
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
  put = _put(plan.mesh, plan.options.sharding.batch_axes)
  return jax.tree.map(lambda x: put(x, data), batch)


def gathered_for_eval(plan: Plan, params: Any) -> Any:
  """Inside eval: sharded params cast to their gather dtypes and replicated."""
  leaves, treedef = jax.tree.flatten(params)
  repl = plan.replicated()
  explicit = set(plan.mesh.axis_types) == {jax.sharding.AxisType.Explicit}
  put = jax.reshard if explicit else jax.lax.with_sharding_constraint
  return treedef.unflatten([put(x.astype(dt) if is_floating_array(x) else x, repl)
                            for x, dt in zip(leaves, plan.gather_dtypes)])
