"""The grouped options of ``make_train_step``: sharding, memory, debugging.

Each is a frozen dataclass that checks its own fields when made, so a bad value is
refused where it is written, naming what would be valid::

  train = jaxamp.make_train_step(
      loss_fn, optax.adamw(3e-4), policy='mixed_bfloat16',
      sharding=jaxamp.ShardingConfig(mesh=mesh, param_sharding=jaxamp.fsdp('fsdp')),
      memory=jaxamp.MemoryConfig(recompute_norms=True),
      debug=jaxamp.DebugConfig(nonfinite_grads=True))

``make_train_step`` still takes each of these fields as a keyword of its own for one
release, with a ``DeprecationWarning`` naming the config that owns it (:data:`DEPRECATED`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxamp import sharding as sharding_lib
from jaxamp.casting import at_least_float32, is_floating_dtype, real_or_complex
from jaxamp.numerics import Numerics

STATE_REDUCTIONS = ("mean", "sum", "max", "min", "same")
"""How a model-state leaf updated on each device is combined under a mesh: averaged
(BatchNorm statistics), the devices' changes summed (a count of examples, a running
sum), the maximum or minimum (a running max), or any device's (all agree: a count of
calls)."""

__all__ = ["DEPRECATED", "DebugConfig", "MASTER_WEIGHTS", "MemoryConfig", "STATE_REDUCTIONS",
           "ShardingConfig"]


def _flag(owner: str, name: str, value: Any) -> bool:
  """``value`` as a bool, refused (naming ``owner.name``) unless it is one."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{owner}.{name} must be True or False, got {value!r}.")
  return bool(value)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """How a train step spreads over devices: the mesh, the batch split, parameter sharding.

  Attributes:
    mesh: a ``jax.sharding.Mesh`` for data parallelism (and sharded params), or None
      (one device). Every batch leaf is split over ``batch_axis`` along its first
      dimension (a 0-d leaf is refused).
    batch_axis: the mesh axis the batch is split on, or a tuple of axes (split over
      their product, e.g. ``('data', 'fsdp')``).
    param_sharding: shard the params, master weights and optimizer state over ``mesh``:
      :func:`jaxamp.fsdp` (each large param split over an axis), :func:`jaxamp.annotated`
      (the model's NNX/Linen partitioning annotations, with logical axis rules), or a
      pytree of ``PartitionSpec`` like the params. Each step gathers the params in their
      compute dtype and reduce-scatters gradients in ``grad_reduce_dtype``; see
      :mod:`jaxamp.sharding`. None (default): params replicated.
    grad_reduce_dtype: dtype of the cross-device gradient mean (reduce-scatter with
      ``param_sharding``); default (None): float32, or a float64 gradient's float64.
    model_state_reduction: with a mesh, how model state a step updates on each device is
      combined, as ``{path pattern: kind}`` (patterns as ``fnmatch``, matched against
      ``'/'``-joined state paths such as ``'counter/count'``; Linen paths start with the
      collection). Kinds (:data:`STATE_REDUCTIONS`): ``'mean'`` (a statistic averaged
      over the batch), ``'sum'`` (the devices' changes added: a count of examples),
      ``'max'``, ``'min'`` (a running maximum or minimum), ``'same'`` (each device makes
      the same change: a count of calls). BatchNorm statistics are averaged and RNG
      streams kept without it; other state a step changes under a mesh is refused until
      declared.
    fp8_gather: with ``param_sharding`` and a per-tensor FP8 policy (``'mixed_fp8'``,
      ``'mixed_fp8_current'``, bfloat16 compute), gather each FP8 module's kernel as
      E4M3 values and one float32 scale (half the bytes of bfloat16), quantized before
      the gather with the scale the matmul uses (current scaling: the whole kernel's
      amax's, one scalar all-reduce; delayed: the module's state's), as torchao's
      float8 all-gather: the FP8 matmul gets bit-identical E4M3 values, and delayed
      scaling records the same amaxes (:mod:`jaxamp.fp8_gather`). Block scaling (``'mixed_fp8_block'``, square weight
      blocks) gathers E4M3 values and one float32 amax per weight block, for the 2-D
      kernels of modules reading them as one matrix (not an Einsum's nor a
      convolution's) whose split dimensions' local sizes the block divides. Rowwise and
      MXFP8 scaling quantize the kernel along ``K`` in the forward and along ``N`` in
      the input gradient, each from the high-precision kernel: gathered quantized in
      one layout, it would reach the other product rounded twice, so they gather the
      compute dtype. True (default) where a
      format can do it exactly; False: every kernel gathered in its compute dtype (also
      for a ``loss_fn`` that reads FP8 kernels itself under ``gather='model'``: it would
      read them E4M3-rounded).

  Example:
    >>> import jax, jaxamp
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> jaxamp.ShardingConfig(mesh=mesh, grad_reduce_dtype='bfloat16').grad_reduce_dtype
    dtype(bfloat16)
    >>> jaxamp.ShardingConfig(mesh=mesh, batch_axis='batch')
    Traceback (most recent call last):
    ...
    ValueError: ShardingConfig.batch_axis 'batch' is not an axis of the mesh; its axes are ('data',).
  """

  mesh: Any = None
  batch_axis: Any = "data"
  param_sharding: Any = None
  grad_reduce_dtype: Any = None
  model_state_reduction: Mapping[str, str] | None = None
  fp8_gather: bool = True

  def __post_init__(self):
    if not isinstance(self.fp8_gather, bool):
      raise ValueError(f"ShardingConfig.fp8_gather must be True (gather FP8 kernels as "
                       f"E4M3 where exact, the default) or False (in the compute dtype), "
                       f"got {self.fp8_gather!r}.")
    if self.mesh is not None:
      if not hasattr(self.mesh, "axis_names"):
        raise ValueError(f"ShardingConfig.mesh must be a jax.sharding.Mesh (e.g. "
                         f"jax.make_mesh((8,), ('data',))) or None, got {self.mesh!r}.")
      for name in self.batch_axes:
        if name not in self.mesh.axis_names:
          raise ValueError(f"ShardingConfig.batch_axis {name!r} is not an axis of the mesh; "
                           f"its axes are {tuple(self.mesh.axis_names)}.")
    if self.param_sharding is not None and self.mesh is None:
      raise ValueError("ShardingConfig.param_sharding needs a mesh: pass "
                       "mesh=jax.make_mesh(...) with the axes the parameters are sharded "
                       "over (e.g. jaxamp.fsdp('fsdp') needs an axis named 'fsdp').")
    for pattern, kind in (self.model_state_reduction or {}).items():
      if kind not in STATE_REDUCTIONS or not isinstance(pattern, str):
        raise ValueError(
            f"ShardingConfig.model_state_reduction maps a model-state path pattern (a str, "
            f"'*' matches within a path) to one of {', '.join(map(repr, STATE_REDUCTIONS))}; "
            f"got {pattern!r}: {kind!r}.")
    dtype = self.grad_reduce_dtype
    if dtype is not None:
      if not is_floating_dtype(dtype):
        raise ValueError(f"ShardingConfig.grad_reduce_dtype must be a floating dtype "
                         f"(float32, bfloat16, float16) or None (float32, or a wider "
                         f"gradient's dtype), got {dtype!r}.")
      object.__setattr__(self, "grad_reduce_dtype", np.dtype(dtype))

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The mesh axes the batch is split over."""
    return sharding_lib.axis_names(self.batch_axis)

  def reduce_dtype(self, grad_dtype: Any) -> np.dtype:
    """The dtype a gradient of ``grad_dtype`` is reduced across devices in:
    ``grad_reduce_dtype``, else float32 (float64 stays float64); a complex gradient's
    complex counterpart (complex64 for a real half or float32 dtype)."""
    if self.grad_reduce_dtype is not None:
      return real_or_complex(grad_dtype, self.grad_reduce_dtype)
    return at_least_float32(grad_dtype)


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  """What a train step keeps in memory: donation, master weights, saved activations.

  Attributes:
    donate: donate the input state's buffers to the step (default).
    master_weights: keep float32 master weights (float64 or complex for such
      parameters) in the optimizer state; default (None): on when ``init`` stores any
      parameter in a half dtype (``'float16'`` and ``'bfloat16'`` policies, or rules
      giving some modules half params), or as the opt level says. Without a float32
      copy (:data:`MASTER_WEIGHTS`): ``'stochastic'``, each bfloat16 parameter updated
      in float32 and rounded back stochastically (:func:`jaxamp.stochastic_rounding`,
      a PRNG key in the optimizer state); ``'kahan'``, with a half-precision
      compensation buffer per half parameter (:func:`jaxamp.kahan_summation`). Either
      gives the optimizer float32 gradients and float32 copies of the params to read,
      and makes its state for float32 params (float32 moments, unless
      ``opt_state_dtype``).
    opt_state_dtype: store the optimizer's floating state (moments) in this dtype
      (:func:`jaxamp.opt_state_dtype`, around the user's optimizer, inside the loss
      scale and the skip), rounded stochastically under ``master_weights='stochastic'``,
      else to nearest. None (default): as the optimizer makes it.
    recompute_norms: recompute norms that compute wider than their inputs in the
      backward pass (see :func:`jaxamp.nnx.with_policy`): less activation memory, more
      time. Off by default; ``half_residuals`` already keeps a norm's half-precision
      input and statistics rather than its float32 intermediates.
    half_residuals: when the model computes in half precision, differentiate the loss
      under :func:`jaxamp.half_residuals`: reverse mode saves half-precision values and
      statistics (matmul, convolution and reduction results) and recomputes float32
      elementwise work (float32 norms' insides, softmax islands, parameter casts) in
      the backward pass, with the same gradients. On by default; False keeps what plain
      reverse mode saves.

  Example:
    >>> import jaxamp
    >>> jaxamp.MemoryConfig(master_weights=True, recompute_norms=True).donate
    True
    >>> jaxamp.MemoryConfig(master_weights='yes')
    Traceback (most recent call last):
    ...
    ValueError: MemoryConfig.master_weights must be True, False, None (decided at init), 'stochastic' or 'kahan', got 'yes'.
    >>> jaxamp.MemoryConfig(master_weights='stochastic', opt_state_dtype='bfloat16').rounding
    'stochastic'
  """

  donate: bool = True
  master_weights: bool | str | None = None
  recompute_norms: bool = False
  half_residuals: bool = True
  opt_state_dtype: Any = None

  def __post_init__(self):
    if self.master_weights is not None and self.master_weights not in MASTER_WEIGHTS:
      if not isinstance(self.master_weights, (bool, np.bool_)):
        raise ValueError(f"MemoryConfig.master_weights must be True, False, None (decided "
                         f"at init), 'stochastic' or 'kahan', got {self.master_weights!r}.")
      object.__setattr__(self, "master_weights", bool(self.master_weights))
    dtype = self.opt_state_dtype
    if dtype is not None:
      if not is_floating_dtype(dtype) or np.dtype(dtype).itemsize > 4:
        raise ValueError(f"MemoryConfig.opt_state_dtype must be a floating dtype of at most "
                         f"32 bits (bfloat16, float16, float32) or None (the optimizer's "
                         f"own), got {dtype!r}.")
      object.__setattr__(self, "opt_state_dtype", np.dtype(dtype))
      if self.rounding == "stochastic" and self.opt_state_dtype.name != "bfloat16":
        raise ValueError(f"MemoryConfig: master_weights='stochastic' rounds the optimizer "
                         f"state stochastically, to bfloat16 only; got opt_state_dtype "
                         f"{self.opt_state_dtype.name}. Use bfloat16.")
    for name in ("donate", "recompute_norms", "half_residuals"):
      object.__setattr__(self, name, _flag("MemoryConfig", name, getattr(self, name)))

  @property
  def rounding(self) -> str | None:
    """``'stochastic'`` or ``'kahan'`` (half params without float32 master weights), or
    None (float32 master weights or none)."""
    return self.master_weights if isinstance(self.master_weights, str) else None


MASTER_WEIGHTS = ("stochastic", "kahan")
"""The ``MemoryConfig.master_weights`` modes that keep no float32 copy of the params."""

SHORTHANDS = ("master_weights", "opt_state_dtype")
"""``make_train_step``'s keywords that set a :class:`MemoryConfig` field of that name."""


def with_shorthands(config: Any, name: str, given: Mapping[str, Any]) -> Any:
  """``config`` (``make_train_step``'s ``name=`` config) with the fields
  ``make_train_step`` took as keywords of their own (``master_weights=``,
  ``opt_state_dtype=``, ``numerics=``; None: not given); one that ``config`` also sets
  (not None) is refused."""
  fields = {k: v for k, v in given.items() if v is not None}
  both = [k for k in fields if getattr(config, k) is not None]
  if both:
    raise ValueError(f"make_train_step got {both[0]}={fields[both[0]]!r} and {name}= "
                     f"setting {both[0]}={getattr(config, both[0])!r}: give it once "
                     "(either spelling).")
  return dataclasses.replace(config, **fields) if fields else config


@dataclasses.dataclass(frozen=True)
class DebugConfig:
  """What a train step reports to find a problem: which gradients overflowed, stalls.

  Attributes:
    nonfinite_grads: add ``metrics['nonfinite_grads']``, a dict from parameter path to
      whether its gradient had an inf/NaN, to find the layer that overflowed
      (``make_train_step``'s former ``debug_nonfinite``).
    warn_skipped_steps: warn (a ``RuntimeWarning``, once per streak) when this many
      consecutive steps were all skipped, i.e. training stopped moving. ``step`` reads
      two counters per that many calls, from results at least that old, so it never
      waits on the step it just dispatched; the warning comes up to three windows after
      the streak began. None: never warn.
    numerics: a :class:`jaxamp.Numerics`: record every N-th step, per module, how close
      activations, cotangents and gradients come to their format's range, in
      ``metrics['numerics']`` (``make_train_step(numerics=...)`` sets it). None: off, and
      the step's program is the one without it.

  Example:
    >>> import jaxamp
    >>> jaxamp.DebugConfig(nonfinite_grads=True, warn_skipped_steps=None).nonfinite_grads
    True
    >>> jaxamp.DebugConfig(warn_skipped_steps=0)
    Traceback (most recent call last):
    ...
    ValueError: DebugConfig.warn_skipped_steps must be a positive int (steps) or None (never warn), got 0.
  """

  nonfinite_grads: bool = False
  warn_skipped_steps: int | None = 100
  numerics: Numerics | None = None

  def __post_init__(self):
    object.__setattr__(self, "nonfinite_grads",
                       _flag("DebugConfig", "nonfinite_grads", self.nonfinite_grads))
    warn = self.warn_skipped_steps
    if warn is not None and (isinstance(warn, bool) or not isinstance(warn, int) or warn < 1):
      raise ValueError(f"DebugConfig.warn_skipped_steps must be a positive int (steps) or "
                       f"None (never warn), got {warn!r}.")
    if self.numerics is not None and not isinstance(self.numerics, Numerics):
      raise ValueError(f"DebugConfig.numerics must be a jaxamp.Numerics (e.g. "
                       f"jaxamp.Numerics(every=100)) or None, got {self.numerics!r}.")


DEPRECATED: Mapping[str, tuple[str, type, str]] = {
    "mesh": ("sharding", ShardingConfig, "mesh"),
    "batch_axis": ("sharding", ShardingConfig, "batch_axis"),
    "param_sharding": ("sharding", ShardingConfig, "param_sharding"),
    "grad_reduce_dtype": ("sharding", ShardingConfig, "grad_reduce_dtype"),
    "model_state_reduction": ("sharding", ShardingConfig, "model_state_reduction"),
    "donate": ("memory", MemoryConfig, "donate"),
    "recompute_norms": ("memory", MemoryConfig, "recompute_norms"),
    "half_residuals": ("memory", MemoryConfig, "half_residuals"),
    "debug_nonfinite": ("debug", DebugConfig, "nonfinite_grads"),
    "warn_skipped_steps": ("debug", DebugConfig, "warn_skipped_steps"),
}
"""``make_train_step``'s former keywords: ``{old keyword: (its config's keyword, the
config, the field)}``."""


def from_keywords(old: Mapping[str, Any], configs: Mapping[str, Any],
                  stacklevel: int) -> dict[str, Any]:
  """``configs`` (``{'sharding': ..., 'memory': ..., 'debug': ...}``, None where not
  given) completed from the former keywords in ``old``: each config made from the
  keywords it owns, with one ``DeprecationWarning`` per config naming the new spelling.
  A former keyword given with the config that owns it, or an unknown keyword, is refused.
  """
  unknown = [k for k in old if k not in DEPRECATED]
  if unknown:
    raise TypeError(f"make_train_step() got an unexpected keyword argument {unknown[0]!r}.")
  out = dict(configs)
  for key, cls in (("sharding", ShardingConfig), ("memory", MemoryConfig),
                   ("debug", DebugConfig)):
    given = {k: v for k, v in old.items() if DEPRECATED[k][0] == key}
    if not given:
      if out[key] is None:
        out[key] = cls()
      continue
    fields = {DEPRECATED[k][2]: v for k, v in given.items()}
    new = (f"{key}=jaxamp.{cls.__name__}("
           + ", ".join(f"{f}=..." for f in fields) + ")")
    olds = ", ".join(f"{k}=..." for k in given)
    if out[key] is not None:
      raise ValueError(f"make_train_step got both {olds} and {key}=: pass {new} only (got "
                       f"{key}={out[key]!r}).")
    warnings.warn(f"make_train_step({olds}) is deprecated; pass {new}.", DeprecationWarning,
                  stacklevel=stacklevel + 1)
    out[key] = cls(**fields)
  return out
