"""The jitted step and eval step of one plan, and making them again when tracing finds
that the plan cannot serve the model.

:class:`TrainStep` holds one :class:`Programs` per ``init``. Tracing a step can show that
the plan ``init`` made does not fit what ``loss_fn`` does with the model (nothing was
donated then); :meth:`Programs.run_step` then changes the plan and compiles again:

- tracing or lowering the step with recording reads (the parameter reads that record
  their half-precision cotangents, a ``custom_vjp``) raises a ``TypeError``: the step is
  made once more with plain reads (every gradient then crosses the skip in float32),
  which it keeps if that works. A ``loss_fn`` that takes a forward-mode derivative
  (``jax.jvp``) with respect to the parameters is such a case: a ``custom_vjp`` has no
  forward-mode derivative. Where plain reads fail too, the plan is left as it was and
  their error is raised (a mistake in ``loss_fn`` raises the same either way);
- under ``gather='auto'`` the model uses a parameter slice as an array rather than
  reading it (:class:`~jaxamp.gather.RawSliceRead`: a Linen tied head reading
  ``self.variables``): the whole model gathered at the step's start. Under
  ``gather='layer'`` that is refused, naming the parameter.

With the numerics monitor (``Numerics(every=N)``) :attr:`Programs.step_jit` is a
:class:`Dispatch`: two compiled programs, the plain step (the program without the
monitor; its constant NaN records are added on the host) and the recording one, picked
per call on the host,
so the N - 1 steps in N that do not record cost what a step without the monitor costs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxamp import gather
from jaxamp import sharding as sharding_lib
from jaxamp.train import step as step_lib
from jaxamp.train import watch as watch_lib
from jaxamp.train.monitor import deferred_full_collections
from jaxamp.train.plan import Options, Plan
from jaxamp.train.state import TrainState

__all__ = ["Dispatch", "Programs"]

class Programs:
  """The jitted ``step`` and ``eval_step`` for ``plan`` (``plan`` changes when a
  program is made again; read it from here).

  Args:
    options: ``make_train_step``'s checked arguments.
    plan: what ``init`` learnt.
    on_trace: called each time ``step`` is traced.
  """

  def __init__(self, options: Options, plan: Plan, on_trace: Callable[[], None]):
    self.options = options
    self.plan = plan
    self._on_trace = on_trace
    self.step_jit: Any = None
    self.eval_jit: Any = None
    self.eval_per_layer = False  # whether eval_step gathers each parameter where read
    self._schedule: watch_lib.Schedule | None = None
    self._compile()

  def _compile(self) -> None:
    numerics = self.options.debug.numerics
    if numerics is None:
      self.step_jit = self._step_jit(self._step_impl)
    else:
      if self._schedule is None:  # kept when the step is made again
        self._schedule = watch_lib.Schedule(numerics)
      self.step_jit = Dispatch(
          self._schedule, self._step_jit(self._step_impl),
          self._step_jit(functools.partial(self._step_impl, record=False)),
          self._step_jit(functools.partial(self._step_impl, record=True)))
    self._compile_eval(self.plan.layer_gather)

  def _step_jit(self, impl: Callable[..., Any]) -> Any:
    """``impl`` (a step) jitted with the step's donation and shardings."""
    plan = self.plan
    donate = (0,) if self.options.memory.donate else ()
    if plan.mesh is None:
      return self._jit(plan.layer_gather)(impl, donate_argnums=donate)
    state, data = self._in_shardings()
    return self._jit(plan.layer_gather)(
        impl, donate_argnums=donate, in_shardings=(state, data),
        out_shardings=(state, plan.replicated()))

  def _compile_eval(self, per_layer: bool) -> None:
    """The eval step's jit: gathering each sharded parameter where it is read
    (``per_layer``), else the whole model at its start."""
    self.eval_per_layer = per_layer
    impl = functools.partial(step_lib.eval_step, self.plan, per_layer=per_layer)
    in_shardings = {} if self.plan.mesh is None else {"in_shardings": self._in_shardings()}
    self.eval_jit = self._jit(per_layer)(impl, **in_shardings)

  def _jit(self, per_layer: bool) -> Callable[..., Any]:
    """``jax.jit`` with the step's compiler options (and, ``per_layer``, the barriers
    per-layer gathering needs kept)."""
    options = self.options.compiler_options
    if per_layer:
      options = gather.compiler_options(options, self.plan.mesh)
    return functools.partial(jax.jit, compiler_options=options)

  def _in_shardings(self) -> tuple[Any, Any]:
    plan = self.plan
    return (plan.state_shardings if plan.sharded else plan.replicated(),
            plan.batch_sharding())

  def _step_impl(self, state: TrainState, batch: Any, record: bool | None = None):
    self._on_trace()  # runs only while tracing
    with deferred_full_collections:
      return step_lib.step(self.plan, state, batch, record)

  def run_step(self, run: Callable[[], Any]) -> Any:
    """``run()`` (which uses :attr:`step_jit`), and once more with the step made again
    where tracing or lowering it found that the plan cannot serve this model and loss."""
    while True:
      try:
        return run()
      except TypeError:
        if not self.plan.narrow_reads:
          raise
        return self._run_with_plain_reads(run)
      except gather.RawSliceRead as e:
        self._refuse_raw_read(e, self.plan.layer_gather)
        self.plan = dataclasses.replace(self.plan, layer_gather=False)
      self._compile()

  def _run_with_plain_reads(self, run: Callable[[], Any]) -> Any:
    """``run_step(run)`` with the step made again with plain reads, after recording
    reads raised a TypeError (chosen by the type: JAX's words are not read). Where
    that fails too, the recording plan is restored and the plain reads' error raised."""
    recording = self.plan
    self.plan = dataclasses.replace(recording, narrow_reads=False)
    self._compile()
    try:
      return self.run_step(run)
    except BaseException:
      self.plan = recording
      self._compile()
      raise

  def run_eval(self, run: Callable[[], Any]) -> Any:
    """``run()`` (which uses :attr:`eval_jit`), and once more with the eval step
    gathering the whole model where ``eval_fn`` used a parameter slice as an array
    (under ``gather='auto'``, as the step)."""
    while True:
      try:
        return run()
      except gather.RawSliceRead as e:
        self._refuse_raw_read(e, self.eval_per_layer)
        self._compile_eval(False)

  def _refuse_raw_read(self, e: gather.RawSliceRead, per_layer: bool) -> None:
    """Raises unless a raw read found while gathering per layer may fall back to the
    whole model: ``gather='auto'``."""
    if not per_layer:
      raise e
    if sharding_lib.gather_of(self.options.sharding.param_sharding) == "layer":
      raise ValueError(str(e)) from None


class Dispatch:
  """The step with the numerics monitor: ``plain`` (the step without the monitor) or
  ``recorded`` (jitted) picked per call by ``schedule`` on the host; ``cond`` (the
  one-program ``lax.cond`` step of ``step_fn``) where the counter is traced (``step``
  inside the user's ``jit``) and for ``trace`` / ``lower``.

  ``plain``'s metrics gain the NaN records and ``numerics_recorded`` False, made once per
  batch signature (the recording step's shapes, from its abstract evaluation) and shared
  by every plain step: the program returns none of those constants.
  """

  def __init__(self, schedule: watch_lib.Schedule, cond: Any, plain: Any, recorded: Any):
    self.schedule, self.cond, self.plain, self.recorded = schedule, cond, plain, recorded
    self._constants: dict[Any, dict[str, Any]] = {}

  def __call__(self, state: TrainState, batch: Any) -> Any:
    if isinstance(state.step, jax.core.Tracer):
      return self.cond(state, batch)
    if self.schedule.records(state.step):
      new_state, metrics = self.recorded(state, batch)
    else:
      extra = self._not_recorded(state, batch)  # before the state is donated
      new_state, metrics = self.plain(state, batch)
      metrics = {**metrics, **extra}
    self.schedule.returned(new_state.step)
    return new_state, metrics

  def _not_recorded(self, state: TrainState, batch: Any) -> dict[str, Any]:
    leaves, tree = jax.tree.flatten(batch)
    key = (tree, tuple((getattr(x, "shape", ()), getattr(x, "dtype", type(x)))
                       for x in leaves))
    if key not in self._constants:
      shapes = self.recorded.eval_shape(state, batch)[1]["numerics"]
      self._constants[key] = watch_lib.not_recorded(shapes)
    return self._constants[key]

  def trace(self, *args: Any) -> Any:
    return self.cond.trace(*args)

  def lower(self, *args: Any) -> Any:
    return self.cond.lower(*args)
