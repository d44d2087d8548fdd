"""What a train step is made of: the user's options, and the plan ``init`` fixes.

:class:`Options` holds ``make_train_step``'s arguments, checked. :class:`Plan` adds what
``init`` learns from the model (its adapter, the optimizer with its loss scale, master
weights, FP8 recipes, parameter layout); every stage of the traced step reads the plan
and nothing else, so ``functools.partial(jaxamp.train.step.step, plan)`` is a pure
function of ``(state, batch)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import optax

from jaxamp.adapters import Adapter
from jaxamp import sharding as sharding_lib
from jaxamp.policy import Policy
from jaxamp import rules as rules_lib
from jaxamp.rules import norm_defaults
from jaxamp import gather as gather_lib
from jaxamp.train.config import (DEPRECATED, STATE_REDUCTIONS, DebugConfig, MemoryConfig,
                                 ShardingConfig)
from jaxamp.train.loss import check_signature

__all__ = ["Options", "OptionsView", "Plan", "STATE_REDUCTIONS", "level_rules", "rules_in_force", "autocast_under_level"]


@dataclasses.dataclass(frozen=True)
class Options:
  """``make_train_step``'s arguments, checked (see there for each one's meaning); the
  grouped ones as their configs (``options.sharding.mesh``, ``options.memory.donate``,
  ``options.debug.nonfinite_grads``), which check their own fields."""

  loss_fn: Callable[..., Any]
  optimizer: optax.GradientTransformation
  policy: Policy
  has_aux: bool = False
  grad_accum_steps: int = 1
  float32_outputs: bool = True
  eval_fn: Callable[..., Any] | None = None
  seed: int = 0
  level: Any = None
  skip_nonfinite: bool = True
  compiler_options: Mapping[str, Any] | None = None
  rng_streams: tuple[str, ...] = ("dropout",)
  sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
  memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
  debug: DebugConfig = dataclasses.field(default_factory=DebugConfig)

  def __post_init__(self):
    for name, cls in (("sharding", ShardingConfig), ("memory", MemoryConfig),
                      ("debug", DebugConfig)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"{name} must be a jaxamp.{cls.__name__} (or None: the defaults), "
                         f"got {getattr(self, name)!r}.")
    if self.grad_accum_steps < 1:
      raise ValueError(f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}.")
    if not isinstance(self.skip_nonfinite, (bool, np.bool_)):
      raise ValueError(f"skip_nonfinite must be True or False, got {self.skip_nonfinite!r}.")
    streams = self.rng_streams
    if (isinstance(streams, str) or not isinstance(streams, (tuple, list))
        or not all(isinstance(n, str) and n for n in streams)):
      raise ValueError(f"rng_streams must be a tuple of Linen RNG stream names, e.g. "
                       f"('dropout', 'droppath'); got {streams!r}.")
    object.__setattr__(self, "rng_streams", tuple(dict.fromkeys(streams)))
    check_signature(self.loss_fn, "loss_fn")
    if self.eval_fn is not None:
      check_signature(self.eval_fn, "eval_fn")
    object.__setattr__(self, "skip_nonfinite", bool(self.skip_nonfinite))

  @property
  def evaluate(self) -> Callable[..., Any]:
    """The function ``eval_step`` runs: ``eval_fn``, else ``loss_fn``."""
    return self.eval_fn if self.eval_fn is not None else self.loss_fn


def _option(name: str, doc: str) -> property:
  return property(lambda self: getattr(self.options, name), doc=doc)


def _moved(name: str) -> property:
  """A former ``TrainStep`` attribute, read from the config that owns its keyword now
  (:data:`~jaxamp.train.config.DEPRECATED`) with a DeprecationWarning."""
  config, _, field = DEPRECATED[name]

  def read(self: Any) -> Any:
    warnings.warn(f"TrainStep.{name} is deprecated; read train.{config}.{field}.",
                  DeprecationWarning, stacklevel=2)
    return getattr(getattr(self.options, config), field)

  return property(read, doc=f"Deprecated: ``{config}.{field}``.")


class OptionsView:
  """Read-through properties for a holder of ``options`` (:class:`Options`): what
  :class:`~jaxamp.TrainStep` shows of ``make_train_step``'s arguments (the grouped ones
  as their configs: ``train.sharding.mesh``)."""

  options: Options

  policy = _option("policy", "The model-level policy.")
  loss_fn = _option("loss_fn", "The loss function.")
  eval_fn = _option("evaluate", "The function eval_step runs (eval_fn, else loss_fn).")
  has_aux = _option("has_aux", "Whether loss_fn returns (loss, aux).")
  grad_accum_steps = _option("grad_accum_steps", "Micro-batches per step.")
  float32_outputs = _option("float32_outputs", "Whether loss_fn sees float32 outputs.")
  seed = _option("seed", "Seed of the state's PRNG key.")
  level = _option("level", "The opt level, or None.")
  skips_nonfinite = _option("skip_nonfinite", "Whether non-finite steps are skipped.")
  sharding = _option("sharding", "The ShardingConfig: mesh, batch axis, param sharding.")
  memory = _option("memory", "The MemoryConfig: donation, master weights, recomputation.")
  debug = _option("debug", "The DebugConfig: non-finite gradients, skipped-step warnings.")
  # Read as attributes before the configs; kept for this release.
  mesh = _moved("mesh")
  batch_axis = _moved("batch_axis")
  param_sharding = _moved("param_sharding")
  grad_reduce_dtype = _moved("grad_reduce_dtype")
  donate = _moved("donate")
  debug_nonfinite = _moved("debug_nonfinite")


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything the traced step reads: the options and what ``init`` found.

  Attributes:
    options: the checked :class:`Options`.
    adapter: how the model is bound to its state and called (``adapters``).
    optimizer: the user's optimizer with a loss-scale element and the exact skip.
    master_weights: whether the optimizer updates float32 master weights.
    rounding: ``'stochastic'`` or ``'kahan'``: half params updated in float32 and stored
      back by ``param_apply`` (:mod:`jaxamp.rounding`), no master weights; else None.
    param_apply: with ``rounding``, its :class:`jaxamp.ApplyUpdates`.
    recompute_norms: whether norms are recomputed in the backward pass.
    half_residuals: whether the loss is differentiated under
      :func:`jaxamp.half_residuals` (asked for, and some module computes in half).
    unit_scale: the step inserted ``no_loss_scale()``: no multiply, no divide.
    overflow: the loss scale's rule for a skipped step, or None (the skip traces a
      second update told the gradients are not finite).
    scaled_recipes: ``{module path: recipe}`` of the modules of a scaled format (FP8)
      with state in ``TrainState.scaled``.
    param_specs: with ``param_sharding``, the ``PartitionSpec`` of each param; else None.
    gather_dtypes: with ``param_sharding``, the dtype each param leaf is gathered in
      (by ``gather='model'``, and by the eval step).
    shards: with ``param_sharding``, each param leaf's
      :class:`~jaxamp.gather.Shard` (in ``jax.tree.leaves`` order).
    layer_gather: with ``param_sharding``, whether each parameter is gathered where a
      module reads it (``gather='layer'``) rather than all at the step's start.
    state_shardings: with ``param_sharding``, the sharding of each state leaf.
    narrow_reads: parameter reads record their half-precision cotangents (turned off
      when ``loss_fn`` takes forward-mode derivatives over the parameters).
    rules: the per-module rules in force at ``init`` (:func:`jaxamp.rules.snapshot`):
      the step and eval step trace under them, wherever and whenever they are called.
    state_reductions: under a mesh, ``(path, reduction)`` per model-state leaf: how its
      per-device values are combined (:data:`STATE_REDUCTIONS`; None: not known, and
      refused if the step changes it).
  """

  options: Options
  adapter: Adapter
  optimizer: optax.GradientTransformation
  master_weights: bool
  rounding: str | None = None
  param_apply: Any = None
  recompute_norms: bool = False
  half_residuals: bool = False
  unit_scale: bool = False
  overflow: Callable[[Any], Any] | None = None
  scaled_recipes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  param_specs: Any = None
  gather_dtypes: tuple[Any, ...] | None = None
  shards: tuple[Any, ...] | None = None
  layer_gather: bool = False
  state_shardings: Any = None
  narrow_reads: bool = True
  rules: Mapping[Any, Any] | None = None
  state_reductions: tuple[tuple[str, str | None], ...] | None = None

  @property
  def master_mode(self) -> bool | str:
    """``rounding`` where set, else ``master_weights``."""
    return self.rounding or self.master_weights

  @property
  def widens(self) -> bool:
    """Whether the optimizer receives float32 gradients and params (master weights, or
    a ``rounding`` mode)."""
    return self.master_weights or self.rounding is not None

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    return self.options.sharding.mesh

  @property
  def sharded(self) -> bool:
    """Whether params are stored sharded (``param_sharding``)."""
    return self.param_specs is not None

  @property
  def prefetch(self) -> bool:
    """Whether per-layer gathers may run one module ahead (``fsdp(prefetch=...)``)."""
    return self.layer_gather and gather_lib.prefetches(
        sharding_lib.prefetch_of(self.options.sharding.param_sharding), self.mesh)

  def replicated(self) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def batch_sharding(self) -> jax.sharding.NamedSharding:
    axes = self.options.sharding.batch_axes
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(axes))


def level_rules(options: Options) -> Any:
  """The norm rule an opt level asks for, in force at init and while the step traces."""
  if options.level is not None:
    return norm_defaults(options.level.norm_rule())
  return contextlib.nullcontext()


@contextlib.contextmanager
def rules_in_force(plan: Plan) -> Iterator[None]:
  """While the step traces: the rules ``init`` saw, and the opt level's norm rule."""
  with (rules_lib.installed(plan.rules) if plan.rules is not None
        else contextlib.nullcontext()), level_rules(plan.options):
    yield


def autocast_under_level(options: Options, fn: Callable[..., Any],
                         batch_argnum: int) -> Callable[..., Any]:
  """``fn`` under the opt level's autocast (O1), else ``fn`` itself. The batch (argument
  ``batch_argnum``) is pinned: float32 data (a regression target) stays float32 where
  it meets half values (``pred - y``), as in torch.autocast; parameters follow."""
  if options.level is None or not options.level.autocast:
    return fn
  from jaxamp.autocast import autocast  # pylint: disable=g-import-not-at-top

  return autocast(fn, options.level.policy, pinned_argnums=(batch_argnum,))
