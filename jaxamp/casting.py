"""Casting the floating leaves of a pytree, and nothing else.

Only arrays (``jax.Array``, ``numpy.ndarray``, tracers) and ``jax.ShapeDtypeStruct``
leaves with a floating dtype are cast. Integers, booleans, PRNG keys (typed or raw
``uint32``), ``None``, Python scalars and any other leaf pass through untouched, so
token ids, masks and random keys survive a policy unchanged. Complex leaves pass through
too: no complex half-precision dtype exists, and a cast to a real one would drop the
imaginary part. What the train step does to every gradient (unscaling, the finiteness
check, the norm, sums over micro-batches and devices) it does to complex ones as well:
:func:`is_inexact_array` says which leaves, :func:`real_or_complex` in which dtype.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxamp.casting import cast_floating
  >>> out = cast_floating({'x': jnp.ones(2), 'ids': jnp.arange(2)}, jnp.bfloat16)
  >>> out['x'].dtype, out['ids'].dtype
  (dtype(bfloat16), dtype('int32'))
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["cast_floating", "is_floating_array", "is_floating_dtype", "is_inexact_array",
           "read_as", "real_or_complex", "narrow_cotangents", "overflowed_casts",
           "at_least_float32", "widen_floating"]


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


_inexact: dict[Any, bool] = {}


def is_inexact_array(x: Any) -> bool:
  """Whether ``x`` is an array (or shape struct) of a floating or complex dtype: a leaf
  that has a gradient, which loss scaling, finiteness checks and norms must cover.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.casting import is_floating_array, is_inexact_array
    >>> z = jnp.ones(2, jnp.complex64)
    >>> is_inexact_array(z), is_floating_array(z), is_inexact_array(jnp.arange(2))
    (True, False, False)
  """
  if not isinstance(x, _ARRAY_TYPES):
    return False
  found = _inexact.get(x.dtype)
  if found is None:
    found = _inexact[x.dtype] = bool(jnp.issubdtype(x.dtype, jnp.inexact))
  return found


def real_or_complex(dtype: Any, target: Any) -> np.dtype:
  """The dtype a value of ``dtype`` takes where a real ``target`` is asked for (a sum in
  float32, a reduction in bfloat16): ``target``, but for a complex ``dtype`` the
  narrowest complex dtype holding both (``complex64`` for float32, bfloat16 and float16,
  none of which has a complex counterpart), so the imaginary part is never dropped.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.casting import real_or_complex
    >>> real_or_complex(jnp.float16, jnp.float32), real_or_complex(jnp.complex64, jnp.bfloat16)
    (dtype('float32'), dtype('complex64'))
  """
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return np.dtype(jnp.promote_types(dtype, target))
  return np.dtype(target)


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


_FLOAT32 = np.dtype(jnp.float32)


@functools.lru_cache(maxsize=None)
def at_least_float32(*dtypes: Any) -> np.dtype:
  """float32, or the widest of ``dtypes`` where that is wider (float64).

  The dtype of every precision-keeping default ("in float32": norms, outputs handed to
  the loss, the loss, gradient accumulation and reductions, global norms, master
  weights): it widens half precision and never narrows a wider policy.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.casting import at_least_float32
    >>> at_least_float32(jnp.bfloat16), at_least_float32(jnp.float64)
    (dtype('float32'), dtype('float64'))
  """
  return np.dtype(functools.reduce(jnp.promote_types, dtypes, _FLOAT32))


def widen_floating(tree: Any) -> Any:
  """Each floating leaf of ``tree`` in :func:`at_least_float32` of its dtype: half
  precision widened to float32, float32 and float64 leaves as they are."""
  return jax.tree.map(
      lambda x: cast_leaf(x, at_least_float32(x.dtype)) if is_floating_array(x) else x, tree)


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


def overflowed_casts(before: Any, after: Any) -> list[tuple[Any, float, np.dtype]]:
  """``(key path, largest magnitude before, dtype after)`` of each floating leaf of
  ``before`` that was finite and whose cast in ``after`` (same structure) is not: a value
  past the new dtype's range (float16 stops at 65504) stored as inf. The reductions run
  where the arrays are.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.casting import cast_floating, overflowed_casts
    >>> w = {'w': jnp.array([1.0, 1e5])}
    >>> overflowed_casts(w, cast_floating(w, jnp.float16))
    [((DictKey(key='w'),), 100000.0, dtype('float16'))]
  """
  found = []
  for (path, old), new in zip(jax.tree_util.tree_flatten_with_path(before)[0],
                              jax.tree.leaves(after)):
    if (is_floating_array(old) and old.dtype != new.dtype
        and bool(jnp.isfinite(old).all()) and not bool(jnp.isfinite(new).all())):
      found.append((path, float(jnp.abs(old).max()), np.dtype(new.dtype)))
  return found


# --- parameter reads that keep their half-precision cotangents ------------------------------


class NarrowCotangents:
  """The half-precision cotangents behind float32 gradients, found while
  :func:`narrow_cotangents` is active.

  A float32 parameter read once in half precision gets, in reverse mode, the widening of
  that read's half-precision cotangent as its gradient. A train step that must hold its
  gradients across a ``lax.cond`` (the exact skip of a non-finite step) can hold that
  cotangent instead and widen it inside the branch: bit-identical gradients, half the
  bytes written and read, and the widening fused into the optimizer's update as it is
  without the skip. A parameter read twice or more (its cotangents summed in float32) or
  inside a loop or ``jax.checkpoint`` gets no entry: :meth:`narrow` returns None for it.
  """

  def __init__(self):
    self._found: dict[int, tuple[jax.Array, jax.Array]] = {}
    self._reads: dict[int, tuple[jax.Array, list[np.dtype]]] = {}

  def record(self, wide: jax.Array, narrow: jax.Array) -> None:
    self._found[id(wide)] = (wide, narrow)

  def read(self, x: jax.Array, dtype: np.dtype) -> None:
    """Notes a narrowing read of ``x`` (forward pass)."""
    entry = self._reads.setdefault(id(x), (x, []))
    if entry[0] is x:
      entry[1].append(dtype)

  def read_once(self, x: Any) -> np.dtype | None:
    """The dtype ``x`` was read in, if it was read exactly once through :func:`read_as`."""
    entry = self._reads.get(id(x))
    return entry[1][0] if entry is not None and entry[0] is x and len(entry[1]) == 1 else None

  def narrow(self, grad: Any) -> jax.Array | None:
    """The half-precision value whose widening ``grad`` is (the same traced value), or None."""
    hit = self._found.get(id(grad))
    return hit[1] if hit is not None and hit[0] is grad else None


_active = threading.local()


@contextlib.contextmanager
def narrow_cotangents() -> Iterator[NarrowCotangents]:
  """While active, :func:`read_as` narrowings record their cotangents in the yielded
  :class:`NarrowCotangents` (in this thread).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxamp.casting import narrow_cotangents, read_as
    >>> loss = lambda w, x: jnp.sum((x @ read_as(w, jnp.bfloat16)).astype(jnp.float32))
    >>> @jax.jit
    ... def kept(w, x):
    ...   with narrow_cotangents() as found:
    ...     g = jax.grad(loss)(w, x)
    ...   return g, found.narrow(g)
    >>> g, narrow = kept(jnp.ones((2, 2)), jnp.ones((1, 2), jnp.bfloat16))
    >>> g.dtype, narrow.dtype, bool((narrow.astype(g.dtype) == g).all())
    (dtype('float32'), dtype(bfloat16), True)
  """
  previous = getattr(_active, "found", None)
  _active.found = found = NarrowCotangents()
  try:
    yield found
  finally:
    _active.found = previous


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _recorded_narrowing(x: jax.Array, dtypes: tuple[np.dtype, np.dtype]) -> jax.Array:
  return jax.lax.convert_element_type(x, dtypes[1])


def _narrowing_fwd(x: jax.Array, dtypes: tuple[np.dtype, np.dtype]) -> tuple[jax.Array, None]:
  return jax.lax.convert_element_type(x, dtypes[1]), None


def _narrowing_bwd(dtypes: tuple[np.dtype, np.dtype], _: None, ct: jax.Array
                   ) -> tuple[jax.Array]:
  wide = jax.lax.convert_element_type(ct, dtypes[0])  # what the plain cast's transpose is
  found = getattr(_active, "found", None)
  if found is not None:
    found.record(wide, ct)
  return (wide,)


_recorded_narrowing.defvjp(_narrowing_fwd, _narrowing_bwd)


def read_as(x: Any, dtype: np.dtype) -> Any:
  """A parameter read in ``dtype``: :func:`cast_floating` of one leaf, which inside
  :func:`narrow_cotangents` also records the cotangent of a narrowing cast of a traced
  array (the same values and gradients either way).

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.casting import read_as
    >>> read_as(jnp.ones(2), jnp.bfloat16).dtype
    dtype(bfloat16)
  """
  if (getattr(_active, "found", None) is None or not isinstance(x, jax.core.Tracer)
      or not is_floating_array(x)):
    return cast_floating(x, dtype)
  dtype = np.dtype(dtype)
  if not _floating_dtype(dtype) or dtype.itemsize >= x.dtype.itemsize:
    return cast_floating(x, dtype)
  _active.found.read(x, dtype)
  return _recorded_narrowing(x, (np.dtype(x.dtype), dtype))


def recording() -> NarrowCotangents | None:
  """The :class:`NarrowCotangents` recording in this thread, or None."""
  return getattr(_active, "found", None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def narrow_at_boundary(x: jax.Array, narrow: np.dtype) -> jax.Array:
  """``x`` itself; its cotangent, known to be a ``narrow`` value widened (the cotangent
  of one narrowing read inside a ``jax.checkpoint``, which :func:`read_as` cannot see
  from outside), is recorded in the active :class:`NarrowCotangents` with that value."""
  del narrow
  return x


def _boundary_fwd(x: jax.Array, narrow: np.dtype) -> tuple[jax.Array, None]:
  del narrow
  return x, None


def _boundary_bwd(narrow: np.dtype, _: None, ct: jax.Array) -> tuple[jax.Array]:
  found = recording()
  if found is not None:
    # Exact: ct is a narrow value widened. XLA folds the round trip.
    found.record(ct, jax.lax.convert_element_type(ct, narrow))
  return (ct,)


narrow_at_boundary.defvjp(_boundary_fwd, _boundary_bwd)
