"""The policy wrapper of an NNX model: :class:`PolicyModule`, :func:`with_policy`,
:func:`module_policies`, and the check that the policy reaches the matmuls."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend.core as jax_core
from flax import nnx

from jaxamp import fp8 as fp8_lib
from jaxamp import residuals as residuals_lib
from jaxamp._flax_compat import set_attr_unchecked
from jaxamp import module_call
from jaxamp.census import module_matmuls
from jaxamp.nnx._call import (_Call, _SCOPE_ATTR, _POLICY_ATTR, _is_node, _methods_for,
                              _policy_class, _run_under, _state)
from jaxamp.nnx._plan import _base_class, _resolve
from jaxamp.policy import get_policy, global_policy, Policy, PolicyLike
from jaxamp.rules import path_name

_MISSING = object()


@contextlib.contextmanager
def _applied(model: nnx.Module, call: _Call) -> Iterator[None]:
  """Gives every module of ``model`` its policy-aware class and resolved policy."""
  saved = []
  pushed = False
  try:
    for path, node, node_policy in _resolve(model, call.policy):
      saved.append((node, type(node), vars(node).get(_POLICY_ATTR, _MISSING),
                    vars(node).get(_SCOPE_ATTR, _MISSING)))
      if call.scopes is not None:
        held = call.scopes.get(id(node))
        if held is None or held[0] is not node:
          held = call.scopes[id(node)] = (node, len(call.names))
          call.names.append(path_name(path))
        set_attr_unchecked(node, _SCOPE_ATTR, held[1])
      # A nested wrapper resolves its own model; containers have no method to wrap.
      if not isinstance(node, PolicyModule) and _methods_for(_base_class(type(node))):
        set_attr_unchecked(node, "__class__", _policy_class(_base_class(type(node))))
      set_attr_unchecked(node, _POLICY_ATTR, node_policy)
    _state.calls.append(call)
    pushed = True
    yield
  finally:
    if pushed:
      _state.calls.pop()
    for node, cls, *olds in reversed(saved):
      set_attr_unchecked(node, "__class__", cls)
      for attr, old in zip((_POLICY_ATTR, _SCOPE_ATTR), olds):
        if old is _MISSING:
          vars(node).pop(attr, None)
        else:
          set_attr_unchecked(node, attr, old)


class PolicyModule(nnx.Module):
  """Runs ``module`` with every submodule under its resolved policy.

  It holds ``module`` itself (not a copy), so ``nnx.split``, ``nnx.jit``, ``nnx.grad``
  and ``nnx.Optimizer`` accept it and its Variables are the model's. Calling it, or
  any public method of ``module`` through it (``amp.generate(...)``), runs under the
  policy; rule paths are relative to ``module``. Submodules reached through it
  (``amp.head``, ``amp.blocks[0]``) are views that run under the whole model's policies
  too and share its Variables; ``amp.module.head`` is the plain submodule. Make it with
  :func:`with_policy`.

  Attributes:
    module: the wrapped model.
    policy: the model-level policy. Made without one, the wrapper takes
      :func:`jaxamp.global_policy` once, when it is made: later ``set_global_policy``
      calls or scopes do not change it, eager or under ``jax.jit`` alike.
    recompute_norms: whether norms that compute wider than their inputs are recomputed
      in the backward pass (off by default).
    half_residuals: whether a call under a transformation (``nnx.grad``, ``jax.jit``)
      runs under :func:`jaxamp.half_residuals` when a module computes in half
      precision (on by default).
  """

  def __init__(self, module: nnx.Module, policy: PolicyLike | None = None, *,
               recompute_norms: bool = False, half_residuals: bool = True):
    if not isinstance(module, nnx.Module):
      raise TypeError(f"with_policy expects a flax.nnx.Module, got {type(module).__name__}; "
                      "for Linen modules use jaxamp.linen.with_policy.")
    self.module = module
    # Resolved now, not per call: a jitted call would otherwise freeze whatever policy was
    # in force at its trace and silently ignore a later set_global_policy.
    self.policy = global_policy() if policy is None else get_policy(policy)
    self.recompute_norms = bool(recompute_norms)
    self.half_residuals = bool(half_residuals)

  def _model_policy(self) -> Policy:
    return self.policy

  def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
    call = _Call(self._model_policy(), self.recompute_norms)
    if not _state.calls:  # an outermost call: check that the policy reaches the matmuls
      _check(self, name, args, kwargs)
      if self.half_residuals:
        return _with_half_residuals(self, name, args, kwargs, call)
    return self._run(name, args, kwargs, call)

  def matmul_census(self, *args: Any, method: str = "__call__", **kwargs: Any
                    ) -> tuple[list[Any], list[str], dict[str, Policy]]:
    """Which module each matmul of a call runs in, and in which dtypes.

    Nothing is computed and the model is not changed: a copy is traced abstractly
    (``jax.make_jaxpr``).

    Args:
      *args: the call's arguments (arrays or ``jax.ShapeDtypeStruct``).
      method: the method to call.
      **kwargs: its keyword arguments.

    Returns:
      ``(ops, modules, policies)``: the :func:`jaxamp.census.module_matmuls` census of
      the forward pass, the ``'/'``-joined module path of each scope number, and each
      module's resolved policy by path.
    """
    return _census(self, method, args, kwargs)

  def _run(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call,
           model: nnx.Module | None = None) -> Any:
    model = self.module if model is None else model
    with _applied(model, call):
      if name in _methods_for(_base_class(type(model))):
        return getattr(model, name)(*args, **kwargs)
      # Another public method: it runs under the model's own policy too.
      fn = getattr(_base_class(type(model)), name)
      return _run_under(model, fn, vars(model)[_POLICY_ATTR], args, kwargs)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self._call("__call__", *args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    # Only reached for names PolicyModule lacks: forward them to the model.
    model = vars(self).get("module")
    if model is None or name.startswith("_"):
      raise AttributeError(name)
    value = getattr(model, name)
    if inspect.ismethod(value) and value.__self__ is model:
      return functools.partial(self._call, name)
    return self._view(value)

  def __getitem__(self, key: Any) -> Any:
    # Python looks dunder methods up on the class, past __getattr__: forward indexing
    # (an nnx.List or nnx.Dict model, or one defining __getitem__) explicitly.
    model = vars(self).get("module")
    if not hasattr(model, "__getitem__"):
      raise TypeError(f"{type(model).__name__} (wrapped by with_policy) cannot be indexed: "
                      "it defines no __getitem__.")
    return self._view(model[key])

  def _view(self, value: Any) -> Any:
    """``value`` itself, or a view running under the policies if it is a submodule."""
    return _SubmoduleView(self, value) if isinstance(value, nnx.Module) else value


class _EagerTrace(threading.local):
  state: Any = None  # jax's opaque trace state outside every transformation


_eager = _EagerTrace()


def _traced(model: nnx.Module, args: Any, kwargs: Any) -> bool:
  """Whether a call runs under a transformation (there is a backward pass to save for).

  An eager call costs no walk of the model: once a call of this thread has found the
  model's values concrete, the trace state it ran in stands for "eager"."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
    return True
  now = jax_core.get_opaque_trace_state(convention="nnx")
  if _eager.state is not None:
    return now != _eager.state
  traced = any(isinstance(node, nnx.Variable)
               and isinstance(node.get_raw_value(), jax.core.Tracer)
               for _, node in nnx.iter_graph(model))
  if not traced:
    _eager.state = now
  return traced


def _with_half_residuals(wrapper: PolicyModule, name: str, args: tuple[Any, ...],
                         kwargs: dict[str, Any], call: _Call) -> Any:
  """``wrapper._run(...)`` under :func:`jaxamp.half_residuals`, the model passed in as
  its state and its new state (BatchNorm statistics, RNG counts, sown values) written
  back; as it is where nothing is traced or nothing computes in half."""
  model = wrapper.module
  if not _traced(model, args, kwargs) or not residuals_lib.computes_in_half(
      p for _, _, p in _resolve(model, call.policy)):
    return wrapper._run(name, args, kwargs, call)
  graphdef, state = nnx.split(model)

  def run(state, args, kwargs):
    copy = nnx.merge(graphdef, state)
    out = wrapper._run(name, args, kwargs, call, model=copy)
    return out, nnx.state(copy)

  out, new_state = residuals_lib.half_residuals(run)(state, args, kwargs)
  # Only what the call changed is written back (the values left alone come back as the
  # very arrays passed in), so a model outside the trace is not touched; new Variables
  # (sown values) are added.
  old = dict(nnx.to_flat_state(state))  # the model's own Variable objects
  added = []
  for path, variable in nnx.to_flat_state(new_state):
    if path not in old:
      added.append((path, variable))
    elif variable.get_raw_value() is not old[path].get_raw_value():
      old[path].set_raw_value(variable.get_raw_value())
  if added:
    nnx.update(model, nnx.from_flat_state(added))
  return out


class _SubmoduleView:
  """A submodule reached through a :class:`PolicyModule` (``amp.head``, ``amp.blocks[0]``).

  Calling it, or one of its methods, runs under the whole model's policies, so path rules
  still count from the model's root.
  """

  def __init__(self, root: PolicyModule, module: nnx.Module):
    self._root = root
    self._module = module

  def _run(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    root = self._root
    with _applied(root.module, _Call(root._model_policy(), root.recompute_norms)):
      return getattr(self._module, name)(*args, **kwargs)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self._run("__call__", args, kwargs)

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_"):
      raise AttributeError(name)
    value = getattr(self._module, name)
    if inspect.ismethod(value) and value.__self__ is self._module:
      return lambda *args, **kwargs: self._run(name, args, kwargs)
    return self._root._view(value)

  def __getitem__(self, key: Any) -> Any:
    return self._root._view(self._module[key])

  def __iter__(self) -> Any:
    return (self._root._view(m) for m in self._module)

  def __len__(self) -> int:
    return len(self._module)

  def __repr__(self) -> str:
    return f"_SubmoduleView({type(self._module).__name__})"


def with_policy(model: nnx.Module, policy: PolicyLike | None = None, *,
                recompute_norms: bool = False, half_residuals: bool = True) -> PolicyModule:
  """Returns ``model`` wrapped to run every submodule under its resolved policy.

  Args:
    model: an ``nnx.Module``, unmodified.
    policy: the model-level policy (anything :func:`jaxamp.get_policy` accepts); None
      takes :func:`jaxamp.global_policy` now, once: the wrapper keeps it whatever
      global policy or scope is in force when it is called (eager or jitted).
    recompute_norms: recompute norms (``nnx.LayerNorm``, ``nnx.RMSNorm``,
      ``nnx.GroupNorm``, ``nnx.BatchNorm``) in the backward pass when they compute wider
      than their inputs (the float32 default inside a half-precision model), statistics
      included. ``half_residuals`` already keeps a norm's half-precision input and
      statistics rather than its float32 intermediates; this matters only where it
      steps aside (a model that rematerializes itself). Off by default. Forward results
      are the same either way.
    half_residuals: a call under a transformation (``nnx.grad``, ``jax.jit``) runs
      under :func:`jaxamp.half_residuals` when some module computes in half precision:
      reverse mode saves half-precision values and statistics and recomputes float32
      elementwise work (float32 norms' insides, parameter casts) in the backward pass,
      with the same gradients. On by default; False keeps what plain reverse mode
      saves.

  Returns:
    A :class:`PolicyModule` sharing ``model``'s Variables: call it instead of ``model``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxamp
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    >>> with jaxamp.policy_scope('mixed_bfloat16'):
    ...   amp = jaxamp.nnx.with_policy(model)  # takes the policy in force now
    >>> amp(jnp.ones((1, 4))).dtype  # and keeps it outside the scope
    dtype(bfloat16)
  """
  return PolicyModule(model, policy, recompute_norms=recompute_norms,
                      half_residuals=half_residuals)


def module_policies(model: nnx.Module, policy: PolicyLike | None = None
                    ) -> list[tuple[str, type, Policy]]:
  """The policy every module of ``model`` runs under.

  Args:
    model: an NNX module, or a :class:`PolicyModule` (its model and policy are used).
    policy: the model-level policy; None means the wrapper's policy, else
      :func:`jaxamp.global_policy`.

  Returns:
    ``(path, class, policy)`` for every module, in ``nnx.iter_graph`` order (children
    before parents); paths are ``'/'``-joined and the model's own is ``''``.

  Example:
    >>> import jaxamp
    >>> from flax import nnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=rngs), nnx.LayerNorm(2, rngs=rngs))
    >>> for path, cls, p in jaxamp.nnx.module_policies(model, 'mixed_float16'):
    ...   print(repr(path), cls.__name__, p.name)
    'layers/0' Linear mixed_float16
    'layers/1' LayerNorm params=float32,compute=float32,output=float16
    'layers' List mixed_float16
    '' Sequential mixed_float16
  """
  if isinstance(model, PolicyModule):
    if policy is None:
      policy = model.policy
    model = model.module
  root = global_policy() if policy is None else get_policy(policy)
  return [(path_name(path), _base_class(type(node)), p)
          for path, node, p in _resolve(model, root)]


# --- did the policy reach the matmuls? ----------------------------------------------------

_checked: set[Any] = set()


def _census(wrapper: PolicyModule, name: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[list[Any], list[str], dict[str, Policy]]:
  """The matmul census of ``wrapper``'s ``name`` call, traced on a copy of the model."""
  graphdef, state = nnx.split(wrapper.module)
  call = _Call(wrapper._model_policy(), wrapper.recompute_norms, {}, [])

  def run(state, a, k):
    copy = PolicyModule(nnx.merge(graphdef, state), wrapper.policy,
                        recompute_norms=wrapper.recompute_norms)
    return copy._run(name, a, k, call)

  # The copy's modules are new objects: number them as _applied meets them. Traced
  # inside a train step, the copy must not read (or warn of missing) FP8 state.
  jaxpr = module_call.traced(run, state, args, kwargs)
  policies = {path_name(path): p for path, _, p in _resolve(wrapper.module, call.policy)}
  return module_matmuls(jaxpr), call.names, policies


def _check(wrapper: PolicyModule, name: str, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> None:
  """Warns once if a module computing in half by policy leaves matmuls in float32.

  Checked once per model class, policy, method and input shapes; skipped when nothing
  computes in half, or when the call takes graph nodes (``nnx.Rngs``, modules).
  """
  policy = wrapper._model_policy()
  leaves = jax.tree.leaves((args, kwargs), is_leaf=_is_node)
  base = _base_class(type(wrapper.module))
  if not module_call.first_time(_checked, (base, policy, name,
                                           module_call.input_signature(leaves))):
    return
  if any(_is_node(x) for x in leaves):
    return
  resolved = _resolve(wrapper.module, policy)
  found = module_call.warn_float32(
      base.__name__, policy.name, {path_name(path): p.compute_dtype for path, _, p in resolved},
      lambda: _census(wrapper, name, args, kwargs)[:2], stacklevel=5)
  if found is None:
    return
  # Under FP8, the modules whose matmuls FP8 cannot reach (they compute them themselves)
  # while some layer runs it; init already said so where none does.
  rows = [(path_name(path), _base_class(type(node)), p) for path, node, p in resolved]
  if any(fp8_lib.runs_fp8(cls, p) for _, cls, p in rows):
    fp8_lib.warn_if_unused(rows, base.__name__, policy.name, census=lambda: found,
                           stacklevel=5)
