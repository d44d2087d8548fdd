"""The first train state, and the :class:`~jaxamp.train.plan.Plan` the step runs.

:func:`init` reads the model once: which modules it has and each one's policy (so each
parameter is stored in its owner's param dtype), which FP8 modules keep state, how the
params are laid out on the mesh, whether master weights are needed, and the optimizer's
loss scale. Everything it learns goes into the plan; the state holds only arrays.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp import _flax_compat
from jaxamp import adapters
from jaxamp import fp8 as fp8_lib
from jaxamp import residuals as residuals_lib
from jaxamp import rounding as rounding_lib
from jaxamp import rules as rules_lib
from jaxamp import scaled
from jaxamp import sharding as sharding_lib
from jaxamp.casting import is_floating_array, overflowed_casts, widen_floating
from jaxamp.adapters import Library
from jaxamp.gather import Shard
from jaxamp.rules import cast_module_params, leaf_name, path_name, warn_unmatched_path_rules
from jaxamp.train import optimizer as optimizer_lib
from jaxamp.train.plan import Options, Plan, level_rules
from jaxamp.train.state import MasterWeightsState, RoundingState, TrainState, check_trainable

__all__ = ["init", "donatable", "arrays_held"]


def unwrap(options: Options, library: Library, model: Any) -> tuple[Any, bool]:
  """``model`` without a jaxamp policy wrapper, and whether the wrapper asked for
  recomputed norms; refuses a wrapper whose policy is not the step's."""
  inner, recompute, policy = library.unwrap(model)
  if policy is not None and policy != options.policy:
    raise ValueError(
        f"init got a model wrapped with policy {policy.name!r}, but this train "
        f"step's policy is {options.policy.name!r}. Pass the unwrapped model (the train "
        "step applies its own policy), or make the step with the same policy.")
  return inner, recompute


def _library(model: Any, variables: Any) -> Library:
  """The registered library of ``model``: Equinox for another pytree of floating arrays
  passed without variables."""
  library = adapters.library_of(model, pytrees=variables is None)
  if library is None:
    names = ", ".join(lib.name for lib in adapters.libraries())
    raise ValueError(f"init takes a model of one of the libraries jaxamp runs ({names}), or "
                     "a pytree of floating arrays passed without variables; got "
                     f"{type(model).__name__}.")
  return library


def _stored(options: Options, library: Library, params: Any, rows: list[Any] | None,
            model: str) -> Any:
  """``params`` cast to their owners' param dtypes; refuses a value that would be inf."""
  policy = options.policy
  cast = (policy.cast_to_param(params) if rows is None
          else cast_module_params(params, rows, lambda p: p.param_dtype))
  values = lambda t: jax.tree.map(library.value, t, is_leaf=library.is_node)
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


def _fp8_gathered(params: Any, recipes: Mapping[str, Any], classes: Mapping[str, type],
                  holders: Mapping[str, list[str]]) -> list[tuple[Any, str | None]]:
  """Per param leaf, ``(recipe, module path)`` of the module whose kernel it is (its
  ``kernel`` or ``weight``, held by that module alone; the recipe in ``recipes``, those of
  the modules keeping scaled-format state, of class ``classes[path]``) where the recipe's
  format gathers that module's read of it
  (:meth:`jaxamp.scaled.ScaledFormat.gathers_read`), else ``(None, None)``: the leaves the
  sharded step may gather in that format (``ShardingConfig.fp8_gather``), and the key of
  the state the format reads. Stacked layers of an ``nnx.scan`` or ``nn.scan`` (whose
  stacked recipe, :class:`jaxamp.fp8_stacked.Stacked`, gathers nothing quantized) read
  one layer of their kernel: one scale for the whole stack would not be theirs, and they
  keep the compute-dtype gather."""
  out = []
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    leaf = leaf_name(path)
    module, _, field = leaf.rpartition("/")
    kernel = field in ("kernel", "weight") and leaf not in holders
    recipe = recipes.get(module) if kernel else None
    if recipe is not None and not scaled.format_of(recipe).gathers_read(
        fp8_lib.kernel_read(classes[module]), recipe):
      recipe = None  # e.g. block scaling: an Einsum's or a convolution's kernel
    out.append((recipe, module if recipe is not None else None))
  return out


def _state_reductions(options: Options, library: Library, model_state: Any
                      ) -> tuple[tuple[str, Any], ...]:
  """``(path, reduction)`` per model-state array leaf: the user's
  ``model_state_reduction`` pattern that matches its path first, else the known kinds'
  (BatchNorm statistics averaged, RNG streams the same on every device), else None."""
  declared = options.sharding.model_state_reduction or {}
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      model_state, is_leaf=library.is_node)[0]:
    name = leaf_name(path)
    kind = next((k for pattern, k in declared.items() if fnmatch.fnmatchcase(name, pattern)),
                None)
    if kind is None:
      kind = library.state_reduction(leaf)
      if name.startswith("batch_stats/"):  # Linen's collection (an NNX BatchStat: 'mean')
        kind = "mean"
    out.extend((name, kind) for _ in jax.tree.leaves(leaf))
  return tuple(out)


def _gathers_per_layer(options: Options, library: Library, model: Any) -> bool:
  """Whether the sharded step gathers each parameter where it is read (``gather``
  ``'layer'``, or ``'auto'`` where the model supports it): models whose parameter reads
  jaxamp sees (the library says why not where it cannot: NNX models holding bridged
  Linen modules, which read their parameters as a whole)."""
  gather = sharding_lib.gather_of(options.sharding.param_sharding)
  why = library.layer_gather_refusal(model)
  if gather == "layer" and why is not None:
    raise ValueError(f"gather='layer' gathers each parameter where a module reads it, but "
                     f"{why}. Use gather='model' (or 'auto'): the whole model gathered at "
                     "the step's start.")
  return gather != "model" and why is None


def _fp8_census(options: Options, library: Library, model: Any, variables: Any,
                example_args: tuple[Any, ...], example_kwargs: Mapping[str, Any]
                ) -> tuple[list[Any], list[str]] | None:
  """``(ops, modules)``: which module each matmul of the forward pass runs in, where the
  library takes that census from ``init``'s inputs (Linen); else None: a check only."""
  with level_rules(options):
    return library.fp8_census(model, variables, example_args, example_kwargs,
                              options.policy)


def _param_apply(options: Options, params: Any, model: str) -> rounding_lib.ApplyUpdates:
  """The apply step of ``MemoryConfig.master_weights='stochastic'`` or ``'kahan'``;
  refuses stochastic rounding of float16 parameters (it rounds to bfloat16)."""
  if options.memory.rounding == "kahan":
    return rounding_lib.kahan_summation()
  half = [path_name(path) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
          if x.dtype == jnp.float16]
  if half:
    raise ValueError(
        f"master_weights='stochastic' rounds parameters to bfloat16, but {model} stores "
        f"{', '.join(half[:4])} in float16. Use a policy with bfloat16 params ('bfloat16'), "
        "master_weights='kahan' (any half dtype) or True (float32 master weights).")
  return rounding_lib.stochastic_rounding(options.seed)


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
  library = _library(model, variables)
  model, recompute = unwrap(options, library, model)
  # Each init decides afresh: a wrapped model's request does not outlive it.
  recompute = options.memory.recompute_norms or recompute
  with level_rules(options):
    split = library.split(model, options.policy, variables=variables,
                          example_args=example_args, example_kwargs=example_kwargs,
                          recompute_norms=recompute, rng_streams=options.rng_streams)
  holders = library.holders(model) if options.sharding.param_sharding is not None else {}
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
  params = _stored(options, library, params, rows, name)
  reductions = (_state_reductions(options, library, model_state)
                if options.sharding.mesh is not None else None)
  # The Variables' types and metadata are read: the state holds plain trees.
  params, model_state, specs = map(library.plain, (params, model_state, specs))
  scaled_recipes = (fp8_lib.recipes_of(split.fp8_rows) if split.fp8_rows is not None
                    else {})
  shards, layer_gather = None, False
  if specs is not None:
    gather_dtypes = _gather_dtypes(params, rows, holders)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
        x, jax.sharding.PartitionSpec))
    classes = {path: cls for path, cls, _ in split.fp8_rows or ()}
    quantized = (_fp8_gathered(params, scaled_recipes, classes, holders)
                 if sharding.fp8_gather else [(None, None)] * len(spec_leaves))
    shards = tuple(Shard.of(s, np.shape(x), sharding.mesh, sharding.batch_axes,
                            sharding.reduce_dtype(x.dtype))._replace(quantized=q, reader=r)
                   for s, x, (q, r) in zip(spec_leaves, jax.tree.leaves(params), quantized))
    layer_gather = _gathers_per_layer(options, library, model)
  master_weights, rounding = options.memory.master_weights, options.memory.rounding
  param_apply = _param_apply(options, params, name) if rounding is not None else None
  if rounding is not None:
    master_weights = False
  elif master_weights is None:
    master_weights = any(is_floating_array(x) and x.dtype.itemsize < 4
                         for x in jax.tree.leaves(params))
  built = optimizer_lib.build(options, params)
  # Master weights of float32 (float64, complex) parameters are the parameters
  # themselves here: donatable gives the state its own buffers. Without master weights
  # (rounding) the optimizer still reads float32 params: its state is made for them.
  opt_params = widen_floating(params) if master_weights or param_apply else params
  opt_state = built.optimizer.init(opt_params)
  if master_weights:
    opt_state = MasterWeightsState(opt_params, opt_state)
  elif param_apply is not None:
    opt_state = RoundingState(param_apply.init(params), opt_state)
  # The scaled formats' state (FP8 amax histories and scales): its own field, out of the
  # optimizer's reach.
  scaled_state = fp8_lib.init_state(split.fp8_rows) if split.fp8_rows is not None else {}
  if rows is not None:
    fp8_lib.warn_if_unused(rows, name, options.policy.name,
                           census=lambda: _fp8_census(options, library, model, variables,
                                                      example_args, example_kwargs))
  state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32),
                     model_state=model_state,
                     rng=jax.random.key(options.seed) if split.adapter.uses_rng else None,
                     scaled=scaled_state or None)
  plan = Plan(options=options, adapter=split.adapter, optimizer=built.optimizer,
              master_weights=bool(master_weights), rounding=rounding,
              param_apply=param_apply, recompute_norms=recompute,
              half_residuals=options.memory.half_residuals and _computes_in_half(options, rows),
              unit_scale=built.unit_scale, overflow=built.overflow,
              scaled_recipes=scaled_recipes,
              param_specs=specs, gather_dtypes=gather_dtypes, shards=shards,
              layer_gather=layer_gather, rules=rules, state_reductions=reductions)
  return state, plan


def arrays_held(model: Any, variables: Any) -> list[jax.Array]:
  """The arrays the user's objects passed to ``init`` hold: an NNX model's Variables,
  the Linen variables, an Equinox model's (or another pytree's) leaves."""
  library = adapters.library_of(model)
  tree = (model, variables) if library is None else library.arrays(model, variables)
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


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
