"""Parameter sharding for the train step: FSDP over a mesh axis, or the model's annotations.

A *param sharding* says how each parameter is laid out over a ``jax.sharding.Mesh``: a
pytree of ``PartitionSpec`` shaped like the params, or a function ``(params, mesh) ->
specs`` such as the presets here. :func:`jaxamp.make_train_step` takes one as
``sharding=jaxamp.ShardingConfig(mesh=..., param_sharding=...)``; the params, float32 master weights and optimizer state are then
stored sharded (each device holds its slice), and each step, per device:

1. casts its param slices to the compute dtype of the module owning them, then
   all-gathers them (so a ``mixed_bfloat16`` step gathers bfloat16: half the bytes);
2. runs forward and backward on its part of the batch;
3. casts the gradients to ``grad_reduce_dtype`` and reduce-scatters them back to the
   params' layout (an all-reduce over batch axes a parameter is not sharded on).

That is PyTorch FSDP's ``MixedPrecision(param_dtype=compute dtype,
reduce_dtype=grad_reduce_dtype)`` written with ``jax.shard_map`` and ``lax`` collectives,
so the dtypes on the wire are the ones chosen, not the partitioner's.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxamp.sharding import fsdp, param_specs
  >>> mesh = jax.make_mesh((1,), ('fsdp',))
  >>> params = {'kernel': jnp.ones((512, 8)), 'bias': jnp.ones(8)}
  >>> specs = param_specs(fsdp('fsdp', min_size=1024), params, mesh)
  >>> specs == {'kernel': jax.P('fsdp', None), 'bias': jax.P()}
  True
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from jaxamp import dtypes
from jaxamp._flax_compat import unbox

__all__ = ["ParamSharding", "GATHERS", "fsdp", "annotated", "gather_of", "prefetch_of",
           "param_specs", "Collective", "collectives"]

P = jax.sharding.PartitionSpec

ParamSharding = Callable[[Any, jax.sharding.Mesh], Any]
"""A function ``(params, mesh) -> pytree of PartitionSpec`` shaped like ``params``."""

AxisNames = str | Sequence[str]


def axis_names(entry: Any) -> tuple[str, ...]:
  """The mesh axes one entry of a PartitionSpec names (None: none).

  Example:
    >>> from jaxamp.sharding import axis_names
    >>> axis_names(None), axis_names('data'), axis_names(('data', 'fsdp'))
    ((), ('data',), ('data', 'fsdp'))
  """
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def axis_size(mesh: jax.sharding.Mesh, names: Sequence[str]) -> int:
  """How many devices the mesh axes ``names`` span together."""
  return math.prod(mesh.shape[n] for n in names)


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


GATHERS = ("auto", "layer", "model")
"""Where a sharded train step gathers its parameters: see :func:`fsdp`."""


def _check_gather(gather: str) -> None:
  if gather not in GATHERS:
    raise ValueError(f"gather must be one of {', '.join(map(repr, GATHERS))}, got "
                     f"{gather!r}.")


def _check_prefetch(prefetch: Any, gather: str) -> None:
  if not isinstance(prefetch, (bool, type(None))):
    raise ValueError(f"prefetch must be True, False or None (on devices other than CPUs), "
                     f"got {prefetch!r}.")
  if prefetch and gather == "model":
    raise ValueError("prefetch=True runs per-layer gathers one module ahead, but "
                     "gather='model' gathers the whole model at the step's start: use "
                     "gather='layer' (or 'auto'), or leave prefetch out.")


def fsdp(axis: AxisNames = "fsdp", *, min_size: int = 2**12,
         gather: str = "auto", prefetch: bool | None = None) -> ParamSharding:
  """Fully-sharded data parallel (ZeRO-3): each large parameter sharded over ``axis``.

  Each floating parameter with at least ``min_size`` elements is split along its largest
  dimension that the axis size divides (the first such on ties); smaller ones, and ones
  with no divisible dimension, are replicated (their bytes are few; gathering them costs
  more latency than it saves).

  Where the step gathers them (``gather``):

  - ``'layer'``: each parameter where a module reads it, in that module's compute dtype,
    and its gradient reduce-scattered as it leaves the module's backward pass; the
    backward pass gathers again rather than keeping the gathered copy. One layer's
    parameters are live at a time (under ``nnx.scan`` over stacked layers, one layer's
    slice; under ``nn.scan``, likewise), so the step's peak memory grows with the
    model's size over the devices, as PyTorch FSDP's does. NNX, Linen and Equinox
    models (an NNX model holding bridged Linen modules, ``nnx.bridge.ToNNX``, is refused).
  - ``'model'``: every parameter at the start of the step, every gradient at its end:
    one collective per parameter, but each device holds the whole model gathered (in
    the compute dtypes) and its whole float32 gradient at once.
  - ``'auto'`` (default): ``'layer'`` where it can be done, else ``'model'``: for NNX
    models holding bridged Linen modules, and for models or losses found, when the step
    is first traced, to use a parameter's raw array (a Linen tied head reading
    ``self.variables``, as Hugging Face's Flax LMs do; a ``loss_fn`` taking
    ``jax.tree.leaves`` of the parameters). ``train.plan.layer_gather`` says which.

  Under ``'layer'``, a module's gathers wait for the inputs of the module read before it
  (``prefetch=True``): the compiler may gather the next module's parameters while the
  current one computes (XLA:GPU's latency-hiding scheduler overlaps the collective with
  the compute), with two modules' parameters gathered at once; or for its own inputs
  (``False``): one module's at a time, each gather on the critical path. The backward
  pass gathers each module's parameters again when its cotangent arrives, either way.

  Args:
    axis: a mesh axis name, or several (sharded over their product).
    min_size: parameters with fewer elements stay replicated.
    gather: ``'auto'``, ``'layer'`` or ``'model'``.
    prefetch: whether per-layer gathers may run one module ahead; None (default): on
      devices other than CPUs (XLA:CPU overlaps nothing, so there it only costs memory).

  Returns:
    A param sharding for ``jaxamp.ShardingConfig(param_sharding=...)``. The batch should
    be split over ``axis`` too (``batch_axis=('data', 'fsdp')`` or ``batch_axis='fsdp'``):
    a parameter sharded over a batch axis has its gradient reduce-scattered.

  Example:
    >>> import jax, jax.numpy as jnp, jaxamp
    >>> mesh = jax.make_mesh((1,), ('fsdp',))
    >>> jaxamp.fsdp(min_size=4)({'w': jnp.ones((3, 8))}, mesh) == {'w': jax.P(None, 'fsdp')}
    True
  """
  names = axis_names(axis)
  if not names:
    raise ValueError("fsdp needs a mesh axis name, got none.")
  _check_gather(gather)
  _check_prefetch(prefetch, gather)

  def specs(params: Any, mesh: jax.sharding.Mesh) -> Any:
    _check_axes(names, mesh, "fsdp axis")
    n = axis_size(mesh, names)
    entry = names[0] if len(names) == 1 else names

    def one(x: Any) -> P:
      shape = np.shape(x)
      dtype = getattr(x, "dtype", None) or np.result_type(x)
      if not jnp.issubdtype(dtype, jnp.inexact) or math.prod(shape) < min_size:
        return P()
      dims = [d for d in range(len(shape)) if shape[d] % n == 0]
      if not dims:
        return P()
      d = max(dims, key=lambda i: (shape[i], -i))
      return P(*([None] * d), entry, *([None] * (len(shape) - d - 1)))

    return jax.tree.map(one, unbox(params))

  specs.gather, specs.prefetch = gather, prefetch
  return specs


def gather_of(param_sharding: Any) -> str:
  """Where a step with ``param_sharding`` gathers its parameters: the ``gather`` its
  preset was made with (:func:`fsdp`, :func:`annotated`), else ``'auto'``."""
  return getattr(param_sharding, "gather", "auto") if callable(param_sharding) else "auto"


def prefetch_of(param_sharding: Any) -> bool | None:
  """Whether a step with ``param_sharding`` gathering per layer prefetches (the
  ``prefetch`` its preset was made with, :func:`fsdp`); None: where the devices can
  overlap it."""
  return getattr(param_sharding, "prefetch", None) if callable(param_sharding) else None


def annotated(rules: Sequence[tuple[str, Any]] | None = None, *,
              gather: str = "auto", prefetch: bool | None = None) -> ParamSharding:
  """The shardings the model declares: NNX ``sharding`` metadata, Linen boxes.

  NNX parameters made with ``nnx.with_partitioning(init, names)`` (or ``nnx.Param(...,
  sharding=names)``) and Linen ones made with ``nn.with_partitioning`` /
  ``nn.with_logical_partitioning`` carry axis names. With ``rules`` (Flax logical axis
  rules, ``[('embed', 'fsdp'), ('mlp', 'model'), ...]``; default: the rules set with
  ``flax.linen.logical_axis_rules``, if any) the names are logical and are mapped to
  mesh axes (a name with no rule is replicated); without, they are mesh axes.

  Args:
    rules: logical-to-mesh axis rules, or None.
    gather: where the step gathers sharded parameters (see :func:`fsdp`).
    prefetch: whether per-layer gathers may run one module ahead (see :func:`fsdp`).

  Returns:
    A param sharding for ``jaxamp.ShardingConfig(param_sharding=...)``. Unannotated
    parameters are replicated.

  Example:
    >>> import jax, jax.numpy as jnp, jaxamp
    >>> from flax import linen as nn
    >>> init = nn.with_logical_partitioning(nn.initializers.ones, ('embed', 'mlp'))
    >>> params = {'w': init(jax.random.key(0), (4, 8))}
    >>> mesh = jax.make_mesh((1,), ('model',))
    >>> jaxamp.annotated(rules=[('mlp', 'model')])(params, mesh) == {'w': jax.P(None, 'model')}
    True
  """

  def specs(params: Any, mesh: jax.sharding.Mesh) -> Any:
    del mesh  # param_specs checks the names against it
    if isinstance(params, nnx.State):
      declared = nnx.get_partition_spec(params)
    else:
      declared = nn.get_partition_spec(params)
    given = rules if rules is not None else nn.get_logical_axis_rules()
    if not given:
      return declared
    to_mesh = nn.logical_to_mesh_axes
    return jax.tree.map(lambda s: P(*to_mesh(tuple(s), given)), declared, is_leaf=_is_spec)

  _check_gather(gather)
  _check_prefetch(prefetch, gather)
  specs.gather, specs.prefetch = gather, prefetch
  return specs


def _check_axes(names: Sequence[str], mesh: jax.sharding.Mesh, what: str) -> None:
  for name in names:
    if name not in mesh.axis_names:
      raise ValueError(f"{what} {name!r} is not an axis of the mesh; its axes are "
                       f"{tuple(mesh.axis_names)}.")


def param_specs(param_sharding: ParamSharding | Any, params: Any,
                mesh: jax.sharding.Mesh) -> Any:
  """The checked ``PartitionSpec`` of every parameter.

  Args:
    param_sharding: a function ``(params, mesh) -> specs`` (:func:`fsdp`,
      :func:`annotated`), or the specs themselves: a pytree of ``PartitionSpec`` shaped
      like ``params``.
    params: the parameters (Linen boxes are read, then unboxed).
    mesh: the mesh.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``flax.core.meta.unbox(params)``.

  Raises:
    ValueError: naming the parameter, if a spec names an axis the mesh lacks, uses one
      twice, has more entries than the parameter has dimensions, or splits a dimension
      its axes' size does not divide; or if the specs do not match the params' structure.
  """
  specs = param_sharding(params, mesh) if callable(param_sharding) else param_sharding
  params = unbox(params)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  try:
    spec_leaves = treedef.flatten_up_to(specs)
  except (ValueError, TypeError) as e:
    raise ValueError("param_sharding gave specs that do not match the params' structure "
                     f"({e}); give one PartitionSpec per parameter, or a function "
                     "(params, mesh) -> specs such as jaxamp.fsdp().") from None
  out = []
  for (path, x), spec in zip(leaves, spec_leaves):
    name = jax.tree_util.keystr(path)
    if spec is None:
      spec = P()
    if not _is_spec(spec):
      raise ValueError(f"param_sharding gave {spec!r} for parameter {name}; expected a "
                       "jax.sharding.PartitionSpec.")
    shape = np.shape(x)
    if len(spec) > len(shape):
      raise ValueError(f"Parameter {name} has shape {shape} but its spec {spec} names "
                       f"{len(spec)} dimensions.")
    seen: set[str] = set()
    for d, entry in enumerate(spec):
      names = axis_names(entry)
      _check_axes(names, mesh, f"Parameter {name}'s spec {spec} names axis")
      twice = seen & set(names) or {a for a in names if names.count(a) > 1}
      if twice:
        raise ValueError(f"Parameter {name}'s spec {spec} uses mesh axis "
                         f"{sorted(twice)[0]!r} twice.")
      seen |= set(names)
      n = axis_size(mesh, names)
      if shape[d] % n:
        raise ValueError(f"Parameter {name} has shape {shape}: dimension {d} ({shape[d]}) "
                         f"is not divisible by the size {n} of mesh axes {names} its spec "
                         f"{spec} splits it over. Replicate it (None) or pick a dividing "
                         "axis.")
    out.append(spec)
  return treedef.unflatten(out)


# --- reading what a compiled step communicates ---------------------------------------------


class Collective(NamedTuple):
  """One collective of a compiled program.

  Attributes:
    op: ``'all-gather'``, ``'reduce-scatter'``, ``'all-reduce'``, ``'all-to-all'`` or
      ``'collective-permute'``.
    dtype: element type of its result, as HLO spells it (``'bf16'``, ``'f32'``).
    bytes: bytes of its result on one device (what it produces, not what it sends).
  """

  op: str
  dtype: str
  bytes: int


_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OP_RE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(_OPS) + r")(?:-start)?\(")
_ARRAY_RE = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_MLIR_OP_RE = re.compile(r'"?stablehlo\.(' + "|".join(o.replace("-", "_") for o in _OPS)
                         + r')"?')
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_MLIR_END_RE = re.compile(r"^\s*\}\)\s*:\s*\(")
_TENSOR_RE = re.compile(r"tensor<((?:\d+x)*)(i1|[a-z]+\d+\w*)>")
_MLIR_DTYPE = {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64"}


def collectives(program_text: str) -> list[Collective]:
  """The collectives in a program's text, one per array they produce.

  Reads both the compiled HLO (``train.lower(state, batch).compile().as_text()``: what
  the backend runs) and the lowered StableHLO (``train.lower(state, batch).as_text()``:
  what jaxamp asked for, before the backend's passes; XLA:CPU, for one, promotes
  bfloat16 collectives to float32). Combined collectives (a tuple result) count once per
  array; an asynchronous pair (``all-gather-start`` / ``-done``) counts once.

  Args:
    program_text: HLO or StableHLO module text.

  Returns:
    A list of :class:`Collective`, dtypes spelled as HLO does (``'bf16'``, ``'f32'``).

  Example:
    >>> from jaxamp.sharding import collectives
    >>> collectives('%ag = bf16[8,4]{1,0} all-gather(bf16[1,4]{1,0} %p), dimensions={0}')
    [Collective(op='all-gather', dtype='bf16', bytes=64)]
  """
  if "stablehlo." in program_text:
    return _mlir_collectives(program_text)
  found = []
  for line in program_text.splitlines():
    line = _COMMENT_RE.sub("", line)  # long tuples carry /*index=5*/ comments
    m = _OP_RE.search(line)
    if m is None:
      continue
    result, op = m.groups()
    arrays = _ARRAY_RE.findall(result)
    if op + "-start(" in line and result.startswith("("):
      arrays = arrays[len(arrays) // 2:]  # a start returns (operands..., results...)
    found += [_collective(op, dtype, dims.split(",")) for dtype, dims in arrays]
  return found


def _collective(op: str, dtype: str, dims: Sequence[str]) -> Collective:
  size = math.prod(int(d) for d in dims if d)
  return Collective(op, _MLIR_DTYPE.get(dtype, dtype), size * dtypes.itemsize(dtype))


def _mlir_collectives(text: str) -> list[Collective]:
  found = []
  lines = text.splitlines()
  for i, line in enumerate(lines):
    m = _MLIR_OP_RE.search(line)
    if m is None or "=" not in line.split("stablehlo.")[0]:
      continue
    op = m.group(1).replace("_", "-")
    signature = line if "->" in line else next(
        (l for l in lines[i + 1:] if _MLIR_END_RE.match(l)), "")
    results = signature.rsplit("->", 1)[-1]
    found += [_collective(op, dtype, dims.split("x")) for dims, dtype in
              _TENSOR_RE.findall(results)]
  return found
