"""Every use jaxamp makes of Flax's private or undocumented API, each behind one name.

Flax changes its internals between releases. Everything of jaxamp that relies on one goes
through this module, so a Flax upgrade that removes one fails here, at import, with a
message naming the internal and the Flax version found; ``tests/test_flax_compat.py``
checks, one test per name, that each still behaves as jaxamp assumes.

Names used on hot paths (every module call of a wrapped NNX model) are bound once at
import (plain functions and constants, no lookup per call).

Example:
  >>> from flax import nnx
  >>> from jaxamp import _flax_compat
  >>> linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> [key for key, _ in _flax_compat.node_items(linear)][:3]
  ['_pytree__nodes', '_pytree__state', 'bias']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import flax.core
import flax.linen as nn
from flax import nnx
from flax.core import meta as _meta
from flax.core import scope as _core_scope
from flax.linen import fp8_ops as _fp8_ops
from flax.nnx import bridge as _bridge

try:
  from flax.nnx import graphlib as _graph  # flax >= 0.12
except ImportError:  # older releases: the same functions in flax.nnx.graph
  from flax.nnx import graph as _graph


def _missing(what: str) -> ImportError:
  return ImportError(
      f"jaxamp needs flax's {what} (found flax {flax.__version__}); this release removed or "
      "changed it. Install the Flax version jaxamp was tested with (see pyproject.toml), or "
      "adapt jaxamp/_flax_compat.py.")


def _require(owner: Any, name: str, what: str) -> Any:
  """``owner.name``, or an ImportError naming ``what`` and the Flax version."""
  if not hasattr(owner, name):
    raise _missing(what)
  return getattr(owner, name)


# --- NNX graph traversal -------------------------------------------------------------

is_graph_node: Callable[[Any], bool] = _require(_graph, "is_node", "nnx.graph.is_node")
"""Whether ``x`` is an NNX graph node (module, ``nnx.List``, registered pytree), not a
Variable or leaf: ``nnx.graph.is_node``, which ``nnx.iter_graph`` follows."""

_get_node_impl = _require(_graph, "get_node_impl", "nnx.graph.get_node_impl")
_get_node_impl_for_type = _require(_graph, "get_node_impl_for_type",
                                   "nnx.graph.get_node_impl_for_type")
_PYTREE_FLATTEN = _require(nnx.Pytree, "_graph_node_flatten",
                           "nnx.Pytree._graph_node_flatten")
_require(nnx.Pytree, "_pytree__has_int_keys", "nnx.Pytree._pytree__has_int_keys")
_module_impl = _get_node_impl_for_type(nnx.Module)
if _module_impl is None:
  raise _missing("nnx.Module registered as an nnx.graph node type")
_require(_module_impl, "node_dict", "the node_dict method of nnx.graph's node implementations")
del _module_impl

_plain_flatten: dict[type, bool] = {}


def node_items(node: Any) -> Any:
  """``node``'s ``(key, child)`` pairs as ``nnx.graph``'s ``node_dict`` gives them, or
  None for a node with no implementation.

  Relies on ``nnx.graph.get_node_impl(_for_type)`` and their ``node_dict``, and on a
  ``Pytree`` whose ``_graph_node_flatten`` is not overridden flattening to its sorted
  instance attributes (keys made ints where ``_pytree__has_int_keys``: ``nnx.List``).
  Such a node's attributes are read directly, without wrapping each in a Data/Static
  element as ``node_dict`` does: this runs on every wrapper call.
  """
  cls = type(node)
  plain = _plain_flatten.get(cls)
  if plain is None:
    plain = _plain_flatten[cls] = (
        issubclass(cls, nnx.Pytree)
        and cls._graph_node_flatten is _PYTREE_FLATTEN  # not overridden
        and _get_node_impl_for_type(cls) is not None)
  if plain and not node._pytree__has_int_keys:
    return sorted(vars(node).items())
  impl = _get_node_impl(node)
  return None if impl is None else impl.node_dict(node).items()


NNX_BOOKKEEPING_PREFIX = "_pytree__"
"""The prefix of the instance attributes NNX keeps on every ``Pytree`` (module) for its
own bookkeeping (``_pytree__state``, ``_pytree__nodes``): not the user's attributes."""


_require(nnx.Module, "_pytree__is_pytree", "nnx.Pytree._pytree__is_pytree")


def graph_subclass(cls: type, namespace: dict[str, Any]) -> type:
  """A subclass of the NNX module class ``cls`` with ``namespace``, registered (as Flax
  registers every ``Pytree`` subclass) as a graph node type, and as a JAX pytree exactly
  when ``cls`` is one.

  Relies on ``Pytree.__init_subclass__`` taking ``pytree=`` and on
  ``cls._pytree__is_pytree`` holding the value ``cls`` was made with.
  """
  return type(cls)(cls.__name__, (cls,), namespace, pytree=cls._pytree__is_pytree)


# --- NNX Variables -------------------------------------------------------------------

_require(nnx.Variable, "_var_metadata", "nnx.Variable._var_metadata")
_require(nnx.Variable, "_raw_value", "nnx.Variable._raw_value")
_require(nnx.Variable, "get_raw_value", "nnx.Variable.get_raw_value")

GET_VALUE_HOOKS = "on_get_value"
"""The key of a Variable's metadata holding its ``on_get_value`` hook(s) (one callable
or a tuple), which ``Variable.get_value`` applies, in order, to every read."""


def variable_metadata(variable: nnx.Variable) -> dict[str, Any] | None:
  """The metadata dict a (non-hijax) Variable keeps in ``_var_metadata``, itself (not a
  copy: writing :data:`GET_VALUE_HOOKS` there changes how it reads); None for a Variable
  without one (``hijax=True``)."""
  meta = getattr(variable, "_var_metadata", None)
  return meta if isinstance(meta, dict) else None


def set_raw_value_unchecked(variable: nnx.Variable, value: Any) -> None:
  """Stores ``value`` as ``variable``'s raw value (the ``_raw_value`` slot), without the
  trace-level check of ``set_raw_value``: an undo that may run after a transform."""
  object.__setattr__(variable, "_raw_value", value)


# Sets an attribute of an NNX module or a Linen module without their __setattr__ (NNX's
# trace-level check and data/static bookkeeping; Linen's frozen dataclass). Relies on
# both keeping attributes, fields included, in the instance __dict__. For attributes
# jaxamp sets and restores around a call (a dtype, a policy, the module's __class__).
set_attr_unchecked: Callable[[Any, str, Any], None] = object.__setattr__


# --- nnx.bridge.ToNNX ------------------------------------------------------------------

TONNX_MODULE = "to_nnx__module"
"""The attribute of an ``nnx.bridge.ToNNX`` holding its Linen module; ToNNX calls that
object's ``init_with_output`` and ``apply``, so another object with those methods set
there runs in its place."""

_require(_bridge, "ToNNX", "nnx.bridge.ToNNX")


def tonnx_module(module: Any) -> Any:
  """The Linen module an ``nnx.bridge.ToNNX`` holds (its :data:`TONNX_MODULE`)."""
  found = vars(module).get(TONNX_MODULE)
  if found is None:
    raise RuntimeError(f"jaxamp needs flax's nnx.bridge.ToNNX to keep its Linen module "
                       f"in {TONNX_MODULE!r} (found flax {flax.__version__}, whose ToNNX "
                       f"has {sorted(vars(module))}); adapt jaxamp/_flax_compat.py.")
  return found


# --- Linen -----------------------------------------------------------------------------

union_filters: Callable[[Any, Any], Any] = _require(
    _core_scope, "union_filters", "flax.core.scope.union_filters")
"""The union of two Linen collection filters (``mutable=``): ``union_filters(False,
'cache')`` is ``{'cache'}``."""

_Scope = _require(flax.core, "Scope", "flax.core.Scope")
_require(nn.Dense, "scope", "linen.Module.scope")


def linen_is_bound(module: nn.Module) -> bool:
  """Whether a Linen module is bound to variables (runs inside ``init``/``apply``): its
  ``scope`` is set; None while it is being defined or in ``setup``'s clone."""
  return module.scope is not None


def linen_is_lifted_body(module: nn.Module) -> bool:
  """Whether a Linen module is the body a lifted transform (``nn.scan``, ``nn.vmap``,
  ``nn.remat``) runs: Flax runs a clone of it bound straight to a ``Scope`` (its
  ``parent`` is that scope, not a module); only a top module is bound so otherwise."""
  return isinstance(module.parent, _Scope) and bool(module.path)


def linen_unbound_method(context: Any) -> Callable[..., Any]:
  """The function behind an ``nn.intercept_methods`` context's method: its
  ``orig_method`` is ``functools.partial(function, module)``, bound to the module."""
  return context.orig_method.func


# --- flax.core.meta and FP8 ------------------------------------------------------------

_unbox = _require(_meta, "unbox", "flax.core.meta.unbox")


def unbox(tree: Any) -> Any:
  """``tree`` with Linen's metadata boxes (``nn.Partitioned``, ``nn.LogicallyPartitioned``)
  replaced by their values: ``flax.core.meta.unbox``."""
  return _unbox(tree)


dot_general_transpose_lhs: Callable[..., Any] = _require(
    _fp8_ops, "dot_general_transpose_lhs", "flax.linen.fp8_ops.dot_general_transpose_lhs")
"""The gradient of ``lax.dot_general`` by its lhs: ``(g, lhs, rhs, dimension_numbers,
precision, preferred_element_type)``, as Flax's FP8 ops compute it."""

dot_general_transpose_rhs: Callable[..., Any] = _require(
    _fp8_ops, "dot_general_transpose_rhs", "flax.linen.fp8_ops.dot_general_transpose_rhs")
"""The gradient of ``lax.dot_general`` by its rhs, as :data:`dot_general_transpose_lhs`."""

VARIABLE_VALUE_KEY = "value"
"""The key under which an ``nnx.Variable`` flattens its value as a JAX pytree
(``GetAttrKey('value')``): the last part of a parameter's path in an ``nnx.State``."""
