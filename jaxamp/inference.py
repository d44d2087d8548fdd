"""Converting a trained model for serving: parameters stored in each module's compute dtype.

Like MXNet's ``convert_hybrid_block``: under ``'mixed_bfloat16'`` every matmul weight is
stored in bfloat16 (half the memory) while modules that compute in float32 — the
normalization layers by default — keep float32 parameters. Non-trainable state
(BatchNorm statistics) is left as it is. Call the converted model under the same policy
(``jaxamp.nnx.with_policy`` / ``jaxamp.linen.with_policy``) to compute in half precision.

Example:
  >>> import jax.numpy as jnp, jaxamp
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
  >>> served = jaxamp.convert_for_inference(model, policy='mixed_bfloat16')
  >>> served.layers[0].kernel.get_value().dtype, served.layers[1].scale.get_value().dtype
  (dtype(bfloat16), dtype('float32'))
  >>> model.layers[0].kernel.get_value().dtype  # the original is untouched
  dtype('float32')
"""

from __future__ import annotations

from typing import Any

from flax import linen as nn
from flax import nnx

from jaxamp._flax_compat import set_attr_unchecked
from jaxamp.casting import is_floating_array, overflowed_casts
from jaxamp.policy import PolicyLike
from jaxamp.rules import path_name
from jaxamp.summary import cast_module_params, module_params

__all__ = ["convert_for_inference"]


def _convert_nnx(model: nnx.Module, policy: PolicyLike | None) -> nnx.Module:
  from jaxamp import nnx as amp_nnx  # pylint: disable=g-import-not-at-top

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
  groups = module_params(values, list(compute))
  for owner, leaves in groups.items():
    dtype = compute[owner]
    for name, value in leaves:
      if is_floating_array(value) and value.dtype != dtype:
        variables[name].set_value(value.astype(dtype))
        if hasattr(modules[owner], "param_dtype"):
          set_attr_unchecked(modules[owner], "param_dtype", dtype)
  _check_in_range(values, {name: v.get_value() for name, v in variables.items()})
  return model


def _check_in_range(before: Any, after: Any) -> None:
  """Refuses a conversion that turned a finite parameter into inf (float16 stops at
  65504), naming the parameters and the fix."""
  overflowed = [f"{path_name(path)} (|max| {big:.4g}, {dtype.name})"
                for path, big, dtype in overflowed_casts(before, after)]
  if overflowed:
    raise ValueError(
        "convert_for_inference: parameters outside the compute dtype's range would be "
        f"stored as inf: {', '.join(overflowed)}. Convert under 'mixed_bfloat16' "
        "(float32's range), or keep their modules in float32 with a rule "
        "(jaxamp.policy_rules({'<path>': 'float32'})).")


def _convert_linen(variables: Any, module: nn.Module, example_inputs: tuple[Any, ...],
                   policy: PolicyLike | None) -> Any:
  from jaxamp import linen as amp_linen  # pylint: disable=g-import-not-at-top

  plan = amp_linen.module_policies(module, variables, *example_inputs, policy=policy)
  params = cast_module_params(variables["params"], plan, lambda p: p.compute_dtype)
  _check_in_range(variables["params"], params)
  converted = dict(variables)
  converted["params"] = params
  return type(variables)(converted) if not isinstance(variables, dict) else converted


def convert_for_inference(model_or_variables: Any, *example_inputs: Any,
                          policy: PolicyLike | None = None, module: nn.Module | None = None
                          ) -> Any:
  """Stores each module's parameters in its compute dtype, for serving.

  Args:
    model_or_variables: an NNX module (or ``jaxamp.nnx.with_policy`` wrapper), or Linen
      variables (then pass ``module`` and ``example_inputs``).
    *example_inputs: for Linen, inputs to trace the module with (arrays or
      ``jax.ShapeDtypeStruct``), to learn which module owns which parameter.
    policy: the model-level policy; None for the global policy (or the wrapper's).
    module: the Linen module the variables belong to.

  Returns:
    A converted copy: a new NNX module, or new Linen variables. The input is unchanged.
  """
  if isinstance(model_or_variables, nnx.Module):
    if module is not None:
      raise ValueError("module= is for Linen variables; an NNX model carries its modules.")
    return _convert_nnx(model_or_variables, policy)
  if module is None or not isinstance(module, nn.Module):
    raise ValueError("convert_for_inference takes an NNX module, or Linen variables with "
                     f"module=<the Linen module> and example inputs; got "
                     f"{type(model_or_variables).__name__} and module={module!r}.")
  if "params" not in model_or_variables:
    raise ValueError("Linen variables must have a 'params' collection; got collections "
                     f"{sorted(model_or_variables)}.")
  if not example_inputs:
    raise ValueError("convert_for_inference of Linen variables needs example inputs.")
  return _convert_linen(model_or_variables, module, example_inputs, policy)
