"""Casting the floating leaves of a pytree, and nothing else.

Only arrays (``jax.Array``, ``numpy.ndarray``, tracers) and ``jax.ShapeDtypeStruct``
leaves with a floating dtype are cast. Integers, booleans, PRNG keys (typed or raw
``uint32``), ``None``, Python scalars and any other leaf pass through untouched, so
token ids, masks and random keys survive a policy unchanged.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxamp.casting import cast_floating
  >>> out = cast_floating({'x': jnp.ones(2), 'ids': jnp.arange(2)}, jnp.bfloat16)
  >>> out['x'].dtype, out['ids'].dtype
  (dtype(bfloat16), dtype('int32'))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["cast_floating", "is_floating_array", "is_floating_dtype"]


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)

# Per-dtype answers: ``jnp.issubdtype`` costs microseconds, and the module wrappers ask
# it for every argument, parameter and output of every call.
_floating: dict[Any, bool] = {}


def _floating_dtype(dtype: Any) -> bool:
  """``jnp.issubdtype(dtype, jnp.floating)`` for an array's dtype, remembered."""
  found = _floating.get(dtype)
  if found is None:
    found = _floating[dtype] = bool(jnp.issubdtype(dtype, jnp.floating))
  return found


def is_floating_array(x: Any) -> bool:
  """Whether ``x`` is an array (or shape struct) whose dtype is floating point."""
  if not isinstance(x, _ARRAY_TYPES):
    return False
  return _floating_dtype(x.dtype)


def is_floating_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` (a dtype, scalar type or name such as ``'float32'``) is floating point.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.casting import is_floating_dtype
    >>> is_floating_dtype('float32'), is_floating_dtype(jnp.bfloat16), is_floating_dtype(None)
    (True, True, False)
  """
  if dtype is None:
    return False
  try:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))
  except TypeError:
    return False


def cast_leaf(x: Any, dtype: np.dtype) -> Any:
  """One leaf of :func:`cast_floating`: a floating array (or shape struct) in ``dtype``
  (a ``np.dtype``, already checked to be floating), anything else as it is."""
  if not is_floating_array(x) or x.dtype == dtype:
    return x
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x).astype(dtype)
  # The same op as ``x.astype(dtype)``, without ``jnp.astype``'s argument checks: the
  # module wrappers cast every parameter and argument of every call through here.
  return jax.lax.convert_element_type(x, dtype)


def cast_floating(tree: Any, dtype: Any) -> Any:
  """Casts every floating-point array leaf of ``tree`` to ``dtype``.

  Works on any pytree: dicts, lists, NamedTuples, ``FrozenDict``, ``nnx.State``.
  Leaves already of ``dtype`` are returned as they are (no cast is traced).

  Args:
    tree: a pytree.
    dtype: the target floating dtype.

  Returns:
    ``tree`` with its floating leaves cast to ``dtype``.
  """
  if dtype is None:  # np.dtype(None) would quietly mean float64
    raise ValueError("cast_floating needs a floating dtype, got None.")
  dtype = np.dtype(dtype)
  if not _floating_dtype(dtype):
    raise ValueError(f"cast_floating casts to a floating dtype, got {dtype}.")
  if isinstance(tree, jax.Array):  # one array (a parameter read): no tree to walk
    return cast_leaf(tree, dtype)
  return jax.tree.map(lambda x: cast_leaf(x, dtype), tree)
