"""``make_train_step`` and :class:`TrainStep`, a thin holder over the pure stages.

``TrainStep`` keeps what a training loop needs between calls: the jitted step and eval
step with the plan ``init`` made (:class:`~jaxamp.train.programs.Programs`), the state
the last step returned (a state it did not return is fitted to the policy, checked and
laid out first), and the skipped-steps monitor.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxamp import policy as policy_lib
from jaxamp.numerics import Numerics
from jaxamp.policy import PolicyLike, get_policy, global_policy
from jaxamp.train import config as config_lib
from jaxamp.train import init as init_lib
from jaxamp.train import layout, resume
from jaxamp.train.programs import Programs
from jaxamp.train import step as step_lib
from jaxamp.train.config import DebugConfig, MemoryConfig, ShardingConfig
from jaxamp.train.monitor import SkipStreaks
from jaxamp.train.plan import Options, OptionsView, Plan
from jaxamp.train.state import TrainState, abstract_state, mismatch

__all__ = ["TrainStep", "make_train_step"]


class TrainStep(OptionsView):
  """A compiled mixed-precision train step; build it with :func:`make_train_step`.

  Attributes:
    options: ``make_train_step``'s arguments, checked (``policy``, ``sharding``,
      ``memory``, ``debug``... read through to it: ``train.sharding.mesh``); plan: what
      :meth:`init` learnt from the model (None before).
    master_weights: whether the optimizer updates master weights (float32; float64 or
      complex for such parameters), or ``'stochastic'`` / ``'kahan'``; when
      ``make_train_step`` left it to the default, None until :meth:`init` decides.
    trace_count: how many times ``step`` was traced (1 for a fixed batch shape; 2 with numerics).
    param_specs: with ``ShardingConfig.param_sharding``, the ``PartitionSpec`` of each parameter (a tree
      like the params) once :meth:`init` has run; else None.
  """

  def __init__(self, options: Options):
    self.options = options
    self._programs: Programs | None = None
    # Without skips skipped_steps never moves: nothing to watch on the step's hot path.
    self._streaks = (SkipStreaks(options.debug.warn_skipped_steps)
                     if options.debug.warn_skipped_steps is not None and options.skip_nonfinite
                     else None)
    # The skeleton of the state init made, the last state step returned (known good) and
    # the layout.signature of the states step returns (computed when first needed).
    self._expected: Any = None
    self._last_state: Any = None
    self._returned: Any = None
    self._fresh: resume.Fresh | None = None  # init's loss-scale and FP8 state, on the host
    self.trace_count = 0

  @property
  def plan(self) -> Plan | None:
    return self._programs.plan if self._programs else None

  @property
  def master_weights(self) -> bool | str | None:
    return self.plan.master_mode if self.plan else self.options.memory.master_weights

  @property
  def recompute_norms(self) -> bool:
    return self.plan.recompute_norms if self.plan else self.options.memory.recompute_norms

  @property
  def param_specs(self) -> Any:
    return self.plan.param_specs if self.plan else None

  @property
  def optimizer(self) -> optax.GradientTransformation | None:
    """The optimizer the step runs (the user's with a loss scale and the skip)."""
    return self.plan.optimizer if self.plan else None

  @property
  def step_fn(self) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """The step as a pure function ``(state, batch) -> (state, metrics)``, for your own
    ``jax.jit``, ``lax.scan`` or ``shard_map`` (available after :meth:`init`).

    It is what :meth:`step` compiles, without :meth:`step`'s per-call work (state
    checks, layout, the skipped-steps warning, donation).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxamp
      >>> from flax import nnx
      >>> train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1),
      ...                                policy='mixed_bfloat16')
      >>> state = train.init(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
      >>> def loop(state, batches):  # many steps in one program
      ...   return jax.lax.scan(train.step_fn, state, batches)
      >>> state, metrics = jax.jit(loop)(state, jnp.ones((5, 8, 4)))
      >>> metrics['loss'].shape, int(state.step)
      ((5,), 5)
    """
    return functools.partial(step_lib.step, self._require_plan("step_fn"))

  @property
  def eval_step_fn(self) -> Callable[[TrainState, Any], Any]:
    """:meth:`eval_step` as a pure function ``(state, batch) -> result``."""
    return functools.partial(step_lib.eval_step, self._require_plan("eval_step_fn"),
                             per_layer=self._programs.eval_per_layer)

  def _require_programs(self, what: str) -> Programs:
    if self._programs is None:
      raise RuntimeError(f"Call train.init(...) before train.{what}.")
    return self._programs

  def _require_plan(self, what: str) -> Plan:
    return self._require_programs(what).plan

  def _traced(self) -> None:
    self.trace_count += 1

  # -- setup --

  def init(self, model: Any, variables: Mapping[str, Any] | None = None,
           *example_args: Any, donate_model: bool = False,
           **example_kwargs: Any) -> TrainState:
    """Builds the first :class:`TrainState`.

    Each parameter is stored in the param dtype of the module that owns it (its resolved
    policy: rules, norm defaults and the opt level's norm rule included). NNX models show
    their modules. For a Linen module pass the example arguments ``module.init`` took
    besides its rngs (arrays or ``jax.ShapeDtypeStruct``; keyword arguments such as
    ``train=False`` too): they are traced abstractly to find the modules. Without them,
    and for modules that do not run for them, parameters get the model policy's param
    dtype. A model wrapped by ``jaxamp.nnx.with_policy`` / ``jaxamp.linen.with_policy``
    is unwrapped: the train step applies its own policy.

    ``step`` donates its input state, so the state gets buffers of its own: a copy of
    each array the model (or ``variables``) holds and the state would store uncast (the
    model stays usable; :meth:`model` gives the trained one), and of each array the state
    would hold twice (two ``nnx.Param`` of one array, an optimizer state holding the
    parameters), which XLA cannot donate twice. An NNX model trains in the mode it has
    now (call ``model.train()`` first if it was set to ``.eval()``).

    Args:
      model: an NNX module, a Linen module (then pass ``variables``), or an Equinox
        module (see :mod:`jaxamp.equinox`).
      variables: the Linen variables (``module.init(...)``'s result).
      *example_args: Linen only: the module's example arguments.
      **example_kwargs: Linen only: its example keyword arguments (``rngs`` too, if
        ``init`` needs more than a ``'params'`` key; the step then gives the module the
        streams named there besides ``rng_streams``).
      donate_model: let the state take the model's own arrays, with no copy (the first
        step then deletes them: the model raises "Array has been deleted").

    Returns:
      The train state (replicated over the mesh, if any).
    """
    state, plan = init_lib.init(self.options, model, variables, *example_args,
                                **example_kwargs)
    plan, state = layout.placed_at_init(plan, state)
    self._programs = Programs(self.options, plan, self._traced)
    kept = (init_lib.arrays_held(model, variables)
            if self.options.memory.donate and not donate_model else [])
    state = init_lib.donatable(state, kept)
    self._fresh = resume.fresh_of(plan, state)
    resume.remember(state, plan.unit_scale)
    self._expected = abstract_state(state)
    self._last_state = self._returned = None  # states made before this init are checked
    return state

  def check_state(self, state: Any) -> None:
    """Raises a ValueError unless ``state`` fits this step (the one its ``init`` made).

    ``step``, ``eval_step``, ``trace`` and ``lower`` call it for any state the step did
    not return (a restored checkpoint, a state from another step, one made before a later
    ``init``): its structure, shapes and dtypes must match. Before the check they fit such
    a state's precision state to this step's policy, with a warning: the fresh loss-scale
    state where its scale cannot serve this step (1, a run's without loss scaling, in a
    float16 step; another scale in a step that does not scale), and fresh or no FP8
    state where the state's policy had none or this one keeps none.
    """
    if self._expected is None:
      raise RuntimeError("Call train.init(...) first.")
    problem = mismatch(state, self._expected)
    if problem is not None:
      raise ValueError(f"This state does not fit this train step: {problem}. Use a state made "
                       "by this step's init (or restored into jaxamp.abstract_state of one); "
                       "a step re-initialised with another model runs only its new states.")

  # -- public steps --

  def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    """One training step; compiled once per batch shape. Donates ``state`` by default."""
    programs = self._require_programs("step(...)")
    state, batch = self._accepted(state), layout.laid_out(self.plan, batch)
    new_state, metrics = programs.run_step(lambda: programs.step_jit(state, batch))
    if not isinstance(new_state.step, jax.core.Tracer):  # not called inside the user's jit
      self._last_state = new_state
      resume.remember(new_state, self.plan.unit_scale)
    if self._streaks is not None:
      self._streaks.observe(metrics)
    return new_state, metrics

  def _accepted(self, state: Any, place: bool = True) -> Any:
    """``state`` checked and (``place``) moved to the step's layout: a restored state, a
    host copy, or one from a step of another layout gets the step's shardings.

    The state this step returned last passes as it is; so does one laid out as the
    states it returns (same structure, shapes, dtypes, placement: say the returned
    state with new params the user computed), after a cheaper comparison than the check.
    """
    if state is self._last_state:
      return state
    # Another run's state: the loss-scale and FP8 state of this step's policy.
    state = resume.fitted(self._fresh, state, stacklevel=4)
    if self._returned is None and self._last_state is not None:
      self._returned = layout.signature(self._last_state)
    if self._returned is None or layout.signature(state) != self._returned:
      self.check_state(state)
      if place:
        state = layout.laid_out_state(self.plan, state)
      else:
        state = layout.shapes_laid_out(self.plan, state)
    return state

  def trace(self, state: TrainState, batch: Any) -> Any:
    """``step`` checked and traced, never lowered, compiled or run: a ``jax.stages.Traced``.

    What a first ``step`` call does before XLA sees the program, for ahead-of-time use
    (``train.trace(state, batch).lower().compile()``) or to read the step's jaxpr.
    ``state`` and ``batch`` may be arrays or ``jax.ShapeDtypeStruct``s (e.g.
    :func:`abstract_state`, or ``jax.eval_shape(train.init, model)`` of a model made
    with ``nnx.eval_shape``: a state never materialised, whose leaves then take the
    step's shardings); this step's own jitted function is traced, so its jit cache is
    the one ``step`` then uses.

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
    programs = self._require_programs("trace(...)")
    state = self._accepted(state, place=False)
    return programs.run_step(lambda: programs.step_jit.trace(state, batch))

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
    programs = self._require_programs("lower(...)")
    return programs.run_step(lambda: _lowered(self.trace(state, batch), platforms))

  def eval_step(self, state: TrainState, batch: Any) -> Any:
    """Runs ``eval_fn`` (default: the loss function) under the policy, in eval mode.

    NNX models are switched to ``.eval()`` (deterministic dropout, running BatchNorm
    statistics); Linen modules get no mutable collections. Nothing is updated. Floating
    results come back in float32. With a mesh it is one program XLA partitions (results
    whose leading dimension is the batch's split over the batch axes, the rest
    replicated); sharded parameters are gathered as the step gathers them: each where a
    module reads it (``gather='layer'``), or the whole model at the start.
    """
    programs = self._require_programs("eval_step(...)")
    state, batch = self._accepted(state), layout.laid_out(self.plan, batch)
    return programs.run_eval(lambda: programs.eval_jit(state, batch))

  def lower_eval(self, state: TrainState, batch: Any, *,
                 platforms: Sequence[str] | None = None) -> Any:
    """:meth:`eval_step` traced and lowered, never compiled or run, as :meth:`lower` is
    for the step: to read its program or its compiled ``memory_analysis()``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from flax import nnx
      >>> train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1))
      >>> state = train.init(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
      >>> 'dot_general' in train.lower_eval(state, jnp.ones((8, 4))).as_text()
      True
    """
    programs = self._require_programs("lower_eval(...)")
    state = self._accepted(state, place=False)
    return programs.run_eval(lambda: _lowered(programs.eval_jit.trace(state, batch), platforms))

  def model(self, state: TrainState, *, copy: bool | None = None) -> Any:
    """The model with the state's parameters: an NNX module, or ``(module, variables)``.

    A step that donates its state (``MemoryConfig.donate``, the default) consumes the state's
    arrays, so by default the model gets copies of them: a model kept as "the best so
    far" survives the steps after it. ``copy=False`` shares the state's arrays (no extra
    memory; deleted by the next donating step); ``copy=True`` copies also without
    donation.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> from flax import nnx
      >>> train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1))
      >>> state = train.init(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
      >>> best = train.model(state)
      >>> state, _ = train.step(state, jnp.ones((8, 4)))  # donates the old state
      >>> best(jnp.ones((1, 4))).shape
      (1, 2)
    """
    plan = self._require_plan("model(state)")
    if self.options.memory.donate if copy is None else copy:
      state = state._replace(params=jax.tree.map(jnp.copy, state.params),
                             model_state=jax.tree.map(jnp.copy, state.model_state))
    return plan.adapter.model(state)


def _lowered(traced: Any, platforms: Sequence[str] | None) -> Any:
  """``traced`` lowered for ``platforms`` (None: this machine's)."""
  return traced.lower(lowering_platforms=tuple(platforms)) if platforms else traced.lower()


def make_train_step(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, *,
                    policy: PolicyLike | None = None, opt_level: Any = None,
                    has_aux: bool = False, eval_fn: Callable[..., Any] | None = None,
                    grad_accum_steps: int = 1, skip_nonfinite: bool = True,
                    float32_outputs: bool = True, seed: int = 0,
                    rng_streams: Sequence[str] = ("dropout",),
                    compiler_options: Mapping[str, Any] | None = None,
                    sharding: ShardingConfig | None = None,
                    memory: MemoryConfig | None = None,
                    debug: DebugConfig | None = None,
                    master_weights: bool | str | None = None, opt_state_dtype: Any = None,
                    numerics: Numerics | None = None,
                    **deprecated: Any) -> TrainStep:
  """Builds a compiled mixed-precision train step.

  Example (on one device a mesh of one; each config's fields are documented with it):
    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> train = jaxamp.make_train_step(
    ...     lambda m, b: jnp.mean(m(b) ** 2), optax.adam(1e-3), policy='mixed_bfloat16',
    ...     sharding=jaxamp.ShardingConfig(mesh=mesh, param_sharding=jaxamp.fsdp('data')),
    ...     memory=jaxamp.MemoryConfig(recompute_norms=True),
    ...     debug=jaxamp.DebugConfig(nonfinite_grads=True))
    >>> state = train.init(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    >>> state, metrics = train.step(state, jnp.ones((8, 4)))
    >>> sorted(metrics['nonfinite_grads']), train.sharding.mesh is mesh
    (['bias', 'kernel'], True)

  Args:
    loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      ``model`` runs under its per-module policies: the policy-wrapped NNX module, or for
      Linen a callable ``model(*args, **kw)`` applying the module (BatchNorm statistics
      and the RNG streams of ``rng_streams`` are handled for you). Its floating outputs
      arrive in float32 unless ``float32_outputs=False``; the loss is computed and
      reported in float32 (float64 ones in float64: every float32 default here means at
      least float32).
    optimizer: an optax transformation. A loss-scale element in it (e.g.
      ``optax.chain(jaxamp.dynamic_loss_scale(), optax.adamw(3e-4))``) is used; without
      one, ``jaxamp.loss_scale_for(policy)`` is put first (dynamic for float16 compute).
    policy: the model-level policy; None takes ``jaxamp.global_policy()`` now.
    opt_level: an Apex-style level, ``'O0'``–``'O3'`` or a :class:`jaxamp.OptLevel`
      (see :func:`jaxamp.opt_level`); it sets the policy, the loss scale inserted when
      ``optimizer`` has none, master weights (unless ``memory`` gives them), whether
      norms stay float32, and for O1 runs the loss computation through
      :func:`jaxamp.autocast` with a float32 model. Not combinable with ``policy``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; a dict ``aux`` is merged into
      the metrics, anything else is under ``metrics['aux']``.
    eval_fn: ``eval_fn(model, batch)`` for :meth:`TrainStep.eval_step`; default ``loss_fn``.
    grad_accum_steps: micro-batches per step, run with ``lax.scan`` inside the step; the
      scale updates once per step and the whole step is skipped if any micro-batch
      overflows. Each micro-batch's loss is scaled by the loss scale over
      ``grad_accum_steps`` (its float16 gradients are as large as without accumulation).
      Each batch leaf of one dimension or more is split along its first (which
      ``grad_accum_steps`` must divide; a leaf it does not is refused, named); 0-d
      leaves go to every micro-batch unchanged.
      The aux of the micro-batches (and, with a mesh, of the devices) is combined into
      the whole batch's: floating values averaged, integers summed (counts), booleans
      or-ed (flags).
    skip_nonfinite: skip a step whose gradients are not finite (inf, NaN, or a global
      norm past float32's range) exactly, leaving the state bit-identical but for the
      loss scale (default, under every policy). False: apply every update, like a plain
      optax step (``metrics['grads_finite']`` still says whether the gradients were
      finite); refused where float16 needs skips (a loss-scale element in ``optimizer``,
      float16 compute, parameters stored in float16).
    float32_outputs: hand the model's floating outputs to ``loss_fn`` in float32
      (float64 ones stay float64: a ``'float64'`` policy trains in float64 throughout).
    seed: seed of the state's PRNG key (Linen's RNG streams).
    rng_streams: the Linen RNG streams the step gives the module (``self.make_rng(name)``):
      ``'dropout'`` by default; add the others a model draws from, e.g.
      ``('dropout', 'droppath')`` for stochastic depth (Hugging Face BEiT). Streams named
      in ``init``'s ``rngs=`` (other than ``'params'``) are added. Each stream's key is
      derived from the state's key, the steps applied, the micro-batch and the device, so
      every step, micro-batch and device draws anew, and a state resumes with the same
      keys.
    compiler_options: XLA options for the step's and eval step's programs, as
      ``jax.jit(..., compiler_options=...)`` takes them (e.g.
      ``{'xla_gpu_enable_latency_hiding_scheduler': True}``); they override
      ``XLA_FLAGS`` for these programs only.
    sharding: a :class:`jaxamp.ShardingConfig`: the mesh, the batch axis, parameter
      sharding (FSDP), the dtype of the cross-device gradient reduction, how model state
      is combined across devices. None: one device.
    memory: a :class:`jaxamp.MemoryConfig`: donation of the input state, master
      weights, recomputed norms, half-precision residuals. None: its defaults.
    debug: a :class:`jaxamp.DebugConfig`: ``metrics['nonfinite_grads']``, the
      skipped-steps warning, the numerics monitor. None: its defaults.
    master_weights, opt_state_dtype: shorthands for the :class:`jaxamp.MemoryConfig`
      fields of those names (``policy='bfloat16', master_weights='stochastic',
      opt_state_dtype=jnp.bfloat16``: 8 bytes per parameter with Adam); one that
      ``memory=`` also sets is refused.
    numerics: a :class:`jaxamp.Numerics`: every N-th step, per module, how close values
      come to their format's range, in ``metrics['numerics']`` (the same as
      ``debug=DebugConfig(numerics=...)``; see :mod:`jaxamp.numerics`).
    **deprecated: this release only, the former keywords of the configs' fields
      (``mesh=``, ``batch_axis=``, ``param_sharding=``, ``grad_reduce_dtype=``,
      ``model_state_reduction=``, ``donate=``,
      ``recompute_norms=``, ``half_residuals=``, ``debug_nonfinite=`` (now
      ``DebugConfig.nonfinite_grads``), ``warn_skipped_steps=``): each still works, with
      a ``DeprecationWarning`` naming the new spelling; one given with the config that
      owns it is refused.

  Returns:
    A :class:`TrainStep` with ``init``, ``step``, ``eval_step`` and ``model``; after
    ``init``, ``step_fn`` is the step as a pure function for your own ``jax.jit``.
  """
  configs = config_lib.from_keywords(
      deprecated, {"sharding": sharding, "memory": memory, "debug": debug}, stacklevel=2)
  configs["memory"] = config_lib.with_shorthands(
      configs["memory"], "memory",
      {"master_weights": master_weights, "opt_state_dtype": opt_state_dtype})
  configs["debug"] = config_lib.with_shorthands(configs["debug"], "debug",
                                                {"numerics": numerics})
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
    if configs["memory"].master_weights is None:
      configs["memory"] = dataclasses.replace(configs["memory"],
                                              master_weights=level.master_weights)
  policy = global_policy() if policy is None else get_policy(policy)
  policy_lib._warn_if_slow(level.policy if level is not None else policy, stacklevel=3)
  return TrainStep(Options(
      loss_fn, optimizer, policy=policy, has_aux=has_aux,
      grad_accum_steps=grad_accum_steps, float32_outputs=float32_outputs, eval_fn=eval_fn,
      seed=seed, level=level, skip_nonfinite=skip_nonfinite,
      compiler_options=compiler_options, rng_streams=rng_streams, **configs))
