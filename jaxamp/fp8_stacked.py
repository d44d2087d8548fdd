"""Delayed scaling for stacked NNX layers: one state per layer of an ``nnx.scan`` stack.

A transformer's blocks are often one NNX layer holding a stack of kernels (made by
``nnx.vmap``, ``[L, in, out]``) that an ``nnx.scan`` runs one slice per step. Its scaled
format's state (FP8's :class:`jaxamp.fp8.Fp8Meta`) is kept stacked the same way:

- at init, the format's ``init_state`` broadcast to the kernel's extra leading
  dimensions (``amax_history [L, 3, H]``, ``scale [L, 3]``), under a :class:`Stacked`
  recipe wrapping the layer's own (its format, :class:`StackedFormat`, runs the wrapped
  format's ``update``, ``reduce`` and ``kept_on_skip`` once per layer);
- in the step, the layer of the step's model copy holds it as a :class:`StackedState`
  Variable (:func:`attach`), which the user's ``nnx.scan`` (``in_axes=(nnx.Carry, 0)``)
  slices along axis 0 with the kernel: inside the body the layer's matmul reads its
  slice (:func:`state_of`), and the slice's cotangent (the new amaxes) flows back through
  the scan into the stacked state's;
- a scan that does not slice the Variable (``nnx.StateAxes`` broadcasting all but
  ``nnx.Param``) leaves the layer without state: it warns and runs current scaling, as
  before.

Linen's lifted transforms (``nn.scan``, ``nn.vmap``, ``nn.remat``) run a clone of their
body that sees only the variable collections the transform lifts. A layer inside one
reads its state from the collection :data:`COLLECTION` (``'jaxamp_fp8'``), which the
step passes to ``apply`` (:func:`linen_variables`) and which ``nn.scan`` slices with the
kernel where its ``variable_axes`` lists it (``{'params': 0, 'jaxamp_fp8': 0}``, as
Flax's own FP8 layers need ``'_overwrite_with_gradient': 0``; ``nn.remat`` lifts every
collection). The state's leading dimensions are those the kernel has beyond what the
layer's call reads (:func:`linen_rows`). A transform that does not lift the collection
leaves the layer without state: it warns and runs current scaling; so does an
``nn.vmap`` or ``nn.scan`` that broadcasts the layer's kernel (one state read once per
example or step would get their amaxes summed by the transform's backward pass).

Example:
  >>> import jax.numpy as jnp, jaxamp
  >>> from jaxamp import fp8_stacked, scaled
  >>> recipe = fp8_stacked.Stacked(jaxamp.DelayedScaling(amax_history_len=4), (2,))
  >>> meta = scaled.format_of(recipe).init_state(recipe)
  >>> meta.amax_history.shape, meta.scale.shape
  ((2, 3, 4), (2, 3))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxamp import scaled
from jaxamp._flax_compat import unbox

__all__ = ["COLLECTION", "Stacked", "StackedFormat", "StackedState", "attach", "extra_dims",
           "linen_reads", "linen_rows", "linen_state_of", "linen_variables",
           "nnx_reads", "rows", "state_of"]

# The attribute of a stacked layer holding its StackedState in the step's model copy.
ATTR = "_jaxamp_fp8_stacked"


@dataclasses.dataclass(frozen=True)
class Stacked:
  """The recipe of a stacked layer: its own ``recipe``, run once per index of its
  kernel's extra leading dimensions ``dims`` (``(L,)`` for one ``nnx.scan`` stack)."""

  recipe: Any
  dims: tuple[int, ...]


def _per_layer(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
  for _ in range(n):
    fn = jax.vmap(fn)
  return fn


class StackedFormat(scaled.ScaledFormat):
  """The format of :class:`Stacked` recipes: the wrapped recipe's format, its state
  stacked over the recipe's ``dims``, updated layer by layer."""

  name = "stacked"

  def init_state(self, recipe: Stacked) -> Any:
    one = scaled.format_of(recipe.recipe).init_state(recipe.recipe)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (*recipe.dims, *jnp.shape(x))), one)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, state, recipe, **kwargs):
    raise NotImplementedError("a stacked layer's matmul runs its own recipe on its slice "
                              "of the state (jaxamp.fp8_stacked.state_of)")

  def update(self, state: Any, cotangent: Any, recipe: Stacked) -> Any:
    fmt, inner = scaled.format_of(recipe.recipe), recipe.recipe
    return _per_layer(lambda s, c: fmt.update(s, c, inner), len(recipe.dims))(
        state, cotangent)

  def reduce(self, cotangent: Any, recipe: Stacked, axes: Any) -> Any:
    fmt, inner = scaled.format_of(recipe.recipe), recipe.recipe
    return _per_layer(lambda c: fmt.reduce(c, inner, axes), len(recipe.dims))(cotangent)

  def kept_on_skip(self, old: Any, new: Any, recipe: Stacked) -> Any:
    fmt, inner = scaled.format_of(recipe.recipe), recipe.recipe
    return _per_layer(lambda o, n: fmt.kept_on_skip(o, n, inner), len(recipe.dims))(
        old, new)

  def describe(self, recipe: Stacked) -> str:
    return scaled.describe(recipe.recipe)


STACKED = StackedFormat()
scaled.register(Stacked, STACKED)


def extra_dims(module: Any) -> tuple[int, ...]:
  """The leading dimensions of an NNX FP8 layer's kernel beyond those the layer
  declares (``(L,)`` for a layer made by ``nnx.vmap`` for an ``nnx.scan`` stack; ``()``
  for a plain layer)."""
  if isinstance(module, (nnx.Einsum, nnx.Conv, nnx.ConvTranspose)):
    declared = len(module.kernel_shape)
  elif isinstance(module, nnx.LinearGeneral):
    declared = len(module.batch_axis) + len(module.in_features) + len(module.out_features)
  else:
    declared = 2
  shape = jnp.shape(module.kernel)
  return tuple(int(d) for d in shape[:max(len(shape) - declared, 0)])


def rows(model: Any, plan: list[Any], classes: tuple[type, ...],
         path_name: Callable[[Any], str]) -> list[Any]:
  """The ``(path, class, policy)`` rows of an NNX ``model``'s scaled-format modules with
  each stacked layer's policy given a :class:`Stacked` recipe (its state is then
  stacked)."""
  dims = {path_name(path): extra_dims(node)
          for path, node in nnx.iter_graph(model) if isinstance(node, classes)}
  out = []
  for path, cls, policy in plan:
    found = dims.get(path, ())
    if found and getattr(policy, "fp8", None) is not None:
      policy = policy.with_fp8(Stacked(policy.fp8, found))
    out.append((path, cls, policy))
  return out


class StackedState(nnx.Variable):
  """A stacked layer's scaled-format state in the step's model copy (jaxamp's own: no
  ``nnx.Param``, so no optimizer or cast reaches it). ``nnx.scan`` slices it with the
  kernel."""


def attach(model: Any, state: dict[str, Any], classes: tuple[type, ...],
           path_name: Callable[[Any], str]) -> None:
  """Gives each stacked layer (of ``classes``) of the NNX ``model`` (the step's own copy)
  whose path has state in ``state`` that state as a :class:`StackedState`."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, classes):
      name = path_name(path)
      if name in state and extra_dims(node):
        setattr(node, ATTR, StackedState(state[name]))


FROM_SCOPE = object()
"""What :func:`state_of` returns for a layer holding no :class:`StackedState`."""


def nnx_reads(module: Any, path: str | None, recipe: Any) -> tuple[str | None, Any]:
  """``(state key, state)`` for an NNX layer's operation (``scaled.dot_for``'s ``path``
  and ``own``): ``(path, its slice)`` for a stacked layer inside its scan, ``(None,
  None)`` where the scan did not slice its state (it runs without, and warns), else
  ``(path, None)``: its state the running scope's."""
  own = state_of(module, recipe)
  if own is FROM_SCOPE:
    return path, None
  return (path, own) if own is not None else (None, None)


def state_of(module: Any, recipe: Any) -> Any:
  """What a layer's matmul reads: its slice of a :class:`StackedState` (inside the scan
  body), ``None`` where that Variable was not sliced (a scan that broadcasts it: the
  layer runs without state, warning), or :data:`FROM_SCOPE` for a layer holding none
  (its state is the running scope's)."""
  held = vars(module).get(ATTR)
  if held is None:
    return FROM_SCOPE
  return _one_layers(held.get_value(), recipe)


def _one_layers(value: Any, recipe: Any) -> Any:
  """``value`` where it is shaped as one layer's state of ``recipe`` (the transform sliced
  it), else None."""
  one = jax.eval_shape(lambda: scaled.format_of(recipe).init_state(recipe))
  same = jax.tree.map(lambda a, b: jnp.shape(a) == b.shape, value, one)
  return value if all(jax.tree.leaves(same)) else None


# --- Linen: lifted transforms ----------------------------------------------------------------

COLLECTION = "jaxamp_fp8"
"""The Linen variable collection holding the state of FP8 layers inside lifted transforms
(each layer's under the variable ``'state'``)."""


def linen_rows(rows: list[Any], lifted: frozenset[str],
               kernels: Mapping[str, tuple[int, ...]], params: Any) -> list[Any]:
  """The ``(path, class, policy)`` rows of a Linen model that keep scaled-format state:
  the layers outside lifted transforms, and those inside whose kernel the transform
  slices in a known way (its stored shape ends with the shape the call read,
  ``kernels``): their policy then gets a :class:`Stacked` recipe over the stored
  kernel's extra leading dimensions (none under ``nn.remat``, the one transform whose
  layers keep an unstacked state). ``params``: the model's ``'params'`` collection."""
  classes = {path: cls for path, cls, _ in rows}
  out = []
  for path, cls, policy in rows:
    if path not in lifted:
      out.append((path, cls, policy))
      continue
    node = params
    for key in (path.split("/") if path else []) + ["kernel"]:
      node = node.get(key) if isinstance(node, Mapping) else None
    if node is None or path not in kernels or getattr(policy, "fp8", None) is None:
      continue  # not a layer with a kernel of its own: no state
    stored, read = tuple(jnp.shape(unbox(node))), tuple(kernels[path])
    extra = len(stored) - len(read)
    if extra < 0 or stored[extra:] != read:
      continue
    if not extra and not _only_checkpoints(path, classes):
      # An unstacked state read inside nn.vmap or nn.scan would have its cotangent summed
      # over the examples or steps: the summed amaxes of a broadcast kernel.
      continue
    out.append((path, cls, policy.with_fp8(Stacked(policy.fp8, stored[:extra]))
                if extra else policy))
  return out


def _lifted_by(cls: Any) -> str | None:
  """The lifted transform whose class Flax made of ``cls``'s base (``nn.remat(nn.Dense)``
  is a ``CheckpointDense``: the transform's name, capitalized, before the class's), or
  None."""
  if getattr(cls, "__module__", None) != "flax.linen.transforms" or len(cls.__mro__) < 2:
    return None
  base = cls.__mro__[1].__name__
  return cls.__name__[:-len(base)].lower() if cls.__name__.endswith(base) else None


def _only_checkpoints(path: str, classes: Mapping[str, type]) -> bool:
  """Whether every lifted transform around the layer at ``path`` (the first class run at
  it and at each path above, from ``classes``) is ``nn.remat``'s checkpoint, which runs
  its body once: its unstacked state is then read once."""
  parts = path.split("/") if path else []
  found = [_lifted_by(classes.get("/".join(parts[:i]))) for i in range(len(parts) + 1)]
  found = [t for t in found if t is not None]
  return bool(found) and all(t == "checkpoint" for t in found)


def linen_variables(state: Mapping[str, Any], paths: Iterable[str]) -> dict[str, Any]:
  """The :data:`COLLECTION` for ``apply``: the state of each layer at ``paths`` (those
  inside lifted transforms) in ``state``, nested as the layers are."""
  out: dict[str, Any] = {}
  for path in paths:
    if path in state:
      node = out
      for key in path.split("/") if path else []:
        node = node.setdefault(key, {})
      node["state"] = state[path]
  return out


def linen_reads(module: Any, path: str, recipe: Any, lifted: bool) -> tuple[str | None, Any]:
  """``(state key, state)`` for a Linen layer's operation (``scaled.dot_for``'s
  ``path`` and ``own``): outside lifted transforms ``(path, None)``, its state the
  running scope's; inside one, ``(path, its slice)`` where the transform lifts
  :data:`COLLECTION`, else ``(None, None)``: no state."""
  if not lifted:
    return path, None
  own = linen_state_of(module, recipe)
  if own is None:
    return None, None
  scaled.read_in_trace(path, own)
  return path, own


def linen_state_of(module: Any, recipe: Any) -> Any:
  """What a Linen layer inside a lifted transform reads: its state in
  :data:`COLLECTION` (one layer's slice inside ``nn.scan``), or None where the transform
  does not lift the collection (or slices it otherwise)."""
  if not module.has_variable(COLLECTION, "state"):
    return None
  return _one_layers(module.get_variable(COLLECTION, "state"), recipe)
