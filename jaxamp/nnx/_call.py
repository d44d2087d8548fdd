"""Running one NNX module method under its policy: the policy-aware subclasses, the
per-thread call state, and the casts of arguments, Variables and results."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from flax.nnx import bridge as _bridge  # noqa: F401  (makes nnx.bridge importable)

from jaxamp import _flax_compat
from jaxamp import fp8 as fp8_lib
from jaxamp import fp8_conv_transpose
from jaxamp._flax_compat import set_attr_unchecked
from jaxamp import module_call
from jaxamp import numerics
from jaxamp.casting import is_floating_dtype
from jaxamp.nnx._attention import half_dot_product_attention
from jaxamp.nnx._plan import _base_class
from jaxamp.nnx._variables import (_gathered_on_read, _keep_dtype, _owned_variables, _read_as,
                                   _reads_as_compute, _set_attr)
from jaxamp.policy import Policy
from jaxamp.residuals import recompute_all
from jaxamp.rules import resolve_policy
from jaxamp.gather import tie_for


# Methods that run under the module's policy, by class (subclasses included). Add your
# own entry points, e.g. POLICY_METHODS[MyModel] = ('encode',); calls after the edit see it.
POLICY_METHODS: dict[type, tuple[str, ...]] = {
    nnx.Module: ("__call__",),
    nnx.Embed: ("attend",),
}

_POLICY_ATTR = "_jaxamp_policy"
# In a census run, each module's scope number: an attribute, not a lookup by id, because
# the modules NNX transforms re-create inside a call (nnx.scan, nnx.vmap) carry it along.
_SCOPE_ATTR = "_jaxamp_scope"


class _Call(NamedTuple):
  """One running wrapper call: its model-level policy and options.

  ``scopes`` is set for a census run: ``{id(module): (module, scope number)}``, filled
  by :func:`_applied`, with ``names`` the module path of each number. Each module is
  held with its number, so no other module takes its id while the census runs.
  """

  policy: Policy
  recompute_norms: bool
  scopes: dict[int, tuple[Any, int]] | None = None
  names: list[str] | None = None


_state = module_call.CallState()  # calls: the _Call of each wrapper call running


# --- the policy-aware subclasses -------------------------------------------------------


def _policy_for(module: Any) -> Policy | None:
  """The policy ``module`` runs under now, or None to run it unchanged."""
  if not _state.calls or id(module) in _state.running:
    # No wrapped call in this thread, or a re-entrant call (a method calling another
    # policy method of the same module): run as is, the policy is already applied.
    return None
  policy = vars(module).get(_POLICY_ATTR)
  if policy is None:  # not seen by the wrapper: inherit the innermost module's policy
    enclosing = _state.stack[-1] if _state.stack else _state.calls[-1].policy
    policy = resolve_policy(_base_class(type(module)), "", enclosing)
  return policy


_classes = module_call.PolicyClasses(
    POLICY_METHODS, _policy_for,
    lambda module, fn, name, policy, args, kwargs: _run_under(module, fn, policy, args, kwargs),
    _flax_compat.graph_subclass)
_methods_for = _classes.methods_for


def _policy_class(cls: type) -> type:
  """A cached subclass of ``cls`` whose policy methods run under the instance's policy."""
  return _classes.subclass(cls, {"_jaxamp_base": cls})


# --- running one module method under a policy ------------------------------------------


def _is_node(x: Any) -> bool:
  return isinstance(x, (nnx.Variable, nnx.Pytree))


_LIBRARY = module_call.Library(keep=_is_node)


def _cast_values(tree: Any, dtype: np.dtype) -> Any:
  """Casts floating arrays in ``tree``; Variables, Rngs and modules pass untouched."""
  return module_call.cast_values(tree, dtype, _is_node)


# Norms, recomputed in the backward pass when they compute wider than their inputs:
# reverse mode then keeps their half-precision input, not float32 intermediates.
_RECOMPUTED = frozenset({nnx.LayerNorm.__call__, nnx.RMSNorm.__call__, nnx.GroupNorm.__call__,
                         nnx.BatchNorm.__call__})


def _recomputed(module: nnx.Module, fn: Callable[..., Any], compute: np.dtype,
                args: tuple[Any, ...], kwargs: dict[str, Any],
                policy: Callable[..., bool] = recompute_all, tied: bool = False) -> Any:
  """``fn(module, *args, **kwargs)`` under ``jax.checkpoint`` with ``policy``, the cast
  to ``compute`` inside it, so that reverse mode saves the narrower inputs rather than
  what ``fn`` computes from them.

  With ``tied`` (parameters gathered at their reads), the module's parameter slices pass
  an ``optimization_barrier`` with what :func:`jaxamp.gather.tie_for` says (its
  array inputs, or under prefetching the previous reading module's): the gathers wait
  for those, so the compiler cannot hoist every layer's gather to the step's start.

  The module runs as a copy merged inside the checkpoint; the Variables it updates
  (BatchNorm's statistics) are written back to ``module`` afterwards, through the
  usual NNX checks. Unchanged ones are not touched, so a model closed over by
  ``jax.jit`` runs as it would without recomputation.
  """
  arrays, put_back = module_call.arrays_of(
      (args, kwargs), lambda x: isinstance(x, (jax.Array, np.ndarray)), _is_node)
  graphdef, params, others = nnx.split(module, nnx.Param, ...)
  updated: list[tuple[Any, ...]] = []  # paths, known once ``run`` is traced

  def run(params, others, arrays, tie):
    if tied and tie:  # prefetching: after the previous module's inputs, not its own
      params, _ = jax.lax.optimization_barrier((params, tie))
    elif tied:  # its inputs pass too (its eval then keeps one layer gathered, not more)
      params, arrays = jax.lax.optimization_barrier((params, arrays))
    copy = nnx.merge(graphdef, params, others, copy=True)
    before = {path: v.get_raw_value()
              for path, v in nnx.to_flat_state(nnx.state(copy, nnx.Not(nnx.Param)))}
    a, k = put_back(arrays)
    out = fn(copy, *_cast_values(a, compute), **_cast_values(k, compute))
    after = nnx.to_flat_state(nnx.state(copy, nnx.Not(nnx.Param)))
    new = [(path, v.get_raw_value()) for path, v in after
           if path in before and v.get_raw_value() is not before[path]]
    updated[:] = [path for path, _ in new]
    return out, [value for _, value in new]

  tie = tie_for(arrays) if tied else arrays
  out, values = jax.checkpoint(run, policy=policy)(params, others, arrays,
                                                   [] if tie is arrays else tie)
  variables = dict(nnx.to_flat_state(others))  # ``module``'s own Variable objects
  for path, value in zip(updated, values):
    variables[path].set_raw_value(value)
  return out


class _LinenUnderPolicy(NamedTuple):
  """What ``nnx.bridge.ToNNX`` calls in place of its Linen module: the module's ``apply``
  through :func:`jaxamp.linen.with_policy`, so each Linen submodule gets its policy."""

  module: Any
  wrapper: Any

  def apply(self, *args: Any, **kwargs: Any) -> Any:
    return self.wrapper.apply(*args, **kwargs)

  def init_with_output(self, *args: Any, **kwargs: Any) -> Any:
    return self.module.init_with_output(*args, **kwargs)


_linen_wrappers: dict[tuple[int, Policy, bool], _LinenUnderPolicy] = {}
_LINEN_WRAPPERS_SIZE = 64


def _linen_under(module: Any, policy: Policy, recompute_norms: bool) -> _LinenUnderPolicy:
  """One cached wrapper per Linen module, policy and option: it caches what it learns
  per shape."""
  from jaxamp import linen as amp_linen  # pylint: disable=g-import-not-at-top

  key = (id(module), policy, recompute_norms)
  found = _linen_wrappers.get(key)
  if found is None or found.module is not module:
    if len(_linen_wrappers) >= _LINEN_WRAPPERS_SIZE:
      _linen_wrappers.clear()
    # half_residuals is the NNX wrapper's (or the train step's) to apply, for the whole
    # call: a Linen module inside runs as it is told.
    found = _linen_wrappers[key] = _LinenUnderPolicy(
        module, amp_linen.with_policy(module, policy, recompute_norms=recompute_norms,
                                      half_residuals=False))
  return found


def _run_under(module: nnx.Module, fn: Callable[..., Any], policy: Policy,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  compute = policy.compute_dtype
  undo: list[Callable[[], None]] = []
  gather = fn is nnx.Embed.__call__  # a lookup: keep the table, cast the rows
  bridged = isinstance(module, nnx.bridge.ToNNX)
  _state.running.add(id(module))
  _state.stack.append(policy)
  reads_slices = False  # whether it owns parameter slices gathered where read (FSDP)
  try:
    for variable in _owned_variables(module):
      sliced = _gathered_on_read(variable)
      reads_slices = reads_slices or sliced
      _keep_dtype(variable, undo)
      # A bridged Linen module's parameters are cast per Linen submodule, by its policy.
      # A lookup reads a sharded table cast, then gathered: the rows it would cast.
      if (not gather or sliced) and not bridged and _reads_as_compute(module, variable):
        _read_as(variable, compute, undo)
    if bridged:
      _set_attr(module, _flax_compat.TONNX_MODULE,
                _linen_under(_flax_compat.tonnx_module(module), policy,
                             _state.calls[-1].recompute_norms), undo)
      # ToNNX turns every other attribute into a Linen collection: hide the policy.
      for attr in (_POLICY_ATTR, _SCOPE_ATTR):
        if attr in vars(module):
          saved = vars(module).pop(attr)
          undo.append(functools.partial(set_attr_unchecked, module, attr, saved))
    attrs = vars(module)
    if "dtype" in attrs and (attrs["dtype"] is None or is_floating_dtype(attrs["dtype"])):
      # A gather looks rows up in the stored dtype: None makes Embed skip its cast.
      _set_attr(module, "dtype", None if gather else compute, undo)
    if attrs.get("attention_fn") is nnx.dot_product_attention and policy.is_mixed:
      _set_attr(module, "attention_fn", half_dot_product_attention, undo)
    for name, value in fp8_lib.nnx_fields(module, policy).items():  # FP8: jaxamp.fp8
      _set_attr(module, name, value, undo)
    fn = fp8_conv_transpose.nnx_call(module, policy, fn)
    call = _state.calls[-1]
    remat = module_call.remat_for(norm=fn in _RECOMPUTED, recompute_norms=call.recompute_norms,
                                  owns_slices=reads_slices, inputs=(args, kwargs),
                                  compute=compute, keep=_is_node)
    # A module reading slices gets its own checkpoint: inside an nnx.scan body, the
    # backward pass then gathers each layer's parameters again in that layer's step.
    out = module_call.call_under(
        _LIBRARY, policy, args, kwargs, call=lambda a, k: fn(module, *a, **k),
        recomputed=lambda r: _recomputed(module, fn, compute, args, kwargs, r.policy,
                                         tied=r.regather),
        remat=remat, scope=vars(module).get(_SCOPE_ATTR) if call.scopes is not None else None,
        widen=False, path=lambda: numerics.name_of(module),  # widened below, once the module is as it was
        layer=type(module))
  finally:
    for step in reversed(undo):
      step()
    _state.stack.pop()
    _state.running.discard(id(module))
  return _cast_values(out, policy.output_dtype)
