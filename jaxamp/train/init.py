"""The first train state, and the :class:`~jaxamp.train.plan.Plan` the step runs.

:func:`init` reads the model once: which modules it has and each one's policy (so each
parameter is stored in its owner's param dtype), which FP8 modules keep state, how the
params are laid out on the mesh, whether master weights are needed, and the optimizer's
loss scale. Everything it learns goes into the plan; the state holds only arrays.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from jaxamp import _flax_compat
from jaxamp import fp8 as fp8_lib
from jaxamp import linen as amp_linen
from jaxamp import nnx as amp_nnx
from jaxamp import residuals as residuals_lib
from jaxamp import rules as rules_lib
from jaxamp import sharding as sharding_lib
from jaxamp.casting import is_floating_array, overflowed_casts, widen_floating
from jaxamp.rules import (asks_for_fp8, cast_module_params, leaf_name, path_name,
                          warn_unmatched_path_rules)
from jaxamp.train import optimizer as optimizer_lib
from jaxamp.train.adapters import EquinoxAdapter, LinenAdapter, NNXAdapter
from jaxamp.gather import Shard
from jaxamp.train.plan import Options, Plan, level_rules
from jaxamp.train.state import MasterWeightsState, TrainState, check_trainable, value_of

__all__ = ["init", "donatable", "arrays_held"]


class _Split(NamedTuple):
  """A model taken apart: its adapter, arrays, and per-module policies (None: unknown)."""

  adapter: Any
  params: Any
  model_state: Any
  rows: list[Any] | None  # (path, class, policy) per module
  fp8_rows: list[Any] | None  # the rows of modules that keep FP8 state
  holders: dict[str, list[str]]  # tied params: the modules holding each (FSDP only)


def unwrap(options: Options, model: Any) -> tuple[Any, bool]:
  """``model`` without a jaxamp policy wrapper, and whether the wrapper asked for
  recomputed norms; refuses a wrapper whose policy is not the step's."""
  if isinstance(model, (amp_nnx.PolicyModule, amp_linen.LinenPolicy)):
    if model.policy is not None and model.policy != options.policy:
      raise ValueError(
          f"init got a model wrapped with policy {model.policy.name!r}, but this train "
          f"step's policy is {options.policy.name!r}. Pass the unwrapped model (the train "
          "step applies its own policy), or make the step with the same policy.")
    return model.module, model.recompute_norms
  return model, False


def _split_model(options: Options, model: Any, recompute: bool, variables: Any,
                 example_args: tuple[Any, ...], example_kwargs: Mapping[str, Any]) -> _Split:
  policy = options.policy
  if isinstance(model, nnx.Module):
    if variables is not None or example_args or example_kwargs:
      raise ValueError("init(model) takes no variables or example inputs for an NNX "
                       "model.")
    rows = amp_nnx.module_policies(model, policy)
    fp8_rows = rows
    if any(fp8_lib.runs_fp8(cls, p) for _, cls, p in rows):
      # Layers holding one kernel per nnx.scan step run FP8 with current scaling.
      stacked = {path_name(path) for path, node in nnx.iter_graph(model)
                 if isinstance(node, fp8_lib.nnx_classes()) and fp8_lib.nnx_stacked(node)}
      fp8_rows = [row for row in rows if row[0] not in stacked]
    graphdef, params, model_state = NNXAdapter.split(model)
    return _Split(NNXAdapter(graphdef, recompute), params, model_state, rows, fp8_rows,
                  _holders(model) if options.sharding.param_sharding is not None else {})
  if _is_pytree_model(model, variables):
    return _split_pytree(options, model, recompute, example_args, example_kwargs)
  if variables is None or "params" not in variables:
    raise ValueError("For a Linen module call init(module, variables), where variables "
                     "is module.init(...)'s result with a 'params' collection.")
  rows = fp8_rows = None
  if example_args or example_kwargs:
    rows, lifted = amp_linen.module_plan(model, None, *example_args, policy=policy,
                                         **example_kwargs)
    # Layers inside nn.scan & co. run FP8 with current scaling: no state for them.
    fp8_rows = [row for row in rows if row[0] not in lifted]
  if rows is None and asks_for_fp8(policy):
    raise ValueError("An FP8 policy with a Linen module needs the example inputs: "
                     "train.init(module, variables, *example_args) finds the Dense "
                     "layers that keep FP8 state from them.")
  model_state = {k: v for k, v in variables.items() if k != "params"}
  return _Split(LinenAdapter(model, recompute, _rng_streams(options, example_kwargs)),
                variables["params"], model_state, rows, fp8_rows, {})


def _rng_streams(options: Options, example_kwargs: Mapping[str, Any]) -> tuple[str, ...]:
  """The Linen RNG streams the step gives the module: ``rng_streams``, and those named
  in ``init``'s ``rngs=`` but ``'params'``."""
  rngs = example_kwargs.get("rngs")
  named = [n for n in rngs if n != "params"] if isinstance(rngs, Mapping) else []
  return tuple(dict.fromkeys([*options.rng_streams, *named]))


def _is_pytree_model(model: Any, variables: Any) -> bool:
  """An Equinox module, or another pytree with floating arrays (not a Linen module)
  passed without variables."""
  eqx = sys.modules.get("equinox")  # a model can be an eqx.Module only once it is imported
  if eqx is not None and isinstance(model, eqx.Module):
    return True
  return (variables is None and not isinstance(model, linen.Module)
          and any(is_floating_array(x) for x in jax.tree.leaves(model)))


def _split_pytree(options: Options, model: Any, recompute: bool,
                  example_args: tuple[Any, ...], example_kwargs: Mapping[str, Any]) -> _Split:
  try:
    from jaxamp import equinox as amp_eqx  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("Training an Equinox model or another pytree needs equinox: pip "
                      "install 'jax-mixed-precision[equinox]'.") from e
  if example_args or example_kwargs:
    raise ValueError("init(model) takes no variables or example inputs for an Equinox "
                     "model or another pytree.")
  model = amp_eqx.checked_model(model, options.policy)
  params, model_state, static = EquinoxAdapter.split(model)
  return _Split(EquinoxAdapter(static, recompute), params, model_state,
                amp_eqx.module_policies(model, options.policy), None, {})


def _stored(options: Options, params: Any, rows: list[Any] | None, model: str) -> Any:
  """``params`` cast to their owners' param dtypes; refuses a value that would be inf."""
  policy = options.policy
  cast = (policy.cast_to_param(params) if rows is None
          else cast_module_params(params, rows, lambda p: p.param_dtype))
  values = lambda t: jax.tree.map(value_of, t, is_leaf=lambda x: isinstance(x, nnx.Variable))
  overflowed = [f"{path_name(path)} (|max| {big:.4g}, {dtype.name})"
                for path, big, dtype in overflowed_casts(values(params), values(cast))]
  if overflowed:
    raise ValueError(
        f"init: parameters of {model} outside the param dtype's range "
        f"would be stored as inf: {', '.join(overflowed)}. Use a policy with float32 "
        "params ('mixed_float16'), or bfloat16 (float32's range), or keep their "
        "modules in float32 with a rule (jaxamp.policy_rules({'<path>': 'float32'})).")
  return cast


def _gather_dtypes(params: Any, rows: list[Any] | None,
                   holders: Mapping[str, list[str]]) -> tuple[Any, ...]:
  """The dtype each param leaf is all-gathered in under ``param_sharding``.

  The compute dtype of the module owning it: the dtype that module casts it to anyway,
  so the cast before the gather changes no value and halves the bytes on the wire.
  Where that is not known to be the only reader's dtype, the widest that can be: a
  parameter several modules hold (tied weights) is gathered in the widest of their
  compute dtypes, and without per-module policies (a Linen module initialised without
  example inputs, where norms and ruled modules cannot be found) in its stored dtype.
  """
  if rows is None:
    return tuple(x.dtype for x in jax.tree.leaves(params))
  policies: dict[str, Any] = {}
  for path, _, policy in rows:
    policies.setdefault(path, policy)
  compute = jax.eval_shape(
      lambda p: cast_module_params(p, rows, lambda q: q.compute_dtype), params)
  out = []
  for (path, leaf), stored in zip(jax.tree_util.tree_flatten_with_path(compute)[0],
                                  jax.tree.leaves(params)):
    readers = [policies[h] for h in holders.get(leaf_name(path), []) if h in policies]
    dtype = leaf.dtype
    if len(readers) > 1 and is_floating_array(stored):
      dtype = max([dtype, *(np.dtype(r.compute_dtype) for r in readers)],
                  key=lambda d: np.dtype(d).itemsize)
    out.append(dtype)
  return tuple(out)


def _state_reductions(options: Options, model_state: Any) -> tuple[tuple[str, Any], ...]:
  """``(path, reduction)`` per model-state array leaf: the user's
  ``model_state_reduction`` pattern that matches its path first, else the known kinds'
  (BatchNorm statistics averaged, RNG streams the same on every device), else None."""
  declared = options.sharding.model_state_reduction or {}
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      model_state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    name = leaf_name(path)
    kind = next((k for pattern, k in declared.items() if fnmatch.fnmatchcase(name, pattern)),
                None)
    if kind is None:
      if isinstance(leaf, nnx.BatchStat) or name.startswith("batch_stats/"):
        kind = "mean"
      elif isinstance(leaf, (nnx.RngCount, nnx.RngKey)):
        kind = "same"
    out.extend((name, kind) for _ in jax.tree.leaves(leaf))
  return tuple(out)


def _holders(model: nnx.Module) -> dict[str, list[str]]:
  """``{param path: paths of the modules holding it}`` for parameters that more than one
  module holds as an attribute (tied weights)."""
  first: dict[int, str] = {}
  held: dict[int, list[str]] = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param):
      first.setdefault(id(node), path_name(path))
    elif isinstance(node, nnx.Module):
      for value in vars(node).values():
        if isinstance(value, nnx.Param):
          held.setdefault(id(value), []).append(path_name(path))
  return {first[k]: v for k, v in held.items() if len(v) > 1 and k in first}


def _linen_census(options: Options, model: Any, variables: Any, example_args: tuple[Any, ...],
                  example_kwargs: Mapping[str, Any]) -> tuple[list[Any], list[str]] | None:
  """``(ops, modules)``: which module each matmul of a Linen model's forward pass runs in
  (traced abstractly from the example inputs); None for other models, or where the
  inputs given for ``init`` cannot run ``apply`` (a dropout RNG it lacks): a check only."""
  if not isinstance(model, linen.Module):
    return None
  kwargs = {"mutable": True, **example_kwargs}
  try:
    with level_rules(options):
      ops, modules, _ = amp_linen.with_policy(model, options.policy).matmul_census(
          _flax_compat.unbox(variables), *example_args, **kwargs)
  except Exception:  # pylint: disable=broad-except
    return None
  return ops, modules


def _gathers_per_layer(options: Options, adapter: Any, model: Any) -> bool:
  """Whether the sharded step gathers each parameter where it is read (``gather``
  ``'layer'``, or ``'auto'`` where the model supports it): models whose parameter reads
  jaxamp sees: NNX models (Variable hooks) without bridged Linen modules (which read
  their parameters as a whole), Linen models (``self.param`` unboxes the slice),
  Equinox models (their policy views' field reads)."""
  gather = sharding_lib.gather_of(options.sharding.param_sharding)
  why = None
  if isinstance(adapter, NNXAdapter) and any(
      isinstance(node, nnx.bridge.ToNNX) for _, node in nnx.iter_graph(model)):
    why = "the model holds bridged Linen modules (nnx.bridge.ToNNX)"
  if gather == "layer" and why is not None:
    raise ValueError(f"gather='layer' gathers each parameter where a module reads it, but "
                     f"{why}. Use gather='model' (or 'auto'): the whole model gathered at "
                     "the step's start.")
  return gather != "model" and why is None


def _computes_in_half(options: Options, rows: list[Any] | None) -> bool:
  """Whether some module computes narrower than float32 (the model-level policy where
  the modules are not known), or the opt level autocasts."""
  if options.level is not None and options.level.autocast:
    return True
  return residuals_lib.computes_in_half([p for _, _, p in rows] if rows else [options.policy])


def init(options: Options, model: Any, variables: Mapping[str, Any] | None = None,
         *example_args: Any, **example_kwargs: Any) -> tuple[TrainState, Plan]:
  """The first state for ``model`` and the plan of the step that trains it (the state
  not yet placed on the mesh). See :meth:`jaxamp.TrainStep.init`."""
  rules = rules_lib.snapshot()  # the step traces under the rules in force now
  model, recompute = unwrap(options, model)
  # Each init decides afresh: a wrapped model's request does not outlive it.
  recompute = options.memory.recompute_norms or recompute
  with level_rules(options):
    split = _split_model(options, model, recompute, variables, example_args, example_kwargs)
  name = type(model).__name__
  rows = split.rows
  if rows is not None:
    warn_unmatched_path_rules(name, [row[0] for row in rows], stacklevel=4)
  check_trainable(split.params, name)
  params, model_state, specs, gather_dtypes = split.params, split.model_state, None, None
  sharding = options.sharding
  if sharding.param_sharding is not None:
    # Read the specs while Linen's partitioning boxes are still on, then drop them.
    specs = sharding_lib.param_specs(sharding.param_sharding, params, sharding.mesh)
    params, model_state = _flax_compat.unbox((params, model_state))
  params = _stored(options, params, rows, name)
  reductions = _state_reductions(options, model_state) if sharding.mesh is not None else None
  if isinstance(split.adapter, NNXAdapter):  # the Variables' types and metadata are read
    params, model_state, specs = map(NNXAdapter.plain, (params, model_state, specs))
  shards, layer_gather = None, False
  if specs is not None:
    gather_dtypes = _gather_dtypes(params, rows, split.holders)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
        x, jax.sharding.PartitionSpec))
    shards = tuple(Shard.of(s, np.shape(x), sharding.mesh, sharding.batch_axes,
                            sharding.reduce_dtype(x.dtype))
                   for s, x in zip(spec_leaves, jax.tree.leaves(params)))
    layer_gather = _gathers_per_layer(options, split.adapter, model)
  master_weights = options.memory.master_weights
  if master_weights is None:
    master_weights = any(is_floating_array(x) and x.dtype.itemsize < 4
                         for x in jax.tree.leaves(params))
  built = optimizer_lib.build(options, params)
  # Master weights of float32 (float64, complex) parameters are the parameters
  # themselves here: donatable gives the state its own buffers.
  opt_params = widen_floating(params) if master_weights else params
  opt_state = built.optimizer.init(opt_params)
  if master_weights:
    opt_state = MasterWeightsState(opt_params, opt_state)
  # FP8 amax histories and scales: their own field, out of the optimizer's reach.
  fp8_state = fp8_lib.init_state(split.fp8_rows) if split.fp8_rows is not None else {}
  if rows is not None:
    fp8_lib.warn_if_unused(rows, name, options.policy.name, census=lambda: _linen_census(
        options, model, variables, example_args, example_kwargs))
  state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32),
                     model_state=model_state,
                     rng=jax.random.key(options.seed) if split.adapter.uses_rng else None,
                     fp8=fp8_state or None)
  plan = Plan(options=options, adapter=split.adapter, optimizer=built.optimizer,
              master_weights=bool(master_weights), recompute_norms=recompute,
              half_residuals=options.memory.half_residuals and _computes_in_half(options, rows),
              unit_scale=built.unit_scale, overflow=built.overflow,
              fp8_recipes=(fp8_lib.recipes_of(split.fp8_rows)
                           if split.fp8_rows is not None else {}),
              param_specs=specs, gather_dtypes=gather_dtypes, shards=shards,
              layer_gather=layer_gather, rules=rules, state_reductions=reductions)
  return state, plan


def arrays_held(model: Any, variables: Any) -> list[jax.Array]:
  """The arrays the user's objects passed to ``init`` hold: an NNX model's Variables,
  the Linen variables, an Equinox model's (or another pytree's) leaves."""
  tree = nnx.state(model) if isinstance(model, nnx.Module) else model
  return [x for x in jax.tree.leaves((tree, variables)) if isinstance(x, jax.Array)]


def _buffers(x: jax.Array) -> set[Any]:
  """The device buffers ``x`` reads (one per addressable shard), or its identity where
  they cannot be read."""
  try:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
  except Exception:  # pylint: disable=broad-except
    return {("id", id(x))}


def donatable(state: Any, kept: list[jax.Array]) -> Any:
  """``state`` with a copy of each array a donating step must not consume: one whose
  buffer appears earlier in ``state`` (two ``nnx.Param`` made from one array, Linen
  variables sharing a leaf, an optimizer state holding the parameters themselves:
  XLA refuses to donate a buffer twice), or one that an array of ``kept`` (the user's
  model) also reads. The first occurrence keeps the original; tracers pass."""
  seen = set().union(*(_buffers(x) for x in kept if not isinstance(x, jax.core.Tracer)))
  own: set[Any] = set()

  def one(x: Any) -> Any:
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return x
    held = _buffers(x)
    shared = held & (seen | own)
    own.update(held)
    # With its own sharding: also for an array spanning other processes' devices.
    return jax.device_put(x, x.sharding, may_alias=False) if shared else x

  return jax.tree.map(one, state)
