"""The numerics monitor: how close each module's values come to the edges of its format.

``make_train_step(..., numerics=jaxamp.Numerics(every=N))`` records, on every N-th step
(a ``lax.cond`` on the step counter between the step that records and the plain one:
the other steps run the program without the monitor), per module
path, for its output activations, the cotangent arriving at its output and the
gradients of its parameters (and, for the layers FP8 can run, the input their matmul
quantizes): the largest finite magnitude (``amax``), the fraction of
nonzero finite values below the compute dtype's smallest normal (``underflow``: they
flush or lose bits), the fraction at or above its largest finite value (``overflow``),
the number of non-finite values, and the same fractions against float16, bfloat16 and
the FP8 formats after per-tensor scaling, and after the scaling of each policy named in
``Numerics(whatif=...)`` (the what-if :func:`jaxamp.suggest_policy` reads). This module holds what the module core and the step call: the scope a step
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
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from jaxamp import _warn_once, scaled
from jaxamp._stack import Stack
from jaxamp.policy import get_policy

__all__ = ["Numerics", "STATS", "KINDS", "whatif_policies", "stats", "size", "tensor_stats",
           "combine", "summarize", "observe", "scope", "suspended", "current", "name_modules",
           "name_of", "warn_unobserved"]

KINDS = ("activation", "cotangent", "grad", "input")

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
    whatif: policy names of block- or row-scaled FP8 recipes (``'mixed_fp8_rowwise'``,
      ``'mixed_fp8_block'``, ``'mixed_mxfp8'``: those whose format defines
      :attr:`jaxamp.scaled.ScaledFormat.whatif`) each record is also measured against:
      ``underflow_<name>`` and ``overflow_<name>`` (saturated: beyond the largest finite
      value by more than half its spacing there), each tensor scaled as the recipe
      scales that matmul operand (an input or activation as a layer's input, a cotangent
      as the output gradient), along its last axis (forward and input-gradient products)
      and along the rows (the weight-gradient product): a value counts if either loses
      it. Per-tensor FP8
      (``'mixed_fp8'``) needs none: ``underflow_e4m3`` / ``underflow_e5m2`` are its.

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
  whatif: tuple[str, ...] = ()

  def __post_init__(self):
    every = self.every
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
      raise ValueError(f"Numerics.every must be a positive int (record every that many "
                       f"steps), got {every!r}.")
    object.__setattr__(self, "every", int(every))
    names = (self.whatif,) if isinstance(self.whatif, str) else tuple(self.whatif)
    object.__setattr__(self, "whatif", names)
    valid = whatif_policies()
    for name in names:
      if name not in valid:
        raise ValueError(f"Numerics.whatif takes the policy names of scaled formats with a "
                         f"what-if: {valid}; got {name!r} (per-tensor FP8, 'mixed_fp8', is "
                         "always measured: the underflow_e4m3 / underflow_e5m2 figures).")

  @property
  def formats(self) -> tuple[tuple[str, Any, Any], ...]:
    """``(name, format, recipe)`` of each :attr:`whatif` policy."""
    out = []
    for name in self.whatif:
      recipe = get_policy(name).fp8
      out.append((name, scaled.format_of(recipe), recipe))
    return tuple(out)


def whatif_policies() -> tuple[str, ...]:
  """The policy names :attr:`Numerics.whatif` takes: the registered scaled formats'
  policies whose format defines :attr:`jaxamp.scaled.ScaledFormat.whatif`, sorted.

  Example:
    >>> from jaxamp import numerics
    >>> numerics.whatif_policies()
    ('mixed_fp8_block', 'mixed_fp8_rowwise', 'mixed_mxfp8')
  """
  return tuple(sorted(n for n in scaled.policy_names() if getattr(
      scaled.format_of(scaled.policy_recipe(n)), "whatif", None) is not None))


def _finfo(name: str) -> Any:
  return jnp.finfo(jnp.dtype(name))


def tensor_stats(x: jax.Array, dtype: Any, axes: Any = None, whatif: Any = (),
                 role: str = "input") -> jax.Array:
  """The raw record of ``x`` (float32, :func:`size` entries) against ``dtype``'s range:
  amax of the finite values, the counts of values, of nonzero finite ones, of
  non-finite ones, of nonzero finite ones below ``dtype``'s smallest normal and of
  values at or above its largest finite one (infinities included), and the same
  against float16 and bfloat16, for E4M3 / E5M2 the nonzero values under the
  smallest normal once ``x`` is scaled so that its amax is the format's largest, and
  the nonzero values under float16's smallest normal even times :data:`LOSS_SCALE`.
  ``axes``: inside ``shard_map``, the mesh axes ``x`` is split over: the FP8 scale is
  then the global amax's, as the FP8 formats' is. ``whatif``: ``(name, format, recipe)``
  triples (:attr:`Numerics.formats`), each adding the count of nonzero finite values
  below its FP8 dtype's smallest normal and of those rounding past its largest once
  ``x`` (``[rows, last axis]``) is scaled as the format's ``whatif`` scales an operand
  in ``role`` (``'input'`` or ``'grad'``), in the forward or input-gradient product
  (along the last axis) or in the weight-gradient product (along the rows): lost in
  either."""
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
  rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
  for _, fmt, recipe in whatif:
    lost = saturated = jnp.zeros(rows.shape, bool)
    for layout, given in ((role, rows), (role + "_wgrad", rows.T)):
      got = fmt.whatif(given, layout, recipe)
      if got is None:
        continue
      v, fp8 = jnp.abs(got[0]), jnp.finfo(got[1])
      v = v.T if layout.endswith("_wgrad") else v
      lost, saturated = lost | (v < float(fp8.tiny)), saturated | (v > _rounds_above(fp8))
    out += [count(nonzero & lost.reshape(a.shape)), count(nonzero & saturated.reshape(a.shape))]
  return jnp.stack(out)


def _rounds_above(f: Any) -> float:
  """The magnitude above which a value rounds past ``f``'s largest finite one (half its
  spacing there above it): it saturates."""
  top = float(f.max)
  return top + 2.0 ** math.floor(math.log2(top)) * float(f.eps) / 2


def size(whatif: Any = ()) -> int:
  """The length of a raw record with ``whatif``'s columns."""
  return SIZE + 2 * len(whatif)


def combine(a: jax.Array, b: jax.Array) -> jax.Array:
  """Two raw records as one (amax: the larger; counts: summed)."""
  return jnp.concatenate([jnp.maximum(a[:1], b[:1]), a[1:] + b[1:]])


def combine_axis(stacked: jax.Array, axis: int = 0) -> jax.Array:
  """Raw records stacked along ``axis`` as one."""
  first, rest = stacked[..., :1], stacked[..., 1:]
  return jnp.concatenate([jnp.max(first, axis=axis), jnp.sum(rest, axis=axis)], axis=-1)


def reduce_over(raw: jax.Array, axes: Any) -> jax.Array:
  """Inside ``shard_map``: the raw records of every device along ``axes`` as one."""
  return jnp.concatenate([jax.lax.pmax(raw[..., :1], axes), jax.lax.psum(raw[..., 1:], axes)],
                         axis=-1)


def stats(whatif: Any = ()) -> tuple[str, ...]:
  """The figures of a record: :data:`STATS`, then ``underflow_<name>`` and
  ``overflow_<name>`` per what-if policy."""
  return STATS + tuple(f"{k}_{name}" for name, *_ in whatif for k in ("underflow", "overflow"))


def summarize(raw: jax.Array, whatif: Any = ()) -> dict[str, jax.Array]:
  """A raw record as the figures ``metrics['numerics']`` reports (:func:`stats`):
  underflow fractions of the nonzero finite values, overflow fractions of all values
  (of the nonzero finite ones for a what-if policy)."""
  r = dict(zip(_RAW + tuple(f"{k}_{name}" for name, *_ in whatif for k in ("u", "o")), raw))
  frac = lambda n, d: jnp.where(d > 0, n / jnp.maximum(d, 1), jnp.where(jnp.isnan(d), d, 0.))
  out = {"amax": r["amax"], "count": r["count"], "nonfinite": r["nonfinite"],
         "underflow": frac(r["under"], r["nonzero"]), "overflow": frac(r["over"], r["count"])}
  for suffix, _, scaled in _FORMATS:
    out[f"underflow_{suffix}"] = frac(r[f"under_{suffix}"], r["nonzero"])
    if not scaled:
      out[f"overflow_{suffix}"] = frac(r[f"over_{suffix}"], r["count"])
  out["underflow_float16_ls"] = frac(r["under_float16_ls"], r["nonzero"])
  for name, *_ in whatif:
    out[f"underflow_{name}"] = frac(r[f"u_{name}"], r["nonzero"])
    out[f"overflow_{name}"] = frac(r[f"o_{name}"], r["nonzero"])
  return {k: out[k] for k in stats(whatif)}


# --- the scope a step opens ----------------------------------------------------------------


class _Scope:
  """One differentiated forward pass being recorded.

  ``probes``:
  ``{'activation' | 'cotangent': {(path, call, leaf): zeros}, 'input': {(path, call):
  zeros}}``, the arrays whose cotangents carry each output's (and FP8-able layer's
  input's) records; None for a discovery pass, which only lists the keys (``keys``,
  ``input_keys``). ``whatif``: :attr:`Numerics.formats`.
  """

  def __init__(self, probes: Mapping[Any, Any] | None, axes: Any = None, whatif: Any = ()):
    self.probes = probes
    self.axes = axes
    self.whatif = tuple(whatif)
    self.trace = jax_core.get_opaque_trace_state(convention="jaxamp")
    self.names: dict[int, str] = {}
    self.calls: dict[str, int] = {}
    self.keys: list[tuple[str, int, int]] = []
    self.input_keys: list[tuple[str, int]] = []
    self.dtypes: dict[str, np.dtype] = {}
    self.unobserved: set[str] = set()  # paths run inside a transform of their own


_scopes = Stack()


def current() -> _Scope | None:
  """The innermost recording scope, or None (the hot path: nothing is recorded)."""
  return _scopes.top()


@contextlib.contextmanager
def scope(probes: Mapping[Any, Any] | None, axes: Any = None,
          whatif: Any = ()) -> Iterator[_Scope]:
  """Records what the module calls in this block observe (see :class:`_Scope`);
  ``axes``: inside ``shard_map``, the batch axes."""
  with _scopes.pushed(_Scope(probes, axes, whatif)) as s:
    yield s


def suspended() -> contextlib.AbstractContextManager[None]:
  """Nothing recorded in this block: the abstract passes a module call makes (plans,
  censuses, on copies of the modules) inside a recording step."""
  return _scopes.pushed(None)


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
            keep: Callable[[Any], bool] | None = None, inputs: Any = None,
            layer: type | None = None) -> Any:
  """What a module call does in a recording scope: taps each floating output, so that
  the forward pass records its statistics against ``compute`` and the backward pass
  those of the cotangent arriving there (both handed out as cotangents of the scope's
  probes); given ``inputs`` (a layer FP8 can run), its first tapped output also carries
  the record of their floating leaves. Returns ``out`` (tapped). Outside a scope, for a
  module with no known path, or inside a transform of its own other than ``jax.vmap``
  (``lax.scan``, a checkpoint) it returns ``out`` as it is, the last two noted in the
  scope's ``unobserved`` (by path, or by ``layer``'s class name) for
  :func:`warn_unobserved`."""
  s = current()
  if s is None:
    return out
  if callable(path):
    path = path()
  if path is None:
    if layer is not None:  # an NNX module copied inside a transform (nnx.scan, nnx.remat)
      s.unobserved.add(f"a {layer.__name__} (no path: made inside a transform)")
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
  ins = [] if inputs is None else [x for x in jax.tree.leaves(inputs, is_leaf=keep)
                                    if _floating(x)]
  if s.probes is None:  # discovery: only the keys
    s.keys.extend((path, call, i) for i in where)
    s.input_keys.extend([(path, call)] if ins else [])
    return out
  carried = None  # (the input probe, the inputs' record): handed out by the first tap
  if ins and (path, call) in s.probes["input"]:
    carried = (s.probes["input"][(path, call)], functools.reduce(
        combine, [_stats(jax.lax.stop_gradient(x), dtype, s.axes, s.whatif, "input")
                  for x in ins]))
  for i in where:
    key = (path, call, i)
    if key in s.probes["activation"]:
      leaves[i] = _tap(leaves[i], s.probes["activation"][key], s.probes["cotangent"][key],
                       carried, dtype, s.axes, s.whatif)
      carried = None
  return jax.tree.unflatten(treedef, leaves)


def warn_unobserved(s: _Scope) -> None:
  """Warns once of the modules a recording pass could not observe (run inside a loop or
  checkpoint of their own)."""
  if not s.unobserved:
    return
  names = tuple(sorted(s.unobserved))
  shown = ", ".join(map(repr, names[:6])) + (f" and {len(names) - 6} more" if len(names) > 6
                                             else "")
  _warn_once.warn_once(
      ("numerics.unobserved", names),
      f"jaxamp: the numerics monitor does not observe {shown}: modules run inside a loop or "
      "checkpoint of their own (nnx.scan, nn.scan, nnx.remat / jax.checkpoint around a "
      "submodule) get no activation, cotangent or input record, and their parameters' "
      "gradients are recorded under the enclosing module's path. Under jax.vmap they are "
      "observed.", stacklevel=3)


@functools.cache
def _batch_stats(axes: Any, whatif: Any, role: str) -> Callable[..., jax.Array]:
  """:func:`tensor_stats` of ``x`` against the dtype of ``dtype_tag``; under
  ``jax.vmap``, of the whole batch at once."""

  @jax.custom_batching.custom_vmap
  def stats(x, dtype_tag):
    return tensor_stats(x, dtype_tag.dtype, axes, whatif, role)

  @stats.def_vmap
  def _(axis_size, in_batched, x, dtype_tag):
    del axis_size, in_batched  # x holds the whole batch: one record of it
    return stats(x, dtype_tag), False

  return stats


def _stats(x: jax.Array, dtype: Any, axes: Any, whatif: Any, role: str) -> jax.Array:
  return _batch_stats(axes, whatif, role)(x, jnp.zeros((), dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tap(x: jax.Array, act: jax.Array, cot: jax.Array, carried: Any, dtype: Any, axes: Any,
         whatif: Any) -> jax.Array:
  """``x``; the backward pass hands ``x``'s record out as ``act``'s cotangent, the
  record of ``x``'s cotangent as ``cot``'s, and ``carried``, ``(probe, record)`` or None,
  its record as ``probe``'s."""
  del act, cot, carried, dtype, axes, whatif
  return x


def _tap_fwd(x, act, cot, carried, dtype, axes, whatif):
  del act, cot
  return x, (_stats(x, dtype, axes, whatif, "input"), carried)


def _tap_bwd(dtype, axes, whatif, residuals, g):
  seen, carried = residuals
  handed = None if carried is None else (carried[1], jnp.zeros_like(carried[1]))
  return g, seen, _stats(g, dtype, axes, whatif, "grad"), handed


_tap.defvjp(_tap_fwd, _tap_bwd)


def by_path(records: Mapping[tuple[str, int, int], jax.Array]) -> dict[str, jax.Array]:
  """Raw records keyed ``(path, call, ...)`` combined per path."""
  out: dict[str, jax.Array] = {}
  for (path, *_), raw in records.items():
    out[path] = raw if path not in out else combine(out[path], raw)
  return out
