"""The numerics monitor's part of the step (:mod:`jaxamp.numerics`): whether this step
records, and its records as ``metrics['numerics']``.

:func:`start` makes the step's :class:`Watch` (None without the monitor: the step's
program is then the one without it); the gradient stage fills it while the loss traces
and returns the activation and cotangent records; :func:`report` adds the parameter
gradients' and shapes them per module path:
``{path: {'activation' | 'cotangent' | 'grad': {stat: value}}}``, every value a float32
scalar, NaN on the steps that do not record.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp import adapters
from jaxamp import numerics as numerics_lib
from jaxamp.rules import leaf_name

__all__ = ["Watch", "start", "report"]


class Watch(NamedTuple):
  """One step's trace of the monitor.

  Attributes:
    record: whether this step records (a traced bool: ``step % every == 0``).
    dtypes: each observed module's compute dtype by path, filled while the loss traces.
  """

  record: Any
  dtypes: dict[str, Any]


def start(options: Any, step: jax.Array) -> Watch | None:
  """The step's :class:`Watch`, or None without ``DebugConfig.numerics``."""
  numerics = options.debug.numerics
  if numerics is None:
    return None
  return Watch(jnp.asarray(step % numerics.every == 0), {})


def _owner(name: str, modules: list[str]) -> str:
  """The module owning the parameter ``name``: the longest observed path above it, else
  its parent path."""
  for path in modules:  # longest first
    if not path or name.startswith(path + "/"):
      return path
  return name.rpartition("/")[0]


def report(watch: Watch, seen: dict[str, Any], grads: Any, default_dtype: Any
           ) -> tuple[dict[str, Any], jax.Array]:
  """``(metrics['numerics'], metrics['numerics_recorded'])``: the gradient stage's
  records and each parameter gradient's (as the backward pass left it: times the loss
  scale, against the owning module's compute dtype; ``default_dtype`` where no call of
  it was observed), per module path."""
  modules = sorted(watch.dtypes, key=len, reverse=True)
  grouped: dict[str, list[jax.Array]] = {}
  for path, g in jax.tree_util.tree_flatten_with_path(grads, is_leaf=adapters.is_node)[0]:
    g = adapters.value_of(g) if adapters.is_node(g) else g
    if hasattr(g, "dtype") and jnp.issubdtype(g.dtype, jnp.floating):
      grouped.setdefault(_owner(leaf_name(path), modules), []).append(g)
  raw: dict[str, dict[str, jax.Array]] = {}
  for kind in ("activation", "cotangent"):
    for path, r in seen[kind].items():
      raw.setdefault(path, {})[kind] = r
  for path, leaves in grouped.items():
    dtype = np.dtype(watch.dtypes.get(path, default_dtype))
    raw.setdefault(path, {})["grad"] = jax.lax.cond(
        watch.record,
        lambda ls: functools.reduce(numerics_lib.combine,
                                    [numerics_lib.tensor_stats(x, dtype) for x in ls]),
        lambda ls: numerics_lib.nan_stats(), leaves)
  out = {path: {kind: numerics_lib.summarize(r) for kind, r in sorted(kinds.items())}
         for path, kinds in sorted(raw.items())}
  return out, watch.record
