"""Model adapters: how a model is split into train state and called from that state.

An adapter is what the train step knows of a model library. It has

- ``uses_rng``: whether the step's key feeds the model (Linen's RNG streams);
- ``bind(params, model_state, rng, policy, *, train, float32_outputs)`` -> ``(model,
  new_state)``: the model ``loss_fn`` receives, running under its policies, and a
  function returning its model state after the calls made so far;
- ``model(state)``: the model with a :class:`~jaxamp.TrainState`'s arrays.

A new model library needs an adapter here and a branch in ``init.split_model`` that
finds its parameters, model state and per-module policies.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any

import flax
import jax
from flax import nnx

from jaxamp import fp8 as fp8_lib
from jaxamp import gather
from jaxamp import nnx as amp_nnx
from jaxamp.casting import widen_floating
from jaxamp.nnx._variables import gather_on_read
from jaxamp.rules import path_name
from jaxamp.train.state import TrainState

__all__ = ["NNXAdapter", "LinenAdapter", "EquinoxAdapter", "Float32Outputs"]


class Float32Outputs(amp_nnx.PolicyModule):
  """The model an NNX ``loss_fn`` receives: a policy wrapper (an ``nnx.Module``, so
  ``nnx.state``, ``nnx.split`` and ``nnx.merge`` see the model's Variables) whose calls
  and public methods hand their floating outputs over in float32 (or wider: a float64
  output stays float64, :func:`~jaxamp.casting.widen_floating`). Submodules reached
  through it run under the policy and return their own dtypes."""

  def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
    return widen_floating(super()._call(name, *args, **kwargs))

  def __getitem__(self, key: Any) -> Any:
    if not hasattr(self.module, "__getitem__"):
      raise TypeError(f"loss_fn indexed the model with {key!r}, as if it were the batch: "
                      "loss_fn is called as loss_fn(model, batch). Are its arguments "
                      "swapped?")
    return super().__getitem__(key)  # a submodule runs under the policy, as attributes do


@dataclasses.dataclass
class NNXAdapter:
  """An NNX model: its ``nnx.Param`` s are the params, every other Variable model state."""

  graphdef: Any
  recompute_norms: bool = False
  uses_rng = False  # NNX models carry their RNG streams in model_state

  @staticmethod
  def split(model: nnx.Module) -> tuple[Any, Any, Any]:
    return nnx.split(model, nnx.Param, ...)

  @staticmethod
  def plain(tree: Any) -> Any:
    """An ``nnx.State`` as the nested dict of arrays it holds (``nnx.to_pure_dict``);
    other trees as they are. The train state holds these: JAX flattens a dict in C++,
    while each ``nnx.State`` and ``nnx.Variable`` node is flattened by Python code on
    every jitted call (a 150-parameter step with Adam held so takes 3x as long per call:
    ``benchmarks/dispatch``).
    ``nnx.merge`` takes them back with the graphdef."""
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree

  def bind(self, params, model_state, rng, policy, *, train, float32_outputs, shards=None):
    """``shards`` (``gather='layer'``, inside the step's ``shard_map``): each param
    leaf's :class:`~jaxamp.gather.Shard`; ``params`` are then this device's slices,
    and each sharded one is gathered where a module reads it."""
    del rng  # NNX models carry their RNG streams in model_state

    # merge() reuses the State's Variable objects; rebuilding them here puts them at this
    # trace level, so the model may update BatchNorm statistics and RNG counts under grad.
    params, model_state = jax.tree.map(lambda x: x, (params, model_state))
    model = nnx.merge(self.graphdef, params, model_state)
    if shards is not None:
      _gather_on_read(model, params, shards)
    fp8_lib.name_nnx_modules(model, path_name)  # FP8 state keys, if a step threads one
    if not train:
      model.eval()
    kind = Float32Outputs if float32_outputs else amp_nnx.PolicyModule
    # The step decides on half_residuals for the whole loss (train.gradients).
    view = kind(model, policy, recompute_norms=self.recompute_norms, half_residuals=False)
    return view, lambda: self.plain(nnx.split(model, nnx.Param, ...)[2])

  def model(self, state: TrainState) -> nnx.Module:
    return nnx.merge(self.graphdef, state.params, state.model_state)


def _gather_on_read(model: nnx.Module, params: Any, shards: tuple[Any, ...]) -> None:
  """Each sharded ``nnx.Param`` of ``model`` read gathered (:func:`gather_on_read`)."""
  paths = [tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  by_path = dict(zip(paths, shards))
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shard = by_path[tuple(path)]
    if shard.sharded:
      gather_on_read(variable, shard)


@dataclasses.dataclass
class LinenAdapter:
  """A Linen module: its ``'params'`` collection is the params, the other collections
  the model state; ``loss_fn`` gets a callable that applies the module."""

  module: Any
  recompute_norms: bool = False
  rng_streams: tuple[str, ...] = ("dropout",)  # the RNG streams each apply gets
  uses_rng = True  # the step key feeds Linen's RNG streams
  _wrapped: Any = None

  def bind(self, params, model_state, rng, policy, *, train, float32_outputs, shards=None):
    """``shards`` (``gather='layer'``, inside the step's ``shard_map``): as for NNX; each
    sharded slice is gathered where a module reads it (``self.param``)."""
    from jaxamp import linen as amp_linen  # pylint: disable=g-import-not-at-top

    # One wrapper, so its plan cache serves every trace (step and eval); the step binds
    # with its one policy.
    if self._wrapped is None or self._wrapped.policy != policy:
      self._wrapped = amp_linen.with_policy(self.module, policy,
                                            recompute_norms=self.recompute_norms,
                                            half_residuals=False)  # the step decides
    wrapped = self._wrapped
    if shards is not None:
      params = gather.sliced(params, shards)
    cell = {"state": dict(model_state), "calls": 0}
    mutable = list(model_state) if train else False

    def apply(*args: Any, **kwargs: Any) -> Any:
      rngs = stream_keys(jax.random.fold_in(rng, cell["calls"]), self.rng_streams)
      cell["calls"] += 1
      variables = {"params": params, **cell["state"]}
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

  def model(self, state: TrainState) -> tuple[Any, dict[str, Any]]:
    return self.module, {"params": state.params, **state.model_state}


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


@dataclasses.dataclass
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

  @staticmethod
  def split(model: Any) -> tuple[Any, Any, Any]:
    """``(params, model_state, static)``: floating arrays, other arrays, the rest."""
    import equinox as eqx  # pylint: disable=g-import-not-at-top

    params, rest = eqx.partition(model, eqx.is_inexact_array)
    model_state, static = eqx.partition(rest, eqx.is_array)
    return params, model_state, static

  def bind(self, params, model_state, rng, policy, *, train, float32_outputs, shards=None):
    """``shards`` (``gather='layer'``, inside the step's ``shard_map``): as for NNX; each
    sharded slice is gathered where a module's field is read."""
    del rng  # Equinox models take their keys as arguments
    import equinox as eqx  # pylint: disable=g-import-not-at-top
    from jaxamp import equinox as amp_eqx  # pylint: disable=g-import-not-at-top

    if shards is not None:
      params = gather.sliced(params, shards)
    model = eqx.combine(params, model_state, self.static, is_leaf=gather.is_slice)
    if not train:
      model = eqx.nn.inference_mode(model)  # Dropout off (eval_step)
    view = amp_eqx.with_policy(model, policy, recompute_norms=self.recompute_norms,
                               float32_outputs=float32_outputs)
    return view, lambda: model_state

  def model(self, state: TrainState) -> Any:
    import equinox as eqx  # pylint: disable=g-import-not-at-top

    return eqx.combine(state.params, state.model_state, self.static)
