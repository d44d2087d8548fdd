"""FP8 scaling recipes: what an FP8 policy's matmuls quantize with, as plain values.

A recipe is a frozen dataclass a :class:`jaxamp.Policy` holds (``Policy(..., fp8=recipe)``)
and :mod:`jaxamp.fp8` runs (the :class:`jaxamp.scaled.ScaledFormat` registered for these
types); a policy takes the recipes of any registered format. It lives below the policy layer so that parsing a policy
never imports the module layer.

- :class:`DelayedScaling`: scales from an amax history of earlier steps (Transformer
  Engine's and flax's default recipe).
- :class:`CurrentScaling`: each tensor scaled by its own amax, computed in the step.

Example:
  >>> from jaxamp import recipes
  >>> recipes.check_recipe("current")
  CurrentScaling(margin=0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax.numpy as jnp

from jaxamp import scaled

__all__ = ["E4M3", "E5M2", "CurrentScaling", "DelayedScaling", "Fp8Recipe", "check_recipe"]

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2

_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """Delayed scaling: scales from an amax history of earlier steps.

  Defaults are Transformer Engine's ``DelayedScaling`` and flax ``fp8_ops``'s.

  Args:
    amax_history_len: how many steps of amaxes are kept (16-32 adapt faster).
    amax_compute_algo: ``'max'`` over the history, or ``'most_recent'``.
    margin: scales are divided by ``2**margin`` (headroom against growth).

  Example:
    >>> import jaxamp
    >>> jaxamp.DelayedScaling(amax_history_len=16).amax_compute_algo
    'max'
  """

  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  margin: int = 0

  def __post_init__(self):
    if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
      raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}.")
    if self.amax_compute_algo not in _ALGOS:
      raise ValueError(f"amax_compute_algo must be one of {_ALGOS}, got "
                       f"{self.amax_compute_algo!r}.")
    if not isinstance(self.margin, int) or self.margin < 0:
      raise ValueError(f"margin must be an int >= 0, got {self.margin!r}.")

  @property
  def history_len(self) -> int:
    return self.amax_history_len


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
  """Current (per-step) scaling: each tensor is scaled by its own amax.

  No scale is carried over between steps; the state keeps the last step's amaxes (a
  history of length 1) so they can be inspected.

  Example:
    >>> import jaxamp
    >>> jaxamp.CurrentScaling().margin
    0
  """

  margin: int = 0

  def __post_init__(self):
    if not isinstance(self.margin, int) or self.margin < 0:
      raise ValueError(f"margin must be an int >= 0, got {self.margin!r}.")

  @property
  def history_len(self) -> int:
    return 1


Fp8Recipe = Union[DelayedScaling, CurrentScaling]


def check_recipe(recipe: Any) -> Any:
  """``recipe`` if it is one (of FP8, or of a format registered with
  :func:`jaxamp.scaled.register`), the recipe a short name makes, else a ValueError
  naming the valid ones."""
  if recipe == "delayed":
    return DelayedScaling()
  if recipe == "current":
    return CurrentScaling()
  if isinstance(recipe, str) and scaled.recipe_named(recipe) is not None:
    return scaled.recipe_named(recipe)
  if not isinstance(recipe, (DelayedScaling, CurrentScaling)) and not scaled.is_recipe(recipe):
    names = ", ".join(repr(n) for n in dict.fromkeys(("delayed", "current")
                                                     + scaled.recipe_names()))
    raise ValueError(f"fp8 must be jaxamp.DelayedScaling(...), jaxamp.CurrentScaling(...), "
                     f"another registered recipe, a name ({names}) or None for no FP8; "
                     f"got {recipe!r}.")
  return recipe
