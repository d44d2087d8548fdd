"""The model-library protocol and the one registry of libraries.

Every public entry point that takes a model (``make_train_step(...).init``,
:func:`jaxamp.summary`, :func:`jaxamp.precision_report`,
:func:`jaxamp.convert_for_inference`) asks :func:`library_of` which registered
:class:`Library` accepts it, and calls that library's operations: no entry point tests a
model against a library's types itself. A new library is one object implementing
:class:`Library`, registered once with :func:`register` (as ``flax.nnx.graphlib``
registers node types).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

from jaxamp import fp8
from jaxamp.casting import is_floating_array
from jaxamp.policy import Policy, PolicyLike

__all__ = ["Adapter", "Library", "Split", "register", "libraries", "library_of"]


@runtime_checkable
class Adapter(Protocol):
  """What the train step knows of a model: ``Plan.adapter``, made by
  :meth:`Library.split`. Immutable: binding it twice binds the same model."""

  uses_rng: bool  # whether the step's key feeds the model (Linen's RNG streams)

  def bind(self, params: Any, model_state: Any, rng: Any, policy: Policy, *, train: bool,
           float32_outputs: bool, shards: Any = None) -> tuple[Any, Callable[[], Any]]:
    """``(model, new_state)``: the model ``loss_fn`` receives, each module under its
    policy, and a function giving the model state after the calls made so far."""

  def model(self, state: Any) -> Any:
    """The model holding a :class:`~jaxamp.TrainState`'s ``params`` and ``model_state``."""


class Split(NamedTuple):
  """A model taken apart for the train step."""

  adapter: Adapter
  params: Any
  model_state: Any
  rows: list[Any] | None  # (path, class, policy) per module; None: not known
  fp8_rows: list[Any] | None  # the rows of the modules that keep FP8 state


@runtime_checkable
class Library(Protocol):
  """A model library jaxamp runs models of (Flax NNX, Flax Linen, Equinox)."""

  name: str
  takes_pytrees: bool  # also trains other pytrees of floating arrays (one library may)

  def accepts(self, model: Any) -> bool:
    """Whether ``model`` is one of this library's models (or a jaxamp view of one).
    Must not import the library when it is not imported."""

  def unwrap(self, model: Any) -> tuple[Any, bool, Policy | None]:
    """``(model, recompute_norms, policy)``: a jaxamp policy wrapper or view taken off
    (its policy; ``(model, False, None)`` for a plain model)."""

  def with_policy(self, model: Any, policy: PolicyLike | None = None, *,
                  recompute_norms: bool = False) -> Any:
    """``model`` running each module under its resolved policy."""

  def split(self, model: Any, policy: Policy, *, variables: Any,
            example_args: tuple[Any, ...], example_kwargs: Mapping[str, Any],
            recompute_norms: bool, rng_streams: tuple[str, ...]) -> Split:
    """The model (unwrapped) taken apart for ``make_train_step``'s ``init``."""

  def plain(self, tree: Any) -> Any:
    """A params / model-state tree as the train state holds it."""

  def is_node(self, x: Any) -> bool:
    """Whether ``x`` is a node of this library's state trees that holds an array
    (``nnx.Variable``): such nodes are read, not flattened."""

  def value(self, x: Any) -> Any:
    """The array a state node holds (``x`` itself if it is an array)."""

  def state_reduction(self, leaf: Any) -> str | None:
    """The cross-device reduction of a model-state node known from its type
    (``'mean'``, ``'same'``), else None."""

  def holders(self, model: Any) -> dict[str, list[str]]:
    """``{param path: paths of the modules holding it}`` for tied parameters."""

  def layer_gather_refusal(self, model: Any) -> str | None:
    """Why parameters cannot be gathered where a module reads them, or None."""

  def arrays(self, model: Any, variables: Any) -> Any:
    """The arrays the user's objects passed to ``init`` hold, as a pytree."""

  def fp8_classes(self) -> tuple[type, ...]:
    """The layer classes whose matmul runs in FP8 under an FP8 policy."""

  def fp8_census(self, model: Any, variables: Any, example_args: tuple[Any, ...],
                 example_kwargs: Mapping[str, Any], policy: Policy
                 ) -> tuple[list[Any], list[str]] | None:
    """``(ops, modules)``: the matmul census the FP8 reach check reads, or None."""

  def summary_plan(self, model: Any, example_inputs: Sequence[Any],
                   example_kwargs: dict[str, Any], policy: PolicyLike | None
                   ) -> tuple[list[Any], Any, Any]:
    """``(rows, params, census)`` for :func:`jaxamp.summary`."""

  def convert_for_inference(self, model: Any, example_inputs: tuple[Any, ...],
                            policy: PolicyLike | None, module: Any) -> Any:
    """A copy with each module's parameters stored in its compute dtype."""

  def report_args(self, fn: Callable[..., Any], args: tuple[Any, ...],
                  argnums: tuple[int, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``fn`` and ``args`` as :func:`jaxamp.precision_report` lowers them: a model's
    non-array leaves closed over (Equinox), else unchanged."""


_LIBRARIES: list[Library] = []


def register(library: Library) -> Library:
  """Adds ``library`` to the registry (once per name); models are offered to the
  libraries in the order they were registered. Returns ``library``."""
  if not isinstance(library, Library):
    raise TypeError(f"{library!r} does not implement jaxamp.adapters.Library.")
  if any(lib.name == library.name for lib in _LIBRARIES):
    raise ValueError(f"A library named {library.name!r} is already registered.")
  _LIBRARIES.append(library)
  fp8.hook_classes(library.fp8_classes)
  return library


def libraries() -> tuple[Library, ...]:
  """The registered libraries, in the order they are asked."""
  return tuple(_LIBRARIES)


def library_of(model: Any, *, pytrees: bool = False) -> Library | None:
  """The first registered library that accepts ``model``; with ``pytrees``, else the one
  that takes pytrees if ``model`` holds floating arrays; else None.

  Example:
    >>> from flax import nnx
    >>> from jaxamp import adapters
    >>> adapters.library_of(nnx.Linear(2, 2, rngs=nnx.Rngs(0))).name
    'nnx'
    >>> adapters.library_of({'w': 1.0}) is None
    True
  """
  found = next((lib for lib in _LIBRARIES if lib.accepts(model)), None)
  if found is None and pytrees and any(is_floating_array(x) for x in jax.tree.leaves(model)):
    found = next((lib for lib in _LIBRARIES if lib.takes_pytrees), None)
  return found


def with_policy(model: Any, policy: PolicyLike | None = None, *,
                recompute_norms: bool = False) -> Any:
  """``model`` running each module under its resolved policy, whichever registered
  library it belongs to: :func:`jaxamp.nnx.with_policy` for an NNX module,
  :func:`jaxamp.linen.with_policy` for a Linen module, :func:`jaxamp.equinox.with_policy`
  for an Equinox model (each library's own keywords are on its function).

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> from flax import nnx
    >>> model = jaxamp.with_policy(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 'mixed_bfloat16')
    >>> model(jnp.ones((1, 4))).dtype
    dtype(bfloat16)

  Raises:
    TypeError: no registered library takes ``model`` (the libraries are named).
  """
  library = library_of(model)
  if library is None:
    raise TypeError(f"with_policy takes a model of a registered library "
                    f"({', '.join(lib.name for lib in _LIBRARIES)}); got "
                    f"{type(model).__name__}.")
  return library.with_policy(model, policy, recompute_norms=recompute_norms)


def is_node(x: Any) -> bool:
  """Whether ``x`` is a node of a registered library's state trees that holds an array
  (an ``nnx.Variable``): a leaf where the train step walks params, gradients or state.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxamp import adapters
    >>> adapters.is_node(nnx.Param(jnp.ones(2))), adapters.is_node(jnp.ones(2))
    (True, False)
  """
  return any(lib.is_node(x) for lib in _LIBRARIES)


def value_of(x: Any) -> Any:
  """The array a library's state node holds (:func:`is_node`), or ``x`` itself."""
  for lib in _LIBRARIES:
    if lib.is_node(x):
      return lib.value(x)
  return x
