"""A functional, compiled train-step factory for mixed precision.

:func:`make_train_step` returns a :class:`TrainStep` whose ``step`` is one XLA program
that runs the model under its per-module policies, scales the loss, accumulates
micro-batch gradients in float32, reduces them across devices, unscales, checks them
for inf/NaN everywhere at once and, on an overflow, skips the whole update exactly:
parameters, every optimizer-state leaf and the model state (BatchNorm statistics, RNG
counters) stay bit-identical while the loss scale backs off.

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxamp
  >>> from flax import nnx
  >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  >>> def loss_fn(model, batch):
  ...   return jnp.mean((model(batch['x']) - batch['y']) ** 2)
  >>> train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy='mixed_bfloat16')
  >>> state = train.init(model)
  >>> batch = {'x': jnp.ones((8, 4)), 'y': jnp.zeros((8, 2))}
  >>> state, metrics = train.step(state, batch)
  >>> metrics['loss'].dtype, state.params['kernel'].dtype, int(metrics['skipped_steps'])
  (dtype('float32'), dtype('float32'), 0)

Loss scaling: the loss-scale element found in ``optimizer`` (see
:func:`jaxamp.dynamic_loss_scale`) is used. If there is none, :func:`jaxamp.loss_scale_for`
picks one from the policy: dynamic scaling for a float16 compute dtype, none (a scale of
1.0 that still counts and skips non-finite steps) for bfloat16 and float32;
``skip_nonfinite=False`` has those apply every update instead, like a plain optax step.

Checkpoints: :class:`TrainState` is a plain pytree; save and restore it with
orbax-checkpoint (``ocp.StandardCheckpointer().save(path, state)``, then
``restore(path, jax.eval_shape(lambda: state))`` — see :func:`abstract_state`). The loss
scale, its counters and the RNG state are in it, so a resumed run continues bit-identically.

Data parallel: pass a ``jax.sharding.Mesh``. The batch is split on ``batch_axis``; params
and optimizer state are replicated; each device computes gradients on its shard and they
are averaged with ``lax.pmean`` in ``grad_reduce_dtype`` before the (global) finite check,
so every device keeps the same loss scale. For several hosts, call
``jax.distributed.initialize()`` in each process first, build the mesh over
``jax.devices()`` and pass each host's part of the batch as a global array (e.g.
``jax.make_array_from_process_local_data``).

Sharded: with ``param_sharding`` (:func:`jaxamp.fsdp`, :func:`jaxamp.annotated`, or
``PartitionSpec`` s) the params, master weights and optimizer state stay sharded over the
mesh; each step gathers the params in their compute dtype and reduce-scatters gradients
in ``grad_reduce_dtype`` (see :mod:`jaxamp.sharding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.core import meta as flax_meta

from jaxamp import fp8 as fp8_lib
from jaxamp import nnx as amp_nnx
from jaxamp import loss_scale as _ls
from jaxamp.casting import (NarrowCotangents, cast_floating, is_floating_array,
                             narrow_cotangents, overflowed_casts)
from jaxamp.clipping import GLOBAL_NORM, KnownNorm
from jaxamp import policy as policy_lib
from jaxamp import sharding as sharding_lib
from jaxamp.policy import Policy, PolicyLike, get_policy, global_policy
from jaxamp.rules import (asks_for_fp8, norm_defaults, path_name,
                          warn_unmatched_path_rules)
from jaxamp.summary import cast_module_params

__all__ = ["TrainState", "MasterWeightsState", "TrainStep", "make_train_step", "abstract_state"]

_F32 = np.dtype(jnp.float32)


class TrainState(NamedTuple):
  """Everything a training run carries from step to step.

  Attributes:
    params: trainable parameters, each stored in the param dtype of the module owning it
      (an ``nnx.State`` for NNX models, the ``'params'`` collection for Linen).
    opt_state: the optimizer state, loss-scale state included
      (:func:`jaxamp.get_loss_scale` reads it).
    step: number of ``step`` calls made (skipped ones included; the optimizer's own
      counters do not advance on skipped steps).
    model_state: non-trainable state: BatchNorm statistics, NNX RNG streams, other
      Linen collections.
    rng: the base PRNG key of Linen's ``'dropout'`` stream: a step draws from
      ``jax.random.fold_in(rng, n)``, ``n`` the number of steps applied before it
      (skipped ones excluded), so the key itself never changes and a model that draws
      none costs no key work. Unused for NNX models (they carry their RNG streams in
      ``model_state``).
    fp8: under an FP8 policy, ``{module path: jaxamp.fp8.Fp8Meta}`` (amax histories and
      scales), updated by the step's forward and backward passes, never by the
      optimizer, and kept as is on a skipped step; None without FP8 modules.
  """

  params: Any
  opt_state: Any
  step: jax.Array
  model_state: Any
  rng: jax.Array
  fp8: Any = None


class MasterWeightsState(NamedTuple):
  """Optimizer state with float32 master weights, for half-precision params.

  Attributes:
    master_params: float32 copies of the parameters; the optimizer updates these and
      the stored params are their casts to each parameter's stored dtype (MXNet
      ``multi_precision``, Apex O2).
    inner_state: the wrapped optimizer's state.
  """

  master_params: Any
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
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else jax.eval_shape(lambda y: y, x), state)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


class _Float32Outputs(amp_nnx.PolicyModule):
  """The model an NNX ``loss_fn`` receives: a policy wrapper (an ``nnx.Module``, so
  ``nnx.state``, ``nnx.split`` and ``nnx.merge`` see the model's Variables) whose calls
  and public methods hand their floating outputs over in float32. Submodules reached
  through it run under the policy and return their own dtypes."""

  def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
    return cast_floating(super()._call(name, *args, **kwargs), _F32)

  def __getitem__(self, key: Any) -> Any:
    if not hasattr(self.module, "__getitem__"):
      raise TypeError(f"loss_fn indexed the model with {key!r}, as if it were the batch: "
                      "loss_fn is called as loss_fn(model, batch). Are its arguments "
                      "swapped?")
    return super().__getitem__(key)  # a submodule runs under the policy, as attributes do


_LOSS_FN_HINT = ("jaxamp calls loss_fn(model, batch): model is the model running under its "
                 "policy (call it: model(batch['x'])), batch is what was passed to "
                 "train.step. Check the order of loss_fn's arguments, and that it does not "
                 "expect parameters in place of the model.")


def _check_signature(fn: Callable[..., Any], what: str) -> None:
  """Refuses a ``what`` (loss_fn, eval_fn) that cannot be called as ``fn(model, batch)``."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return  # no signature to read (a builtin, say): the call itself will tell
  try:
    signature.bind(None, None)
  except TypeError as e:
    raise TypeError(f"{what} must take (model, batch), but {what}{signature} cannot be "
                    f"called so ({e}).") from None


def _split_loss(out: Any, has_aux: bool) -> tuple[jax.Array, Any]:
  """``loss_fn``'s result as ``(float32 scalar loss, aux)``, or a TypeError naming the fix."""
  if has_aux:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(f"With has_aux=True, loss_fn must return (loss, aux); it returned "
                      f"{_describe(out)}.")
    loss, aux = out
  elif isinstance(out, (tuple, list)):
    raise TypeError(f"loss_fn returned a {type(out).__name__} of {len(out)} items; a loss_fn "
                    "that returns (loss, aux) needs make_train_step(..., has_aux=True).")
  else:
    loss, aux = out, None
  try:
    loss = jnp.asarray(loss)
  except TypeError:
    raise TypeError(f"loss_fn must return a scalar float loss, got {_describe(loss)}.") from None
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(f"loss_fn must return a floating loss, got dtype {loss.dtype}; a loss of "
                    "another dtype has no gradient.")
  if loss.shape != ():
    raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}; reduce it "
                     "(e.g. .mean()).")
  return loss.astype(_F32), aux


def _describe(x: Any) -> str:
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)} items"
  shape = getattr(x, "shape", None)
  return f"an array of shape {shape}" if shape is not None else f"a {type(x).__name__}"


def _state_mismatch(state: Any, expected: Any) -> str | None:
  """What differs between ``state`` and ``expected`` (an abstract TrainState), or None."""
  if not isinstance(state, TrainState):
    return f"it is a {type(state).__name__}, not a jaxamp.TrainState"
  fields = {"params": "another model", "opt_state": "another optimizer or loss scale",
            "model_state": "another model", "step": None, "rng": None,
            "fp8": "another model or FP8 policy"}
  for field, cause in fields.items():
    got, want = getattr(state, field), getattr(expected, field)
    if jax.tree.structure(got) != jax.tree.structure(want):
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


# --- model adapters: how a model is split into state and called from the state --------


@dataclasses.dataclass
class _NNXAdapter:
  graphdef: Any
  uses_rng = False  # NNX models carry their RNG streams in model_state

  @staticmethod
  def split(model: nnx.Module) -> tuple[Any, Any, Any]:
    return nnx.split(model, nnx.Param, ...)

  recompute_norms: bool = False

  def bind(self, params, model_state, rng, policy, *, train, float32_outputs):
    del rng  # NNX models carry their RNG streams in model_state

    # merge() reuses the State's Variable objects; rebuilding them here puts them at this
    # trace level, so the model may update BatchNorm statistics and RNG counts under grad.
    params, model_state = jax.tree.map(lambda x: x, (params, model_state))
    model = nnx.merge(self.graphdef, params, model_state)
    fp8_lib.name_nnx_modules(model, path_name)  # FP8 state keys, if a step threads one
    if not train:
      model.eval()
    kind = _Float32Outputs if float32_outputs else amp_nnx.PolicyModule
    view = kind(model, policy, recompute_norms=self.recompute_norms)
    return view, lambda: nnx.split(model, nnx.Param, ...)[2]

  def model(self, state: TrainState) -> nnx.Module:
    return nnx.merge(self.graphdef, state.params, state.model_state)


@dataclasses.dataclass
class _LinenAdapter:
  module: Any
  uses_rng = True  # the step key feeds Linen's 'dropout' stream
  recompute_norms: bool = False
  _wrapped: Any = None

  def bind(self, params, model_state, rng, policy, *, train, float32_outputs):
    from jaxamp import linen as amp_linen  # pylint: disable=g-import-not-at-top

    # One wrapper, so its plan cache serves every trace (step and eval); the step binds
    # with its one policy.
    if self._wrapped is None or self._wrapped.policy != policy:
      self._wrapped = amp_linen.with_policy(self.module, policy,
                                            recompute_norms=self.recompute_norms)
    wrapped = self._wrapped
    cell = {"state": dict(model_state), "calls": 0}
    mutable = list(model_state) if train else False

    def apply(*args: Any, **kwargs: Any) -> Any:
      rngs = {"dropout": jax.random.fold_in(rng, cell["calls"])}
      cell["calls"] += 1
      variables = {"params": params, **cell["state"]}
      if mutable:
        out, new_state = wrapped.apply(variables, *args, rngs=rngs, mutable=mutable, **kwargs)
        cell["state"] = dict(new_state)
      else:
        out = wrapped.apply(variables, *args, rngs=rngs, **kwargs)
      return cast_floating(out, _F32) if float32_outputs else out

    return apply, lambda: cell["state"]

  def model(self, state: TrainState) -> tuple[Any, dict[str, Any]]:
    return self.module, {"params": state.params, **state.model_state}


def _place(tree: Any, shardings: Any) -> Any:
  """``jax.device_put(tree, shardings)``, also where a sharding spans other processes.

  There device_put refuses an array committed to one local device; every process holds
  the same value (same seed, same model), so each places its slices from a host copy.
  """

  def one(x: Any, sharding: Any) -> Any:
    if (not isinstance(x, jax.Array) or sharding.is_fully_addressable
        or not x.is_fully_addressable):
      return jax.device_put(x, sharding)
    if _is_key(x):
      data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sharding)

  return jax.tree.map(one, tree, shardings)


def _per_device_keys(rng: jax.Array, model_state: Any, axes: Any) -> tuple[jax.Array, Any]:
  """Inside ``shard_map``: the step key and the key streams the model carries (NNX Rngs)
  with this device's index on ``axes`` folded in, so each device draws its own dropout
  masks. :func:`_shared_keys` hands the shared keys back afterwards."""
  index = jax.lax.axis_index(axes)
  keys = jax.tree.map(lambda x: jax.random.fold_in(x, index) if _is_key(x) else x,
                      model_state)
  return jax.random.fold_in(rng, index), keys


def _shared_keys(new_state: Any, model_state: Any) -> Any:
  """``new_state`` with the model's PRNG keys as they were before the per-device fold."""
  return jax.tree.map(lambda n, o: o if _is_key(o) else n, new_state, model_state)


def _mean_floats(tree: Any, axes: Any) -> Any:
  """Inside ``shard_map``: floating leaves averaged over ``axes``, the rest as they are."""
  return jax.tree.map(lambda a: jax.lax.pmean(a, axes)
                      if jnp.issubdtype(a.dtype, jnp.inexact) else a, tree)


def _check_trainable(params: Any, model: str) -> None:
  """Refuses, naming the fix, parameters a gradient step cannot train: none at all, or
  ones that are not floating (``jax.grad`` takes floating inputs only)."""
  found = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  if not found:
    raise ValueError(
        f"init found no parameters to train in {model}: the train step differentiates "
        "the model's nnx.Param variables (Linen: its 'params' collection). State it "
        "only reads (a plain nnx.Variable, a buffer) is not trained; hold what should "
        "be trained in an nnx.Param.")
  wrong = [f"{path_name(path) or '(model)'} ({np.dtype(_value_of(x).dtype).name})"
           for path, x in found if not jnp.issubdtype(_value_of(x).dtype, jnp.inexact)]
  if wrong:
    raise ValueError(
        f"init found parameters of {model} that are not floating: {', '.join(wrong)}. "
        "Gradients exist for floating parameters only: hold integer or boolean tables "
        "in a plain nnx.Variable (Linen: another collection than 'params'), which the "
        "step passes along untrained.")


def _value_of(x: Any) -> Any:
  return x.get_value() if isinstance(x, nnx.Variable) else x


def _combine_aux(tree: Any, over_axis: int | None = None, over_devices: Any = None) -> Any:
  """``loss_fn``'s aux over micro-batches (stacked on ``over_axis``) or, inside
  ``shard_map``, over the batch's ``over_devices`` axes, as the whole batch's.

  Floating leaves are averaged (a per-example mean stays a mean), integer leaves summed
  (a count stays the batch's count), boolean leaves or-ed (a flag set by any part of the
  batch); other leaves (PRNG keys) are the last micro-batch's, or each device's own.
  """
  def combine(a: Any) -> Any:
    if jnp.issubdtype(a.dtype, jnp.inexact):
      return (jnp.mean(a, axis=over_axis) if over_devices is None
              else jax.lax.pmean(a, over_devices))
    if jnp.issubdtype(a.dtype, jnp.bool_):
      return (jnp.any(a, axis=over_axis) if over_devices is None
              else jax.lax.pmax(a.astype(jnp.int32), over_devices).astype(jnp.bool_))
    if jnp.issubdtype(a.dtype, jnp.integer):
      return (jnp.sum(a, axis=over_axis, dtype=a.dtype) if over_devices is None
              else jax.lax.psum(a, over_devices))
    return a[-1] if over_devices is None else a
  return jax.tree.map(combine, tree)


def _held(grad: Any, opt_grad: Any, found: NarrowCotangents | None
          ) -> tuple[Any, np.dtype | None]:
  """What the skip's cond holds for one gradient: ``(narrow, dtype)``, the gradient as
  narrow as it was computed and the dtype ``grad`` has (the branch widens it to that and
  on as ``opt_grad`` was made), or ``(opt_grad, None)`` where nothing narrower exists."""
  if not is_floating_array(grad):
    return opt_grad, None
  narrow = found.narrow(grad) if found is not None else None
  if narrow is not None:
    return narrow, np.dtype(grad.dtype)
  if opt_grad is not grad and np.dtype(grad.dtype).itemsize < np.dtype(opt_grad.dtype).itemsize:
    return grad, np.dtype(grad.dtype)
  return opt_grad, None


def _flat_cond(pred: jax.Array, true_fn: Callable[[Any], Any],
               false_fn: Callable[[Any], Any], operands: Any) -> Any:
  """``jax.lax.cond(pred, true_fn, false_fn, operands)``, given the operands' leaves.

  The same program; only cheaper to trace. ``cond`` names every leaf of a structured
  operand and result by its key path and rebuilds the trees several times, which for a
  train state of hundreds of leaves (NNX ``State``s) is a noticeable share of the
  step's trace; here each tree is flattened and rebuilt once.
  """
  leaves, treedef = jax.tree.flatten(operands)
  out_trees = []

  def branch(fn: Callable[[Any], Any]) -> Callable[..., list[Any]]:
    def run(*leaves: Any) -> list[Any]:
      out, out_tree = jax.tree.flatten(fn(treedef.unflatten(leaves)))
      out_trees.append(out_tree)
      return out
    return run

  out = jax.lax.cond(pred, branch(true_fn), branch(false_fn), *leaves)
  if out_trees[0] != out_trees[1]:
    raise TypeError(f"cond branches return different structures: {out_trees[0]} and "
                    f"{out_trees[1]}")
  return out_trees[0].unflatten(out)


class _DeferredFullCollections:
  """While active, Python's cyclic garbage collector makes no full (oldest-generation)
  collections; the young generations are collected as usual.

  Tracing a train step allocates container objects by the hundred thousand (tracers,
  equations, pytree nodes), and every few hundred thousand the collector walks the
  whole heap: with a large model, a compiled program or a dataset alive, one such walk
  took ~0.2 s on a 2-core CPU, and the 48-layer transformer of ``benchmarks/compile``
  made 4-5 of them per trace. A change proposed for PyTorch's dynamo
  (pytorch/pytorch#193289) defers them while it compiles, as this does while jaxamp
  traces a step. Garbage that reached the oldest
  generation meanwhile waits for the next full collection after it. Re-entrant and
  shared by threads: the first to enter raises the threshold, the last to leave puts
  the one it found back.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._depth = 0
    self._saved: tuple[int, ...] | None = None

  def __enter__(self) -> None:
    with self._lock:
      self._depth += 1
      if self._depth == 1:
        self._saved = gc.get_threshold()
        gc.set_threshold(self._saved[0], self._saved[1], 2**30)

  def __exit__(self, *exc: Any) -> None:
    with self._lock:
      self._depth -= 1
      if self._depth == 0 and self._saved is not None:
        gc.set_threshold(*self._saved)
        self._saved = None


_deferred_full_collections = _DeferredFullCollections()


def _float16_leaves(params: Any) -> list[Any]:
  return [x for x in jax.tree.leaves(params) if x.dtype == jnp.float16]


def _skip_on_param_overflow(params_finite: jax.Array, new: Any, old: Any) -> Any:
  """``new`` optimizer state where ``params_finite``, else ``old`` with the step counted
  as skipped in its loss-scale state (the scale itself is kept: it did not cause this)."""

  def pick(n: Any, o: Any) -> Any:
    if isinstance(n, _ls.LossScaleState):
      skipped = o._replace(growth_count=jnp.zeros_like(o.growth_count),
                           finite=jnp.asarray(False),
                           overflow_steps=o.overflow_steps + 1)
      return _ls._select_tree(params_finite, n, skipped)
    return _ls._select_tree(params_finite, n, o)

  return jax.tree.map(pick, new, old, is_leaf=lambda x: isinstance(x, _ls.LossScaleState))


# --- the factory --------------------------------------------------------------------------


class _SkipStreaks:
  """Warns once per streak when all of ``window`` consecutive steps were skipped.

  Samples ``metrics['skipped_steps']`` every ``window`` calls and compares the two
  samples before the newest one: both are at least ``window`` calls old, so reading them
  never waits on a step just dispatched.
  """

  def __init__(self, window: int):
    self.window = window
    self.calls = 0
    self.samples: list[Any] = []
    self.warned = False

  def observe(self, metrics: Mapping[str, Any]) -> None:
    skipped = metrics["skipped_steps"]
    if isinstance(skipped, jax.core.Tracer):  # step called inside the user's jit
      return
    self.calls += 1
    # Below, once per window, not per call: a mesh spanning hosts cannot be read here.
    if self.calls % self.window or not skipped.is_fully_addressable:
      return
    # The newest sample is kept, not read; the two before it span `window` calls.
    self.samples = [*self.samples[-2:], (skipped, {
        k: metrics[k] for k in ("loss_scale", "grads_finite", "params_finite") if k in metrics})]
    if len(self.samples) < 3:
      return
    (old, _), (new, sample) = self.samples[0], self.samples[1]
    if int(new) - int(old) != self.window:  # != : a state from elsewhere between them
      self.warned = False
      return
    if not self.warned:
      self.warned = True
      scale = float(sample["loss_scale"])
      if bool(sample["grads_finite"]) and not bool(sample.get("params_finite", True)):
        why = (f"their gradients were finite (loss scale {scale:g}), but the updates made "
               "float16 parameters inf or NaN, so the step was skipped. The optimizer "
               "computes in float16 there: Adam's default eps=1e-8 is 0 in float16 (a zero "
               "gradient gives 0/0), and its moments overflow. Keep float32 master "
               "weights (make_train_step(..., master_weights=True)) or give Adam "
               "eps=1e-4 or more.")
      else:
        why = (f"their gradients were not finite (inf or NaN), so the parameters did not "
               f"change (loss scale {scale:g}). Find the overflowing parameters with "
               "make_train_step(..., debug_nonfinite=True) (metrics['nonfinite_grads']). "
               "Common causes: NaN in the inputs or the loss, a learning rate that "
               "diverged, or an op that overflows in float16 whatever the scale "
               "(jax.nn.gelu's backward pass; see the README).")
      warnings.warn(
          f"jaxamp: the last {self.window} train steps were all skipped: {why} "
          "warn_skipped_steps=None turns this warning off.", RuntimeWarning, stacklevel=3)


class TrainStep:
  """A compiled mixed-precision train step; build it with :func:`make_train_step`.

  Attributes:
    policy: the model-level policy.
    master_weights: whether the optimizer updates float32 master weights; when
      ``make_train_step`` left it to the default, None until :meth:`init` decides.
    trace_count: how many times ``step`` was traced (1 for a fixed batch shape).
    param_specs: with ``param_sharding``, the ``PartitionSpec`` of each parameter (a tree
      like the params) once :meth:`init` has run; else None.
  """

  def __init__(self, loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, *,
               policy: Policy, has_aux: bool, grad_accum_steps: int, mesh: Any,
               batch_axis: str, donate: bool, grad_reduce_dtype: Any,
               master_weights: bool | None, float32_outputs: bool, debug_nonfinite: bool,
               eval_fn: Callable[..., Any] | None, seed: int, level: Any = None,
               recompute_norms: bool = False, param_sharding: Any = None,
               warn_skipped_steps: int | None = 100, skip_nonfinite: bool = True):
    if grad_accum_steps < 1:
      raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}.")
    batch_axes = sharding_lib.axis_names(batch_axis)
    if mesh is not None:
      for name in batch_axes:
        if name not in mesh.axis_names:
          raise ValueError(f"batch_axis {name!r} is not an axis of the mesh; its axes are "
                           f"{tuple(mesh.axis_names)}.")
    if param_sharding is not None and mesh is None:
      raise ValueError("param_sharding needs a mesh: pass mesh=jax.make_mesh(...) with the "
                       "axes the parameters are sharded over (e.g. jaxamp.fsdp('fsdp') "
                       "needs an axis named 'fsdp').")
    if warn_skipped_steps is not None and (isinstance(warn_skipped_steps, bool) or not
                                           isinstance(warn_skipped_steps, int)
                                           or warn_skipped_steps < 1):
      raise ValueError(f"warn_skipped_steps must be a positive int (steps) or None (never "
                       f"warn), got {warn_skipped_steps!r}.")
    if not isinstance(skip_nonfinite, (bool, np.bool_)):
      raise ValueError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}.")
    self.skips_nonfinite = bool(skip_nonfinite)
    # Without skips skipped_steps never moves: nothing to watch on the step's hot path.
    self._streaks = (_SkipStreaks(warn_skipped_steps)
                     if warn_skipped_steps is not None and self.skips_nonfinite else None)
    _check_signature(loss_fn, "loss_fn")
    if eval_fn is not None:
      _check_signature(eval_fn, "eval_fn")
    self.policy = policy
    self.recompute_norms = self._recompute_norms_arg = bool(recompute_norms)
    self.loss_fn = loss_fn
    self.eval_fn = eval_fn if eval_fn is not None else loss_fn
    self.has_aux = has_aux
    self.grad_accum_steps = grad_accum_steps
    self.mesh = mesh
    self.batch_axis = batch_axis
    self._batch_axes = batch_axes
    self.param_sharding = param_sharding
    # Set by init when param_sharding is given: the specs of the params (a tree like
    # them), the dtypes they are gathered in, and the shardings of the whole state.
    self.param_specs: Any = None
    self._gather_dtypes: Any = None
    self._state_shardings: Any = None
    self.donate = donate
    if grad_reduce_dtype is None or not jnp.issubdtype(np.dtype(grad_reduce_dtype),
                                                        jnp.floating):
      raise ValueError(f"grad_reduce_dtype must be a floating dtype (float32, bfloat16, "
                       f"float16), got {grad_reduce_dtype!r}.")
    self.grad_reduce_dtype = np.dtype(grad_reduce_dtype)
    # None: decided at init, from the dtypes the parameters are stored in.
    self._master_weights_arg = master_weights
    self.master_weights = master_weights
    self.float32_outputs = float32_outputs
    self.debug_nonfinite = debug_nonfinite
    self.seed = seed
    self.level = level
    self._user_optimizer = optimizer
    self.optimizer: optax.GradientTransformation | None = None
    self._adapter: Any = None
    self._fp8_recipes: dict[str, Any] = {}
    self._step_jit: Any = None
    self._eval_jit: Any = None
    self._unit_scale = False  # the step inserted no_loss_scale(): no multiply, no divide
    self._overflow = None  # the loss scale's rule for a skipped step (_build_optimizer)
    # The skeleton of the state init made, and the last state step returned (known good).
    self._expected: Any = None
    self._last_state: Any = None
    self.trace_count = 0
    # Parameter reads record their half-precision cotangents (casting.narrow_cotangents)
    # until a loss_fn turns out to take forward-mode derivatives over the parameters.
    self._narrow_reads = True

  # -- setup --

  def init(self, model: Any, variables: Mapping[str, Any] | None = None,
           *example_args: Any, **example_kwargs: Any) -> TrainState:
    """Builds the first :class:`TrainState`.

    Each parameter is stored in the param dtype of the module that owns it (its resolved
    policy: rules, norm defaults and the opt level's norm rule included). NNX models show
    their modules. For a Linen module pass the example arguments ``module.init`` took
    besides its rngs (arrays or ``jax.ShapeDtypeStruct``; keyword arguments such as
    ``train=False`` too): they are traced abstractly to find the modules. Without them,
    and for modules that do not run for them, parameters get the model policy's param
    dtype. A model wrapped by ``jaxamp.nnx.with_policy`` / ``jaxamp.linen.with_policy``
    is unwrapped: the train step applies its own policy.

    The state holds the model's own arrays where no cast was needed, and ``step``
    donates its input state (``donate=True``): the first step consumes them, so use
    :meth:`model` afterwards, or pass a copy to keep the original. An NNX model trains in
    the mode it has now (call ``model.train()`` first if it was set to ``.eval()``).

    Args:
      model: an NNX module, or a Linen module (then pass ``variables``).
      variables: the Linen variables (``module.init(...)``'s result).
      *example_args: Linen only: the module's example arguments.
      **example_kwargs: Linen only: its example keyword arguments (``rngs`` too, if
        ``init`` needs more than a ``'params'`` key).

    Returns:
      The train state (replicated over the mesh, if any).
    """
    from jaxamp import linen as amp_linen  # pylint: disable=g-import-not-at-top

    if isinstance(model, (amp_nnx.PolicyModule, amp_linen.LinenPolicy)):
      if model.policy is not None and model.policy != self.policy:
        raise ValueError(
            f"init got a model wrapped with policy {model.policy.name!r}, but this train "
            f"step's policy is {self.policy.name!r}. Pass the unwrapped model (the train "
            "step applies its own policy), or make the step with the same policy.")
      model, recompute = model.module, model.recompute_norms
    else:
      recompute = False
    # Each init decides afresh: a wrapped model's request does not outlive it.
    self.recompute_norms = self._recompute_norms_arg or recompute
    with self._level_rules():
      if isinstance(model, nnx.Module):
        if variables is not None or example_args or example_kwargs:
          raise ValueError("init(model) takes no variables or example inputs for an NNX "
                           "model.")
        plan = amp_nnx.module_policies(model, self.policy)
        fp8_plan = plan
        if any(fp8_lib.runs_fp8(cls, p) for _, cls, p in plan):
          # Layers holding one kernel per nnx.scan step run FP8 with current scaling.
          stacked = {path_name(path) for path, node in nnx.iter_graph(model)
                     if isinstance(node, fp8_lib.nnx_classes()) and fp8_lib.nnx_stacked(node)}
          fp8_plan = [row for row in plan if row[0] not in stacked]
        graphdef, params, model_state = _NNXAdapter.split(model)
        self._adapter = _NNXAdapter(graphdef, self.recompute_norms)
      else:
        if variables is None or "params" not in variables:
          raise ValueError("For a Linen module call init(module, variables), where variables "
                           "is module.init(...)'s result with a 'params' collection.")
        plan = fp8_plan = None
        if example_args or example_kwargs:
          plan, lifted = amp_linen.module_plan(model, None, *example_args,
                                               policy=self.policy, **example_kwargs)
          # Layers inside nn.scan & co. run FP8 with current scaling: no state for them.
          fp8_plan = [row for row in plan if row[0] not in lifted]
        self._adapter = _LinenAdapter(model, self.recompute_norms)
        if plan is None and asks_for_fp8(self.policy):
          raise ValueError("An FP8 policy with a Linen module needs the example inputs: "
                           "train.init(module, variables, *example_args) finds the Dense "
                           "layers that keep FP8 state from them.")
        params = variables["params"]
        model_state = {k: v for k, v in variables.items() if k != "params"}
    if plan is not None:
      warn_unmatched_path_rules(type(model).__name__, [row[0] for row in plan])
    _check_trainable(params, type(model).__name__)
    if self.param_sharding is not None:
      # Read the specs while Linen's partitioning boxes are still on, then drop them.
      self.param_specs = sharding_lib.param_specs(self.param_sharding, params, self.mesh)
      params, model_state = flax_meta.unbox((params, model_state))
    uncast = params
    params = (self.policy.cast_to_param(params) if plan is None
              else cast_module_params(params, plan, lambda p: p.param_dtype))
    values = lambda t: jax.tree.map(_value_of, t, is_leaf=lambda x: isinstance(x, nnx.Variable))
    overflowed = [f"{path_name(path)} (|max| {big:.4g}, {dtype.name})"
                  for path, big, dtype in overflowed_casts(values(uncast), values(params))]
    if overflowed:
      raise ValueError(
          f"init: parameters of {type(model).__name__} outside the param dtype's range "
          f"would be stored as inf: {', '.join(overflowed)}. Use a policy with float32 "
          "params ('mixed_float16'), or bfloat16 (float32's range), or keep their "
          "modules in float32 with a rule (jaxamp.policy_rules({'<path>': 'float32'})).")
    if self.param_specs is not None:
      # Each parameter is gathered in the compute dtype of the module owning it: the dtype
      # the module casts it to anyway, so the cast before the gather changes no value.
      compute = jax.eval_shape(lambda p: (
          self.policy.cast_to_compute(p) if plan is None
          else cast_module_params(p, plan, lambda q: q.compute_dtype)), params)
      self._gather_dtypes = [x.dtype for x in jax.tree.leaves(compute)]
    if self._master_weights_arg is None:
      self.master_weights = any(is_floating_array(x) and x.dtype.itemsize < 4
                                for x in jax.tree.leaves(params))
    self.optimizer = self._build_optimizer(params)
    opt_params = params
    if self.master_weights:
      # A copy where a parameter is float32 already: the state must not hold one buffer
      # twice (the step donates it).
      opt_params = jax.tree.map(lambda m, p: jnp.copy(m) if m is p else m,
                                cast_floating(params, _F32), params)
    opt_state = self.optimizer.init(opt_params)
    if self.master_weights:
      opt_state = MasterWeightsState(opt_params, opt_state)
    # FP8 amax histories and scales: their own field, out of the optimizer's reach.
    fp8_state = fp8_lib.init_state(fp8_plan) if fp8_plan is not None else {}
    if plan is not None:
      fp8_lib.warn_if_unused(plan, type(model).__name__)
    self._fp8_recipes = fp8_lib.recipes_of(fp8_plan) if fp8_plan is not None else {}
    state = TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32),
                       model_state=model_state, rng=jax.random.key(self.seed),
                       fp8=fp8_state or None)
    if self.param_specs is not None:
      self._state_shardings = self._shardings_of(state)
    self._compile()
    if self.param_specs is not None:
      state = _place(state, self._state_shardings)
    elif self.mesh is not None:
      state = jax.device_put(state, self._replicated())
    self._expected = abstract_state(state)
    self._last_state = None  # states made before this init must pass the check
    return state

  def check_state(self, state: Any) -> None:
    """Raises a ValueError unless ``state`` fits this step (the one its ``init`` made).

    ``step`` and ``eval_step`` call it for any state they did not return themselves (a
    restored checkpoint, a state from another step, one made before a later ``init``):
    its structure, shapes and dtypes must match. The loss scale travels with the state:
    whatever scale it holds is the one its next step multiplies and divides by, so a
    state saved under ``mixed_float16`` resumes correctly under a bfloat16 step (which
    then returns the scale to 1).
    """
    if self._expected is None:
      raise RuntimeError("Call train.init(...) first.")
    problem = _state_mismatch(state, self._expected)
    if problem is not None:
      raise ValueError(f"This state does not fit this train step: {problem}. Use a state made "
                       "by this step's init (or restored into jaxamp.abstract_state of one); "
                       "a step re-initialised with another model runs only its new states.")

  def _build_optimizer(self, params: Any) -> optax.GradientTransformation:
    shapes = jax.eval_shape(self._user_optimizer.init, params)
    # After clipping (torch's "clip before unscale" pitfall), inside masked/MultiSteps...:
    # refused, with what to write instead.
    _ls.check_loss_scale_placement(shapes)
    tx = self._user_optimizer
    self._unit_scale = False
    if not optax.tree_utils.tree_get_all_with_path(shapes, "LossScaleState"):
      scale = (self.level.make_loss_scale() if self.level is not None
               else _ls.loss_scale_for(self.policy))
      # A scale fixed at 1 (bfloat16, float32) needs no multiply and no divide, whatever
      # scale a restored state holds (the loss scale returns it to 1).
      self._unit_scale = _ls.is_no_loss_scale(scale)
      tx = optax.chain(scale, tx)
    if (self._unit_scale and self.mesh is not None
        and self.grad_reduce_dtype == np.dtype(jnp.float16)):
      warnings.warn(
          "jaxamp: grad_reduce_dtype=float16 with no loss scale (policy "
          f"{self.policy.name!r}): gradients below float16's smallest value (6e-8) are "
          "averaged as 0 and ones past 65504 as inf. Use bfloat16 (float32's range), or "
          "a policy that scales the loss.", RuntimeWarning, stacklevel=3)
    # skip_nonfinite=False (apply every update, as optax and the peers do without a loss
    # scaler) only where float16 does not need skips: an overflowing float16 step, or a
    # float16 param pushed past 65504, must not be applied.
    if not self.skips_nonfinite and (not self._unit_scale or _float16_leaves(params)):
      why = ("a parameter is stored in float16 (an update past 65504 would store inf)"
             if self._unit_scale else
             "the optimizer has a loss scale (an overflowing step's update would be applied)")
      raise ValueError(f"skip_nonfinite=False cannot be honoured: {why}. Drop it, or "
                       "train in bfloat16/float32 without a loss-scale element in the chain.")
    tx = _ls.skip_nonfinite(tx)
    # A skipped step moves only the loss scale; when that is all the optimizer's rule can
    # do, the step traces the rule rather than a second, dead copy of the whole update.
    self._overflow = _ls.overflow_rule(tx, params) if self.skips_nonfinite else None
    return tx

  def _replicated(self) -> Any:
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def _compile(self) -> None:
    donate = (0,) if self.donate else ()
    if self.mesh is None:
      self._step_jit = jax.jit(self._step_impl, donate_argnums=donate)
      self._eval_jit = jax.jit(self._eval_impl)
    else:
      repl = self._replicated()
      state = self._state_shardings if self.param_specs is not None else repl
      data = self._batch_sharding()
      self._step_jit = jax.jit(self._step_impl, donate_argnums=donate,
                               in_shardings=(state, data), out_shardings=(state, repl))
      self._eval_jit = jax.jit(self._eval_impl, in_shardings=(state, data))

  def _batch_sharding(self) -> Any:
    return jax.sharding.NamedSharding(self.mesh,
                                      jax.sharding.PartitionSpec(self._batch_axes))

  def _shardings_of(self, state: TrainState) -> TrainState:
    """Where each leaf of ``state`` lives: params by their specs, optimizer-state subtrees
    shaped like the params (moments, master weights) likewise, the rest replicated."""
    repl = self._replicated()
    named = lambda spec: jax.sharding.NamedSharding(self.mesh, spec)
    param_def = jax.tree.structure(state.params)
    shapes = [np.shape(x) for x in jax.tree.leaves(state.params)]
    spec_leaves = param_def.flatten_up_to(self.param_specs)

    def mirrors(x: Any) -> bool:
      try:
        return jax.tree.structure(x) == param_def
      except Exception:  # pylint: disable=broad-except
        return False

    def place(x: Any) -> Any:
      if not mirrors(x):
        return jax.tree.map(lambda _: repl, x)
      # Same structure; a leaf of another shape (a factored statistic) is replicated.
      leaves = [named(s) if np.shape(l) == shape else repl
                for l, s, shape in zip(jax.tree.leaves(x), spec_leaves, shapes)]
      return param_def.unflatten(leaves)

    return TrainState(params=place(state.params),
                      opt_state=jax.tree.map(place, state.opt_state, is_leaf=mirrors),
                      step=repl, model_state=jax.tree.map(lambda _: repl, state.model_state),
                      rng=repl, fp8=jax.tree.map(lambda _: repl, state.fp8))

  # -- public steps --

  def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    """One training step; compiled once per batch shape. Donates ``state`` by default."""
    if self._step_jit is None:
      raise RuntimeError("Call train.init(...) before train.step(...).")
    state, batch = self._accepted(state), self._laid_out(batch)
    new_state, metrics = self._plain_reads_if_needed(lambda: self._step_jit(state, batch))
    self._last_state = new_state
    if self._streaks is not None:
      self._streaks.observe(metrics)
    return new_state, metrics

  def _laid_out(self, batch: Any) -> Any:
    """With a mesh, ``batch``'s arrays committed to another layout (one device, replicated,
    split on another axis) moved to the step's batch sharding, which the compiled step
    would otherwise refuse; host arrays and arrays already so laid out pass untouched."""
    if self.mesh is None:
      return batch
    data = self._batch_sharding()

    def one(x: Any) -> Any:
      if (isinstance(x, jax.Array) and x.committed
          and not x.sharding.is_equivalent_to(data, x.ndim)):
        return jax.device_put(x, data)
      return x
    return jax.tree.map(one, batch)

  def _accepted(self, state: Any, place: bool = True) -> Any:
    """``state`` checked, unless this step returned it, and (``place``) laid out on the
    mesh: a restored or replicated state gets the step's shardings."""
    if state is not self._last_state:  # the step's own output needs no check
      self.check_state(state)
      if place and self._state_shardings is not None:
        state = _place(state, self._state_shardings)
    return state

  def trace(self, state: TrainState, batch: Any) -> Any:
    """``step`` checked and traced, never lowered, compiled or run: a ``jax.stages.Traced``.

    What a first ``step`` call does before XLA sees the program, for ahead-of-time use
    (``train.trace(state, batch).lower().compile()``) or to read the step's jaxpr.
    ``state`` and ``batch`` may be arrays or ``jax.ShapeDtypeStruct``s (e.g.
    :func:`abstract_state`); this step's own jitted function is traced, so its jit cache
    is the one ``step`` then uses.

    Example (ahead of time, from shapes alone):
      >>> import jax, optax, jaxamp
      >>> from flax import nnx
      >>> train = jaxamp.make_train_step(lambda m, b: m(b).mean(), optax.adam(1e-3))
      >>> state = jaxamp.abstract_state(train.init(nnx.Linear(3, 1, rngs=nnx.Rngs(0))))
      >>> traced = train.trace(state, jax.ShapeDtypeStruct((2, 3), 'float32'))
      >>> [e.primitive.name for e in traced.jaxpr.eqns].count('cond')  # the exact skip
      1
      >>> compiled = traced.lower().compile()

    A ``loss_fn`` that takes ``jax.jvp`` with respect to the parameters under a mixed
    policy gives a trace whose ``.lower()`` fails (the parameter reads record their
    cotangents with a ``custom_vjp``); :meth:`lower` and :meth:`step` make the step again
    without them.
    """
    if self._step_jit is None:
      raise RuntimeError("Call train.init(...) before train.trace(...).")
    return self._step_jit.trace(self._accepted(state, place=False), batch)

  def lower(self, state: TrainState, batch: Any, *,
            platforms: Sequence[str] | None = None) -> Any:
    """``step`` traced and lowered, never compiled or run: a ``jax.stages.Lowered``.

    ``platforms=('cuda',)`` lowers for a GPU from any machine, CPU included, so the
    program a GPU would receive can be read (``.as_text()``) without one.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from flax import nnx
      >>> train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
      ...                                policy='mixed_bfloat16')
      >>> state = train.init(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
      >>> text = train.lower(state, jnp.ones((8, 4)), platforms=('cuda',)).as_text()
      >>> 'bf16' in text and 'dot_general' in text
      True
    """
    def lower() -> Any:
      traced = self.trace(state, batch)
      return traced.lower(lowering_platforms=tuple(platforms)) if platforms else traced.lower()

    return self._plain_reads_if_needed(lower)

  def _plain_reads_if_needed(self, run: Callable[[], Any]) -> Any:
    """``run()``; if it fails because ``loss_fn`` takes a forward-mode derivative
    (``jax.jvp``) with respect to the parameters, which a recording read's
    ``custom_vjp`` cannot take (JAX says so when it lowers the step), the step is made
    again with plain reads (every gradient then crosses the skip in float32) and
    ``run()`` runs once more. Nothing was donated: lowering failed before any run."""
    try:
      return run()
    except TypeError as e:
      if not self._narrow_reads or "forward-mode autodiff (jvp) to a custom_vjp" not in str(e):
        raise
    self._narrow_reads = False
    self._compile()
    return run()

  def eval_step(self, state: TrainState, batch: Any) -> Any:
    """Runs ``eval_fn`` (default: the loss function) under the policy, in eval mode.

    NNX models are switched to ``.eval()`` (deterministic dropout, running BatchNorm
    statistics); Linen modules get no mutable collections. Nothing is updated. Floating
    results come back in float32.
    """
    if self._eval_jit is None:
      raise RuntimeError("Call train.init(...) before train.eval_step(...).")
    return self._eval_jit(self._accepted(state), self._laid_out(batch))

  def model(self, state: TrainState) -> Any:
    """The model with the state's parameters: an NNX module, or ``(module, variables)``."""
    if self._adapter is None:
      raise RuntimeError("Call train.init(...) first.")
    return self._adapter.model(state)

  # -- the traced bodies --

  def _loss_and_grads(self, params, model_state, batch, rng, scale, fp8=None,
                      keep_float32=False):
    """Scaled-loss gradients over micro-batches, accumulated in float32 (and kept so
    with ``keep_float32``), and the new FP8 state (the cotangent of its histories
    carries the backward pass's amaxes)."""
    used: set[str] = set()  # FP8 modules that ran, known once traced
    k = self.grad_accum_steps
    # Each micro-batch's loss is scaled by scale / k (torch's recipe: the loss divided by
    # k before scaling), so its float16 backward pass carries the values of the k=1 step's
    # and overflows no sooner; the accumulated sum is then the mean's scaled gradient.
    weight = scale if k == 1 else scale / k

    def scaled_loss(p, f8, ms, mb, key):
      with fp8_lib.state_scope(f8) as scope:
        model, new_state = self._adapter.bind(p, ms, key, self.policy, train=True,
                                              float32_outputs=self.float32_outputs)
        loss, aux = _split_loss(self._call_user(self.loss_fn, model, mb), self.has_aux)
        used.update(scope.used if scope is not None else ())
      return loss * weight, (loss, aux, new_state())

    raw_grad_fn = jax.grad(self._autocast(scaled_loss, batch_argnum=3), argnums=(0, 1),
                           has_aux=True)

    def grad_fn(p, f8, ms, mb, key):
      (g, f8_cot), out = raw_grad_fn(p, f8, ms, mb, key)
      if f8:
        f8 = fp8_lib.merge_state(f8, f8_cot, used, self._fp8_recipes)
      return g, f8, out

    if k == 1:
      grads, fp8, (loss, aux, model_state) = grad_fn(params, fp8, model_state, batch, rng)
      return grads, loss, aux, model_state, fp8

    def split(x):
      if x.shape[0] % k:
        raise ValueError(f"grad_accum_steps={k} must divide the batch size {x.shape[0]} "
                         "(per device, with a mesh).")
      return x.reshape(k, x.shape[0] // k, *x.shape[1:])

    micro = jax.tree.map(split, batch)
    acc0 = jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params)

    def body(carry, xs):
      acc, ms, f8 = carry
      mb, i = xs
      g, f8, (loss, aux, ms) = grad_fn(params, f8, ms, mb, jax.random.fold_in(rng, i))
      acc = jax.tree.map(lambda a, b: a + b.astype(_F32), acc, g)
      return (acc, ms, f8), (loss, aux)

    (acc, model_state, fp8), (losses, auxes) = jax.lax.scan(
        body, (acc0, model_state, fp8), (micro, jnp.arange(k)))
    # Accumulated in float32. Master weights take them so; otherwise they go on in each
    # parameter's dtype, so the optimizer state keeps its dtypes (and the step its single
    # trace).
    grads = jax.tree.map(lambda a, p: a.astype(
        _F32 if self.master_weights or keep_float32 else p.dtype), acc, params)
    return grads, jnp.mean(losses), _combine_aux(auxes, over_axis=0), model_state, fp8

  def _reduce(self, loss, aux, model_state):
    """Inside shard_map: the loss, aux and model state averaged over the batch axes (the
    floating leaves; counters and keys as they are)."""
    axes = self._batch_axes
    return (jax.lax.pmean(loss, axes), _combine_aux(aux, over_devices=axes),
            _mean_floats(model_state, axes))

  def _grads(self, state: TrainState, batch: Any, scale: jax.Array, rng: jax.Array):
    if self.mesh is None:
      return self._loss_and_grads(state.params, state.model_state, batch, rng, scale,
                                  state.fp8)
    if self.param_specs is not None:
      return self._sharded_grads(state, batch, scale, rng)
    P = jax.sharding.PartitionSpec
    axis = self._batch_axes

    def local(params, model_state, batch, rng, scale, fp8):
      rng, keys = _per_device_keys(rng, model_state, axis)
      grads, loss, aux, new_state, new_fp8 = self._loss_and_grads(
          params, keys, batch, rng, scale, fp8)
      dt = self.grad_reduce_dtype
      grads = jax.tree.map(lambda g: jax.lax.pmean(g.astype(dt), axis).astype(g.dtype),
                           grads)
      return (grads, *self._reduce(loss, aux, _shared_keys(new_state, model_state)),
              fp8_lib.reduce_state(new_fp8, fp8, self._fp8_recipes, axis))

    sharded = jax.shard_map(local, mesh=self.mesh,
                            in_specs=(P(), P(), P(axis), P(), P(), P()),
                            out_specs=P(), check_vma=False)
    return sharded(state.params, state.model_state, self._put_batch(batch), rng, scale,
                   state.fp8)

  def _put_batch(self, batch: Any) -> Any:
    data = self._batch_sharding()
    types = dict(zip(self.mesh.axis_names, self.mesh.axis_types))
    explicit = any(types[a] == jax.sharding.AxisType.Explicit for a in self._batch_axes)
    # Explicit mesh axes take a reshard; Auto ones a sharding constraint.
    put = jax.reshard if explicit else jax.lax.with_sharding_constraint
    return jax.tree.map(lambda x: put(x, data), batch)

  def _gather(self, params: Any) -> Any:
    """Inside shard_map: each param slice cast to its compute dtype, then all-gathered."""
    leaves, treedef = jax.tree.flatten(params)
    specs = treedef.flatten_up_to(self.param_specs)
    out = []
    for x, spec, dtype in zip(leaves, specs, self._gather_dtypes):
      x = x.astype(dtype) if is_floating_array(x) else x
      for d, entry in enumerate(spec):
        if entry is not None:
          x = jax.lax.all_gather(x, sharding_lib.axis_names(entry), axis=d, tiled=True)
      out.append(x)
    return treedef.unflatten(out)

  def _reduce_scatter(self, grads: Any, params: Any) -> Any:
    """Inside shard_map: each full local gradient cast to ``grad_reduce_dtype``, summed
    over the batch axes and scattered to its param's layout, then averaged."""
    axes = self._batch_axes
    n = sharding_lib.axis_size(self.mesh, axes)
    leaves, treedef = jax.tree.flatten(grads)
    specs = treedef.flatten_up_to(self.param_specs)
    out = []
    for g, spec, p in zip(leaves, specs, jax.tree.leaves(params)):
      out_dtype = _F32 if self.master_weights else p.dtype
      g = g.astype(self.grad_reduce_dtype)
      summed: tuple[str, ...] = ()
      for d, entry in enumerate(spec):
        names = sharding_lib.axis_names(entry)
        if not names:
          continue
        if all(a in axes for a in names):
          g = jax.lax.psum_scatter(g, names, scatter_dimension=d, tiled=True)
          summed += names
        else:  # a storage-only axis: every device along it has the same gradient
          size = g.shape[d] // sharding_lib.axis_size(self.mesh, names)
          g = jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(names) * size, size, d)
      rest = tuple(a for a in axes if a not in summed)
      if rest:
        g = jax.lax.psum(g, rest)
      out.append((g / n).astype(out_dtype))
    return treedef.unflatten(out)

  def _sharded_grads(self, state: TrainState, batch: Any, scale: jax.Array, rng: jax.Array):
    P = jax.sharding.PartitionSpec
    axes = self._batch_axes

    def local(params, model_state, batch, rng, scale, fp8):
      rng, keys = _per_device_keys(rng, model_state, axes)
      full = self._gather(params)
      grads, loss, aux, new_state, new_fp8 = self._loss_and_grads(
          full, keys, batch, rng, scale, fp8, keep_float32=True)
      return (self._reduce_scatter(grads, params),
              *self._reduce(loss, aux, _shared_keys(new_state, model_state)),
              fp8_lib.reduce_state(new_fp8, fp8, self._fp8_recipes, axes))

    specs = self.param_specs
    sharded = jax.shard_map(local, mesh=self.mesh,
                            in_specs=(specs, P(), P(axes), P(), P(), P()),
                            out_specs=(specs, P(), P(), P(), P()), check_vma=False)
    return sharded(state.params, state.model_state, self._put_batch(batch), rng, scale,
                   state.fp8)

  @staticmethod
  def _call_user(fn: Callable[..., Any], model: Any, batch: Any) -> Any:
    """``fn(model, batch)``; a TypeError, AttributeError or lookup error gets a hint."""
    try:
      return fn(model, batch)
    except (TypeError, AttributeError, KeyError, IndexError) as e:
      e.add_note(_LOSS_FN_HINT)
      raise

  def _autocast(self, fn: Callable[..., Any], batch_argnum: int) -> Callable[..., Any]:
    """``fn`` under the opt level's autocast (O1), else ``fn`` itself. The batch (argument
    ``batch_argnum``) is pinned: float32 data (a regression target) stays float32 where
    it meets half values (``pred - y``), as in torch.autocast; parameters follow."""
    if self.level is None or not self.level.autocast:
      return fn
    from jaxamp.autocast import autocast  # pylint: disable=g-import-not-at-top

    return autocast(fn, self.level.policy, pinned_argnums=(batch_argnum,))

  def _level_rules(self) -> Any:
    """The norm rule an opt level asks for, in force at init and while the step traces."""
    if self.level is not None:
      return norm_defaults(self.level.norm_rule())
    return contextlib.nullcontext()

  def _step_impl(self, state: TrainState, batch: Any):
    self.trace_count += 1  # runs only while tracing
    with _deferred_full_collections, self._level_rules():
      return self._step_body(state, batch)

  def _step_body(self, state: TrainState, batch: Any):
    scale = (jnp.ones([], _F32) if self._unit_scale
             else _ls.get_loss_scale(state.opt_state))
    step_rng = self._step_key(state) if self._adapter.uses_rng else state.rng
    # Without accumulation (a float32 sum over micro-batches) or a mesh (a pmean), the
    # float32 gradient of a parameter read once in half precision is that read's
    # cotangent widened; narrow_cotangents finds those for the skip's cond below.
    narrowable = (self._narrow_reads and self.skips_nonfinite and self.mesh is None
                  and self.grad_accum_steps == 1)
    with narrow_cotangents() if narrowable else contextlib.nullcontext() as found:
      grads, loss, aux, model_state, fp8 = self._grads(state, batch, scale, step_rng)
    unit = None if self._unit_scale else scale

    def received(grads: Any) -> Any:
      # What the optimizer receives (unscaled): float32 for master weights, else each
      # parameter's dtype.
      return cast_floating(grads, _F32) if self.master_weights else grads

    # One reduction gives the metric and the verdict (a finite float32 global norm: every
    # element finite, and no norm past float32's range, which no update could use);
    # the update then runs only on a finite step (lax.cond, not a select over every
    # parameter and optimizer leaf: a skipped step must leave them bit-identical, and a
    # select keeps old and new copies of everything alive).
    opt_grads, grad_norm, grads_finite = _ls.unscaled_norm_and_finite(received(grads), unit)
    # The cond holds each gradient as narrow as it was computed and widens (and unscales)
    # it inside the branch, as a step without the skip does in its update: a float32
    # gradient that is a half-precision cotangent widened crosses as that cotangent, and
    # a half-precision gradient before its cast to float32 master weights. The same
    # values, half the bytes, and the widening fused into the update, where a float32
    # copy of each such gradient was written ahead of the branch and read back in it.
    held, widened = zip(*(_held(g, o, found) for g, o in zip(jax.tree.leaves(grads),
                                                             jax.tree.leaves(opt_grads))))
    opt_treedef = jax.tree.structure(opt_grads)

    def widen(held: Any, dtype: np.dtype | None) -> Any:
      if dtype is None:  # held as the optimizer receives it
        return held
      wide = received(held.astype(dtype))
      return wide if unit is None else _ls.unscale(wide, unit)

    def unpack(held: list[Any]) -> Any:
      # In the branch: each held gradient back as the optimizer receives it.
      return opt_treedef.unflatten([widen(h, d) for h, d in zip(held, widened)])

    # The branches take what they read as operands, as flat leaves (_flat_cond).
    def apply(operands):
      state, held, loss, grad_norm, model_state, fp8 = operands
      opt_grads = unpack(held)
      # jaxamp.clip_by_global_norm in the chain reuses the norm (XLA cannot share it
      # with a second one computed inside this branch).
      known_norm = KnownNorm.of(opt_grads, grad_norm)
      opt_state, params = self._update(state, opt_grads, loss, finite=True,
                                       known_norm=known_norm)
      # A float16 parameter past 65504 (a master weight that grew, or a float16 update)
      # would be stored as inf: skip such a step like an overflowing one.
      params_finite = self._params_finite(params)
      if params_finite is None:
        return params, opt_state, model_state, fp8, np.bool_(True)
      opt_state = _skip_on_param_overflow(params_finite, opt_state, state.opt_state)
      keep = lambda new, old: _ls._select_tree(params_finite, new, old)
      return (keep(params, state.params), opt_state, keep(model_state, state.model_state),
              keep(fp8, state.fp8), params_finite)

    def skip(operands):
      # Only the loss scale moves (it backs off); the rest of the state is kept.
      state, held = operands[:2]
      if self._overflow is not None:
        opt_state = jax.tree.map(
            lambda s: self._overflow(s) if isinstance(s, _ls.LossScaleState) else s,
            state.opt_state, is_leaf=lambda x: isinstance(x, _ls.LossScaleState))
      else:
        opt_state, _ = self._update(state, unpack(held), operands[2], finite=False)
      return state.params, opt_state, state.model_state, state.fp8, np.bool_(True)

    operands = (state, list(held), loss, grad_norm, model_state, fp8)
    if self.skips_nonfinite:
      outs = _flat_cond(grads_finite, apply, skip, operands)
    else:
      # skip_nonfinite=False: every update applied, no lax.cond (whose predicate an XLA
      # GPU program reads back to the host before running a branch). init refused it
      # with float16 params, so apply checks none.
      outs = apply(operands)
    params, opt_state, model_state, fp8, params_finite = outs
    ls_state = optax.tree_utils.tree_get(opt_state, "LossScaleState")
    metrics: dict[str, Any] = {
        "loss": loss,
        "loss_scale": ls_state.scale,
        "grads_finite": grads_finite,
        "grad_norm": grad_norm,
        "skipped_steps": ls_state.overflow_steps,
    }
    if _float16_leaves(state.params):
      metrics["params_finite"] = params_finite
    if self.debug_nonfinite:
      leaves = jax.tree_util.tree_flatten_with_path(
          grads, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
      metrics["nonfinite_grads"] = {
          path_name(path): jnp.logical_not(_ls.all_finite(g)) for path, g in leaves}
    if self.has_aux:
      if isinstance(aux, Mapping) and not set(aux) & set(metrics):
        metrics.update(aux)
      else:
        metrics["aux"] = aux
    new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1,
                           model_state=model_state, rng=state.rng, fp8=fp8)
    return new_state, metrics

  @staticmethod
  def _step_key(state: TrainState) -> jax.Array:
    """The key of Linen's ``'dropout'`` stream for this step: the base key folded with the
    number of steps applied so far (skipped ones do not count, so a skipped step leaves
    no trace, not even in later dropout masks). Folded, not split off a key carried in
    the state: a model that draws no key leaves the fold dead code XLA removes."""
    skipped = optax.tree_utils.tree_get(state.opt_state, "LossScaleState").overflow_steps
    return jax.random.fold_in(state.rng, state.step - skipped)

  def _update(self, state: TrainState, grads: Any, loss: jax.Array, *, finite: bool,
              known_norm: KnownNorm | None = None) -> tuple[Any, Any]:
    """The optimizer's new state and the new params, told whether ``grads`` are finite
    (and, if known, their global norm). The loss goes along as optax's ``value`` extra
    argument (``optax.contrib.reduce_on_plateau`` reads it; chains give it only to the
    elements that take it)."""
    flag = {_ls.GRADS_FINITE: finite, _ls.GRADS_UNSCALED: True,  # divided in _step_body
            "value": loss}
    if known_norm is not None:
      flag[GLOBAL_NORM] = known_norm
    if self.master_weights:
      master, inner = state.opt_state
      updates, inner = self.optimizer.update(grads, inner, master, **flag)
      master = optax.apply_updates(master, updates) if finite else master
      params = jax.tree.map(lambda n, o: n.astype(o.dtype), master, state.params)
      return MasterWeightsState(master, inner), params
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params, **flag)
    return opt_state, optax.apply_updates(state.params, updates)

  @staticmethod
  def _params_finite(params: Any) -> jax.Array | None:
    """Whether every float16 parameter is finite; None if none is stored in float16."""
    half = _float16_leaves(params)
    return _ls.all_finite(half) if half else None

  def _eval_impl(self, state: TrainState, batch: Any):
    params = state.params
    if self.param_specs is not None:
      # Gathered in the compute dtype, as the step gathers them; then run data parallel.
      leaves, treedef = jax.tree.flatten(params)
      repl = self._replicated()
      explicit = set(self.mesh.axis_types) == {jax.sharding.AxisType.Explicit}
      put = jax.reshard if explicit else jax.lax.with_sharding_constraint
      params = treedef.unflatten([put(x.astype(dt) if is_floating_array(x) else x, repl)
                                  for x, dt in zip(leaves, self._gather_dtypes)])

    def run(params, model_state, batch):
      model, _ = self._adapter.bind(params, model_state, state.rng, self.policy, train=False,
                                    float32_outputs=self.float32_outputs)
      return cast_floating(self._call_user(self.eval_fn, model, batch), _F32)

    with self._level_rules(), fp8_lib.state_scope(state.fp8):
      return self._autocast(run, batch_argnum=2)(params, state.model_state, batch)


def make_train_step(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, *,
                    policy: PolicyLike | None = None, has_aux: bool = False,
                    grad_accum_steps: int = 1, mesh: Any = None, batch_axis: str = "data",
                    donate: bool = True, grad_reduce_dtype: Any = jnp.float32,
                    master_weights: bool | None = None, float32_outputs: bool = True,
                    debug_nonfinite: bool = False, eval_fn: Callable[..., Any] | None = None,
                    seed: int = 0, opt_level: Any = None,
                    recompute_norms: bool = False,
                    param_sharding: Any = None,
                    warn_skipped_steps: int | None = 100,
                    skip_nonfinite: bool = True) -> TrainStep:
  """Builds a compiled mixed-precision train step.

  Args:
    loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      ``model`` runs under its per-module policies: the policy-wrapped NNX module, or for
      Linen a callable ``model(*args, **kw)`` applying the module (BatchNorm statistics
      and the ``'dropout'`` RNG are handled for you). Its floating outputs arrive in
      float32 unless ``float32_outputs=False``; the loss is computed and reported in float32.
    optimizer: an optax transformation. A loss-scale element in it (e.g.
      ``optax.chain(jaxamp.dynamic_loss_scale(), optax.adamw(3e-4))``) is used; without
      one, ``jaxamp.loss_scale_for(policy)`` is put first (dynamic for float16 compute).
    policy: the model-level policy; None takes ``jaxamp.global_policy()`` now.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; a dict ``aux`` is merged into
      the metrics, anything else is under ``metrics['aux']``.
    grad_accum_steps: micro-batches per step, run with ``lax.scan`` inside the step; the
      scale updates once per step and the whole step is skipped if any micro-batch
      overflows. Each micro-batch's loss is scaled by the loss scale over
      ``grad_accum_steps`` (its float16 gradients are as large as without accumulation).
      The aux of the micro-batches (and, with a mesh, of the devices) is combined into
      the whole batch's: floating values averaged, integers summed (counts), booleans
      or-ed (flags).
    mesh: a ``jax.sharding.Mesh`` for data parallelism (and sharded params), or None.
    batch_axis: the mesh axis the batch is split on, or a tuple of axes (split over
      their product, e.g. ``('data', 'fsdp')``).
    donate: donate the input state's buffers to the step.
    grad_reduce_dtype: dtype of the cross-device gradient mean (reduce-scatter with
      ``param_sharding``).
    master_weights: keep float32 master weights in the optimizer state; default (None):
      on when ``init`` stores any parameter in a half dtype (``'float16'`` and
      ``'bfloat16'`` policies, or rules giving some modules half params).
    float32_outputs: hand the model's floating outputs to ``loss_fn`` in float32.
    debug_nonfinite: add ``metrics['nonfinite_grads']``, a dict from parameter path to
      whether its gradient had an inf/NaN, to find the layer that overflowed.
    eval_fn: ``eval_fn(model, batch)`` for :meth:`TrainStep.eval_step`; default ``loss_fn``.
    seed: seed of the state's PRNG key (Linen dropout).
    opt_level: an Apex-style level, ``'O0'``–``'O3'`` or a :class:`jaxamp.OptLevel`
      (see :func:`jaxamp.opt_level`); it sets the policy, the loss scale inserted when
      ``optimizer`` has none, master weights (unless given), whether norms stay float32,
      and for O1 runs the loss computation through :func:`jaxamp.autocast` with a
      float32 model. Not combinable with ``policy``.
    recompute_norms: recompute norms that compute wider than their inputs in the
      backward pass (see :func:`jaxamp.nnx.with_policy`): less activation memory, more
      time. Off by default.
    param_sharding: shard the params, master weights and optimizer state over ``mesh``:
      :func:`jaxamp.fsdp` (each large param split over an axis), :func:`jaxamp.annotated`
      (the model's NNX/Linen partitioning annotations, with logical axis rules), or a
      pytree of ``PartitionSpec`` like the params. Each step gathers the params in their
      compute dtype and reduce-scatters gradients in ``grad_reduce_dtype``; see
      :mod:`jaxamp.sharding`. None (default): params replicated.
    warn_skipped_steps: warn (a ``RuntimeWarning``, once per streak) when this many
      consecutive steps were all skipped, i.e. training stopped moving. ``step`` reads
      two counters per that many calls, from results at least that old, so it never
      waits on the step it just dispatched; the warning comes up to three windows after
      the streak began. None: never warn.
    skip_nonfinite: skip a step whose gradients are not finite (inf, NaN, or a global
      norm past float32's range) exactly, leaving the state bit-identical but for the
      loss scale (default, under every policy). False: apply every update, like a plain
      optax step (``metrics['grads_finite']`` still says whether the gradients were
      finite); refused where float16 needs skips (a loss-scale element in ``optimizer``,
      float16 compute, parameters stored in float16).

  Returns:
    A :class:`TrainStep` with ``init``, ``step``, ``eval_step`` and ``model``.
  """
  level = None
  if opt_level is not None:
    from jaxamp.opt_levels import opt_level as get_level  # pylint: disable=g-import-not-at-top

    if policy is not None:
      raise ValueError(f"Pass either policy= or opt_level=, not both (got policy={policy!r}, "
                       f"opt_level={opt_level!r}); override a level's policy with "
                       "jaxamp.opt_level(name, policy=...).")
    level = get_level(opt_level)
    # O1 keeps the model in float32 and lets autocast pick each operation's precision.
    policy = get_policy("float32") if level.autocast else level.policy
    if master_weights is None:
      master_weights = level.master_weights
  policy = global_policy() if policy is None else get_policy(policy)
  policy_lib._warn_if_slow(level.policy if level is not None else policy, stacklevel=3)
  return TrainStep(loss_fn, optimizer, policy=policy, has_aux=has_aux,
                   grad_accum_steps=grad_accum_steps, mesh=mesh, batch_axis=batch_axis,
                   donate=donate, grad_reduce_dtype=grad_reduce_dtype,
                   master_weights=master_weights, float32_outputs=float32_outputs,
                   debug_nonfinite=debug_nonfinite, eval_fn=eval_fn, seed=seed, level=level,
                   recompute_norms=recompute_norms, param_sharding=param_sharding,
                   warn_skipped_steps=warn_skipped_steps, skip_nonfinite=skip_nonfinite)
