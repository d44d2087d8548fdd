"""Which module of an NNX model runs under which policy: the module walk and the plan."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from jaxamp import _flax_compat
from jaxamp.policy import Policy
from jaxamp.rules import NORM_CLASSES, resolve_tree


def _holds_matrix(module: Any) -> bool:
  """Whether ``module`` holds, as its own attribute, a floating parameter of two or more
  dimensions."""
  return any(isinstance(v, nnx.Param) and getattr(v, "ndim", 0) >= 2
             for v in vars(module).values())


def _base_class(cls: type) -> type:
  """The user's class behind a policy-aware subclass."""
  return cls.__dict__.get("_jaxamp_base", cls)


# What a graph attribute is, by type: the module walks below run on every wrapper call
# and module call, and ``isinstance(x, nnx.Variable)`` (a metaclass check) or
# ``is_graph_node`` cost microseconds each, on every attribute of every module.
_LEAF, _VARIABLE, _NODE = 0, 1, 2
_kinds: dict[type, int] = {}
_is_graph_node = _flax_compat.is_graph_node
_node_items = _flax_compat.node_items


def _kind(x: Any) -> int:
  """Whether ``x`` is a Variable, another graph node (module, list, dict...) or a leaf."""
  kind = _kinds.get(type(x))
  if kind is None:
    kind = (_VARIABLE if isinstance(x, nnx.Variable) else
            _NODE if _is_graph_node(x) else _LEAF)
    # A tracer may be a hijax Variable: decided per instance. (A type registered as a
    # pytree after a wrapped call has seen it stays a leaf here.)
    if not isinstance(x, jax.core.Tracer):
      _kinds[type(x)] = kind
  return kind


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
  # A module holding a matrix (a kernel: norms hold vectors) runs a matmul or convolution
  # of its own, so it is no norm, whatever its name (a weight-normed linear layer).
  kernels = [path for path, node in modules
             if not isinstance(node, NORM_CLASSES) and _holds_matrix(node)]
  resolved = resolve_tree([(path, _base_class(type(node))) for path, node in modules], policy,
                          matmuls=kernels)
  return [(path, node, resolved[path]) for path, node in modules]
