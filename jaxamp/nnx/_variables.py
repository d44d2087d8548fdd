"""How a module's Variables read and keep their dtypes inside a call under a policy.

Parameters are read in the compute dtype through the Variable's ``on_get_value`` hook
(their stored values never change); updates in another dtype are cast back on exit.
Every change is undone by the ``undo`` steps each function appends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxamp import _flax_compat
from jaxamp._flax_compat import NNX_BOOKKEEPING_PREFIX, set_attr_unchecked
from jaxamp.casting import is_floating_array, read_as
from jaxamp.rules import is_named_attention
from jaxamp.gather import read

_MISSING = object()


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
        if not name.startswith(NNX_BOOKKEEPING_PREFIX):
          visit(value)
    elif how == _ITEMS:
      for value in x:
        visit(value)
    elif how == _VALUES:
      for value in x.values():
        visit(value)

  for name, value in vars(module).items():
    if not name.startswith(NNX_BOOKKEEPING_PREFIX):
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


_metadata = _flax_compat.variable_metadata  # None for hijax Variables
_GET_VALUE_HOOKS = _flax_compat.GET_VALUE_HOOKS


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
  if _SHARD in meta:  # a slice gathered at its read: gathered in ``dtype``
    _set_meta(variable, _GATHER_DTYPE, dtype, undo)
    return
  _set_meta(variable, _GET_VALUE_HOOKS, _hooks_and(meta, _cast_hook(dtype)), undo)


def _hooks_and(meta: dict[str, Any], hook: Callable[[Any, Any], Any]) -> tuple[Any, ...]:
  """The ``on_get_value`` hooks of ``meta`` (one, or a tuple or list) with ``hook`` last."""
  hooks = meta.get(_GET_VALUE_HOOKS, ())
  return (tuple(hooks) if isinstance(hooks, (tuple, list)) else (hooks,)) + (hook,)


def _set_meta(variable: nnx.Variable, key: str, value: Any,
              undo: list[Callable[[], None]]) -> None:
  """Sets ``variable``'s metadata ``key`` to ``value`` until ``undo`` runs."""
  previous = _metadata(variable).get(key, _MISSING)
  _metadata(variable)[key] = value

  def restore() -> None:
    current = _metadata(variable)  # NNX transforms may have replaced the dict
    if current is None:
      return
    if previous is _MISSING:
      current.pop(key, None)
    else:
      current[key] = previous

  undo.append(restore)


# --- parameters gathered where they are read (FSDP, gather='layer') -------------------------

# Metadata of a sharded parameter's slice: its Shard, and the dtype the module reading it
# now computes in (set for the call by _read_as; absent: the stored dtype).
_SHARD = "jaxamp_shard"
_GATHER_DTYPE = "jaxamp_gather_dtype"


def _gather_on_read(variable: nnx.Variable, value: Any) -> Any:
  """An ``on_get_value`` hook: the slice ``value`` gathered over the mesh."""
  meta = _metadata(variable)
  dtype = meta.get(_GATHER_DTYPE) or value.dtype
  return read(value, meta[_SHARD], dtype)


def _gathered_on_read(variable: nnx.Variable) -> bool:
  meta = _metadata(variable)
  return meta is not None and _SHARD in meta


def gather_on_read(variable: nnx.Variable, shard: Any) -> None:
  """Makes the parameter slice ``variable`` (inside the step's ``shard_map``) read as the
  whole parameter, all-gathered (:func:`jaxamp.gather.gathered`), in the compute
  dtype of the module reading it; its gradient leaves reduce-scattered. For the
  Variables of a model bound for one step: nothing is undone."""
  meta = _metadata(variable)
  if meta is None:
    raise ValueError("gather='layer' needs NNX Variables with metadata; this one is a "
                     f"{type(variable).__name__} without: use gather='model'.")
  meta[_SHARD] = shard
  meta[_GET_VALUE_HOOKS] = _hooks_and(meta, _gather_on_read)


def _keep_dtype(variable: nnx.Variable, undo: list[Callable[[], None]]) -> None:
  """Casts an in-call update of ``variable`` back to its stored dtype."""
  value = _stored_value(variable)
  if _metadata(variable) is None or not is_floating_array(value):
    return
  dtype = value.dtype

  def restore() -> None:
    new = _stored_value(variable)
    if is_floating_array(new) and new.dtype != dtype:
      _flax_compat.set_raw_value_unchecked(variable, new.astype(dtype))

  undo.append(restore)


def _set_attr(module: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
  old = vars(module)[name]
  set_attr_unchecked(module, name, value)  # no NNX trace-level check: undone below
  undo.append(lambda: set_attr_unchecked(module, name, old))
