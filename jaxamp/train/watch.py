"""The numerics monitor's part of the step (:mod:`jaxamp.numerics`): which steps
record, and their records as ``metrics['numerics']``.

:func:`every` runs the step as a ``lax.cond`` on the step counter between the step
that records (given a :class:`Watch`) and the plain one, so the other steps run the
program without the monitor; the gradient stage fills the watch while the loss traces
and returns the activation and cotangent records; :func:`report` adds the parameter
gradients' and shapes them per module path:
``{path: {'activation' | 'cotangent' | 'grad': {stat: value}}}``, every value a float32
scalar, NaN on the steps that do not record.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp import adapters
from jaxamp import numerics as numerics_lib
from jaxamp.rules import leaf_name

__all__ = ["Watch", "every", "report"]


class Watch(NamedTuple):
  """The recording step's trace of the monitor.

  Attributes:
    dtypes: each observed module's compute dtype by path, filled while the loss traces.
  """

  dtypes: dict[str, Any]


def every(numerics: numerics_lib.Numerics, step: jax.Array,
          run: Callable[[Watch | None], tuple[Any, dict[str, Any]]]
          ) -> tuple[Any, dict[str, Any]]:
  """``run(Watch)`` on the steps ``numerics`` records (``step % every == 0``), else
  ``run(None)`` with NaN records (the plain step: nothing more computed); the metrics
  gain ``numerics_recorded``."""
  shapes = jax.eval_shape(lambda: run(Watch({})))[1]["numerics"]

  def plain():
    state, metrics = run(None)
    nan = jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shapes)
    return state, {**metrics, "numerics": nan, "numerics_recorded": jnp.bool_(False)}

  def recorded():
    state, metrics = run(Watch({}))
    return state, {**metrics, "numerics_recorded": jnp.bool_(True)}

  return jax.lax.cond(step % numerics.every == 0, recorded, plain)


def _owner(name: str, modules: list[str]) -> str:
  """The module owning the parameter ``name``: the longest observed path above it, else
  its parent path."""
  for path in modules:  # longest first
    if not path or name.startswith(path + "/"):
      return path
  return name.rpartition("/")[0]


def report(watch: Watch, seen: dict[str, Any], grads: Any, default_dtype: Any
           ) -> dict[str, Any]:
  """``metrics['numerics']``: the gradient stage's records and each parameter gradient's (as the backward pass left it: times the loss
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
    raw.setdefault(path, {})["grad"] = functools.reduce(
        numerics_lib.combine, [numerics_lib.tensor_stats(x, dtype) for x in leaves])
  return {path: {kind: numerics_lib.summarize(r) for kind, r in sorted(kinds.items())}
          for path, kinds in sorted(raw.items())}
