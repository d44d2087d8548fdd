"""The train state, its skeleton, and the checks a state and a model's parameters pass."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp import adapters
from jaxamp.rules import path_name

__all__ = ["TrainState", "MasterWeightsState", "RoundingState", "abstract_state"]


class _TrainStateFields(NamedTuple):
  params: Any
  opt_state: Any
  step: jax.Array
  model_state: Any
  rng: jax.Array | None
  fp8: Any = None  # the stored name: orbax checkpoints key the state by it


class TrainState(_TrainStateFields):
  """Everything a training run carries from step to step.

  Attributes:
    params: trainable parameters, each stored in the param dtype of the module owning it
      (for NNX models the nested dict of arrays ``nnx.to_pure_dict`` makes of the
      ``nnx.Param`` state, which ``nnx.merge(graphdef, params, model_state)`` takes;
      the ``'params'`` collection for Linen).
    opt_state: the optimizer state, loss-scale state included
      (:func:`jaxamp.get_loss_scale` reads it).
    step: number of ``step`` calls made (skipped ones included; the optimizer's own
      counters do not advance on skipped steps).
    model_state: non-trainable state: BatchNorm statistics, NNX RNG streams (as a
      nested dict of arrays for NNX models), other Linen collections.
    rng: the base PRNG key of Linen's RNG streams (``'dropout'``, and those named in
      ``make_train_step(..., rng_streams=...)``): a step draws from
      ``jax.random.fold_in(rng, n)``, ``n`` the number of steps applied before it
      (skipped ones excluded), so the key itself never changes and a model that draws
      none costs no key work. None for NNX models (they carry their RNG streams in
      ``model_state``) and Equinox models (they take keys as arguments).
    fp8: the scaled formats' state (:mod:`jaxamp.scaled`), also read as :attr:`scaled`:
      under a policy with a scaled format (FP8), ``{module path: that module's state}``
      (:class:`jaxamp.fp8.Fp8Meta` for FP8: amax histories and scales), updated by the
      step's forward and backward passes, never by the optimizer, and kept on a skipped
      step; None without such modules. Stored under the name ``fp8``, which checkpoints
      key it by; ``TrainState(..., scaled=)`` and ``_replace(scaled=)`` take either name.
  """

  __slots__ = ()

  def __new__(cls, params: Any, opt_state: Any, step: jax.Array, model_state: Any,
              rng: jax.Array | None, fp8: Any = None, *, scaled: Any = None):
    if scaled is not None:
      if fp8 is not None:
        raise TypeError("TrainState takes scaled= or fp8= (the same field), not both.")
      fp8 = scaled
    return super().__new__(cls, params, opt_state, step, model_state, rng, fp8)

  @property
  def scaled(self) -> Any:
    """The scaled formats' state, ``{module path: state}`` or None (the ``fp8`` field)."""
    return self.fp8

  def _replace(self, **changes: Any) -> TrainState:
    if "scaled" in changes:
      if "fp8" in changes:
        raise TypeError("_replace takes scaled= or fp8= (the same field), not both.")
      changes["fp8"] = changes.pop("scaled")
    return super()._replace(**changes)


class MasterWeightsState(NamedTuple):
  """Optimizer state with float32 master weights, for half-precision params (float64
  and complex parameters keep their own dtype).

  Attributes:
    master_params: float32 copies of the parameters; the optimizer updates these and
      the stored params are their casts to each parameter's stored dtype (MXNet
      ``multi_precision``, Apex O2).
    inner_state: the wrapped optimizer's state.
  """

  master_params: Any
  inner_state: Any


class RoundingState(NamedTuple):
  """Optimizer state of ``master_weights='stochastic'`` or ``'kahan'``: half-precision
  params updated in float32 and stored back without a float32 copy.

  Attributes:
    rounding: the apply step's state: a :class:`jaxamp.StochasticRoundingState` (the
      PRNG key of the next rounding) or a :class:`jaxamp.KahanState` (a compensation
      buffer per half-precision parameter, laid out like the params under FSDP). A
      skipped step keeps it bit for bit.
    inner_state: the wrapped optimizer's state (made for float32 copies of the params:
      float32 moments unless ``opt_state_dtype`` narrows them).
  """

  rounding: Any
  inner_state: Any


def abstract_state(state: TrainState) -> TrainState:
  """The shape/dtype/sharding skeleton of ``state``, the target for an orbax restore.

  Args:
    state: a :class:`TrainState` (or any pytree of arrays).

  Returns:
    The same structure with ``jax.ShapeDtypeStruct`` leaves; each array's carries its
    sharding, so a sharded state is restored sharded (each device reads its slices).

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> jaxamp.abstract_state({'w': jnp.ones((2, 3))})['w'].shape
    (2, 3)
  """
  # Concrete shardings: eval_shape's may name an abstract mesh, which a restore cannot use.
  # A tracer (train.init under jax.eval_shape) has none to give.
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                      else jax.eval_shape(lambda y: y, x), state)


def is_key(x: Any) -> bool:
  """Whether ``x`` is a typed PRNG key array."""
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _holds_nnx_nodes(tree: Any) -> bool:
  """Whether ``tree`` holds a library's state nodes (an ``nnx.State`` holds Variables)."""
  return any(map(adapters.is_node, jax.tree.leaves(tree, is_leaf=adapters.is_node)))


def mismatch(state: Any, expected: Any) -> str | None:
  """What differs between ``state`` and ``expected`` (an abstract TrainState), or None."""
  if not isinstance(state, TrainState):
    return f"it is a {type(state).__name__}, not a jaxamp.TrainState"
  fields = {"params": "another model", "opt_state": "another optimizer or loss scale",
            "model_state": "another model", "step": None, "rng": None,
            "fp8": "another model or FP8 policy"}
  for field, cause in fields.items():
    got, want = getattr(state, field), getattr(expected, field)
    if jax.tree.structure(got) != jax.tree.structure(want):
      if _holds_nnx_nodes(got) and not _holds_nnx_nodes(want):
        return (f"its {field} holds nnx.State or nnx.Variable nodes where this step's "
                "holds the plain dicts of arrays nnx.to_pure_dict makes of them (set "
                "from nnx.state(...), or made before jaxamp held NNX states so?); pass "
                f"nnx.to_pure_dict(...) of it as {field}")
      why = f" (made for {cause}?)" if cause else ""
      return f"its {field} has another structure than this step's{why}"
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, g), w in zip(got_leaves, jax.tree.leaves(want)):
      shape, dtype = ((g.shape, g.dtype) if isinstance(g, jax.ShapeDtypeStruct)
                      else (jnp.shape(g), jnp.result_type(g)))
      if (shape, dtype) != (w.shape, w.dtype):
        return (f"its {field}{jax.tree_util.keystr(path)} is {dtype}{list(shape)} where "
                f"this step's is {w.dtype}{list(w.shape)} (made under another policy or "
                "model?)")
  return None


def check_trainable(params: Any, model: str) -> None:
  """Refuses, naming the fix, parameters a gradient step cannot train: none at all, or
  ones that are not floating (``jax.grad`` takes floating inputs only)."""
  found = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=adapters.is_node)[0]
  if not found:
    raise ValueError(
        f"init found no parameters to train in {model}: the train step differentiates "
        "the model's nnx.Param variables (Linen: its 'params' collection). State it "
        "only reads (a plain nnx.Variable, a buffer) is not trained; hold what should "
        "be trained in an nnx.Param.")
  wrong = [f"{path_name(path) or '(model)'} ({np.dtype(adapters.value_of(x).dtype).name})"
           for path, x in found if not jnp.issubdtype(adapters.value_of(x).dtype, jnp.inexact)]
  if wrong:
    raise ValueError(
        f"init found parameters of {model} that are not floating: {', '.join(wrong)}. "
        "Gradients exist for floating parameters only: hold integer or boolean tables "
        "in a plain nnx.Variable (Linen: another collection than 'params'), which the "
        "step passes along untrained.")
