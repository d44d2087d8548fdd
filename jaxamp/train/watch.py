"""The numerics monitor's part of the step (:mod:`jaxamp.numerics`): which steps
record, and their records as ``metrics['numerics']``.

:func:`every` runs the step as a ``lax.cond`` on the step counter between the step
that records (given a :class:`Watch`) and the plain one (``TrainStep.step_fn``);
``TrainStep.step`` instead compiles the step without the monitor and :func:`recorded`
as two programs and picks one per call on the host (:class:`Schedule`), adding
:func:`not_recorded`'s constant records (made once) to the plain one's metrics, so the
other steps run exactly the program without the monitor; the gradient stage fills the watch while the loss traces
and returns the activation and cotangent records; :func:`report` adds the parameter
gradients' and shapes them per module path:
``{path: {'activation' | 'cotangent' | 'grad' | 'input': {stat: value}}}``, every value a float32
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

__all__ = ["Schedule", "Watch", "every", "not_recorded", "plain", "read_step", "recorded", "report"]


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
  ``run(None)`` with NaN records, as one ``lax.cond`` (``TrainStep.step_fn``'s program;
  ``TrainStep.step`` picks :func:`plain` or :func:`recorded` on the host instead)."""
  return jax.lax.cond(step % numerics.every == 0, lambda: recorded(run), lambda: plain(run))


def plain(run: Callable[[Watch | None], tuple[Any, dict[str, Any]]]
          ) -> tuple[Any, dict[str, Any]]:
  """``run(None)`` (the step without the monitor: nothing more computed) with NaN
  records shaped as :func:`recorded`'s (found abstractly) and ``numerics_recorded``
  False."""
  shapes = jax.eval_shape(lambda: run(Watch({})))[1]["numerics"]
  state, metrics = run(None)
  return state, {**metrics, **not_recorded(shapes)}


def not_recorded(shapes: Any) -> dict[str, Any]:
  """The metrics a step that does not record adds: ``numerics``, NaN records shaped as
  ``shapes`` (the recording step's), and ``numerics_recorded`` False."""
  nan = jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shapes)
  return {"numerics": nan, "numerics_recorded": jnp.bool_(False)}


def recorded(run: Callable[[Watch | None], tuple[Any, dict[str, Any]]]
             ) -> tuple[Any, dict[str, Any]]:
  """``run(Watch)``: the step that records, ``numerics_recorded`` True."""
  state, metrics = run(Watch({}))
  return state, {**metrics, "numerics_recorded": jnp.bool_(True)}


def read_step(step: jax.Array) -> int:
  """The step counter read from the device (a host sync)."""
  return int(step)


class Schedule:
  """Which steps record, decided on the host with no device read in the usual loop.

  It remembers the step counter array of the state the step last returned and its value
  (the counter it was given plus one): a state carrying that array (the returned one,
  or it with fields replaced) is known; any other (a resumed or user-made state) costs
  one :func:`read_step`.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> schedule = Schedule(jaxamp.Numerics(every=2))
    >>> first = jnp.int32(5)
    >>> schedule.records(first)  # unknown: read once
    False
    >>> returned = first + 1
    >>> schedule.returned(returned)
    >>> schedule.records(returned)  # known: 6, no read
    True
  """

  def __init__(self, numerics: numerics_lib.Numerics):
    self.every = numerics.every
    self._last: Any = None  # the counter array last returned
    self._next = 0  # its value
    self._given = 0  # the value of the counter last asked about

  def records(self, step: jax.Array) -> bool:
    """Whether the step given the counter ``step`` records."""
    self._given = self._next if step is self._last else read_step(step)
    return self._given % self.every == 0

  def returned(self, step: jax.Array) -> None:
    """Notes the counter of the state the step just returned (that of :meth:`records`'
    plus one)."""
    self._last, self._next = step, self._given + 1


def _owner(name: str, modules: list[str]) -> str:
  """The module owning the parameter ``name``: the longest observed path above it, else
  its parent path."""
  for path in modules:  # longest first
    if not path or name.startswith(path + "/"):
      return path
  return name.rpartition("/")[0]


def report(watch: Watch, seen: dict[str, Any], grads: Any, default_dtype: Any,
           whatif: Any = ()) -> dict[str, Any]:
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
  for kind, records in seen.items():  # activation, cotangent, input
    for path, r in records.items():
      raw.setdefault(path, {})[kind] = r
  for path, leaves in grouped.items():
    dtype = np.dtype(watch.dtypes.get(path, default_dtype))
    raw.setdefault(path, {})["grad"] = functools.reduce(
        numerics_lib.combine, [numerics_lib.tensor_stats(x, dtype, None, whatif, "grad")
                               for x in leaves])
  return {path: {kind: numerics_lib.summarize(r, whatif) for kind, r in sorted(kinds.items())}
          for path, kinds in sorted(raw.items())}
