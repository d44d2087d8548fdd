"""Which precision each JAX primitive runs in under :func:`jaxamp.autocast`: the lists as data.

:func:`jaxamp.autocast` looks up every primitive of the traced function in an
:class:`AutocastLists` and casts its floating operands accordingly:

- ``low_precision``: to the policy's compute dtype (``dot_general``, convolutions);
- ``float32``: float16/bfloat16 operands to float32 (``exp``, ``log``, ``pow``,
  ``rsqrt``, linear algebra);
- ``follow_compute``: to the compute dtype when one operand is in it and the others are
  float32 values not *pinned* to float32, else as ``widest`` (``add``, ``sub``,
  ``mul``: a bias or residual add stays in the compute dtype). A value is pinned when a
  float32-list op produced it or it was computed from one, or when it crosses a loop,
  ``cond`` or custom-derivative boundary: a norm's statistics, a loss;
- ``widest``: to the widest floating operand dtype (``div``, ``select_n``, comparisons);
- ``passthrough``: nothing (``reshape``, ``tanh``, ``reduce_max``, ``gather``);
- ``as_traced``: to the dtypes the function was traced with (``scatter``, callbacks);
- ``conditional``: a rule (:class:`ReductionSize`) picks one of those per equation:
  ``reduce_sum`` and ``cumsum`` run in float32 when they sum more than one element.

A primitive in no list runs as traced. Integer, boolean, PRNG-key and float64 operands
are never cast, and autocast recurses into the :data:`HIGHER_ORDER` primitives. Under
bfloat16 the defaults are :data:`BFLOAT16_LISTS`. The autocast guide
(``docs/guides/autocast.md``) sets the lists beside torch.autocast's and MXNet AMP's and
says where and why they differ.

The lists are immutable; edit a copy:

  >>> from jaxamp.op_lists import AutocastLists, ReductionSize
  >>> lists = AutocastLists().add('tanh', to='float32')
  >>> lists.category('tanh'), AutocastLists().category('tanh')
  ('float32', 'passthrough')
  >>> lists = lists.add('reduce_sum', to=ReductionSize(more_than=1024))
  >>> lists.category('reduce_sum'), lists.remove('tanh').category('tanh') is None
  ('conditional', True)
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

__all__ = [
    "AutocastLists",
    "BFLOAT16_LISTS",
    "CATEGORIES",
    "DEFAULT_LISTS",
    "HIGHER_ORDER",
    "ReductionSize",
    "Rule",
]

CATEGORIES: tuple[str, ...] = ("low_precision", "float32", "follow_compute", "widest",
                               "passthrough", "as_traced")
"""The lists an equation can be run by (a conditional rule returns one of these)."""

# A rule gets the equation (a ``jax.extend.core.JaxprEqn``: primitive, params, operand
# avals) and returns one of CATEGORIES.
Rule = Callable[[Any], str]

HIGHER_ORDER: frozenset[str] = frozenset({
    # calls: inlined (jax 0.11 folds call/closed_call into eval_jaxpr)
    "jit", "closed_call", "call", "eval_jaxpr",
    # rematerialisation (jax.checkpoint): re-wrapped in jax.checkpoint
    "remat2",
    # control flow: bodies autocast, operands and results at the traced dtypes
    "scan", "while", "cond",
    # custom derivatives: primal and rules autocast, the rules kept
    "custom_jvp_call", "custom_vjp_call",
    "shard_map",
})
"""Primitives autocast recurses into; they belong to no list and cannot be added to one."""

class _PrimitiveNames(frozenset):
  """A frozenset of primitive names whose repr gives only their number.

  The default lists are ``AutocastLists``' field defaults, so signatures and ``help()``
  print them: ~250 names. In every other way this is a plain frozenset (equal to, and
  hashed as, one with the same names); ``AutocastLists`` stores plain frozensets.
  """

  __slots__ = ()

  def __repr__(self) -> str:
    return f"<jax primitives: {len(self)} names>"


_LOW_PRECISION = _PrimitiveNames({"dot_general", "conv_general_dilated", "ragged_dot_general"})

_FLOAT32 = _PrimitiveNames({
    # exponentials, logarithms, powers (torch: exp, expm1, log*, pow, rsqrt)
    "exp", "exp2", "expm1", "log", "log1p", "log2", "pow", "integer_pow", "square", "rsqrt",
    "reciprocal",
    # trigonometric and hyperbolic functions torch keeps in float32, and their inverses
    "tan", "acos", "asin", "cosh", "sinh", "acosh", "asinh", "atanh",
    # special functions
    "erf_inv", "erfc", "lgamma", "digamma", "polygamma", "igamma", "igammac",
    "igamma_grad_a", "zeta", "bessel_i0e", "bessel_i1e",
    "regularized_incomplete_beta", "random_gamma",
    # products and log-sum-exps (torch: prod, cumprod)
    "reduce_prod", "cumprod", "cumlogsumexp",
    # linear algebra and FFT: no half-precision kernels, and ill-conditioned in half
    "cholesky", "eig", "eigh", "lu", "qr", "svd", "schur", "hessenberg",
    "householder_product", "triangular_solve", "tridiagonal", "tridiagonal_solve", "geqrf",
    "geqp3", "ormqr", "cholesky_update", "symmetric_product", "fft",
})

_FOLLOW_COMPUTE = _PrimitiveNames({
    # a bias, scale or residual stream added to, or multiplied into, a matmul's result
    "add", "sub", "mul",
})

_WIDEST = _PrimitiveNames({
    # binary arithmetic and comparisons: lax requires equal operand dtypes
    "add_any", "div", "rem", "max", "min", "atan2", "nextafter",
    "complex", "eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to", "lt_to",
    # several arrays combined into one
    "clamp", "select_n", "concatenate", "stack", "pad", "dynamic_update_slice",
    "select_and_gather_add", "select_and_scatter_add", "ragged_all_to_all",
    # Horner evaluation of x and its coefficients (jax >= 0.12: jnp.polyval)
    "polynomial",
})

_PASSTHROUGH = _PrimitiveNames({
    # elementwise functions fine in half precision (torch leaves them alone too)
    "abs", "neg", "sign", "floor", "ceil", "round", "is_finite", "sqrt", "cbrt", "tanh",
    "logistic", "sin", "cos", "atan", "erf", "real", "imag", "conj", "reduce_precision",
    # 1 - x**2 as (1 + x)(1 - x) (jax >= 0.11: tanh's derivative); exact enough in half
    "one_minus_square",
    "convert_element_type", "stop_gradient", "copy", "zeros_like",
    # layout and indexing
    "broadcast_in_dim", "broadcast_to", "reshape", "squeeze", "transpose", "rev", "slice",
    "dynamic_slice", "gather", "split", "tile", "unstack", "iota",
    # exact reductions, selections and sorts
    "reduce_max", "reduce_min", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin",
    "cummax", "cummin", "sort", "top_k", "approx_top_k", "reduce_window_max",
    "reduce_window_min", "reduce_window_sum",
    # integer and boolean bit operations
    "not", "and", "or", "xor", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "population_count", "clz", "mulhi",
    # PRNG (keys and bits are never floating)
    "rng_bit_generator", "random_seed", "random_split", "random_fold_in", "random_bits",
    "random_wrap", "random_unwrap", "random_clone", "threefry2x32", "threefry4x32",
    "philox2x32", "philox4x32", "iota_2x32_shape", "lu_pivots_to_permutation",
    # collectives: each operand reduced or moved on its own
    "psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_gather", "all_to_all",
    "reduce_scatter", "pvary", "psum_invariant", "all_gather_invariant", "axis_index",
    # placement, naming and effects plumbing
    "device_put", "sharding_constraint", "reshard", "layout_constraint", "inspect_sharding",
    "with_memory_space_constraint", "optimization_barrier", "name", "stage", "dce_sink",
    "create_token", "after_all", "platform_index", "shape_assertion", "dimension_size",
    "dim_as_value",
})

_AS_TRACED = _PrimitiveNames({
    # their params hold a combiner jaxpr typed at the traced dtype
    "reduce", "reduce_window", "select_and_scatter", "scatter", "scatter-add",
    "scatter-sub", "scatter-mul", "scatter-min", "scatter-max", "custom_linear_solve",
    # meaning depends on the exact dtype
    "bitcast_convert_type", "rng_uniform",
    # mutable references keep their dtype
    "get", "swap", "addupdate", "empty2",
    # opaque: callbacks, kernels and fused calls typed when traced, internal linearization
    "pure_callback", "io_callback", "debug_callback", "debug_print", "pallas_call",
    "ffi_call", "cudnn_fusion", "composite", "custom_partitioning", "call_exported",
    "dot_product_attention_fwd", "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
    "scaled_matmul_wrapper", "scaled_dot", "custom_lin", "linear_call",
})


@dataclasses.dataclass(frozen=True)
class ReductionSize:
  """A conditional rule: one list for large reductions, another for small ones.

  The size is how many elements are combined into each output element: the product
  of the reduced axes for ``reduce_*`` (``axes``), the scanned axis for ``cum*``
  (``axis``).

  Args:
    more_than: reductions of more than this many elements go to ``large``.
    large: the list for large reductions.
    small: the list for the others.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxamp.op_lists import ReductionSize
    >>> eqn = jax.make_jaxpr(lambda x: x.sum(1))(jnp.ones((2, 8))).eqns[0]
    >>> ReductionSize(4)(eqn), ReductionSize(8)(eqn)
    ('float32', 'passthrough')
  """

  more_than: int
  large: str = "float32"
  small: str = "passthrough"

  def __post_init__(self):
    for field in ("large", "small"):
      if getattr(self, field) not in CATEGORIES:
        raise ValueError(f"ReductionSize.{field} must be one of {CATEGORIES}, "
                         f"got {getattr(self, field)!r}.")

  def __call__(self, eqn: Any) -> str:
    shape = eqn.invars[0].aval.shape
    if "axes" in eqn.params:
      axes = tuple(eqn.params["axes"])
    elif "axis" in eqn.params:
      axes = (eqn.params["axis"],)
    else:
      axes = tuple(range(len(shape)))
    size = math.prod(shape[a] for a in axes)
    return self.large if size > self.more_than else self.small


_CONDITIONAL: Mapping[str, Rule] = {
    # torch and MXNet sum in float32 always; a sum of a single element is a copy.
    "reduce_sum": ReductionSize(more_than=1),
    "cumsum": ReductionSize(more_than=1),
}


def _frozen(names: Iterable[str], what: str) -> frozenset[str]:
  if isinstance(names, str):
    raise TypeError(f"AutocastLists.{what} must be a collection of primitive names, "
                    f"got the string {names!r}.")
  return frozenset(names)


@dataclasses.dataclass(frozen=True)
class AutocastLists:
  """The op lists of :func:`jaxamp.autocast`: primitive names per precision rule.

  ``AutocastLists()`` is the default. Instances are immutable and hashable;
  :meth:`add` and :meth:`remove` return edited copies. A name may be in one list
  at most; names of :data:`HIGHER_ORDER` primitives may be in none.

  Attributes:
    low_precision: cast to the policy's compute dtype.
    float32: float16/bfloat16 operands cast to float32.
    follow_compute: cast to the compute dtype when one floating operand is in it and
      the others are float32 values not pinned to float32 (see the module docstring);
      else as ``widest``.
    widest: cast to the widest floating operand dtype (scalar literals and weakly
      typed values follow the others).
    passthrough: run in whatever dtype arrives.
    as_traced: cast back to the dtypes the function was traced with.
    conditional: name -> rule; the rule gets the equation and returns one of
      :data:`CATEGORIES`.
  """

  low_precision: frozenset[str] = _LOW_PRECISION
  float32: frozenset[str] = _FLOAT32
  follow_compute: frozenset[str] = _FOLLOW_COMPUTE
  widest: frozenset[str] = _WIDEST
  passthrough: frozenset[str] = _PASSTHROUGH
  as_traced: frozenset[str] = _AS_TRACED
  conditional: Mapping[str, Rule] = dataclasses.field(
      default_factory=lambda: dict(_CONDITIONAL))

  def __post_init__(self):
    seen: dict[str, str] = {}
    clashes = []
    for what in CATEGORIES:
      names = _frozen(getattr(self, what), what)
      object.__setattr__(self, what, names)
      for name in names:
        if name in seen:
          clashes.append(f"{name!r} ({seen[name]} and {what})")
        seen[name] = what
    conditional = dict(self.conditional)
    for name, rule in conditional.items():
      if not callable(rule):
        raise TypeError(f"The conditional rule for {name!r} must be callable, got {rule!r}.")
      if name in seen:
        clashes.append(f"{name!r} ({seen[name]} and conditional)")
      seen[name] = "conditional"
    object.__setattr__(self, "conditional", types.MappingProxyType(conditional))
    if clashes:
      raise ValueError("A primitive may be in one list only; found " + ", ".join(clashes) + ".")
    higher = sorted(HIGHER_ORDER.intersection(seen))
    if higher:
      raise ValueError(f"{higher} are higher-order primitives that autocast recurses into; "
                       "they cannot be put in a list.")

  def __hash__(self) -> int:
    return hash((*(getattr(self, c) for c in CATEGORIES),
                 tuple(sorted(self.conditional.items(), key=lambda kv: kv[0]))))

  @property
  def names(self) -> frozenset[str]:
    """Every primitive name in some list (conditional included)."""
    return frozenset().union(*(getattr(self, c) for c in CATEGORIES), self.conditional)

  def category(self, name: str) -> str | None:
    """The list holding ``name`` (``'conditional'`` for a rule), or None."""
    for what in CATEGORIES:
      if name in getattr(self, what):
        return what
    return "conditional" if name in self.conditional else None

  def resolve(self, eqn: Any) -> str:
    """The list that runs ``eqn`` (a ``jax.extend.core.JaxprEqn``): conditional rules
    are applied, and a primitive in no list is ``'as_traced'``."""
    name = eqn.primitive.name
    rule = self.conditional.get(name)
    if rule is None:
      return self.category(name) or "as_traced"
    what = rule(eqn)
    if what not in CATEGORIES:
      raise ValueError(f"The conditional rule for {name!r} returned {what!r}; "
                       f"it must return one of {CATEGORIES}.")
    return what

  def add(self, *names: str, to: Union[str, Rule]) -> AutocastLists:
    """A copy with ``names`` moved to the list ``to``, or made conditional on rule ``to``.

    Args:
      *names: primitive names (``jax.extend.core.Primitive.name``, e.g. ``'tanh'``).
      to: one of :data:`CATEGORIES`, or a rule (a callable from the equation to one
        of them).

    Returns:
      The edited copy; ``self`` is unchanged.
    """
    if isinstance(to, str) and to not in CATEGORIES:
      raise ValueError(f"Unknown list {to!r}; the lists are {CATEGORIES}, or pass a rule "
                       "(a callable) for a conditional entry.")
    edited = self.remove(*names)
    if isinstance(to, str):
      return dataclasses.replace(edited, **{to: getattr(edited, to) | set(names)})
    return dataclasses.replace(edited,
                               conditional={**edited.conditional, **{n: to for n in names}})

  def remove(self, *names: str) -> AutocastLists:
    """A copy with ``names`` in no list (so they run at their traced dtypes)."""
    drop = set(names)
    return dataclasses.replace(
        self,
        **{what: getattr(self, what) - drop for what in CATEGORIES},
        conditional={n: r for n, r in self.conditional.items() if n not in drop})


DEFAULT_LISTS = AutocastLists()
"""The default lists (``AutocastLists()``), for float16 compute."""

# Powers are float32 for float16's range (x**2 overflows above 256); bfloat16 has
# float32's range.
BFLOAT16_LISTS = DEFAULT_LISTS.add("square", "integer_pow", to="passthrough")
"""The default lists for bfloat16 compute: :data:`DEFAULT_LISTS` with ``square`` and
``integer_pow`` passthrough."""
