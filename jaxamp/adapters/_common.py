"""Helpers the library adapters share: parameters grouped by owner, the range check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxamp.casting import overflowed_casts
from jaxamp.rules import _owner, leaf_name, path_name

__all__ = ["PlainTrees", "module_params", "check_in_range"]


def module_params(params: Any, module_paths: Sequence[str]) -> dict[str, list[tuple[str, Any]]]:
  """Groups the array leaves of a params tree by the module that owns them.

  Args:
    params: a params pytree (an ``nnx.State`` or Linen ``'params'`` collection).
    module_paths: ``'/'``-joined module paths.

  Returns:
    ``{module_path: [(leaf_path, leaf), ...]}``.

  Example:
    >>> from jaxamp.summary import module_params
    >>> params = {'dense': {'kernel': 1.0, 'bias': 2.0}, 'norm': {'scale': 3.0}}
    >>> sorted(module_params(params, ['', 'dense', 'norm'])['dense'])
    [('dense/bias', 2.0), ('dense/kernel', 1.0)]
  """
  groups: dict[str, list[tuple[str, Any]]] = {m: [] for m in module_paths}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = leaf_name(path)
    groups.setdefault(_owner(name, module_paths), []).append((name, leaf))
  return groups


def check_in_range(before: Any, after: Any) -> None:
  """Refuses a conversion that turned a finite parameter into inf (float16 stops at
  65504), naming the parameters and the fix."""
  overflowed = [f"{path_name(path)} (|max| {big:.4g}, {dtype.name})"
                for path, big, dtype in overflowed_casts(before, after)]
  if overflowed:
    raise ValueError(
        "convert_for_inference: parameters outside the compute dtype's range would be "
        f"stored as inf: {', '.join(overflowed)}. Convert under 'mixed_bfloat16' "
        "(float32's range), or keep their modules in float32 with a rule "
        "(jaxamp.policy_rules({'<path>': 'float32'})).")


class PlainTrees:
  """The :class:`~jaxamp.adapters.Library` operations of a library whose state is plain
  pytrees of arrays (Linen's variables, Equinox's fields): no nodes to unwrap, no model
  state reduced by its type, no owners to find for FSDP, per-layer gathering served."""

  def plain(self, tree: Any) -> Any:
    return tree

  def is_node(self, x: Any) -> bool:
    return False

  def value(self, x: Any) -> Any:
    return x

  def state_reduction(self, leaf: Any) -> str | None:
    return None  # known by its path (Linen's 'batch_stats/...'), if at all

  def holders(self, model: Any) -> dict[str, list[str]]:
    return {}

  def layer_gather_refusal(self, model: Any) -> str | None:
    return None
