"""Flax NNX in the registry: :data:`NNX` and the train step's :class:`NNXAdapter`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxamp import fp8 as fp8_lib
from jaxamp import nnx as amp_nnx
from jaxamp import fp8_stacked, numerics, scaled
from jaxamp._flax_compat import set_attr_unchecked
from jaxamp.adapters._common import check_in_range, module_params
from jaxamp.adapters._registry import Split
from jaxamp.casting import is_floating_array, widen_floating
from jaxamp.nnx._variables import gather_on_read
from jaxamp.policy import Policy, PolicyLike
from jaxamp.rules import path_name

__all__ = ["NNX", "NNXAdapter", "Float32Outputs"]


class Float32Outputs(amp_nnx.PolicyModule):
  """The model an NNX ``loss_fn`` receives: a policy wrapper (an ``nnx.Module``, so
  ``nnx.state``, ``nnx.split`` and ``nnx.merge`` see the model's Variables) whose calls
  and public methods hand their floating outputs over in float32 (or wider: a float64
  output stays float64, :func:`~jaxamp.casting.widen_floating`). Submodules reached
  through it run under the policy and return their own dtypes."""

  def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
    return widen_floating(super()._call(name, *args, **kwargs))

  def __getitem__(self, key: Any) -> Any:
    if not hasattr(self.module, "__getitem__"):
      raise TypeError(f"loss_fn indexed the model with {key!r}, as if it were the batch: "
                      "loss_fn is called as loss_fn(model, batch). Are its arguments "
                      "swapped?")
    return super().__getitem__(key)  # a submodule runs under the policy, as attributes do


def _plain(tree: Any) -> Any:
  """An ``nnx.State`` as the nested dict of arrays it holds (``nnx.to_pure_dict``);
  other trees as they are. The train state holds these: JAX flattens a dict in C++,
  while each ``nnx.State`` and ``nnx.Variable`` node is flattened by Python code on
  every jitted call (a 150-parameter step with Adam held so takes 3x as long per call:
  ``benchmarks/dispatch``). ``nnx.merge`` takes them back with the graphdef."""
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


@dataclasses.dataclass(frozen=True)
class NNXAdapter:
  """An NNX model: its ``nnx.Param`` s are the params, every other Variable model state."""

  graphdef: Any
  recompute_norms: bool = False
  uses_rng = False  # NNX models carry their RNG streams in model_state

  def bind(self, params, model_state, rng, policy, *, train, float32_outputs, shards=None):
    """``shards`` (``gather='layer'``, inside the step's ``shard_map``): each param
    leaf's :class:`~jaxamp.gather.Shard`; ``params`` are then this device's slices,
    and each sharded one is gathered where a module reads it."""
    del rng  # NNX models carry their RNG streams in model_state

    # merge() reuses the State's Variable objects; rebuilding them here puts them at this
    # trace level, so the model may update BatchNorm statistics and RNG counts under grad.
    params, model_state = jax.tree.map(lambda x: x, (params, model_state))
    model = nnx.merge(self.graphdef, params, model_state)
    if shards is not None:
      _gather_on_read(model, params, shards)
    fp8_lib.name_nnx_modules(model, path_name)  # FP8 state keys, if a step threads one
    scope = scaled.current()
    if scope is not None and scope.state:  # stacked layers carry theirs into nnx.scan
      fp8_stacked.attach(model, scope.state, fp8_lib.nnx_classes(), path_name)
    if numerics.current() is not None:  # the numerics monitor records by module path
      numerics.name_modules({id(node): path_name(path) for path, node in nnx.iter_graph(model)
                             if isinstance(node, nnx.Module)})
    if not train:
      model.eval()
    kind = Float32Outputs if float32_outputs else amp_nnx.PolicyModule
    # The step decides on half_residuals for the whole loss (train.gradients).
    view = kind(model, policy, recompute_norms=self.recompute_norms, half_residuals=False)
    return view, lambda: _plain(nnx.split(model, nnx.Param, fp8_stacked.StackedState,
                                          ...)[3])

  def model(self, state: Any) -> nnx.Module:
    return nnx.merge(self.graphdef, state.params, state.model_state)


def _gather_on_read(model: nnx.Module, params: Any, shards: tuple[Any, ...]) -> None:
  """Each sharded ``nnx.Param`` of ``model`` read gathered (:func:`gather_on_read`)."""
  paths = [tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  by_path = dict(zip(paths, shards))
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shard = by_path[tuple(path)]
    if shard.sharded:
      gather_on_read(variable, shard)


class _NNX:
  """Flax NNX models (``nnx.Module``, or a :func:`jaxamp.nnx.with_policy` wrapper)."""

  name = "nnx"
  takes_pytrees = False

  def accepts(self, model: Any) -> bool:
    return isinstance(model, nnx.Module)

  def unwrap(self, model: Any) -> tuple[Any, bool, Policy | None]:
    if isinstance(model, amp_nnx.PolicyModule):
      return model.module, model.recompute_norms, model.policy
    return model, False, None

  def with_policy(self, model: Any, policy: PolicyLike | None = None, *,
                  recompute_norms: bool = False) -> Any:
    return amp_nnx.with_policy(model, policy, recompute_norms=recompute_norms)

  def split(self, model, policy, *, variables, example_args, example_kwargs,
            recompute_norms, rng_streams) -> Split:
    del rng_streams  # NNX models carry their RNG streams in model_state
    if variables is not None or example_args or example_kwargs:
      raise ValueError("init(model) takes no variables or example inputs for an NNX "
                       "model.")
    rows = amp_nnx.module_policies(model, policy)
    fp8_rows = rows
    if any(fp8_lib.runs_fp8(cls, p) for _, cls, p in rows):
      # Layers holding one kernel per nnx.scan step keep one state per kernel.
      fp8_rows = fp8_stacked.rows(model, rows, fp8_lib.nnx_classes(), path_name)
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    return Split(NNXAdapter(graphdef, recompute_norms), params, model_state, rows, fp8_rows)

  def plain(self, tree: Any) -> Any:
    return _plain(tree)

  def is_node(self, x: Any) -> bool:
    return isinstance(x, nnx.Variable)

  def value(self, x: Any) -> Any:
    return x.get_value() if isinstance(x, nnx.Variable) else x

  def state_reduction(self, leaf: Any) -> str | None:
    if isinstance(leaf, nnx.BatchStat):
      return "mean"
    if isinstance(leaf, (nnx.RngCount, nnx.RngKey)):
      return "same"
    return None

  def holders(self, model: Any) -> dict[str, list[str]]:
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

  def layer_gather_refusal(self, model: Any) -> str | None:
    if any(isinstance(node, nnx.bridge.ToNNX) for _, node in nnx.iter_graph(model)):
      return "the model holds bridged Linen modules (nnx.bridge.ToNNX)"
    return None

  def arrays(self, model: Any, variables: Any) -> Any:
    return (nnx.state(model), variables)

  def fp8_classes(self) -> tuple[type, ...]:
    return fp8_lib.nnx_classes()

  def fp8_census(self, model, variables, example_args, example_kwargs, policy):
    return None  # the NNX wrapper's own first-call check names unreached FP8 matmuls

  def summary_plan(self, model: Any, example_inputs: Sequence[Any],
                   example_kwargs: dict[str, Any], policy: PolicyLike | None):
    module = model.module if isinstance(model, amp_nnx.PolicyModule) else model
    plan = amp_nnx.module_policies(model, policy)
    census = None
    if example_inputs or example_kwargs:
      wrapper = amp_nnx.with_policy(module, plan[-1][2])  # the root's policy comes last
      census = wrapper.matmul_census(*example_inputs, **example_kwargs)
    return plan, nnx.state(module, nnx.Param), census

  def convert_for_inference(self, model: Any, example_inputs: tuple[Any, ...],
                            policy: PolicyLike | None, module: Any) -> Any:
    if module is not None:
      raise ValueError("module= is for Linen variables; an NNX model carries its modules.")
    if isinstance(model, amp_nnx.PolicyModule):
      policy = model.policy if policy is None else policy
      model = model.module
    plan = amp_nnx.module_policies(model, policy)
    model = nnx.clone(model)
    compute = {path: p.compute_dtype for path, _, p in plan}
    modules, variables = {}, {}
    for path, node in nnx.iter_graph(model):
      if isinstance(node, nnx.Module):
        modules[path_name(path)] = node
      elif isinstance(node, nnx.Param):
        variables[path_name(path)] = node
    values = {name: v.get_value() for name, v in variables.items()}
    for owner, leaves in module_params(values, list(compute)).items():
      dtype = compute[owner]
      for name, value in leaves:
        if is_floating_array(value) and value.dtype != dtype:
          variables[name].set_value(value.astype(dtype))
          if hasattr(modules[owner], "param_dtype"):
            set_attr_unchecked(modules[owner], "param_dtype", dtype)
    check_in_range(values, {name: v.get_value() for name, v in variables.items()})
    return model

  def report_args(self, fn: Callable[..., Any], args: tuple[Any, ...],
                  argnums: tuple[int, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return fn, args


NNX = _NNX()
