"""The numerics monitor: how close each module's values come to the edges of its format.

``make_train_step(..., numerics=jaxamp.Numerics(every=N))`` records, on every N-th step
(a ``lax.cond`` on the step counter between the step that records and the plain one:
the other steps run the program without the monitor), per module
path, for its output activations, the cotangent arriving at its output and the
gradients of its parameters: the largest finite magnitude (``amax``), the fraction of
nonzero finite values below the compute dtype's smallest normal (``underflow``: they
flush or lose bits), the fraction at or above its largest finite value (``overflow``),
the number of non-finite values, and the same fractions against float16, bfloat16 and
the FP8 formats after per-tensor scaling (the what-if :func:`jaxamp.suggest_policy`
reads). This module holds what the module core and the step call: the scope a step
opens while its loss is differentiated, what a module call records
(:func:`observe`), the statistics of one tensor (:func:`tensor_stats`) and how records
combine (:func:`combine`, :func:`summarize`).

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from jaxamp import numerics
  >>> s = numerics.summarize(numerics.tensor_stats(jnp.array([1e-6, 1.0, 7e4, 0.0]),
  ...                                               np.float16))
  >>> float(s['amax']), float(s['underflow']), float(s['overflow'])
  (70000.0, 0.3333333432674408, 0.25)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

__all__ = ["Numerics", "STATS", "KINDS", "tensor_stats", "combine", "summarize",
           "observe", "scope", "current", "name_modules", "name_of", "nan_stats"]

KINDS = ("activation", "cotangent", "grad")

# The formats a record is measured against besides the compute dtype: (column suffix,
# dtype name, scaled). A scaled one is FP8: each tensor scaled so its amax meets the
# format's largest value (current scaling), so only underflow is possible.
_FORMATS = (("float16", "float16", False), ("bfloat16", "bfloat16", False),
            ("e4m3", "float8_e4m3fn", True), ("e5m2", "float8_e5m2", True))

# The raw record: a float32 vector of counts (and amax), combined by max / sum, so that
# micro-batches and devices reduce to the figures of the whole batch.
_RAW = ("amax", "count", "nonzero", "nonfinite", "under", "over",
        "under_float16", "over_float16", "under_bfloat16", "over_bfloat16",
        "under_e4m3", "under_e5m2", "under_float16_ls")
SIZE = len(_RAW)

# What metrics['numerics'][path][kind] holds.
STATS = ("amax", "count", "nonfinite", "underflow", "overflow",
         "underflow_float16", "overflow_float16", "underflow_bfloat16", "overflow_bfloat16",
         "underflow_e4m3", "underflow_e5m2", "underflow_float16_ls")

# The loss scale the ``underflow_float16_ls`` column assumes: a value below float16's
# smallest normal even times this (dynamic loss scaling's usual level) underflows in a
# float16 run of a model logged without loss scaling.
LOSS_SCALE = 2.0 ** 15


@dataclasses.dataclass(frozen=True)
class Numerics:
  """What the numerics monitor records, and how often.

  Attributes:
    every: record on the steps whose counter (``TrainState.step``) is a multiple of
      ``every`` (steps 0, N, 2N, ...); the others report NaN and
      ``metrics['numerics_recorded']`` False.

  Example:
    >>> import jaxamp
    >>> jaxamp.Numerics(every=100).every
    100
    >>> jaxamp.Numerics(every=0)
    Traceback (most recent call last):
    ...
    ValueError: Numerics.every must be a positive int (record every that many steps), got 0.
  """

  every: int = 100

  def __post_init__(self):
    every = self.every
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
      raise ValueError(f"Numerics.every must be a positive int (record every that many "
                       f"steps), got {every!r}.")
    object.__setattr__(self, "every", int(every))


def _finfo(name: str) -> Any:
  return jnp.finfo(jnp.dtype(name))


def tensor_stats(x: jax.Array, dtype: Any, axes: Any = None) -> jax.Array:
  """The raw record of ``x`` (float32, ``SIZE`` entries) against ``dtype``'s range:
  amax of the finite values, the counts of values, of nonzero finite ones, of
  non-finite ones, of nonzero finite ones below ``dtype``'s smallest normal and of
  values at or above its largest finite one (infinities included), and the same
  against float16 and bfloat16, for E4M3 / E5M2 the nonzero values under the
  smallest normal once ``x`` is scaled so that its amax is the format's largest, and
  the nonzero values under float16's smallest normal even times :data:`LOSS_SCALE`.
  ``axes``: inside ``shard_map``, the mesh axes ``x`` is split over: the FP8 scale is
  then the global amax's, as the FP8 formats' is."""
  wide = jnp.promote_types(x.dtype, jnp.float32)
  a = jnp.abs(x.astype(wide))
  finite = jnp.isfinite(a)
  nonzero = finite & (a > 0)
  amax = jnp.max(jnp.where(finite, a, 0), initial=0)
  scale_amax = amax if axes is None else jax.lax.pmax(amax, axes)

  def count(mask):
    return jnp.sum(mask, dtype=jnp.float32)

  def under(tiny):
    return count(nonzero & (a < tiny))

  def over(big):
    return count(a >= big)

  info = jnp.finfo(dtype)
  out = [amax.astype(jnp.float32), jnp.float32(a.size), count(nonzero), count(~finite),
         under(info.tiny), over(info.max)]
  for _, name, scaled in _FORMATS:
    f = _finfo(name)
    if scaled:  # |x| * max / amax < tiny
      out.append(under(scale_amax * (float(f.tiny) / float(f.max))))
    else:
      out += [under(f.tiny), over(f.max)]
  out.append(under(float(_finfo("float16").tiny) / LOSS_SCALE))
  return jnp.stack(out)


def nan_stats() -> jax.Array:
  """A raw record of a step that does not record."""
  return jnp.full((SIZE,), jnp.nan, jnp.float32)


def combine(a: jax.Array, b: jax.Array) -> jax.Array:
  """Two raw records as one (amax: the larger; counts: summed)."""
  return jnp.concatenate([jnp.maximum(a[:1], b[:1]), a[1:] + b[1:]])


def combine_axis(stacked: jax.Array, axis: int = 0) -> jax.Array:
  """Raw records stacked along ``axis`` as one."""
  first = jnp.take(stacked, jnp.array([0]), axis=-1)
  rest = jnp.take(stacked, jnp.arange(1, SIZE), axis=-1)
  return jnp.concatenate([jnp.max(first, axis=axis), jnp.sum(rest, axis=axis)], axis=-1)


def reduce_over(raw: jax.Array, axes: Any) -> jax.Array:
  """Inside ``shard_map``: the raw records of every device along ``axes`` as one."""
  return jnp.concatenate([jax.lax.pmax(raw[..., :1], axes), jax.lax.psum(raw[..., 1:], axes)],
                         axis=-1)


def summarize(raw: jax.Array) -> dict[str, jax.Array]:
  """A raw record as the figures ``metrics['numerics']`` reports (:data:`STATS`):
  underflow fractions of the nonzero finite values, overflow fractions of all values."""
  r = dict(zip(_RAW, raw))
  frac = lambda n, d: jnp.where(d > 0, n / jnp.maximum(d, 1), jnp.where(jnp.isnan(d), d, 0.))
  out = {"amax": r["amax"], "count": r["count"], "nonfinite": r["nonfinite"],
         "underflow": frac(r["under"], r["nonzero"]), "overflow": frac(r["over"], r["count"])}
  for suffix, _, scaled in _FORMATS:
    out[f"underflow_{suffix}"] = frac(r[f"under_{suffix}"], r["nonzero"])
    if not scaled:
      out[f"overflow_{suffix}"] = frac(r[f"over_{suffix}"], r["count"])
  out["underflow_float16_ls"] = frac(r["under_float16_ls"], r["nonzero"])
  return {k: out[k] for k in STATS}


# --- the scope a step opens ----------------------------------------------------------------


class _Scope:
  """One differentiated forward pass being recorded.

  ``probes``:
  ``{'activation' | 'cotangent': {(path, call, leaf): zeros}}``, the arrays whose
  cotangents carry each output's records; None for a discovery pass, which only lists
  the keys (``keys``).
  """

  def __init__(self, probes: Mapping[Any, Any] | None, axes: Any = None):
    self.probes = probes
    self.axes = axes
    self.trace = jax_core.get_opaque_trace_state(convention="jaxamp")
    self.names: dict[int, str] = {}
    self.calls: dict[str, int] = {}
    self.keys: list[tuple[str, int, int]] = []
    self.dtypes: dict[str, np.dtype] = {}
    self.unobserved: set[str] = set()  # paths run inside a transform of their own


class _Local(threading.local):
  def __init__(self):
    super().__init__()
    self.scopes: list[_Scope] = []


_local = _Local()


def current() -> _Scope | None:
  """The innermost recording scope, or None (the hot path: nothing is recorded)."""
  return _local.scopes[-1] if _local.scopes else None


@contextlib.contextmanager
def scope(probes: Mapping[Any, Any] | None, axes: Any = None) -> Iterator[_Scope]:
  """Records what the module calls in this block observe (see :class:`_Scope`);
  ``axes``: inside ``shard_map``, the batch axes."""
  s = _Scope(probes, axes)
  _local.scopes.append(s)
  try:
    yield s
  finally:
    _local.scopes.pop()


def name_modules(named: Mapping[int, str]) -> None:
  """Tells the running scope the path of each module id (NNX: paths are the graph's)."""
  s = current()
  if s is not None:
    s.names.update(named)


def name_of(module: Any) -> str | None:
  """``module``'s path as :func:`name_modules` told it, or None."""
  s = current()
  return None if s is None else s.names.get(id(module))


def _floating(x: Any) -> bool:
  return (isinstance(x, (jax.Array, jax.core.Tracer)) and hasattr(x, "dtype")
          and jnp.issubdtype(x.dtype, jnp.floating))


def _inside_own_trace(s: _Scope, leaves: list[Any]) -> bool:
  """Whether the call runs in the scope's trace, or under a ``jax.vmap`` inside it
  (whose batch the statistics span whole); not inside a loop or a checkpoint of its
  own, whose values cannot leave it once per run."""
  if jax_core.get_opaque_trace_state(convention="jaxamp") == s.trace:
    return True
  return all(type(x).__name__ == "BatchTracer" for x in leaves)  # jax keeps it private


def observe(path: str | Callable[[], str | None] | None, compute: Any, out: Any,
            keep: Callable[[Any], bool] | None = None) -> Any:
  """What a module call does in a recording scope: taps each floating output, so that
  the forward pass records its statistics against ``compute`` and the backward pass
  those of the cotangent arriving there (both handed out as cotangents of the scope's
  probes). Returns ``out`` (tapped). Outside a scope, for a module with no known path,
  or inside a transform of its own other than ``jax.vmap`` (``lax.scan``, a checkpoint)
  it returns ``out`` as it is."""
  s = current()
  if s is None:
    return out
  if callable(path):
    path = path()
  if path is None:
    return out
  leaves, treedef = jax.tree.flatten(out, is_leaf=keep)
  where = [i for i, x in enumerate(leaves) if _floating(x)]
  if not where:
    return out
  if not _inside_own_trace(s, [leaves[i] for i in where]):
    s.unobserved.add(path)
    return out
  call = s.calls.get(path, 0)
  s.calls[path] = call + 1
  dtype = np.dtype(compute)
  s.dtypes[path] = dtype
  if s.probes is None:  # discovery: only the keys
    s.keys.extend((path, call, i) for i in where)
    return out
  for i in where:
    key = (path, call, i)
    if key in s.probes["activation"]:
      leaves[i] = _tap(leaves[i], s.probes["activation"][key], s.probes["cotangent"][key],
                       dtype, s.axes)
  return jax.tree.unflatten(treedef, leaves)


@functools.cache
def _batch_stats(axes: Any) -> Callable[..., jax.Array]:
  """:func:`tensor_stats` of ``x`` against the dtype of ``dtype_tag``; under
  ``jax.vmap``, of the whole batch at once."""

  @jax.custom_batching.custom_vmap
  def stats(x, dtype_tag):
    return tensor_stats(x, dtype_tag.dtype, axes)

  @stats.def_vmap
  def _(axis_size, in_batched, x, dtype_tag):
    del axis_size, in_batched  # x holds the whole batch: one record of it
    return stats(x, dtype_tag), False

  return stats


def _stats(x: jax.Array, dtype: Any, axes: Any) -> jax.Array:
  return _batch_stats(axes)(x, jnp.zeros((), dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tap(x: jax.Array, act: jax.Array, cot: jax.Array, dtype: Any, axes: Any) -> jax.Array:
  """``x``; the backward pass hands ``x``'s record out as ``act``'s cotangent, the
  record of ``x``'s cotangent as ``cot``'s."""
  del act, cot, dtype, axes
  return x


def _tap_fwd(x, act, cot, dtype, axes):
  del act, cot
  return x, _stats(x, dtype, axes)


def _tap_bwd(dtype, axes, seen, g):
  return g, seen, _stats(g, dtype, axes)


_tap.defvjp(_tap_fwd, _tap_bwd)


def by_path(records: Mapping[tuple[str, int, int], jax.Array]) -> dict[str, jax.Array]:
  """Raw records keyed ``(path, call, leaf)`` combined per path."""
  out: dict[str, jax.Array] = {}
  for (path, _, _), raw in records.items():
    out[path] = raw if path not in out else combine(out[path], raw)
  return out
