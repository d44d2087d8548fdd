"""Per-module mixed-precision policies for unmodified Flax NNX models.

:func:`with_policy` returns a :class:`PolicyModule` to call in place of a model. It
holds the same Variables (an update through one is seen by the other) and calling it
runs every submodule under its resolved policy (:func:`jaxamp.resolve_policy`: path
rules, then class rules, then the enclosing module's policy; the model itself takes
the model-level policy). Inside a module whose compute dtype is ``c``:

- floating positional and keyword arguments are cast to ``c``; integers (token ids),
  booleans (masks), PRNG keys, ``nnx.Rngs`` and other graph nodes pass untouched;
- the module's own floating ``nnx.Param`` s (attributes it holds directly, also inside
  ``nnx.List``/``nnx.Dict``/plain containers, not those of its submodules) read as
  ``c``: ``x @ self.w[...]`` in a module you wrote computes in ``c``. The stored
  values never change dtype, so gradients come back in the stored (param) dtype;
- a ``dtype`` attribute (``None`` or floating, as every Flax layer has) reads ``c``:
  this is what makes ``nnx.Embed``, ``nnx.MultiHeadAttention`` and its projections,
  whose ``dtype`` was fixed at construction, compute in ``c``;
- floating outputs are cast to the policy's output dtype;
- every floating Variable keeps its stored dtype (an in-call update written in another
  dtype is cast back): BatchNorm's ``BatchStat`` stays float32 and, computed in float32
  by default, is updated in float32; the decoding ``nnx.Cache`` of an attention layer
  (``nnx.MultiHeadAttention``, or a class named like one: ``jaxamp.rules.
  is_named_attention``) is read in ``c`` like a parameter and stays in the dtype
  ``init_cache`` gave it. Any other ``nnx.Cache`` (a running sum, a recurrent state
  your module keeps) is read and updated in its stored dtype: a float32 one
  accumulates in float32.

Some built-in layers get targeted treatment:

- ``nnx.Embed.__call__`` is a gather, not a matmul: it looks rows up in the stored
  dtype and casts only the rows (the same values; no cast of the whole table, and the
  table's gradient is accumulated in float32). ``Embed.attend`` is a matmul and reads
  the table in ``c``.
- ``nnx.MultiHeadAttention`` with its default ``attention_fn`` and a half ``c`` uses
  :func:`half_dot_product_attention`: float32 logits and softmax as in
  ``jax.nn.dot_product_attention``, but without the ``F16_F16_F32`` dot algorithm XLA
  on CPU rejects, and with half-precision operands in the backward matmuls too.
- ``nnx.LayerNorm``, ``nnx.RMSNorm``, ``nnx.GroupNorm`` and ``nnx.BatchNorm`` compute
  in float32 by default inside a half model. With ``recompute_norms=True`` those that
  compute wider than their inputs run under ``jax.checkpoint``: reverse mode keeps their
  half-precision input instead of float32 intermediates and recomputes the norm in the
  backward pass. Off by default: it saves activation memory but costs time on a GPU
  (ResNet-50 step 1.25× with it in a run not kept, 1.03× the hand-set model without:
  ``benchmarks/gpu``).

Linen modules bridged with ``nnx.bridge.ToNNX`` run through
:func:`jaxamp.linen.with_policy` under the ``ToNNX`` module's policy (rule paths
inside them count from the Linen module). The first outermost call per model class,
policy, method and input shapes traces a copy of the model (``jax.make_jaxpr``) under
per-module scopes and warns once if a module computing in half by policy still runs
matmuls in float32 (:mod:`jaxamp.census`).

How: NNX has no method interceptor, so while the wrapper runs, each module instance of
the graph is given a cached policy-aware subclass of its class (``__call__`` and the
methods of :data:`POLICY_METHODS` wrapped) and its resolved policy as a static
attribute; both are restored when the call returns. Modules that NNX transforms
re-create inside the call (``nnx.scan``, ``nnx.vmap``, ``nnx.remat``) carry both with
them, because both are part of the graph definition. Params are cast on read through
the Variable ``on_get_value`` hook, so transforms see float32 state.

Limits: policies and rules are read when the call is traced: under ``jax.jit`` or
``nnx.jit`` a function traced once keeps them (with ``policy=None``, the global policy
of that moment) until it is traced again. Modules constructed during the call run
unmodified. A model must not be called from two threads while a wrapped call of it
runs (its instances are shared). Variables made with ``hijax=True`` are not cast on
read (the ``dtype`` attribute still covers the built-in layers).

Example:
  >>> import jax.numpy as jnp
  >>> import jaxamp
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
  ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
  >>> amp = jaxamp.nnx.with_policy(model, 'mixed_bfloat16')
  >>> amp(jnp.ones((3, 4))).dtype, model.layers[0].kernel.dtype
  (dtype(bfloat16), dtype('float32'))
  >>> [(path, p.name) for path, _, p in jaxamp.nnx.module_policies(amp)][-1]
  ('', 'mixed_bfloat16')
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import bridge as _bridge  # noqa: F401  (makes nnx.bridge importable)
from flax.nnx import graph as _graph

from jaxamp.casting import (cast_floating, cast_leaf, is_floating_array, is_floating_dtype,
                             read_as)
from jaxamp.census import (float32_in_half_modules, module_matmuls, scope_name,
                           warn_float32_matmuls)
from jaxamp import fp8 as fp8_lib
from jaxamp.policy import get_policy, global_policy, Policy, PolicyLike
from jaxamp.rules import is_named_attention, path_name, resolve_policy, resolve_tree

__all__ = [
    "POLICY_METHODS",
    "PolicyModule",
    "half_dot_product_attention",
    "module_policies",
    "with_policy",
]

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
_MISSING = object()


class _Call(NamedTuple):
  """One running wrapper call: its model-level policy and options.

  ``scopes`` is set for a census run: ``{id(module): scope number}``, filled by
  :func:`_applied`, with ``names`` the module path of each number.
  """

  policy: Policy
  recompute_norms: bool
  scopes: dict[int, int] | None = None
  names: list[str] | None = None


class _ThreadState(threading.local):
  """Per-thread call state: NNX graphs are shared objects, the running calls are not."""

  def __init__(self):
    super().__init__()
    self.calls: list[_Call] = []  # the wrapper calls running, innermost last
    self.stack: list[Policy] = []  # policy of each module call running
    self.running: set[int] = set()  # ids of modules whose wrapped method is running


_state = _ThreadState()


# --- policy resolution -----------------------------------------------------------------


def _base_class(cls: type) -> type:
  """The user's class behind a policy-aware subclass."""
  return cls.__dict__.get("_jaxamp_base", cls)


# What a graph attribute is, by type: the module walks below run on every wrapper call
# and module call, and ``isinstance(x, nnx.Variable)`` (a metaclass check) or
# ``nnx.graph.is_node`` cost microseconds each, on every attribute of every module.
_LEAF, _VARIABLE, _NODE = 0, 1, 2
_kinds: dict[type, int] = {}


def _kind(x: Any) -> int:
  """Whether ``x`` is a Variable, another graph node (module, list, dict...) or a leaf."""
  kind = _kinds.get(type(x))
  if kind is None:
    kind = (_VARIABLE if isinstance(x, nnx.Variable) else
            _NODE if _graph.is_node(x) else _LEAF)
    # A tracer may be a hijax Variable: decided per instance. (A type registered as a
    # pytree after a wrapped call has seen it stays a leaf here.)
    if not isinstance(x, jax.core.Tracer):
      _kinds[type(x)] = kind
  return kind


_plain_flatten: dict[type, bool] = {}


def _node_items(node: Any) -> Any:
  """``node``'s ``(key, child)`` pairs as ``nnx.graph``'s ``node_dict`` gives them, or
  None for a node with no implementation. A Pytree (module) flattens to its sorted
  attributes: read them directly instead of wrapping each in a Data/Static element."""
  cls = type(node)
  plain = _plain_flatten.get(cls)
  if plain is None:
    plain = _plain_flatten[cls] = (
        issubclass(cls, nnx.Pytree)
        and cls._graph_node_flatten is nnx.Pytree._graph_node_flatten  # not overridden
        and _graph.get_node_impl_for_type(cls) is not None)
  if plain and not node._pytree__has_int_keys:
    return sorted(vars(node).items())
  impl = _graph.get_node_impl(node)
  return None if impl is None else impl.node_dict(node).items()


def _iter_modules(root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
  """``(path, module)`` for every module under ``root``, exactly as ``nnx.iter_graph``
  yields them (same paths, same order, shared modules once), without visiting Variables
  and leaves: it runs on every wrapper call, and ``iter_graph`` spends most of its time
  on the Variables' own contents."""
  visited: set[int] = set()
  stack: list[tuple[tuple[Any, ...], Any, bool]] = [((), root, False)]
  while stack:
    path, node, traversed = stack.pop()
    if traversed:
      if isinstance(node, nnx.Module):
        yield path, node
      continue
    if _kind(node) != _NODE or id(node) in visited:
      continue
    visited.add(id(node))
    items = _node_items(node)
    if items is None:
      continue
    stack.append((path, node, True))
    for key, child in reversed(list(items)):
      if _kind(child) == _NODE:
        stack.append(((*path, key), child, False))


def _resolve(model: nnx.Module, policy: Policy) -> list[tuple[tuple[Any, ...], Any, Policy]]:
  """(path, module, policy) for every module of ``model``, in ``nnx.iter_graph`` order."""
  modules = list(_iter_modules(model))
  resolved = resolve_tree([(path, _base_class(type(node))) for path, node in modules], policy)
  return [(path, node, resolved[path]) for path, node in modules]


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


# --- the policy-aware subclasses -------------------------------------------------------


_methods: dict[type, tuple[str, ...]] = {}
_methods_source: dict[type, tuple[str, ...]] = {}  # the POLICY_METHODS _methods reflects


def _methods_for(cls: type) -> tuple[str, ...]:
  """The policy methods of ``cls``; remembered per class until POLICY_METHODS changes."""
  if POLICY_METHODS != _methods_source:  # a small dict: cheaper than the MRO walk
    _methods.clear()
    _methods_source.clear()
    _methods_source.update(POLICY_METHODS)
  found = _methods.get(cls)
  if found is None:
    found = _methods[cls] = _find_methods(cls)
  return found


def _find_methods(cls: type) -> tuple[str, ...]:
  names: list[str] = []
  for klass in cls.__mro__:
    for name in POLICY_METHODS.get(klass, ()):
      # Look in the class dicts: getattr(cls, '__call__') finds the metaclass's.
      if name not in names and any(name in vars(k) for k in cls.__mro__):
        names.append(name)
  return tuple(names)


_classes: dict[tuple[type, tuple[str, ...]], type] = {}
_classes_lock = threading.Lock()


def _policy_class(cls: type) -> type:
  """A cached subclass of ``cls`` whose policy methods run under the instance's policy."""
  key = (cls, _methods_for(cls))
  sub = _classes.get(key)
  if sub is not None:
    return sub
  with _classes_lock:
    sub = _classes.get(key)
    if sub is None:
      namespace: dict[str, Any] = {
          "__module__": cls.__module__,
          "__qualname__": cls.__qualname__,
          "__doc__": cls.__doc__,
          "_jaxamp_base": cls,
      }
      for name in key[1]:
        namespace[name] = _policy_method(getattr(cls, name))
      # Flax registers every Pytree subclass as a graph node (and pytree) type.
      sub = type(cls)(cls.__name__, (cls,), namespace, pytree=cls._pytree__is_pytree)
      _classes[key] = sub
  return sub


def _policy_method(fn: Callable[..., Any]) -> Callable[..., Any]:

  @functools.wraps(fn)
  def method(self, *args, **kwargs):
    policy = _policy_for(self)
    if policy is None:
      return fn(self, *args, **kwargs)
    return _run_under(self, fn, policy, args, kwargs)

  return method


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


# --- running one module method under a policy ------------------------------------------


def _is_node(x: Any) -> bool:
  return isinstance(x, (nnx.Variable, nnx.Pytree))


def _is_plain_array(x: Any) -> bool:
  """A ``jax.Array`` or an array tracer (not a hijax Variable's): a leaf to cast as is."""
  if isinstance(x, jax.core.Tracer):
    return type(x.aval) is jax.core.ShapedArray
  return isinstance(x, jax.Array)


def _cast_values(tree: Any, dtype: np.dtype) -> Any:
  """Casts floating arrays in ``tree``; Variables, Rngs and modules pass untouched."""
  # Most calls pass and return plain arrays: no tree to build.
  if _is_plain_array(tree):
    return cast_leaf(tree, dtype)
  if type(tree) is tuple and all(_is_plain_array(x) for x in tree):
    return tuple(cast_leaf(x, dtype) for x in tree)
  if type(tree) is dict and not tree:
    return tree
  return jax.tree.map(lambda x: x if _is_node(x) else cast_leaf(x, dtype), tree,
                      is_leaf=_is_node)


def _reads_as_compute(module: nnx.Module, variable: nnx.Variable) -> bool:
  """Whether ``variable`` of ``module`` is read in the compute dtype: a parameter, or the
  decoding cache of an attention layer (:func:`jaxamp.rules.is_named_attention`: it
  writes computed keys and values into it; the cache keeps its stored dtype). Any other
  ``nnx.Cache`` is state a module accumulates (a running sum, a recurrent state): read in
  the compute dtype, a float32 one would be updated in half precision, so it is read,
  and updated, in its stored dtype, as ``BatchStat`` is."""
  return isinstance(variable, nnx.Param) or (
      isinstance(variable, nnx.Cache) and is_named_attention(type(module)))

# Modules that only hold things: a Param in a module's nnx.List is that module's.
_CONTAINERS = (nnx.List, nnx.Dict)


# How _owned_variables treats an attribute, by type (see _kind).
_SKIP, _OWN, _SUBMODULE, _ATTRS, _ITEMS, _VALUES = range(6)
_holds: dict[type, int] = {}


def _holding(x: Any) -> int:
  how = _holds.get(type(x))
  if how is None:
    how = (_OWN if isinstance(x, nnx.Variable) else
           _SUBMODULE if isinstance(x, nnx.Module) and not isinstance(x, _CONTAINERS) else
           _ATTRS if isinstance(x, nnx.Pytree) else  # nnx.List, nnx.Dict, nnx.Rngs, ...
           _ITEMS if isinstance(x, (list, tuple)) else
           _VALUES if isinstance(x, dict) else _SKIP)
    if not isinstance(x, jax.core.Tracer):  # a tracer may be a hijax Variable
      _holds[type(x)] = how
  return how


def _owned_variables(module: nnx.Module) -> list[nnx.Variable]:
  """The Variables ``module`` holds itself: not through a submodule."""
  found: dict[int, nnx.Variable] = {}

  def visit(x: Any) -> None:
    how = _holding(x)
    if how == _OWN:
      found.setdefault(id(x), x)
    elif how == _ATTRS:
      for name, value in vars(x).items():
        if not name.startswith("_pytree__"):
          visit(value)
    elif how == _ITEMS:
      for value in x:
        visit(value)
    elif how == _VALUES:
      for value in x.values():
        visit(value)

  for name, value in vars(module).items():
    if not name.startswith("_pytree__"):
      visit(value)
  return list(found.values())


_hooks: dict[np.dtype, Callable[[Any, Any], Any]] = {}


def _cast_hook(dtype: np.dtype) -> Callable[[Any, Any], Any]:
  """An ``on_get_value`` hook reading a Variable as ``dtype``; one per dtype, so graph
  definitions that carry it compare equal across calls (jit caches stay warm)."""
  hook = _hooks.get(dtype)
  if hook is None:
    def hook(variable, value, dtype=dtype):
      del variable
      return read_as(value, dtype)
    hook.__name__ = hook.__qualname__ = f"jaxamp_read_as_{dtype.name}"
    hook = _hooks.setdefault(dtype, hook)
  return hook


def _stored_value(variable: nnx.Variable) -> Any:
  return variable.get_raw_value()


def _metadata(variable: nnx.Variable) -> dict[str, Any] | None:
  meta = getattr(variable, "_var_metadata", None)  # plain (not hijax) Variables
  return meta if isinstance(meta, dict) else None


def _float_dtype(value: Any) -> np.dtype | None:
  """The dtype of a floating array or ``jax.Ref`` (Variables made with ``ref=True``)."""
  if is_floating_array(value) or (isinstance(value, jax.Ref)
                                  and jnp.issubdtype(value.dtype, jnp.floating)):
    return np.dtype(value.dtype)
  return None


def _read_as(variable: nnx.Variable, dtype: np.dtype, undo: list[Callable[[], None]]) -> None:
  """Makes ``variable`` read as ``dtype`` until ``undo`` runs; its stored value stays."""
  meta = _metadata(variable)
  stored = _float_dtype(_stored_value(variable))
  if meta is None or stored is None or stored == dtype:
    return
  previous = meta.get("on_get_value", _MISSING)
  hooks = () if previous is _MISSING else (
      previous if isinstance(previous, tuple) else (previous,))
  meta["on_get_value"] = hooks + (_cast_hook(dtype),)

  def restore() -> None:
    # NNX transforms may have replaced the metadata dict: restore on the current one.
    current = _metadata(variable)
    if current is None:
      return
    if previous is _MISSING:
      current.pop("on_get_value", None)
    else:
      current["on_get_value"] = previous

  undo.append(restore)


def _keep_dtype(variable: nnx.Variable, undo: list[Callable[[], None]]) -> None:
  """Casts an in-call update of ``variable`` back to its stored dtype."""
  value = _stored_value(variable)
  if _metadata(variable) is None or not is_floating_array(value):
    return
  dtype = value.dtype

  def restore() -> None:
    new = _stored_value(variable)
    if is_floating_array(new) and new.dtype != dtype:
      object.__setattr__(variable, "_raw_value", new.astype(dtype))

  undo.append(restore)


def _set_attr(module: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
  old = vars(module)[name]
  object.__setattr__(module, name, value)  # no NNX trace-level check: undone below
  undo.append(lambda: object.__setattr__(module, name, old))


# Norms, recomputed in the backward pass when they compute wider than their inputs:
# reverse mode then keeps their half-precision input, not float32 intermediates.
_RECOMPUTED = frozenset({nnx.LayerNorm.__call__, nnx.RMSNorm.__call__, nnx.GroupNorm.__call__,
                         nnx.BatchNorm.__call__})


def _widens(args: Any, kwargs: Any, compute: np.dtype) -> bool:
  leaves = jax.tree.leaves((args, kwargs), is_leaf=_is_node)
  return any(is_floating_array(x) and x.dtype.itemsize < compute.itemsize for x in leaves)


def _recomputed(module: nnx.Module, fn: Callable[..., Any], compute: np.dtype,
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """``fn(module, *args, **kwargs)`` under ``jax.checkpoint``, the cast to ``compute``
  inside it, so that reverse mode saves the narrower inputs rather than what ``fn``
  computes from them.

  The module runs as a copy merged inside the checkpoint; the Variables it updates
  (BatchNorm's statistics) are written back to ``module`` afterwards, through the
  usual NNX checks. Unchanged ones are not touched, so a model closed over by
  ``jax.jit`` runs as it would without recomputation.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_node)
  where = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
  graphdef, params, others = nnx.split(module, nnx.Param, ...)
  updated: list[tuple[Any, ...]] = []  # paths, known once ``run`` is traced

  def run(params, others, arrays):
    copy = nnx.merge(graphdef, params, others, copy=True)
    before = {path: v.get_raw_value()
              for path, v in nnx.to_flat_state(nnx.state(copy, nnx.Not(nnx.Param)))}
    full = list(leaves)
    for i, x in zip(where, arrays):
      full[i] = x
    a, k = jax.tree.unflatten(treedef, full)
    out = fn(copy, *_cast_values(a, compute), **_cast_values(k, compute))
    after = nnx.to_flat_state(nnx.state(copy, nnx.Not(nnx.Param)))
    new = [(path, v.get_raw_value()) for path, v in after
           if path in before and v.get_raw_value() is not before[path]]
    updated[:] = [path for path, _ in new]
    return out, [value for _, value in new]

  out, values = jax.checkpoint(run)(params, others, [leaves[i] for i in where])
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
    found = _linen_wrappers[key] = _LinenUnderPolicy(
        module, amp_linen.with_policy(module, policy, recompute_norms=recompute_norms))
  return found


def _run_under(module: nnx.Module, fn: Callable[..., Any], policy: Policy,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  compute = policy.compute_dtype
  undo: list[Callable[[], None]] = []
  gather = fn is nnx.Embed.__call__  # a lookup: keep the table, cast the rows
  bridged = isinstance(module, nnx.bridge.ToNNX)
  _state.running.add(id(module))
  _state.stack.append(policy)
  try:
    for variable in _owned_variables(module):
      _keep_dtype(variable, undo)
      # A bridged Linen module's parameters are cast per Linen submodule, by its policy.
      if not gather and not bridged and _reads_as_compute(module, variable):
        _read_as(variable, compute, undo)
    if bridged:
      _set_attr(module, "to_nnx__module",
                _linen_under(vars(module)["to_nnx__module"], policy,
                             _state.calls[-1].recompute_norms), undo)
      # ToNNX turns every other attribute into a Linen collection: hide the policy.
      for attr in (_POLICY_ATTR, _SCOPE_ATTR):
        if attr in vars(module):
          saved = vars(module).pop(attr)
          undo.append(functools.partial(object.__setattr__, module, attr, saved))
    attrs = vars(module)
    if "dtype" in attrs and (attrs["dtype"] is None or is_floating_dtype(attrs["dtype"])):
      # A gather looks rows up in the stored dtype: None makes Embed skip its cast.
      _set_attr(module, "dtype", None if gather else compute, undo)
    if attrs.get("attention_fn") is nnx.dot_product_attention and policy.is_mixed:
      _set_attr(module, "attention_fn", half_dot_product_attention, undo)
    for name, value in fp8_lib.nnx_fields(module, policy).items():  # FP8: jaxamp.fp8
      _set_attr(module, name, value, undo)
    call = _state.calls[-1]

    def run() -> Any:
      if fn in _RECOMPUTED and call.recompute_norms and _widens(args, kwargs, compute):
        return _recomputed(module, fn, compute, args, kwargs)
      return fn(module, *_cast_values(args, compute), **_cast_values(kwargs, compute))

    scope = vars(module).get(_SCOPE_ATTR) if call.scopes is not None else None
    if scope is not None:  # a census run
      with jax.named_scope(scope_name(scope)):
        out = run()
    else:
      out = run()
  finally:
    for step in reversed(undo):
      step()
    _state.stack.pop()
    _state.running.discard(id(module))
  return _cast_values(out, policy.output_dtype)


# --- the wrapper -----------------------------------------------------------------------


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
        if id(node) not in call.scopes:
          call.scopes[id(node)] = len(call.names)
          call.names.append(path_name(path))
        object.__setattr__(node, _SCOPE_ATTR, call.scopes[id(node)])
      # A nested wrapper resolves its own model; containers have no method to wrap.
      if not isinstance(node, PolicyModule) and _methods_for(_base_class(type(node))):
        object.__setattr__(node, "__class__", _policy_class(_base_class(type(node))))
      object.__setattr__(node, _POLICY_ATTR, node_policy)
    _state.calls.append(call)
    pushed = True
    yield
  finally:
    if pushed:
      _state.calls.pop()
    for node, cls, *olds in reversed(saved):
      object.__setattr__(node, "__class__", cls)
      for attr, old in zip((_POLICY_ATTR, _SCOPE_ATTR), olds):
        if old is _MISSING:
          vars(node).pop(attr, None)
        else:
          object.__setattr__(node, attr, old)


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
  """

  def __init__(self, module: nnx.Module, policy: PolicyLike | None = None, *,
               recompute_norms: bool = False):
    if not isinstance(module, nnx.Module):
      raise TypeError(f"with_policy expects a flax.nnx.Module, got {type(module).__name__}; "
                      "for Linen modules use jaxamp.linen.with_policy.")
    self.module = module
    # Resolved now, not per call: a jitted call would otherwise freeze whatever policy was
    # in force at its trace and silently ignore a later set_global_policy.
    self.policy = global_policy() if policy is None else get_policy(policy)
    self.recompute_norms = bool(recompute_norms)

  def _model_policy(self) -> Policy:
    return self.policy

  def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
    if not _state.calls:  # an outermost call: check that the policy reaches the matmuls
      _check(self, name, args, kwargs)
    return self._run(name, args, kwargs, _Call(self._model_policy(), self.recompute_norms))

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

  def _run(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], call: _Call) -> Any:
    model = self.module
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
                recompute_norms: bool = False) -> PolicyModule:
  """Returns ``model`` wrapped to run every submodule under its resolved policy.

  Args:
    model: an ``nnx.Module``, unmodified.
    policy: the model-level policy (anything :func:`jaxamp.get_policy` accepts); None
      takes :func:`jaxamp.global_policy` now, once: the wrapper keeps it whatever
      global policy or scope is in force when it is called (eager or jitted).
    recompute_norms: recompute norms (``nnx.LayerNorm``, ``nnx.RMSNorm``,
      ``nnx.GroupNorm``, ``nnx.BatchNorm``) in the backward pass when they compute wider
      than their inputs (the float32 default inside a half-precision model), so reverse
      mode keeps their half-precision inputs instead of float32 intermediates. Saves
      activation memory, costs time: off by default. Forward results are the same
      either way.

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
  return PolicyModule(model, policy, recompute_norms=recompute_norms)


# --- did the policy reach the matmuls? ----------------------------------------------------

_checked: set[Any] = set()
_CHECKED_SIZE = 256


def _census(wrapper: PolicyModule, name: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[list[Any], list[str], dict[str, Policy]]:
  """The matmul census of ``wrapper``'s ``name`` call, traced on a copy of the model."""
  graphdef, state = nnx.split(wrapper.module)
  leaves, treedef = jax.tree.flatten((args, kwargs))
  arrays = [hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves]
  call = _Call(wrapper._model_policy(), wrapper.recompute_norms, {}, [])

  def run(state, *dynamic):
    copy = PolicyModule(nnx.merge(graphdef, state), wrapper.policy,
                        recompute_norms=wrapper.recompute_norms)
    it = iter(dynamic)
    a, k = jax.tree.unflatten(treedef, [next(it) if is_array else x
                                        for x, is_array in zip(leaves, arrays)])
    out = copy._run(name, a, k, call)
    return [x for x in jax.tree.leaves(out) if hasattr(x, "shape") and hasattr(x, "dtype")]

  # The copy's modules are new objects: number them as _applied meets them. Traced
  # inside a train step, the copy must not read (or warn of missing) FP8 state.
  with fp8_lib.suspended():
    jaxpr = jax.make_jaxpr(run)(state, *(x for x, a in zip(leaves, arrays) if a))
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
  key = (_base_class(type(wrapper.module)), policy, name,
         tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))))
               for x in leaves))
  if key in _checked:  # checked first: this runs on every outermost call
    return
  if len(_checked) >= _CHECKED_SIZE:
    _checked.clear()
  _checked.add(key)
  if any(_is_node(x) for x in leaves):
    return
  if all(p.compute_dtype.itemsize >= 4 for _, _, p in _resolve(wrapper.module, policy)):
    return
  ops, names, by_name = _census(wrapper, name, args, kwargs)
  stray, total = float32_in_half_modules(
      ops, names, {n: p.compute_dtype for n, p in by_name.items()})
  warn_float32_matmuls(_base_class(type(wrapper.module)).__name__,
                       wrapper._model_policy().name, stray, total, stacklevel=5)


# --- attention with half-precision operands in both passes ------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scores(query, key, precision):
  """Float32 logits ``[..., K, G, T, S]`` of ``query [..., T, K, G, D]`` and
  ``key [..., S, K, D]`` (K key/value heads, G query heads per key/value head)."""
  return jnp.einsum("...tkgd,...skd->...kgts", query, key, precision=precision,
                    preferred_element_type=jnp.float32)


def _scores_fwd(query, key, precision):
  return _scores(query, key, precision), (query, key)


def _scores_bwd(precision, residuals, grad):
  # The float32 cotangent is rounded to the operands' dtype first, so the two
  # backward matmuls run on half-precision operands too (as for any half matmul).
  query, key = residuals
  grad = grad.astype(query.dtype)
  d_query = jnp.einsum("...kgts,...skd->...tkgd", grad, key, precision=precision)
  d_key = jnp.einsum("...kgts,...tkgd->...skd", grad, query, precision=precision)
  return d_query.astype(query.dtype), d_key.astype(key.dtype)


_scores.defvjp(_scores_fwd, _scores_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(logits, keep, dtype):
  """``softmax(where(keep, logits, -inf))`` over the last axis in float32, cast to ``dtype``."""
  if keep is not None:
    logits = jnp.where(keep, logits, jnp.finfo(logits.dtype).min)
  return jax.nn.softmax(logits, axis=-1).astype(dtype)


def _softmax_fwd(logits, keep, dtype):
  probs = _softmax(logits, keep, dtype)
  return probs, (probs, keep)


def _softmax_bwd(dtype, residuals, grad):
  # The backward pass needs the probabilities, which the second matmul keeps anyway
  # in ``dtype``: reuse them rather than also saving them in float32.
  del dtype
  probs, keep = residuals
  probs = probs.astype(jnp.float32)
  grad = grad.astype(jnp.float32)
  d_logits = probs * (grad - jnp.sum(grad * probs, axis=-1, keepdims=True))
  if keep is not None:
    d_logits = jnp.where(keep, d_logits, 0.0)
  return d_logits, None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _by_group(x, groups: int):
  """``[..., H, T, S]`` masks and biases to the grouped ``[..., K, G, T, S]`` layout."""
  if x.ndim < 3:
    return x
  if x.shape[-3] == 1:
    return x[..., None, :, :]
  return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def half_dot_product_attention(query, key, value, bias=None, mask=None,
                               broadcast_dropout: bool = True, dropout_rng=None,
                               dropout_rate: float = 0.0, deterministic: bool = False,
                               dtype=None, precision=None, module=None,
                               is_causal: bool = False, **kwargs):
  """Dot-product attention whose matmuls take ``dtype`` operands forward and backward.

  A drop-in ``attention_fn`` for ``nnx.MultiHeadAttention`` (same arguments and
  semantics as ``nnx.dot_product_attention``, grouped-query attention included):
  logits are accumulated and returned in float32 and the softmax runs in float32, as
  in ``jax.nn.dot_product_attention``; the probabilities are cast to ``dtype`` for the
  second matmul. Unlike ``jax.nn.dot_product_attention`` it asks for no
  ``F16_F16_F32``/``BF16_BF16_F32`` dot algorithm (XLA on CPU rejects the float16
  one) and the logits' gradient is rounded to ``dtype`` before the backward matmuls,
  so those run in half precision too. :func:`with_policy` uses it for
  ``nnx.MultiHeadAttention`` layers that keep the default ``attention_fn`` and compute
  in float16 or bfloat16.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.nnx import half_dot_product_attention
    >>> q = jnp.ones((2, 5, 4, 8), jnp.float16)  # [batch, length, heads, head_dim]
    >>> half_dot_product_attention(q, q, q).dtype
    dtype('float16')
  """
  del kwargs  # promote_dtype: the inputs are cast to ``dtype`` here
  dtype = query.dtype if dtype is None else dtype
  query, key, value = (jnp.asarray(t, dtype) for t in (query, key, value))
  heads, kv_heads = query.shape[-2], key.shape[-2]
  if heads % kv_heads:
    raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads "
                     f"({kv_heads}).")
  groups = heads // kv_heads
  *batch, length, _, depth = query.shape
  query = query / jnp.sqrt(depth).astype(dtype)
  query = query.reshape(*batch, length, kv_heads, groups, depth)
  logits = _scores(query, key, precision)  # [..., K, G, T, S] float32
  if bias is not None:
    logits = logits + _by_group(jnp.asarray(bias, jnp.float32), groups)
  keep = None if mask is None else _by_group(jnp.asarray(mask, bool), groups)
  if is_causal:
    causal = jnp.tril(jnp.ones(logits.shape[-2:], bool))
    keep = causal if keep is None else jnp.logical_and(keep, causal)
  weights = _softmax(logits, keep, np.dtype(dtype))  # [..., K, G, T, S]
  dropout = not deterministic and dropout_rate > 0.0
  if module is not None or dropout:
    # Reshaped only when needed: the backward pass would keep both layouts.
    weights = weights.reshape(weights.shape[:-4] + (heads,) + weights.shape[-2:])
    if module is not None:
      module.sow(nnx.Intermediate, "attention_weights", weights)
    if dropout:  # as nnx.dot_product_attention_weights does
      keep_prob = 1.0 - dropout_rate
      shape = ((1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast_dropout
               else weights.shape)
      kept = jax.random.bernoulli(dropout_rng, keep_prob, shape)
      weights = weights * (kept.astype(dtype) / jnp.asarray(keep_prob, dtype))
    weights = weights.reshape(weights.shape[:-3] + (kv_heads, groups) + weights.shape[-2:])
  out = jnp.einsum("...kgts,...skd->...tkgd", weights, value, precision=precision)
  return out.reshape(*batch, length, heads, value.shape[-1])
