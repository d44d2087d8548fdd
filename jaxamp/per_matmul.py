"""A scaled format per matmul: forward, input-gradient and weight-gradient products each
in a format of their own, or in the compute dtype.

:class:`PerMatmulScaling` (issue 43's ``Fp8Recipe(fwd=..., dgrad=..., wgrad=None)``)
composes the registered scaled formats: each of a layer's three matmuls runs through the
chosen recipe's format's ``product`` (:class:`jaxamp.scaled.ScaledFormat`), on operands
laid out as :func:`jaxamp.scaled.matmul_layout` lays them, with current scaling; None
runs that matmul in the compute dtype (float32 accumulation). The formats that define
``product``: per-tensor FP8 with :class:`jaxamp.CurrentScaling` (delayed scaling needs a
state per matmul, and is refused), :class:`jaxamp.RowwiseScaling` and
:class:`jaxamp.BlockScaling`. With the same recipe for all three, the products are that
recipe's own dot's: bit for bit for :class:`jaxamp.BlockScaling`, to float32 rounding for
the others, whose dots lay their backward matmuls out another way
(``tests/test_per_matmul.py``).

Example:
  >>> import jaxamp
  >>> recipe = jaxamp.PerMatmulScaling(fwd=jaxamp.BlockScaling(), dgrad=jaxamp.BlockScaling())
  >>> jaxamp.scaled.describe(recipe)
  'fwd fp8 e4m3fn, 1x128 act / 128x128 weight blocks; dgrad fp8 e4m3fn, 1x128 act / 128x128 weight blocks; wgrad compute dtype'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp import dtypes, scaled

__all__ = ["PerMatmul", "PerMatmulScaling", "per_matmul_dot_general"]

_F32 = jnp.float32
ROLES = ("fwd", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True)
class PerMatmulScaling:
  """A recipe per matmul: ``fwd`` (``y = x @ W``), ``dgrad`` (``dx = g @ W^T``),
  ``wgrad`` (``dW = x^T @ g``), each a recipe whose format defines ``product`` and needs
  no state, or None for the compute dtype.

  Example:
    >>> import jaxamp
    >>> r = jaxamp.PerMatmulScaling(fwd=jaxamp.RowwiseScaling(), wgrad=jaxamp.BlockScaling())
    >>> r.dgrad is None
    True
  """

  fwd: Any = None
  dgrad: Any = None
  wgrad: Any = None

  def __post_init__(self):
    for role in ROLES:
      recipe = getattr(self, role)
      if recipe is None:
        continue
      fmt = scaled.format_of(recipe) if scaled.is_recipe(recipe) else None
      if (fmt is None or isinstance(recipe, PerMatmulScaling)
          or not callable(getattr(fmt, "product", None))
          or fmt.stateless_warning(recipe, "layer") is not None):
        raise ValueError(
            f"PerMatmulScaling.{role} must be None (the compute dtype) or a recipe of a "
            "scaled format with a product and no state (jaxamp.CurrentScaling(), "
            f"jaxamp.RowwiseScaling(), jaxamp.BlockScaling()), got {recipe!r}.")


def _product(recipe: Any, role: str, a: jax.Array, b: jax.Array) -> jax.Array:
  if recipe is None:
    batch = tuple(range(a.ndim - 2))
    return lax.dot_general(a, b, (((a.ndim - 1,), (a.ndim - 2,)), (batch, batch)),
                           preferred_element_type=_F32)
  return scaled.format_of(recipe).product(role, a, b, recipe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _per_matmul(a, b, amaxes, recipe):
  del amaxes
  return _product(recipe.fwd, "fwd", a, b).astype(a.dtype)


def _per_matmul_fwd(a, b, amaxes, recipe):
  return _per_matmul(a, b, amaxes, recipe), (a, b)


def _per_matmul_bwd(recipe, residuals, g):
  a, b = residuals
  g = g.astype(a.dtype)
  da = _product(recipe.dgrad, "dgrad", g, jnp.swapaxes(b, -1, -2))
  db = _product(recipe.wgrad, "wgrad", jnp.swapaxes(a, -1, -2), g)
  amaxes = jnp.stack([scaled.amax(a), scaled.amax(b), scaled.amax(g)])
  return da.astype(a.dtype), db.astype(b.dtype), amaxes


_per_matmul.defvjp(_per_matmul_fwd, _per_matmul_bwd)


def per_matmul_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                           precision: Any = None, preferred_element_type: Any = None, *,
                           state: jax.Array | None = None,
                           recipe: PerMatmulScaling | None = None,
                           **kwargs: Any) -> jax.Array:
  """``lax.dot_general`` (``lhs`` the input, ``rhs`` the kernel) with each of its three
  matmuls in ``recipe``'s format for it; the result in ``preferred_element_type`` (None:
  ``lhs``'s dtype). ``precision`` is ignored. ``state``: the module's float32 ``[3]``
  amaxes (their cotangent is this pass's largest input, kernel and output-gradient
  magnitudes); None: zeros. ``kwargs``: ``out_sharding`` (must be None)."""
  del precision
  scaled.refuse_extra_arguments(kwargs, "per-matmul dot", "per_matmul_dot_general")
  recipe = PerMatmulScaling() if recipe is None else recipe
  state = jnp.zeros((3,), _F32) if state is None else state
  dtype = jnp.result_type(lhs) if preferred_element_type is None else preferred_element_type
  rhs = rhs.astype(lhs.dtype) if rhs.dtype != lhs.dtype else rhs
  a, b, back = scaled.matmul_layout(lhs, rhs, dimension_numbers)
  return back(_per_matmul(a, b, state, recipe)).astype(dtype)


class PerMatmul(scaled.ScaledFormat):
  """The :class:`jaxamp.scaled.ScaledFormat` of :class:`PerMatmulScaling`: its state per
  module, float32 ``[3]``, the last pass's largest input, kernel and output-gradient
  magnitudes (for inspection)."""

  name = "per-matmul scaled"

  census_dtypes = dtypes.FP8  # the parts' operand dtypes

  def init_state(self, recipe: PerMatmulScaling) -> jax.Array:
    return jnp.zeros((3,), _F32)

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, state, recipe, **kwargs):
    return per_matmul_dot_general(lhs, rhs, dimension_numbers, precision,
                                  preferred_element_type, state=state, recipe=recipe,
                                  **kwargs)

  def update(self, state: jax.Array, cotangent: jax.Array,
             recipe: PerMatmulScaling) -> jax.Array:
    return cotangent

  def stateless_warning(self, recipe: PerMatmulScaling, what: str) -> str | None:
    return None  # current scaling: the same without state

  def describe(self, recipe: PerMatmulScaling) -> str:
    """``'fwd <format>; dgrad <format>; wgrad compute dtype'``."""
    return "; ".join(f"{role} " + ("compute dtype" if getattr(recipe, role) is None
                                   else scaled.describe(getattr(recipe, role)))
                     for role in ROLES)


PER_MATMUL = PerMatmul()
scaled.register(PerMatmulScaling, PER_MATMUL)
