"""Equinox in the registry: :data:`EQUINOX` and the train step's :class:`EquinoxAdapter`.

Equinox is optional, and this module never imports it: a model can be an ``eqx.Module``
only once ``equinox`` has been imported, so :meth:`_Equinox.accepts` looks it up in
``sys.modules`` (the one place outside :mod:`jaxamp.equinox` that knows the library's
name) and every operation imports :mod:`jaxamp.equinox` when it runs.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jaxamp import gather
from jaxamp.adapters._common import PlainTrees, check_in_range
from jaxamp.adapters._registry import Split
from jaxamp.policy import Policy, PolicyLike, get_policy, global_policy
from jaxamp.rules import cast_module_params

__all__ = ["EQUINOX", "EquinoxAdapter"]


def _eqx() -> Any:
  """The ``equinox`` module if it has been imported, else None."""
  return sys.modules.get("equinox")


def _amp() -> Any:
  """:mod:`jaxamp.equinox`, imported on first use."""
  try:
    from jaxamp import equinox as amp_eqx  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("Training an Equinox model or another pytree needs equinox: pip "
                      "install 'jax-mixed-precision[equinox]'.") from e
  return amp_eqx


@dataclasses.dataclass(frozen=True)
class EquinoxAdapter:
  """An Equinox model, or any other pytree ``loss_fn`` takes: its floating arrays are
  the params, its other arrays (integer tables, masks) the model state, the rest
  (functions, hyperparameters, the structure) ``static``. ``loss_fn`` gets the model
  put together again as a :func:`jaxamp.equinox.with_policy` view.

  ``eqx.nn.State`` (``eqx.nn.BatchNorm``, ``SpectralNorm``) is not threaded: a
  ``loss_fn(model, batch)`` has no way to hand a new State back, so ``init`` refuses
  models that hold an ``eqx.nn.StateIndex``.
  """

  static: Any
  recompute_norms: bool = False
  uses_rng = False  # Equinox models take their keys as arguments: put them in the batch

  def bind(self, params, model_state, rng, policy, *, train, float32_outputs, shards=None):
    """``shards`` (``gather='layer'``, inside the step's ``shard_map``): as for NNX; each
    sharded slice is gathered where a module's field is read."""
    del rng  # Equinox models take their keys as arguments
    eqx, amp_eqx = _eqx(), _amp()
    if shards is not None:
      params = gather.sliced(params, shards)
    model = eqx.combine(params, model_state, self.static, is_leaf=gather.is_slice)
    if not train:
      model = eqx.nn.inference_mode(model)  # Dropout off (eval_step)
    view = amp_eqx.with_policy(model, policy, recompute_norms=self.recompute_norms,
                               float32_outputs=float32_outputs)
    return view, lambda: model_state

  def model(self, state: Any) -> Any:
    return _eqx().combine(state.params, state.model_state, self.static)


class _Equinox(PlainTrees):
  """Equinox models (``eqx.Module``, or a :func:`jaxamp.equinox.with_policy` view), and
  for the train step any other pytree of floating arrays."""

  name = "equinox"
  takes_pytrees = True

  def accepts(self, model: Any) -> bool:
    eqx = _eqx()  # a model can be an eqx.Module only once equinox is imported
    return eqx is not None and isinstance(model, eqx.Module)

  def unwrap(self, model: Any) -> tuple[Any, bool, Policy | None]:
    if _eqx() is None:
      return model, False, None
    amp_eqx = _amp()
    return amp_eqx.unwrap(model), False, amp_eqx.view_policy(model)

  def with_policy(self, model: Any, policy: PolicyLike | None = None, *,
                  recompute_norms: bool = False) -> Any:
    return _amp().with_policy(model, policy, recompute_norms=recompute_norms)

  def split(self, model, policy, *, variables, example_args, example_kwargs,
            recompute_norms, rng_streams) -> Split:
    del rng_streams  # Equinox models take their keys as arguments
    amp_eqx = _amp()
    if variables is not None or example_args or example_kwargs:
      raise ValueError("init(model) takes no variables or example inputs for an Equinox "
                       "model or another pytree.")
    model = amp_eqx.checked_model(model, policy)
    eqx = _eqx()
    params, rest = eqx.partition(model, eqx.is_inexact_array)
    model_state, static = eqx.partition(rest, eqx.is_array)
    rows = amp_eqx.module_policies(model, policy)
    return Split(EquinoxAdapter(static, recompute_norms), params, model_state, rows,
                 amp_eqx.fp8_rows(model, rows))

  def arrays(self, model: Any, variables: Any) -> Any:
    return (model, variables)

  def fp8_classes(self) -> tuple[type, ...]:
    return _amp().fp8_classes() if _eqx() is not None else ()

  def fp8_census(self, model, variables, example_args, example_kwargs, policy):
    return None  # the view's own first-call check runs the census

  def summary_plan(self, model: Any, example_inputs: Sequence[Any],
                   example_kwargs: dict[str, Any], policy: PolicyLike | None):
    return _amp().summary_plan(model, example_inputs, example_kwargs, policy)

  def convert_for_inference(self, model: Any, example_inputs: tuple[Any, ...],
                            policy: PolicyLike | None, module: Any) -> Any:
    """The model (a view unwrapped: its policy is the default) with each module's
    floating fields stored in its compute dtype; other fields as they are."""
    if module is not None:
      raise ValueError("module= is for Linen variables; an Equinox model carries its "
                       "modules.")
    eqx, amp_eqx = _eqx(), _amp()
    if policy is None:
      policy = amp_eqx.view_policy(model) or global_policy()
    model = amp_eqx.unwrap(model)
    rows = amp_eqx.module_policies(model, get_policy(policy))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    cast = cast_module_params(params, rows, lambda p: p.compute_dtype)
    check_in_range(params, cast)
    return eqx.combine(cast, static)

  def report_args(self, fn: Callable[..., Any], args: tuple[Any, ...],
                  argnums: tuple[int, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if _eqx() is None:
      return fn, args
    amp_eqx = _amp()
    return amp_eqx.arrays_only(fn, args, argnums) if amp_eqx.holds_modules(args) else (fn, args)


EQUINOX = _Equinox()
