"""Scaled formats: the protocol a precision with per-module state implements.

A scaled format runs a layer's matmul on operands it quantizes with scales of its own
(FP8 with one scale per tensor, :mod:`jaxamp.fp8`, is the one jaxamp ships), and may keep
state per module between steps (delayed scaling's amax history). Its configuration is a
*recipe*, a frozen, hashable value a :class:`jaxamp.Policy` holds (``Policy(...,
fp8=recipe)``: a policy is a static argument of ``jax.jit``); its behaviour is a
:class:`ScaledFormat`, registered for the recipe's type with :func:`register`. The train
step knows formats only through this module:

- ``init``: each module the format runs gets ``fmt.init_state(recipe)`` in
  ``TrainState.fp8`` (``{module path: state}``, also read as ``TrainState.scaled``), out
  of the optimizer's reach;
- the forward pass: the layer's matmul is ``fmt.dot_general(..., state=, recipe=)``, with
  the module's state read from :func:`state_scope`;
- after the backward pass: the state's gradient (what the format's ``custom_vjp`` hands
  back as the state's cotangent) is reduced across devices (``fmt.reduce``) and turned
  into the new state (``fmt.update``), after every micro-batch (:func:`merge_state`);
- a skipped step keeps ``fmt.kept_on_skip(old, new)`` (the old state by default).

A toy format rounding both operands to a grid of ``1 / scale`` and counting its matmuls
(``tests/test_scaled.py`` trains a model with one, its state updated through a
``custom_vjp``):

Example:
  >>> import dataclasses, jax, jax.numpy as jnp
  >>> from jaxamp import scaled
  >>> @dataclasses.dataclass(frozen=True)
  ... class Grid:
  ...   scale: float = 2.0
  >>> class GridFormat(scaled.ScaledFormat):
  ...   name = "grid"
  ...   def init_state(self, recipe):
  ...     return jnp.zeros((), jnp.float32)
  ...   def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
  ...                   preferred_element_type=None, *, state, recipe):
  ...     q = lambda x: jnp.round(x * recipe.scale) / recipe.scale
  ...     return jax.lax.dot_general(q(lhs), q(rhs), dimension_numbers)
  ...   def update(self, state, cotangent, recipe):
  ...     return state + 1
  >>> scaled.register(Grid, GridFormat())
  >>> fmt = scaled.format_of(Grid())
  >>> fmt.dot_general(jnp.array([[0.7]]), jnp.array([[1.2]]), (((1,), (0,)), ((), ())),
  ...                 state=None, recipe=Grid()).tolist()
  [[0.5]]
  >>> scaled.unregister(Grid)
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from jax import lax

from jaxamp import _warn_once, patch_conv
from jaxamp._stack import Stack

__all__ = [
    "ScaledFormat",
    "describe",
    "described_in",
    "amax",
    "conv_for",
    "dims",
    "transpose_lhs",
    "format_of",
    "is_recipe",
    "matmul_layout",
    "kept_on_skip",
    "merge_state",
    "policy_name",
    "policy_recipe",
    "read_in_trace",
    "recipe_named",
    "refuse_extra_arguments",
    "register",
    "runs_conv",
    "state_scope",
    "unregister",
]


class ScaledFormat(abc.ABC):
  """What a scaled format defines. Subclass it, and :func:`register` an instance for the
  type of its recipes.

  Attributes:
    name: what warnings and errors call it (``'FP8'``).
    census_dtypes: the operand dtype names of its matmuls (``'float8_e4m3fn'``): a
      matmul with such an operand counts as run in the format (the census and
      :func:`jaxamp.precision_report` read it).
    min_compute_capability: the NVIDIA compute capability whose tensor cores run its
      matmuls natively (8.9: Ada and Hopper's FP8; 10.0: Blackwell's MX blocks); the
      policy's "no fast path here" warning names it.
    runs_convolutions: whether convolution layers run in the format (through
      :meth:`conv_general_dilated`); False leaves them in the compute dtype, with a
      warning naming them.
  """

  name: str = "scaled"
  census_dtypes: frozenset[str] = frozenset()
  min_compute_capability: float = 8.9
  runs_convolutions: bool = True

  @abc.abstractmethod
  def init_state(self, recipe: Any) -> Any:
    """A module's fresh state: a pytree of arrays, whose structure never changes."""

  @abc.abstractmethod
  def dot_general(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                  precision: Any = None, preferred_element_type: Any = None, *,
                  state: Any, recipe: Any) -> jax.Array:
    """The layer's matmul (``lhs`` the input, ``rhs`` the kernel), as
    ``lax.dot_general``. ``state``: the module's state, or None where there is none
    (outside a train step). In a train step the state is differentiated: its cotangent
    is what :meth:`update` receives (a ``custom_vjp`` hands out what the pass observed,
    such as the amaxes of the output gradient)."""

  def conv_general_dilated(self, lhs: jax.Array, rhs: jax.Array, window_strides: Any,
                           padding: Any, lhs_dilation: Any = None, rhs_dilation: Any = None,
                           dimension_numbers: Any = None, feature_group_count: int = 1,
                           batch_group_count: int = 1, precision: Any = None,
                           preferred_element_type: Any = None, *, state: Any,
                           recipe: Any, **kwargs: Any) -> jax.Array:
    """A convolution layer's convolution (``lhs`` the input, ``rhs`` the kernel), as
    ``lax.conv_general_dilated``, with ``state`` as for :meth:`dot_general`.

    By default an im2col GEMM through the format's own :meth:`dot_general`
    (:func:`jaxamp.patch_conv.conv_general_dilated`: the input's patches times the kernel
    as ``[C_in * prod(window), C_out]``, groups a batch dimension of the dot), so a format
    defining only a dot runs convolution layers too. A format may define its own (the
    per-tensor FP8 one runs FP8 convolutions), or decline convolutions with
    ``runs_convolutions = False``: its convolution layers then stay in the compute dtype,
    with a warning naming them (:func:`runs_conv` tells)."""
    if not self.runs_convolutions:
      raise NotImplementedError(f"the {self.name} format runs no convolutions")
    dot = functools.partial(self.dot_general, state=state, recipe=recipe, **kwargs)
    return patch_conv.conv_general_dilated(
        dot, lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
        dimension_numbers, feature_group_count, batch_group_count, precision,
        preferred_element_type)

  @abc.abstractmethod
  def update(self, state: Any, cotangent: Any, recipe: Any) -> Any:
    """The state after a forward and backward pass that ran the module, from the old
    ``state`` and the state's ``cotangent`` (already :meth:`reduce`-d)."""

  def reduce(self, cotangent: Any, recipe: Any, axes: Any) -> Any:
    """Inside ``shard_map``: the ``cotangent`` combined over the batch mesh ``axes``, so
    every device updates its state alike. The default: each leaf's maximum."""
    del recipe
    return jax.tree.map(lambda x: lax.pmax(x, axes), cotangent)

  def kept_on_skip(self, old: Any, new: Any, recipe: Any) -> Any:
    """The state a skipped step (non-finite gradients) keeps: the old one by default."""
    del new, recipe
    return old

  def describe(self, recipe: Any) -> str:
    """What :func:`jaxamp.precision_report` and :func:`jaxamp.summary` call a matmul run
    with ``recipe``: its operand formats and what one scale covers (``'fp8 e4m3fn
    rowwise'``). Optional: by default the format's ``name``."""
    del recipe
    return self.name

  # Optional: ``product(self, role, a, b, recipe) -> jax.Array``, one of a layer's three
  # matmuls run in the format alone, without state (current scaling), on operands laid
  # out as :func:`matmul_layout` lays them (``a [*batch, M, K] @ b [*batch, K, N]``),
  # float32: ``role`` ``'fwd'`` (``a`` the input, ``b`` the kernel), ``'dgrad'`` (``a``
  # the output gradient, ``b`` the kernel transposed) or ``'wgrad'`` (``a`` the input
  # transposed, ``b`` the output gradient). :class:`jaxamp.PerMatmulScaling` composes
  # formats through it.
  product = None

  # Optional: ``gather_quantized(self, x, axes, gather, recipe, state=None) ->
  # jax.Array | None``, FSDP's all-gather of a kernel this format quantizes
  # (``jaxamp.fsdp``; the gather passes it ``x``, this device's slice already in the
  # reader's compute dtype, ``axes``, the mesh axes the slice is split over, ``gather``,
  # which all-gathers an array laid out as ``x``, and, where the step has it, ``state=``,
  # the reading module's state, read only). It returns the whole kernel in ``x``'s dtype, moved in fewer bytes (FP8
  # values and a scale), such that the format's matmul quantizes it to exactly the values
  # it would have quantized the kernel gathered in the compute dtype to; or None where it
  # cannot promise that (the gather then moves the compute dtype). Its gradient is the
  # gather's (straight-through). :mod:`jaxamp.fp8` defines it (delayed scaling from the
  # state), :mod:`jaxamp.block` for square weight blocks.
  gather_quantized = None

  def gathers_read(self, read: str, recipe: Any) -> bool:
    """Whether :attr:`gather_quantized` may gather the kernel of a module that reads it
    as ``read``: ``'matrix'`` (one operand of a matmul, transposed or not: Linear, Dense,
    LinearGeneral, DenseGeneral, Hugging Face's FlaxConv1D, Equinox's Linear),
    ``'einsum'`` (an Einsum: its pattern, known only at call time, may make a kernel
    dimension a batch one) or ``'conv'`` (a convolution). The default: every read (a
    per-tensor scale does not care how the kernel is laid out)."""
    del read, recipe
    return True

  # Optional: ``whatif(self, x, role, recipe) -> tuple[jax.Array, Any] | None``, what the
  # numerics monitor's what-if measures (``jaxamp.Numerics(whatif=(policy name,))``):
  # ``x``, 2-D with the contraction last, scaled as the format scales that operand of a
  # layer's matmuls: ``role`` ``'input'`` (the forward product's input, ``[tokens,
  # features]``), ``'grad'`` (the output gradient in the input-gradient product),
  # ``'input_wgrad'`` / ``'grad_wgrad'`` (the same tensors transposed, ``[features,
  # tokens]``, as the weight-gradient product reads them): the float32 values before
  # their rounding and clipping to the FP8 format, and that format's dtype; None where
  # that product does not quantize the operand. The monitor counts the nonzero values
  # below the dtype's smallest normal in either layout (underflow) and those rounding
  # past its largest (saturated). Per-tensor FP8 needs none: the monitor's ``e4m3`` /
  # ``e5m2`` columns are its what-if, the layout making no difference.
  whatif = None

  def stateless_warning(self, recipe: Any, what: str) -> str | None:
    """The warning for a module run in a train step without state (inside
    ``nnx.scan``, say), or None where the recipe needs none."""
    del recipe
    return (f"jaxamp: the {self.name} {what} has no state in this train step (a layer "
            "inside a scan/vmap transform that does not slice its state, or one created "
            "during the call): it runs with no state. In Linen's nn.scan, add "
            "'jaxamp_fp8': 0 to variable_axes. Or keep it out of the format with a "
            "jaxamp.set_policy rule to silence this.")


# --- the registry: recipe type -> format -------------------------------------------------

_FORMATS: dict[type, ScaledFormat] = {}
_NAMES: dict[str, Callable[[], Any]] = {}
_POLICIES: dict[str, Callable[[], Any]] = {}


def register(recipe_type: type, fmt: ScaledFormat,
             names: Mapping[str, Callable[[], Any]] | None = None,
             policies: Mapping[str, Callable[[], Any]] | None = None) -> None:
  """Makes ``fmt`` run the recipes of ``recipe_type`` (and its subclasses): a policy then
  takes them (``Policy(..., fp8=recipe)``).

  Args:
    recipe_type: the recipes' class.
    fmt: the format running them.
    names: short names policy strings take (``'p=f32,c=bf16,fp8=<name>'``), each with a
      function making its recipe.
    policies: policy names ``get_policy`` takes (``'mixed_fp8_rowwise'``), each with a
      function making its recipe: float32 params, bfloat16 compute and output, as
      ``'mixed_fp8'``.
  """
  if not isinstance(fmt, ScaledFormat):
    raise TypeError(f"register takes a jaxamp.scaled.ScaledFormat, got {fmt!r}.")
  _FORMATS[recipe_type] = fmt
  _NAMES.update(names or {})
  _POLICIES.update(policies or {})


def unregister(recipe_type: type) -> None:
  """Forgets ``recipe_type``'s format and the names that make its recipes."""
  _FORMATS.pop(recipe_type, None)
  for table in (_NAMES, _POLICIES):
    for name in [n for n, make in table.items() if make is recipe_type]:
      del table[name]


def _lookup(recipe: Any) -> ScaledFormat | None:
  for cls in type(recipe).__mro__:
    if cls in _FORMATS:
      return _FORMATS[cls]
  return None


def is_recipe(recipe: Any) -> bool:
  """Whether ``recipe`` is of a registered type."""
  return _lookup(recipe) is not None


def format_of(recipe: Any) -> ScaledFormat:
  """The format registered for ``recipe``'s type; a ValueError naming those known."""
  fmt = _lookup(recipe)
  if fmt is None:
    known = ", ".join(sorted(t.__name__ for t in _FORMATS))
    raise ValueError(f"{recipe!r} is not a recipe of a registered scaled format "
                     f"(registered: {known}); see jaxamp.scaled.register.")
  return fmt


def describe(recipe: Any) -> str:
  """What ``recipe``'s format calls its matmuls (:meth:`ScaledFormat.describe`; a format
  without the method: its ``name``).

  Example:
    >>> import jaxamp
    >>> jaxamp.scaled.describe(jaxamp.DelayedScaling())
    'fp8 e4m3fn/e5m2 per-tensor delayed'
  """
  fmt = format_of(recipe)
  method = getattr(fmt, "describe", None)
  return str(method(recipe)) if callable(method) else fmt.name


# The named scope each scaled matmul runs under: the lowered program's ops carry it in
# their locations, where jaxamp.precision_report reads which format ran them.
SCOPE = "jaxamp_scaled"


def scope_name(recipe: Any) -> str:
  """The named scope of ``recipe``'s matmuls: ``'jaxamp_scaled[<describe>]'``."""
  return f"{SCOPE}[{describe(recipe)}]"


_SCOPE_RE = re.compile(re.escape(SCOPE) + r"\[([^\]]*)\]")


def described_in(name_stack: str) -> str:
  """The format an op ran in, read off its name stack (a jaxpr equation's, or a lowered
  op's location name): the innermost :func:`scope_name` label, ``''`` outside every one.

  Example:
    >>> from jaxamp import scaled
    >>> scaled.described_in('jit(f)/transpose(jvp(jaxamp_scaled[fp8 x / y]))/dot_general')
    'fp8 x / y'
  """
  found = _SCOPE_RE.findall(name_stack)
  return found[-1] if found else ""


def recipe_named(name: str) -> Any:
  """The recipe a registered short name makes, or None."""
  make = _NAMES.get(name)
  return None if make is None else make()


def policy_recipe(name: str) -> Any:
  """The recipe a registered policy name makes, or None."""
  make = _POLICIES.get(name)
  return None if make is None else make()


def policy_names() -> tuple[str, ...]:
  """The policy names registered formats add (``'mixed_fp8_rowwise'``), in order."""
  return tuple(_POLICIES)


def recipe_names() -> tuple[str, ...]:
  """The short names registered formats add for ``fp8=`` in policy strings."""
  return tuple(_NAMES)


def policy_name(recipe: Any) -> str | None:
  """The registered policy name whose recipe equals ``recipe``, or None."""
  return next((name for name, make in _POLICIES.items() if make() == recipe), None)


# --- the state a train step threads through the model ------------------------------------


class _Scope:
  """One traced forward pass: the state it reads and, in a train step's forward pass
  (``record``), which modules used it."""

  def __init__(self, state: Mapping[str, Any], record: bool = False):
    self.state = dict(state)
    self.record = record
    self.names: dict[int, str] = {}  # id(NNX module) -> path
    self.used: set[str] = set()
    self.readers: dict[str, Any] = {}  # path -> the state a lifted layer's trace read


_scopes = Stack()


def current() -> _Scope | None:
  """The innermost running scope, or None."""
  return _scopes.top()


@contextlib.contextmanager
def state_scope(state: Mapping[str, Any] | None, *,
                record: bool = False) -> Iterator[_Scope | None]:
  """Makes ``state`` (module path -> its format's state) what scaled layers read here.

  ``record``: the block is a train step's forward pass, whose backward pass hands out
  the new state: each module's use is recorded (a module run twice is refused), and a
  layer whose recipe needs state but has none (even with no state at all) warns. Without
  it (eval) modules only read their state, as often as they run.
  """
  if not state and not record:
    yield None
    return
  with _scopes.pushed(_Scope(state or {}, record)) as scope:
    yield scope


@contextlib.contextmanager
def suspended() -> Iterator[None]:
  """No state in this block: abstract passes (plans, censuses) traced inside a step run
  without state and count no module as run."""
  with _scopes.pushed(_Scope({})):
    yield


def name_modules(named: Mapping[int, str]) -> None:
  """Tells the running scope the path of each NNX module id (its state's key)."""
  scope = current()
  if scope is not None:
    scope.names.update(named)


def read_in_trace(path: str, state: Any) -> None:
  """Notes that the layer at ``path`` inside a lifted transform reads ``state`` (its
  slice, a value of the trace running it). A transform that traces its body more than
  once and keeps the last trace (Flax's ``nn.scan`` first traces it to check its
  broadcast variables, and drops that trace) reads another ``state`` each time: that
  trace replaces the earlier (:func:`retraced`); a second run within one trace is
  still refused."""
  scope = current()
  if scope is not None and scope.readers.get(path, state) is not state:
    retraced(path)
  if scope is not None:
    scope.readers[path] = state


def retraced(path: str | None) -> None:
  """Forgets that the module at ``path`` ran its matmul in this step: its matmul is
  traced again to replace that trace, whose result is dropped (a ``custom_vmap`` rule
  replacing the function's own trace), and is not a second run."""
  scope = current()
  if scope is not None and path is not None:
    scope.used.discard(path)


def _checked(path: str | None, recipe: Any, what: str, own: Any = None
             ) -> tuple[ScaledFormat, Any, Callable[[], None]]:
  """The format of ``recipe``, the state of the module at ``path`` in the running scope,
  and the check its operation runs when it runs (not before: a module whose matmul does
  not run, an outer-product einsum, keeps its state; one run twice in a step is
  refused)."""
  scope = current()
  state = scope.state.get(path) if scope is not None and path is not None else None
  state = state if own is None else own
  fmt = format_of(recipe)

  def check():
    # Warned when the matmul runs, not when the layer is set up: a lifted transform's
    # wrapper (nn.remat's) gets a dot that only its clone, named by its own path, runs.
    if scope is not None and scope.record and state is None:
      message = fmt.stateless_warning(recipe, what)
      if message is not None:
        _warn_once.warn_once(("fp8.stateless", what), message, RuntimeWarning,
                             stacklevel=3)
    if state is not None and scope.record:
      if path in scope.used:
        raise ValueError(
            f"{fmt.name} module {path!r} ran twice in one step; its state holds one "
            "history per module, and the two backward passes would add their histories. "
            f"Keep it out of {fmt.name} with jaxamp.set_policy({path!r}, "
            "'mixed_bfloat16').")
      scope.used.add(path)

  return fmt, state, check


def dot_for(path: str | None, recipe: Any, what: str, own: Any = None) -> Callable[..., Any]:
  """The ``dot_general`` of the module at ``path`` (``what`` names it in messages) in the
  running scope: its format's, with its state (``own``, where given: a stacked layer's
  slice of its state, :mod:`jaxamp.fp8_stacked`).

  The state is read when the module's matmul runs, not before: a module whose matmul
  does not run (an outer-product einsum) keeps its state, and one whose matmul runs
  twice in a step is refused.
  """
  fmt, state, check = _checked(path, recipe, what, own)

  def dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
          **kwargs):
    check()
    if kwargs.get("out_sharding", "absent") is None:
      del kwargs["out_sharding"]  # Flax layers pass it; None asks for nothing
    with jax.named_scope(scope_name(recipe)):
      return fmt.dot_general(lhs, rhs, dimension_numbers, precision,
                             preferred_element_type, state=state, recipe=recipe, **kwargs)

  dot.jaxamp_fp8 = True  # ours, not the user's: a lifted clone gets its own
  return dot


def matmul_layout(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any
                  ) -> tuple[jax.Array, jax.Array, Callable[[jax.Array], jax.Array]]:
  """A ``dot_general``'s operands laid out as ``[*batch, M, K]`` and ``[*batch, K, N]``
  (the contracted dimensions flattened in order, the free ones into ``M`` and ``N``), and
  the function laying a ``[*batch, M, N]`` result back out as ``dot_general``'s: the
  layout :meth:`ScaledFormat.product` takes.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp import scaled
    >>> a, b, back = scaled.matmul_layout(jnp.ones((2, 3, 4)), jnp.ones((4, 5)),
    ...                                   (((2,), (0,)), ((), ())))
    >>> a.shape, b.shape, back(a @ b).shape
    ((6, 4), (4, 5), (2, 3, 5))
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = (tuple(int(i) for i in d) for d in (lc, rc, lb, rb))
  lfree = [i for i in range(lhs.ndim) if i not in lc and i not in lb]
  rfree = [i for i in range(rhs.ndim) if i not in rc and i not in rb]
  batch = tuple(lhs.shape[i] for i in lb)
  k = math.prod(lhs.shape[i] for i in lc)
  m_shape = tuple(lhs.shape[i] for i in lfree)
  n_shape = tuple(rhs.shape[i] for i in rfree)
  a = jax.numpy.transpose(lhs, (*lb, *lfree, *lc)).reshape(*batch, math.prod(m_shape), k)
  b = jax.numpy.transpose(rhs, (*rb, *rc, *rfree)).reshape(*batch, k, math.prod(n_shape))
  return a, b, lambda out: out.reshape(*batch, *m_shape, *n_shape)


def dims(dimension_numbers: Any) -> tuple[Any, ...]:
  """``dot_general``'s dimension numbers as tuples of ints (hashable: a custom_vjp's
  static argument)."""
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
          (tuple(int(i) for i in lb), tuple(int(i) for i in rb)))


def amax(x: jax.Array) -> jax.Array:
  """``max |x|`` as a float32 scalar: what a format's state records of an operand."""
  return jax.numpy.max(jax.numpy.abs(x)).astype(jax.numpy.float32)


def _ranges_like(*xs):
  start = 0
  for x in xs:
    yield tuple(range(start, start + len(x)))
    start += len(x)


def transpose_lhs(g: jax.Array, x_ndim: int, y_ndim: int, dimension_numbers: Any,
                  dot: Callable[[jax.Array, Any], jax.Array],
                  swap_ans: bool = False) -> jax.Array:
  """The cotangent of ``dot_general(x, y, dimension_numbers)``'s ``x`` from the output's
  cotangent ``g``, as ``lax``'s transpose rule builds it, with ``dot(g, g_dims)`` the
  matmul it runs (``y`` bound by the caller): a format quantizes that matmul's operands
  along its own contraction. ``swap_ans``: ``x`` is the rhs (the output's dimensions are
  ``y``'s free ones first), for the rhs's cotangent with the dimension numbers swapped.

  Example:
    >>> import jax.numpy as jnp
    >>> from jax import lax
    >>> from jaxamp import scaled
    >>> x, y, g = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones((2, 4))
    >>> scaled.transpose_lhs(g, 2, 2, (((1,), (0,)), ((), ())),
    ...                      lambda g, d: lax.dot_general(g, y, d)).shape
    (2, 3)
  """
  (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
  x_kept = [i for i in range(x_ndim) if i not in x_contract and i not in x_batch]
  y_kept = tuple(i for i in range(y_ndim) if i not in y_contract and i not in y_batch)
  if swap_ans:
    ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
  else:
    ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
  g_dims = ((ans_y, y_kept), (ans_batch, tuple(y_batch)))
  x_contract_by_y = [x_contract[i] for i in sorted(range(len(y_contract)),
                                                   key=lambda i: y_contract[i])]
  order = list(x_batch) + x_kept + x_contract_by_y
  out_axes = sorted(range(len(order)), key=lambda i: order[i])
  return jax.numpy.transpose(dot(g, g_dims), tuple(out_axes))


def refuse_extra_arguments(kwargs: Mapping[str, Any], what: str, function: str) -> None:
  """Refuses what a format's ``dot_general`` or convolution (``function``, doing
  ``what``) cannot honour: an ``out_sharding`` (Flax layers pass None, which is fine)
  or any other keyword."""
  if kwargs.get("out_sharding") is not None:
    raise NotImplementedError(f"jaxamp's {what} takes no out_sharding; shard its inputs.")
  unknown = set(kwargs) - {"out_sharding"}
  if unknown:
    raise TypeError(f"{function} got unexpected arguments {sorted(unknown)}.")


def runs_conv(recipe: Any) -> bool:
  """Whether ``recipe``'s format runs convolution layers
  (:attr:`ScaledFormat.runs_convolutions`: its own convolution or the default im2col
  GEMM through its dot)."""
  fmt = _lookup(recipe)
  return fmt is not None and bool(fmt.runs_convolutions)


def conv_for(path: str | None, recipe: Any, what: str, own: Any = None) -> Callable[..., Any]:
  """The ``conv_general_dilated`` of the convolution layer at ``path`` in the running
  scope: its format's, with its state (``own`` where given, as :func:`dot_for`'s),
  checked as :func:`dot_for`'s dot."""
  fmt, state, check = _checked(path, recipe, what, own)

  def conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
           dimension_numbers=None, feature_group_count=1, batch_group_count=1,
           precision=None, preferred_element_type=None, **kwargs):
    check()
    if kwargs.get("out_sharding", "absent") is None:
      del kwargs["out_sharding"]  # Flax layers pass it; None asks for nothing
    with jax.named_scope(scope_name(recipe)):  # reports name the format
      return fmt.conv_general_dilated(
          lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
          feature_group_count, batch_group_count, precision, preferred_element_type,
          state=state, recipe=recipe, **kwargs)

  conv.jaxamp_fp8 = True
  return conv


def merge_state(old: Mapping[str, Any], cotangent: Mapping[str, Any], used: set[str],
                recipes: Mapping[str, Any], axes: Any = None) -> dict[str, Any]:
  """The state after a forward and backward pass: each module that ran updated by its
  format from its state's cotangent (first reduced over the mesh ``axes``, inside
  ``shard_map``); the others as they were."""
  out = {}
  for path, state in old.items():
    if path in used:
      fmt, recipe = format_of(recipes[path]), recipes[path]
      cot = cotangent[path]
      if axes:
        cot = fmt.reduce(cot, recipe, axes)
      out[path] = fmt.update(state, cot, recipe)
    else:
      out[path] = state
  return out


def kept_on_skip(old: Any, new: Any, recipes: Mapping[str, Any]) -> Any:
  """The state a skipped step keeps: each module's format decides (the old state by
  default); None stays None."""
  if old is None:
    return old
  return {path: format_of(recipes[path]).kept_on_skip(state, new[path], recipes[path])
          if path in recipes else state for path, state in old.items()}


def operand_dtypes() -> frozenset[str]:
  """The dtype names the census counts as run in some registered format."""
  return frozenset().union(*(f.census_dtypes for f in _FORMATS.values()))

