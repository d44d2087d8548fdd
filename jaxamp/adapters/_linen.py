"""Flax Linen in the registry: :data:`LINEN` and the train step's :class:`LinenAdapter`."""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
from flax import linen as nn

from jaxamp import _flax_compat
from jaxamp import fp8 as fp8_lib
from jaxamp import fp8_stacked, gather, scaled
from jaxamp import linen as amp_linen
from jaxamp.adapters._common import PlainTrees, check_in_range
from jaxamp.adapters._registry import Split
from jaxamp.casting import widen_floating
from jaxamp.policy import Policy, PolicyLike
from jaxamp.rules import asks_for_fp8, cast_module_params

__all__ = ["LINEN", "LinenAdapter", "stream_keys"]


@dataclasses.dataclass(frozen=True)
class LinenAdapter:
  """A Linen module: its ``'params'`` collection is the params, the other collections
  the model state; ``loss_fn`` gets a callable that applies the module.

  ``wrapped`` is the module's policy wrapper for the step's policy, made once by
  ``init``: its plan cache (per input shapes) then serves every trace, step and eval.
  """

  module: Any
  wrapped: Any  # amp_linen.LinenPolicy under the step's policy
  recompute_norms: bool = False
  rng_streams: tuple[str, ...] = ("dropout",)  # the RNG streams each apply gets
  lifted_fp8: frozenset[str] = frozenset()  # scaled-format layers inside lifted transforms
  uses_rng = True  # the step key feeds Linen's RNG streams

  def bind(self, params, model_state, rng, policy, *, train, float32_outputs, shards=None):
    """``shards`` (``gather='layer'``, inside the step's ``shard_map``): as for NNX; each
    sharded slice is gathered where a module reads it (``self.param``)."""
    wrapped = self.wrapped
    if wrapped.policy != policy:  # not the step's own policy: a wrapper for this bind
      wrapped = _wrap(self.module, policy, self.recompute_norms)
    if shards is not None:
      params = gather.sliced(params, shards)
    cell = {"state": dict(model_state), "calls": 0}
    mutable = list(model_state) if train else False

    def apply(*args: Any, **kwargs: Any) -> Any:
      rngs = stream_keys(jax.random.fold_in(rng, cell["calls"]), self.rng_streams)
      cell["calls"] += 1
      variables = {"params": params, **cell["state"]}
      scope = scaled.current()
      if self.lifted_fp8 and scope is not None and scope.state:
        # Layers inside nn.scan & co. read theirs from a collection the transform lifts.
        variables[fp8_stacked.COLLECTION] = fp8_stacked.linen_variables(scope.state,
                                                                        self.lifted_fp8)
      try:
        if mutable:
          out, new_state = wrapped.apply(variables, *args, rngs=rngs, mutable=mutable,
                                         **kwargs)
          cell["state"] = dict(new_state)
        else:
          out = wrapped.apply(variables, *args, rngs=rngs, **kwargs)
      except flax.errors.InvalidRngError as e:
        raise _missing_stream(e, self.rng_streams) from None
      return widen_floating(out) if float32_outputs else out

    return apply, lambda: cell["state"]

  def model(self, state: Any) -> tuple[Any, dict[str, Any]]:
    return self.module, {"params": state.params, **state.model_state}


def _wrap(module: Any, policy: Policy, recompute_norms: bool) -> Any:
  return amp_linen.with_policy(module, policy, recompute_norms=recompute_norms,
                               half_residuals=False)  # the step decides


def _missing_stream(e: Exception, streams: tuple[str, ...]) -> ValueError:
  """A module drew from a stream the step does not give: the error naming it and the fix."""
  found = re.search(r'needs PRNG for "([^"]+)"', str(e))
  name = found.group(1) if found else "<stream>"
  return ValueError(
      f"The Linen module draws from the RNG stream {name!r} (self.make_rng), but the train "
      f"step gives it only {streams}. Name every stream it draws from: "
      f"make_train_step(..., rng_streams={(*streams, name)!r}), or pass them in init's "
      f"rngs=. (Flax: {str(e).split(' (https')[0]})")


def stream_keys(key: jax.Array, streams: tuple[str, ...]) -> dict[str, jax.Array]:
  """The key of each Linen RNG stream for one ``apply``: ``'dropout'``'s is ``key``
  itself (what it was before other streams were given), any other's ``key`` folded with
  a hash of its name, so streams draw independently and each keeps its keys whatever
  the others are."""
  return {name: key if name == "dropout"
          else jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
          for name in streams}


def _is_pair(model: Any) -> bool:
  return isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Module)


class _Linen(PlainTrees):
  """Flax Linen modules (a module, a :func:`jaxamp.linen.with_policy` wrapper, or a
  ``(module, variables)`` pair for :func:`jaxamp.summary`)."""

  name = "linen"
  takes_pytrees = False

  def accepts(self, model: Any) -> bool:
    return isinstance(model, (nn.Module, amp_linen.LinenPolicy)) or _is_pair(model)

  def unwrap(self, model: Any) -> tuple[Any, bool, Policy | None]:
    if isinstance(model, amp_linen.LinenPolicy):
      return model.module, model.recompute_norms, model.policy
    return model, False, None

  def with_policy(self, model: Any, policy: PolicyLike | None = None, *,
                  recompute_norms: bool = False) -> Any:
    return amp_linen.with_policy(model, policy, recompute_norms=recompute_norms)

  def split(self, model, policy, *, variables, example_args, example_kwargs,
            recompute_norms, rng_streams) -> Split:
    if variables is None or "params" not in variables:
      raise ValueError("For a Linen module call init(module, variables), where variables "
                       "is module.init(...)'s result with a 'params' collection.")
    rows = fp8_rows = None
    if example_args or example_kwargs:
      rows, lifted, kernels = amp_linen.module_plan(model, None, *example_args,
                                                    policy=policy, **example_kwargs)
      # Layers inside nn.scan & co. keep their state stacked as their kernels are.
      fp8_rows = fp8_stacked.linen_rows(rows, lifted, kernels,
                                        _flax_compat.unbox(variables["params"]))
    if rows is None and asks_for_fp8(policy):
      raise ValueError("An FP8 policy with a Linen module needs the example inputs: "
                       "train.init(module, variables, *example_args) finds the Dense "
                       "layers that keep FP8 state from them.")
    model_state = {k: v for k, v in variables.items() if k != "params"}
    adapter = LinenAdapter(model, _wrap(model, policy, recompute_norms), recompute_norms,
                           _rng_streams(rng_streams, example_kwargs),
                           frozenset(r[0] for r in fp8_rows or () if r[0] in lifted))
    return Split(adapter, variables["params"], model_state, rows, fp8_rows)

  def arrays(self, model: Any, variables: Any) -> Any:
    return (model, variables)

  def fp8_classes(self) -> tuple[type, ...]:
    return fp8_lib.linen_classes()

  def fp8_census(self, model, variables, example_args, example_kwargs, policy):
    kwargs = {"mutable": True, **example_kwargs}
    try:
      ops, modules, _ = amp_linen.with_policy(model, policy).matmul_census(
          _flax_compat.unbox(variables), *example_args, **kwargs)
    except Exception:  # pylint: disable=broad-except
      return None  # inputs init got cannot run apply (a dropout RNG they lack): a check only
    return ops, modules

  def summary_plan(self, model: Any, example_inputs: Sequence[Any],
                   example_kwargs: dict[str, Any], policy: PolicyLike | None):
    if not example_inputs and not example_kwargs:
      raise ValueError("summary of a Linen module needs example inputs to trace it with.")
    if isinstance(model, tuple):
      module, variables = model
    else:
      module = model
      init_kwargs = {k: v for k, v in example_kwargs.items() if k != "mutable"}
      variables = jax.eval_shape(lambda: module.init(jax.random.key(0), *example_inputs,
                                                     **init_kwargs))
    plan = amp_linen.module_policies(module, variables, *example_inputs, policy=policy,
                                     **example_kwargs)
    root = next(p for path, _, p in plan if path == "")
    census = amp_linen.with_policy(module, root).matmul_census(variables, *example_inputs,
                                                               **example_kwargs)
    return plan, variables["params"], census

  def convert_for_inference(self, model: Any, example_inputs: tuple[Any, ...],
                            policy: PolicyLike | None, module: Any) -> Any:
    variables = model
    if not isinstance(module, nn.Module):
      raise ValueError("convert_for_inference takes an NNX module, an Equinox model, or "
                       "Linen variables with module=<the Linen module> and example "
                       f"inputs; got {type(variables).__name__} and module={module!r}.")
    if "params" not in variables:
      raise ValueError("Linen variables must have a 'params' collection; got collections "
                       f"{sorted(variables)}.")
    if not example_inputs:
      raise ValueError("convert_for_inference of Linen variables needs example inputs.")
    plan = amp_linen.module_policies(module, variables, *example_inputs, policy=policy)
    params = cast_module_params(variables["params"], plan, lambda p: p.compute_dtype)
    check_in_range(variables["params"], params)
    converted = dict(variables)
    converted["params"] = params
    return type(variables)(converted) if not isinstance(variables, dict) else converted

  def report_args(self, fn: Callable[..., Any], args: tuple[Any, ...],
                  argnums: tuple[int, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return fn, args


def _rng_streams(streams: tuple[str, ...], example_kwargs: Mapping[str, Any]) -> tuple[str, ...]:
  """The Linen RNG streams the step gives the module: ``rng_streams``, and those named
  in ``init``'s ``rngs=`` but ``'params'``."""
  rngs = example_kwargs.get("rngs")
  named = [n for n in rngs if n != "params"] if isinstance(rngs, Mapping) else []
  return tuple(dict.fromkeys([*streams, *named]))


LINEN = _Linen()
