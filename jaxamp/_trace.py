"""Tracing a call abstractly, and the key its inputs' shapes give a cache.

The module wrappers (NNX, Linen, Equinox) trace a module call without running it, to
learn which modules run matmuls (the census) and which modules own which parameters:
array leaves of the call's arguments (concrete, traced or ``jax.ShapeDtypeStruct``)
become abstract arguments, every other leaf (flags, method names) stays static.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxamp import _trace
  >>> f = lambda x, scale: {"y": x * scale, "note": "static"}
  >>> jaxpr = _trace.abstractly(jax.make_jaxpr, _trace.arrays_of(f),
  ...                           jax.ShapeDtypeStruct((2,), jnp.float32), 3.0)
  >>> [v.aval.shape for v in jaxpr.jaxpr.outvars]
  [(2,)]
  >>> _trace.signature(jnp.ones(2), 3.0) == _trace.signature(jnp.zeros(2), 3.0)
  True
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax

__all__ = ["is_array_like", "abstractly", "arrays_of", "signature"]


def is_array_like(x: Any) -> bool:
  """Whether ``x`` has a shape and a dtype (an array, a tracer, a ShapeDtypeStruct)."""
  return hasattr(x, "shape") and hasattr(x, "dtype")


def abstractly(trace: Callable[..., Any], fn: Callable[..., Any], *trees: Any) -> Any:
  """``trace`` (``jax.eval_shape``, ``jax.make_jaxpr``) applied to ``fn(*trees)``, the
  trees' array leaves abstract and their other leaves static."""
  leaves, treedef = jax.tree.flatten(trees)
  arrays = [is_array_like(x) for x in leaves]

  def run(*dynamic):
    it = iter(dynamic)
    return fn(*jax.tree.unflatten(treedef, [next(it) if a else x
                                            for x, a in zip(leaves, arrays)]))

  return trace(run)(*(x for x, a in zip(leaves, arrays) if a))


def arrays_of(fn: Callable[..., Any]) -> Callable[..., list[Any]]:
  """``fn`` returning only the arrays of its result (tracing needs array outputs)."""
  return lambda *a: [x for x in jax.tree.leaves(fn(*a)) if is_array_like(x)]


class _Uncacheable(Exception):
  pass


def _leaf_key(x: Any) -> Hashable:
  if is_array_like(x):
    return ("array", tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
  try:
    hash(x)
  except TypeError:
    raise _Uncacheable() from None
  return ("value", type(x), x)


def signature(*trees: Any) -> Hashable | None:
  """A hashable key for the shapes, dtypes and static values of ``trees``, or None when
  a static value cannot be hashed."""
  leaves, treedef = jax.tree.flatten(trees)
  try:
    return treedef, tuple(_leaf_key(x) for x in leaves)
  except _Uncacheable:
    return None
