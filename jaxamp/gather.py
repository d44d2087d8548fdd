"""Where a sharded step gathers its parameters: all at its start, or each where it is read.

Under ``param_sharding`` each device stores a slice of every sharded parameter. Inside
the step's ``shard_map`` a slice is cast to the dtype its reader computes in and
all-gathered (the forward pass), and the parameter's gradient is cast to
``grad_reduce_dtype``, summed over the batch axes and scattered back to the slice's
layout (the backward pass). Two places to do it:

- ``gather='model'``: every parameter at the start of the step, every gradient at its
  end (:func:`gather_all`, :func:`reduce_all`). Simple, one collective per parameter,
  but each device holds the whole model gathered, and its whole gradient, at once:
  ZeRO-3 storage with ZeRO-1's peak.
- ``gather='layer'``: each parameter where a module reads it (:func:`gathered`: one
  ``jax.custom_vjp`` whose backward pass is the reduce-scatter), so one layer's
  parameters are live at a time, and its gradient leaves the layer reduce-scattered.
  Under ``nnx.scan``/``nn.scan``/``lax.scan`` over stacked layers a read inside the body
  gathers one layer's slice. The gathered values are not saved for the backward pass:
  each reading module runs under its own checkpoint, whose policy
  (:func:`jaxamp.residuals.gathers`) has them gathered again there, as PyTorch FSDP and
  MaxText do. A module's gathers wait for its inputs, or with :func:`prefetching` for
  those of the module before it (:func:`tie_for`), so the compiler cannot hoist them
  all to the step's start. Where the reads happen: NNX Variables' ``on_get_value`` hooks
  (:mod:`jaxamp.nnx`); for Linen (``self.param``) and Equinox (a policy view's field
  reads) the slice is boxed as a :class:`Slice`, which the read unboxes, in the dtype
  and after the inputs :func:`reading` names. A slice used as an array otherwise (a raw
  read) raises :class:`RawSliceRead`: ``gather='auto'`` then gathers the whole model.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jaxamp.gather import Shard
  >>> mesh = jax.make_mesh((1,), ('fsdp',))
  >>> shard = Shard.of(jax.P(None, None, 'fsdp'), (24, 8, 512), mesh, ('fsdp',), jnp.float32)
  >>> shard.spec, shard.of_slice((8, 512)).spec  # one layer of 24 stacked ones
  (((), (), ('fsdp',)), ((), ('fsdp',)))
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jax_core
import numpy as np
from flax import struct
from flax.core import meta as flax_meta

from jaxamp import scaled
from jaxamp import sharding as sharding_lib
from jaxamp.casting import is_floating_array, real_or_complex
from jaxamp.residuals import gathers
from jaxamp.rules import path_name

__all__ = ["Shard", "Slice", "RawSliceRead", "gathered", "reduced", "read", "global_reads",
           "sliced", "is_slice", "whole", "reading", "prefetching", "tie_for", "prefetches",
           "gather_all", "reduce_all",
           "compiler_options", "check_reads"]

P = jax.sharding.PartitionSpec

# XLA:CPU removes optimization barriers (its pass 'cse_barrier_expander') before common-
# subexpression elimination, which then merges each re-gather of the backward pass with
# the forward pass's gather of the same slice: every layer's gathered parameters stay
# live from the forward pass to the backward pass (a 24-layer LM on 8 devices: 442 MiB
# per device against 168 MiB with the barriers kept; benchmarks/fsdp). jax.checkpoint
# puts such barriers there for this very reason. Other backends are left as they are
# (whether XLA:GPU keeps them through CSE is not checked here).
_KEEP_BARRIERS = ("xla_disable_hlo_passes", "cse_barrier_expander")


class RawSliceRead(AttributeError):
  """A model or loss used a parameter slice (``gather='layer'``) as an array without
  reading it as a parameter: a Linen module reading ``self.variables['params']`` rather
  than ``self.param`` (Hugging Face's tied LM heads), a ``loss_fn`` taking
  ``jax.tree.leaves`` of the parameters. Raised while the step is traced;
  ``gather='auto'`` then gathers the whole model instead, ``'layer'`` refuses. An
  ``AttributeError``, so ``hasattr`` probes of a :class:`Slice` say no."""


class Shard(NamedTuple):
  """How one parameter is split over the mesh and how its gradient is reduced: what a
  read needs to gather it (hashable: it rides in an NNX Variable's metadata).

  Attributes:
    spec: per dimension of the stored slice, the mesh axes splitting it (major first).
    batch_axes: the mesh axes the batch is split over: a gradient is summed over them.
    sizes: ``(axis, size)`` of every mesh axis.
    reduce_dtype: the dtype gradients are summed in (``grad_reduce_dtype``).
    shape: the shape of one device's slice.
    quantized: the scaled-format recipe of the one module reading it as the operand its
      format quantizes (a kernel), or None: the gather may then move the slice in that
      format (:meth:`jaxamp.scaled.ScaledFormat.gather_quantized`) rather than in the
      reader's compute dtype.
    reader: that module's path (its scaled-format state's key), or None.
  """

  spec: tuple[tuple[str, ...], ...]
  batch_axes: tuple[str, ...]
  sizes: tuple[tuple[str, int], ...]
  reduce_dtype: np.dtype
  shape: tuple[int, ...]
  quantized: Any = None
  reader: str | None = None

  @classmethod
  def of(cls, spec: jax.sharding.PartitionSpec, shape: Sequence[int],
         mesh: jax.sharding.Mesh, batch_axes: Sequence[str], reduce_dtype: Any) -> Shard:
    """The Shard of a parameter of (global) ``shape`` laid out by ``spec``."""
    names = [sharding_lib.axis_names(e) for e in spec]
    names += [()] * (len(shape) - len(names))
    local = tuple(n // sharding_lib.axis_size(mesh, e) for n, e in zip(shape, names))
    return cls(tuple(names), tuple(batch_axes), tuple(mesh.shape.items()),
               np.dtype(reduce_dtype), local)

  @property
  def sharded(self) -> bool:
    return any(self.spec)

  @property
  def global_shape(self) -> tuple[int, ...]:
    """The parameter's whole shape (every slice gathered)."""
    sizes = dict(self.sizes)
    return tuple(n * int(np.prod([sizes[a] for a in names], dtype=int))
                 for n, names in zip(self.shape, self.spec))

  def without(self, dim: int) -> Shard:
    """The layout of one layer along dimension ``dim`` of a stacked slice (Linen's
    ``nn.scan``/``nn.vmap`` say which dimension they take out).

    Raises:
      ValueError: if the mesh splits ``dim`` (each layer would live on other devices).
    """
    dim %= len(self.spec)
    if self.spec[dim]:
      raise ValueError(
          f"A parameter slice of shape {self.shape} is split over the mesh along dimension "
          f"{dim}, which a transformation over stacked layers (nn.scan, nn.vmap) takes out: "
          "each layer would live on other devices. Give the specs yourself (split another "
          "dimension), or gather='model'.")
    return self._replace(spec=self.spec[:dim] + self.spec[dim + 1:],
                         shape=self.shape[:dim] + self.shape[dim + 1:])

  def with_axis(self, dim: int, size: int) -> Shard:
    """The inverse of :meth:`without`: an unsplit dimension of ``size`` put back at ``dim``."""
    dim = dim if dim >= 0 else len(self.spec) + 1 + dim
    return self._replace(spec=self.spec[:dim] + ((),) + self.spec[dim:],
                         shape=self.shape[:dim] + (size,) + self.shape[dim:])

  def of_slice(self, shape: Sequence[int]) -> Shard:
    """The layout of a read of ``shape``: the stored slice itself, or one layer of it
    (``nnx.scan`` / ``nnx.vmap`` over stacked layers hand their body the slice with the
    layer dimension, or dimensions, taken out).

    Raises:
      ValueError: if the dimensions taken out are split over the mesh (each layer would
        live on other devices), or if which ones were taken out is ambiguous.
    """
    shape, full = tuple(shape), self.shape
    if shape == full:
      return self
    k = len(full) - len(shape)  # dimensions taken out; each way of taking them out that
    # leaves ``shape`` and splits none of them gives a candidate layout
    found = {tuple(e for i, e in enumerate(self.spec) if i not in out)
             for out in itertools.combinations(range(len(full)), k)
             if tuple(n for i, n in enumerate(full) if i not in out) == shape
             and not any(self.spec[i] for i in out)} if k > 0 else set()
    if len(found) != 1:
      split = [d for d, e in enumerate(self.spec) if e]
      raise ValueError(
          f"A parameter slice of shape {full}, split over the mesh along dimensions "
          f"{split}, was read with shape {shape}: not one layer of it along an unsplit "
          "dimension (an nnx.scan/nnx.vmap over stacked layers may only slice a "
          "dimension the mesh does not split; jaxamp.fsdp splits the largest one). Give "
          "the specs yourself, or gather='model'.")
    return self._replace(spec=found.pop(), shape=shape)


def _gather_slice(x: jax.Array, spec: tuple[tuple[str, ...], ...]) -> jax.Array:
  for d, names in enumerate(spec):
    if names:
      x = jax.lax.all_gather(x, names, axis=d, tiled=True)
  return x


def _cast_and_gather(x: jax.Array, shard: Shard, dtype: Any, state: Any = None) -> jax.Array:
  """The slice ``x`` cast to ``dtype`` and all-gathered: moved in its reader's scaled
  format where the Shard names one whose format gathers quantized (and says it applies
  to this recipe and dtype; ``state``: the reader's scaled-format state, if the step has
  it), else in ``dtype``."""
  x = x.astype(dtype)
  if shard.quantized is not None and shard.sharded:
    hook = getattr(scaled.format_of(shard.quantized), "gather_quantized", None)
    if hook is not None:
      axes = tuple(a for names in shard.spec for a in names)
      out = hook(x, axes, functools.partial(_gather_slice, spec=shard.spec),
                 shard.quantized, **({} if state is None else {"state": state}))
      if out is not None:
        return out
  return _gather_slice(x, shard.spec)


def reduced(g: jax.Array, shard: Shard) -> jax.Array:
  """Inside shard_map: a full local gradient cast to ``reduce_dtype`` (a complex one to
  the complex dtype holding it), summed over the batch axes and scattered to the slice's
  layout (each device's loss was weighted by one over the number of devices, so the sum
  is the mean)."""
  sizes = dict(shard.sizes)
  axes = shard.batch_axes
  g = g.astype(real_or_complex(g.dtype, shard.reduce_dtype))
  summed: tuple[str, ...] = ()
  for d, names in enumerate(shard.spec):
    # An entry's axes split the dimension major to minor; each run of batch axes is
    # summed and scattered, each run of other axes (storage only: every device along
    # them has the same gradient) sliced, in that order. An entry may mix both kinds
    # (('data', 'model') with batch axis 'data').
    for is_batch, run in itertools.groupby(names, key=lambda a: a in axes):
      run = tuple(run)
      if is_batch:
        g = jax.lax.psum_scatter(g, run, scatter_dimension=d, tiled=True)
        summed += run
      else:
        size = g.shape[d] // int(np.prod([sizes[a] for a in run]))
        g = jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(run) * size, size, d)
  rest = tuple(a for a in axes if a not in summed)
  return jax.lax.psum(g, rest) if rest else g


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def gathered(x: jax.Array, state: Any, shard: Shard, dtype: Any) -> jax.Array:
  """Inside ``shard_map``: the slice ``x`` cast to ``dtype`` and all-gathered; its
  gradient is the full gradient reduce-scattered in ``shard.reduce_dtype`` (returned in
  ``x``'s dtype). Where ``shard.quantized`` names a format that gathers quantized, the
  slice travels in that format (the forward value is then what the format's matmul
  quantizes alike; the gradient is straight-through, as that matmul treats it), with
  ``state``, the reader's scaled-format state (None: none; its cotangent is zero)."""
  return _cast_and_gather(x, shard, dtype, state)


def _gathered_fwd(x: jax.Array, state: Any, shard: Shard, dtype: Any) -> tuple[jax.Array, Any]:
  # The stored dtype travels as a zero-size array, the state for its zero cotangent.
  return gathered(x, state, shard, dtype), (jax.numpy.zeros((0,), x.dtype), state)


def _gathered_bwd(shard: Shard, dtype: Any, residuals: Any, ct: jax.Array) -> tuple[Any, Any]:
  del dtype
  stored, state = residuals
  return reduced(ct, shard).astype(stored.dtype), jax.tree.map(jax.numpy.zeros_like, state)


gathered.defvjp(_gathered_fwd, _gathered_bwd)


class _Reading(threading.local):
  dtype: Any = None  # the compute dtype of the module reading (None: the stored dtype)
  tie: Any = None  # the arrays that module's gathers wait for (see tie_for)
  mesh: Any = None  # global_reads' mesh (None: reads are inside the step's shard_map)
  prefetch: bool = False  # prefetching's setting
  previous: Any = None  # (trace, inputs) of the last reading module, under prefetching


_reading_now = _Reading()


@contextlib.contextmanager
def reading(dtype: Any, tie: Any = None) -> Iterator[None]:
  """:class:`Slice` s read in the ``with`` block are gathered in ``dtype`` (None: their
  stored dtype), after ``tie`` (arrays the gathers wait for: :func:`tie_for`)."""
  old = _reading_now.dtype, _reading_now.tie
  _reading_now.dtype, _reading_now.tie = dtype, tie
  try:
    yield
  finally:
    _reading_now.dtype, _reading_now.tie = old


@contextlib.contextmanager
def prefetching(on: bool) -> Iterator[None]:
  """In the ``with`` block (one trace of a step's model), :func:`tie_for` lets each
  reading module's gathers start once the module read before it starts (``on``), or
  once its own inputs are ready."""
  old = _reading_now.prefetch, _reading_now.previous
  _reading_now.prefetch, _reading_now.previous = bool(on), None
  try:
    yield
  finally:
    _reading_now.prefetch, _reading_now.previous = old


def tie_for(inputs: list[Any]) -> list[Any]:
  """What the gathers of a module reading parameter slices wait for (an
  ``optimization_barrier`` with them), given the module's array ``inputs``, as the
  module is called (outside its checkpoint).

  Its own inputs: the gathers run one module at a time, in the model's order, and the
  compiler cannot hoist every layer's gather to the step's start (XLA:CPU would). Under
  :func:`prefetching`, the inputs of the module read before it in the same trace
  (none: its own): its gathers may then run while that module computes, so a compiler
  that overlaps collectives with compute (XLA:GPU's latency-hiding scheduler) can
  hide them, at the cost of two modules' parameters gathered at once rather than one,
  as PyTorch FSDP's prefetch of the next module does. "Before" is the order modules
  are called in (for parallel branches, the order they are traced), and not across a
  transformation's boundary (the first module in an ``nnx.scan`` body waits for its
  own inputs)."""
  if not _reading_now.prefetch:
    return inputs
  trace = jax_core.get_opaque_trace_state()
  previous, _reading_now.previous = _reading_now.previous, (trace, inputs)
  if previous is not None and previous[0] == trace:
    return previous[1]
  return inputs


def prefetches(setting: bool | None, mesh: jax.sharding.Mesh | None) -> bool:
  """Whether a step on ``mesh`` prefetches (``fsdp(..., prefetch=setting)``): the
  setting, or where it is None, on devices other than CPUs (whose collectives do not
  overlap compute: a prefetch there costs memory and buys nothing)."""
  if setting is not None:
    return setting
  return mesh is not None and not _on_cpu(mesh)


@contextlib.contextmanager
def global_reads(mesh: jax.sharding.Mesh) -> Iterator[None]:
  """Reads in the ``with`` block see global arrays, not slices: a program partitioned by
  XLA over ``mesh`` rather than written per device (``eval_step``, which has no
  gradient to reduce-scatter and may return anything ``eval_fn`` does). There
  :func:`read` casts the sharded parameter to the reader's dtype and constrains the
  result replicated: XLA all-gathers it where it is read, in that dtype, instead of
  partitioning the reader's matmul over the parameter's shards (partial sums, rounded
  in half precision before they are added)."""
  old = _reading_now.mesh
  _reading_now.mesh = mesh
  try:
    yield
  finally:
    _reading_now.mesh = old


def read(x: jax.Array, shard: Shard, dtype: Any) -> jax.Array:
  """A sharded parameter as a module reads it: cast to ``dtype`` and gathered. Inside the
  step's ``shard_map`` ``x`` is this device's slice (or one layer of it), gathered by
  :func:`gathered`; under :func:`global_reads` it is the global array (or one layer of
  it), cast, constrained split as it is stored, then constrained replicated. Without
  the first constraint Shardy's propagation makes the cast itself replicated, and XLA
  gathers before it, in the stored dtype (float32: twice the bytes)."""
  mesh = _reading_now.mesh
  if mesh is None:
    return gathered(x, _reader_state(shard), shard.of_slice(np.shape(x)), dtype)
  stored = shard._replace(shape=shard.global_shape).of_slice(np.shape(x)).spec
  x = _constrained(x.astype(dtype), P(*[names or None for names in stored]), mesh)
  return _constrained(x, P(), mesh)


def _constrained(x: jax.Array, spec: jax.sharding.PartitionSpec,
                 mesh: jax.sharding.Mesh) -> jax.Array:
  if jax.sharding.get_abstract_mesh().empty:  # no mesh in context: name the step's
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
  return jax.lax.with_sharding_constraint(x, spec)  # e.g. inside jax.sharding.auto_axes


class Slice(struct.PyTreeNode, flax_meta.AxisMetadata):
  """This device's slice of a sharded parameter, in the model a step binds inside its
  ``shard_map`` (``gather='layer'``) where the model library has no per-read hook of its
  own: Linen unboxes it where a module reads it (``self.param``, this being a Flax
  ``AxisMetadata``; ``nn.scan``/``nn.vmap`` take the stacked dimension out of its layout),
  Equinox policy views where a module's field is read. Reading it (:meth:`unbox`) casts
  the slice to the dtype :func:`reading` says and all-gathers it (:func:`gathered`).
  Used as an array otherwise, it raises :class:`RawSliceRead`.
  """

  value: Any
  shard: Any = struct.field(pytree_node=False)  # a Shard
  name: str = struct.field(pytree_node=False, default="")  # the parameter's path

  def unbox(self) -> Any:
    x = self.value
    if _reading_now.tie:  # the gather waits for these (tie_for)
      x, _ = jax.lax.optimization_barrier((x, _reading_now.tie))
    dtype = _reading_now.dtype if is_floating_array(x) and _reading_now.dtype else x.dtype
    return read(x, self.shard, dtype)

  def replace_boxed(self, val: Any) -> Slice:
    return self.replace(value=val)

  def add_axis(self, index: int, params: Any) -> Slice:
    del params
    return self.replace(shard=self.shard.with_axis(index, np.shape(self.value)[index]))

  def remove_axis(self, index: int, params: Any) -> Slice:
    del params
    return self.replace(shard=self.shard.without(index))

  def _raw(self, what: str) -> Any:
    raise RawSliceRead(
        f"gather='layer': parameter {self.name} was used as an array ({what}) without "
        "being read as a parameter (a Linen module reading self.variables['params'] "
        "rather than self.param, e.g. a tied head): there it is this device's slice, not "
        "the parameter. Gather the whole model at the step's start: "
        "jaxamp.fsdp(..., gather='model') (what gather='auto' falls back to).")

  def __getattr__(self, name: str) -> Any:  # .T, .shape, .astype, ...: not an array
    if name.startswith("__"):
      raise AttributeError(name)
    return self._raw(f".{name}")

  def __jax_array__(self) -> Any:
    return self._raw("jnp.asarray")

  def __array__(self, *args: Any, **kwargs: Any) -> Any:
    return self._raw("np.asarray")

  def __getitem__(self, key: Any) -> Any:
    return self._raw("indexed")

  def __matmul__(self, other: Any) -> Any:
    return self._raw("@")

  __rmatmul__ = __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = __matmul__


def is_slice(x: Any) -> bool:
  return isinstance(x, Slice)


def sliced(params: Any, shards: Sequence[Shard]) -> Any:
  """``params`` (this device's slices, inside the step's ``shard_map``) with each
  sharded leaf (``shards``: one per leaf) boxed as a :class:`Slice`."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  return treedef.unflatten([Slice(x, s, path_name(p)) if s.sharded else x
                            for (p, x), s in zip(paths, shards)])


def whole(tree: Any) -> Any:
  """``tree`` with each :class:`Slice` as a ``jax.ShapeDtypeStruct`` of the whole
  parameter (what an abstract pass over the model may trace)."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shard.global_shape, x.value.dtype) if is_slice(x)
      else x, tree, is_leaf=is_slice)


def _reader_state(shard: Shard) -> Any:
  """The scaled-format state of the module reading a kernel the gather may quantize, as
  the running scope holds it (gradients stopped: the gather only reads it), or None."""
  scope = scaled.current()
  if shard.quantized is None or shard.reader is None or scope is None:
    return None
  state = scope.state.get(shard.reader)
  return None if state is None else jax.lax.stop_gradient(state)


def gather_all(shards: Sequence[Shard], dtypes: Sequence[Any], params: Any,
               states: Mapping[str, Any] | None = None) -> Any:
  """Inside shard_map (``gather='model'``): every param slice cast to its dtype in
  ``dtypes``, then all-gathered (a kernel of a scaled format's module in that format, as
  :func:`gathered`, with its reader's state in ``states``)."""
  leaves, treedef = jax.tree.flatten(params)
  states = states or {}
  return treedef.unflatten([
      _cast_and_gather(x, s, dt, states.get(s.reader)) if is_floating_array(x)
      else _gather_slice(x, s.spec) for x, s, dt in zip(leaves, shards, dtypes)])


def reduce_all(shards: Sequence[Shard], grads: Any, dtypes: Sequence[Any]) -> Any:
  """Inside shard_map: each full local gradient reduced to its slice (see
  :func:`gathered`), returned in its dtype in ``dtypes``."""
  leaves, treedef = jax.tree.flatten(grads)
  return treedef.unflatten([reduced(g, s).astype(dt)
                            for g, s, dt in zip(leaves, shards, dtypes)])


def _on_cpu(mesh: jax.sharding.Mesh) -> bool:
  return mesh.devices.flat[0].platform == "cpu"


def compiler_options(options: Any, mesh: jax.sharding.Mesh) -> Any:
  """The XLA options of a step gathering per layer on ``mesh``: ``options`` (the
  user's, or None) and, on CPU devices, the optimization barriers kept."""
  if not _on_cpu(mesh):
    return options
  key, value = _KEEP_BARRIERS
  out = dict(options or {})
  passes = [p for p in str(out.get(key, "")).split(",") if p]
  out[key] = ",".join(passes + [value] if value not in passes else passes)
  return out


# Primitives that pass a value through unchanged, output i being input i.
_PASS_THROUGH = frozenset({"optimization_barrier", "copy", "copy_p"})


def check_reads(jaxpr: Any, shards: Sequence[Shard], names: Sequence[str]) -> None:
  """Refuses a loss whose jaxpr uses a sharded parameter's slice other than through a
  :func:`gathered` read: its value there would be this device's shard, not the
  parameter (a silent wrong loss and gradient). The first ``len(shards)`` inputs of
  ``jaxpr`` are the parameter slices, ``names`` their paths.

  Raises:
    RawSliceRead: naming the parameter and what used it (the train step then gathers
      the whole model under ``gather='auto'``, and refuses under ``'layer'``).
  """
  for var, shard, name in zip(jaxpr.invars, shards, names):
    if shard.sharded:
      raw = _raw_use(jaxpr, var)
      if raw is not None:
        raise RawSliceRead(
            f"gather='layer': parameter {name} is used as its raw array by {raw} (not read "
            "as a parameter: through its NNX Variable, module[...] or .get_value(), a "
            "Linen module's self.param, an Equinox module's field): there it is this "
            "device's shard of the parameter, not the parameter. Read it as a parameter "
            "(model.layer.kernel[...]), or gather the whole model at the step's start: "
            "jaxamp.fsdp(..., gather='model') (what gather='auto' falls back to).")


def _sub_jaxpr(eqn: Any) -> Any:
  """The jaxpr an equation runs on its own inputs, one to one (jit, checkpoint, scan,
  custom_jvp/custom_vjp functions), or None."""
  for key in ("jaxpr", "call_jaxpr"):
    sub = eqn.params.get(key)
    sub = getattr(sub, "jaxpr", sub)
    if sub is not None and hasattr(sub, "invars") and len(sub.invars) == len(eqn.invars):
      return sub
  return None


def _raw_use(jaxpr: Any, var: Any) -> str | None:
  """The first primitive using ``var`` other than through a gather, or None."""
  for eqn in jaxpr.eqns:
    positions = [i for i, v in enumerate(eqn.invars) if v is var]
    if not positions:
      continue
    if gathers(eqn.primitive, eqn.params):
      continue
    if eqn.primitive.name in _PASS_THROUGH:
      found = [_raw_use(jaxpr, eqn.outvars[i]) for i in positions]
    elif (sub := _sub_jaxpr(eqn)) is not None:
      found = [_raw_use(sub, sub.invars[i]) for i in positions]
    else:
      return eqn.primitive.name
    found = [f for f in found if f is not None]
    if found:
      return found[0]
  if any(out is var for out in jaxpr.outvars):
    return "an output (returned as it is)"
  return None

