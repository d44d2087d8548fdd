"""Compiling, inspecting and timing candidate steps: the measuring half of the harness.

A :class:`Candidate` is one way of running one model under one policy: a pure step
``step(state, batch) -> (state, out)`` and its inputs. :func:`measure` compiles each
ahead of time (``Candidate.traced(...).lower().compile()``, timed), reads
XLA's memory figures from the compiled executable, asks :func:`jaxamp.precision_report`
what its matmuls run in, then times the compiled executables *interleaved*: after a
warm-up, every round runs each candidate for a few steps, in an order that rotates
and alternates direction from round to round, so a slow spell of a shared machine
lands on all candidates alike. The step time is the median over rounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

import jaxamp


@dataclasses.dataclass
class Candidate:
  """One implementation of one model under one policy.

  Attributes:
    impl: who wrote the precision handling: ``'jaxamp'``, ``'hand-written Flax'``
      (``'hand-written Flax + skip'`` with jaxamp's exact skip written in),
      ``'Keras 3'`` or ``'jax.numpy'``.
    policy: the policy label (``'float32'``, ``'float32 HIGHEST'``, ``'mixed_bfloat16'``...).
    step: ``step(state, batch) -> (state, out)``, pure; ``state`` is donated.
    state: the initial state.
    batch: the batch every step runs on (already on the device).
    report: a zero-argument function returning the :class:`jaxamp.PrecisionReport` of
      the loss's forward and backward pass (or of the forward for a bare matmul).
    matmul_precision: ``'highest'`` to lower under
      ``jax.default_matmul_precision('highest')``, else None (the backend default,
      TF32 for float32 on Ampere and newer GPUs).
    items: examples per step (tokens, images, or None), for the throughput column.
    call: the user-facing entry point running ``step`` (``train.step`` for jaxamp), timed
      instead of the ahead-of-time executable when :func:`measure` gets ``aot=False``;
      None means ``jax.jit(step, donate_argnums=0)``.
    trace: ``trace(state, batch) -> jax.stages.Traced`` of the user-facing entry point
      (``train.trace`` for jaxamp: what a first ``train.step`` call traces, not a ``jit``
      wrapped around it); None means ``jax.jit(step, donate_argnums=0).trace``. Every
      compile and lowering measurement starts from it.
  """

  impl: str
  policy: str
  step: Callable[[Any, Any], tuple[Any, Any]]
  state: Any
  batch: Any
  report: Callable[[], jaxamp.PrecisionReport] | None = None
  matmul_precision: str | None = None
  items: int | None = None
  call: Callable[[Any, Any], tuple[Any, Any]] | None = None
  trace: Callable[[Any, Any], Any] | None = None

  @property
  def name(self) -> str:
    return f"{self.impl} / {self.policy}"

  def traced(self, state: Any, batch: Any) -> Any:
    """The step traced for ``state`` and ``batch`` (arrays or ShapeDtypeStructs)."""
    trace = self.trace or jax.jit(self.step, donate_argnums=0).trace
    return trace(state, batch)


@dataclasses.dataclass
class Measurement:
  """What :func:`measure` found for one candidate (times in seconds, sizes in bytes)."""

  impl: str
  policy: str
  items: int | None
  compile_s: float
  memory: dict[str, int]
  round_step_s: list[float]
  half_share: float | None = None
  matmul_flops: int | None = None
  residual_bytes: int | None = None
  error: str | None = None
  # The sitting each round came from (see measure_sittings); empty: all from one.
  round_sitting: list[int] = dataclasses.field(default_factory=list)

  @property
  def step_s(self) -> float:
    """Median time per step over the rounds."""
    return statistics.median(self.round_step_s) if self.round_step_s else float("nan")

  @property
  def spread(self) -> float:
    """Interquartile range of the round times over their median (0.05 is 5 %)."""
    if len(self.round_step_s) < 2:
      return float("nan")
    q1, _, q3 = statistics.quantiles(self.round_step_s, n=4, method="inclusive")
    return (q3 - q1) / self.step_s

  @property
  def throughput(self) -> float | None:
    return None if self.items is None else self.items / self.step_s

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out.update(step_s=self.step_s, spread=self.spread, throughput=self.throughput)
    return out


def _precision(name: str | None):
  return jax.default_matmul_precision(name) if name else contextlib.nullcontext()


def memory_figures(compiled: Any) -> dict[str, int]:
  """XLA's compiled memory figures, in bytes (empty if the backend gives none)."""
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  figures = {name: int(getattr(stats, f"{name}_size_in_bytes", 0) or 0)
             for name in ("argument", "output", "alias", "temp", "generated_code")}
  peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
  # Not every backend fills in the peak (XLA:CPU reports one below its own temp size);
  # then arguments + outputs + temporaries, less what donation lets outputs reuse,
  # bounds it from above.
  bound = figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]
  figures["peak"] = peak if peak >= figures["temp"] else bound
  return figures


def _compile(c: Candidate) -> tuple[Any, float]:
  start = time.perf_counter()
  with _precision(c.matmul_precision):
    compiled = c.traced(c.state, c.batch).lower().compile()
  return compiled, time.perf_counter() - start


def _order(n: int, r: int, stride: int = 1) -> list[int]:
  """Round ``r``'s order: rotated by ``r * stride``, reversed every other round.

  With ``stride=2`` candidates ``2k`` and ``2k + 1`` always run back to back (with
  ``stride=3`` the groups of three, and so on).
  """
  order = [(i + r * stride) % n for i in range(n)]
  return order[::-1] if r % 2 else order


def _prepare(c: Candidate, aot: bool, inspect: bool, warmup: int
             ) -> tuple[Callable[[Any, Any], Any], Any, Measurement]:
  """Compiles ``c`` (timed), inspects it and warms it up: (runner, state, measurement)."""
  if aot:
    runner, seconds = _compile(c)
    memory = memory_figures(runner)
  else:
    # The user-facing call compiles on first use: time that call (one step included).
    runner = c.call if c.call is not None else jax.jit(c.step, donate_argnums=0)
    start = time.perf_counter()
    with _precision(c.matmul_precision):
      state, out = runner(c.state, c.batch)
      jax.block_until_ready((state, out))
    seconds, memory, warmup = time.perf_counter() - start, {}, warmup - 1
  m = Measurement(c.impl, c.policy, c.items, seconds, memory, [])
  if inspect and c.report is not None:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)  # float16 on a CPU: known to be slow
      with _precision(c.matmul_precision):
        report = c.report()
    m.half_share = report.half_share
    m.matmul_flops = report.total_flops
    m.residual_bytes = report.residual_bytes
  if aot:
    state = c.state
  with _precision(c.matmul_precision):  # a jitted call retraces under another precision
    for _ in range(max(warmup, 0)):
      state, out = runner(state, c.batch)
  jax.block_until_ready(state)
  return runner, state, m


def _error(e: Exception) -> str:
  first = str(e).strip().splitlines()[0] if str(e).strip() else ""
  return f"{type(e).__name__}: {first[:300]}"


def measure(candidates: Sequence[Candidate], *, warmup: int, rounds: int, steps: int,
            aot: bool = True, inspect: bool = True, group: int = 1,
            log: Callable[[str], None] = print) -> list[Measurement]:
  """Compiles, inspects and times ``candidates``; see the module docstring.

  A candidate that fails to compile or run is reported with its error and no times,
  so one unsupported combination does not end the whole run.

  Args:
    candidates: the candidates; their states are donated and consumed.
    warmup: untimed steps per candidate after compiling.
    rounds: interleaved timing rounds; the median is over these.
    steps: steps per candidate per round, timed together (one sync at the end).
    aot: time the ahead-of-time compiled executable (and read its memory figures); if
      False, time each candidate's user-facing ``call`` instead, and report the first
      call's time (trace, compile and one step) as the compile time.
    inspect: run each candidate's precision report.
    group: candidates come in groups of this size to compare (a pair: ``2k`` with
      ``2k + 1``): keep each group back to back in every round.
    log: where progress lines go.

  Returns:
    One :class:`Measurement` per candidate, in input order.
  """
  results: list[Measurement] = []
  live: list[tuple[int, Any, Candidate]] = []  # (index, runner, candidate)
  states: dict[int, Any] = {}
  for i, c in enumerate(candidates):
    log(f"  compiling {c.name}")
    try:
      runner, states[i], m = _prepare(c, aot, inspect, warmup)
      live.append((i, runner, c))
    except Exception as e:  # pylint: disable=broad-except
      log(f"    failed: {_error(e)}")
      m = Measurement(c.impl, c.policy, c.items, float("nan"), {}, [], error=_error(e))
    results.append(m)
    c.state = None  # donated or copied into ``states``: drop the reference

  for r in range(rounds):
    stride = group if len(live) % group == 0 else 1
    for k in _order(len(live), r, stride):
      i, runner, c = live[k]
      state = states[i]
      with _precision(c.matmul_precision):
        start = time.perf_counter()
        for _ in range(steps):
          state, out = runner(state, c.batch)
        jax.block_until_ready((state, out))
        results[i].round_step_s.append((time.perf_counter() - start) / steps)
      states[i] = state
  for i, _, c in live:
    m = results[i]
    log(f"  {c.name:<40} {1e3 * m.step_s:9.2f} ms/step  (IQR {100 * m.spread:.1f}%)")
  states.clear()
  return results


def measure_sittings(make: Callable[[], Sequence[Candidate]], sittings: int, *,
                     group: int | None = None, **kwargs: Any) -> list[Measurement]:
  """:func:`measure` in ``sittings`` sittings, each on fresh candidates from ``make()``,
  pooled: one :class:`Measurement` per candidate with every sitting's rounds.

  Two instances of one compiled program can differ by a percent or more in a process
  (where XLA's buffers landed), so a ratio from one sitting carries that instance's luck;
  pooled sittings spread it, and :func:`benchmarks.report.paired_ratio` resamples the
  sittings as well as their rounds.

  Args:
    make: builds the candidates (fresh models and states: a sitting consumes them).
    sittings: how many times to build and measure them.
    group: as :func:`measure`'s; None: all the candidates of a sitting are one group.
    **kwargs: :func:`measure`'s other keyword arguments.

  Returns:
    One :class:`Measurement` per candidate, in ``make()``'s order: the rounds of all
    sittings, ``round_sitting`` saying which, the median compile time.
  """
  runs = []
  for _ in range(sittings):
    candidates = make()
    runs.append(measure(candidates, group=group or len(candidates), **kwargs))
    del candidates
    gc.collect()  # one sitting's programs and states at a time
  pooled = []
  for ms in zip(*runs):
    first = ms[0]
    rounds = [t for m in ms for t in m.round_step_s]
    pooled.append(dataclasses.replace(
        first, compile_s=statistics.median(m.compile_s for m in ms), round_step_s=rounds,
        round_sitting=[s for s, m in enumerate(ms) for _ in m.round_step_s],
        error=next((m.error for m in ms if m.error), None)))
  return pooled


# --- lowering and compiling only ----------------------------------------------------------------


def abstract(tree: Any) -> Any:
  """``tree`` with every array replaced by its ``jax.ShapeDtypeStruct``: what lowering needs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                      if isinstance(x, jax.Array) else x, tree)


@dataclasses.dataclass
class Lowering:
  """One candidate lowered (not compiled) for another platform, e.g. ``'cuda'`` on a CPU."""

  impl: str
  policy: str
  platform: str
  lower_s: float
  ops: int = 0
  half_share: float | None = None
  error: str | None = None
  fp8_share: float | None = None

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def lower_for(c: Candidate, platform: str) -> Lowering:
  """Traces and lowers ``c.step`` for ``platform`` from abstract inputs; nothing runs.

  The matmuls of the lowered module are read as :func:`jaxamp.precision_report` reads
  them: ``half_share`` is the share of their FLOPs with half-precision operands.
  """
  from jaxamp import report as report_lib  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  try:
    with _precision(c.matmul_precision):
      lowered = c.traced(abstract(c.state), abstract(c.batch)).lower(
          lowering_platforms=(platform,))
    seconds = time.perf_counter() - start
    ops, _, _, _ = report_lib._parse_module(report_lib._lowered_module(lowered))  # pylint: disable=protected-access
  except Exception as e:  # pylint: disable=broad-except
    return Lowering(c.impl, c.policy, platform, time.perf_counter() - start, error=_error(e))
  total = sum(op.total_flops for op in ops)
  half = sum(op.total_flops for op in ops if op.is_half)
  fp8 = sum(op.total_flops for op in ops if op.is_fp8)
  return Lowering(c.impl, c.policy, platform, seconds, len(ops), half / total if total else None,
                  fp8_share=fp8 / total if total else None)


@dataclasses.dataclass
class CompileCost:
  """Trace, lower and XLA compile times (seconds, one per repetition) and XLA's memory
  figures of one candidate's step, each repetition from cold caches."""

  impl: str
  policy: str
  layers: int
  trace_s: list[float]
  lower_s: list[float]
  compile_s: list[float]
  memory: dict[str, int]
  error: str | None = None

  def median(self, what: str) -> float:
    values = getattr(self, what)
    return statistics.median(values) if values else float("nan")

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out.update({f"{w}_median": self.median(w) for w in ("trace_s", "lower_s", "compile_s")})
    return out


def compile_costs(cs: Sequence[Candidate], layers: int, reps: int, trace_reps: int = 0,
                  clock: Callable[[], float] = time.process_time) -> list[CompileCost]:
  """Times ``c.traced`` (the trace), ``.lower`` and ``.compile`` of each candidate,
  ``reps`` times, taking turns.

  By default in CPU seconds of this process (``time.process_time``: every thread, so
  XLA's parallel compile counts in full), which other programs running on the machine
  do not inflate; pass ``clock=time.perf_counter`` for wall time.

  ``jax.clear_caches()`` before each repetition makes every one a first call, as a user's
  first ``train.step`` is (jaxamp's step is a jitted function inside: its cache too).
  Every repetition runs each candidate once, in an order that rotates, so a slow spell of
  the machine hits all of them rather than whichever ran then. ``trace_reps`` more
  repetitions time the trace alone: it is cheap, and at small sizes the noisiest.
  """
  costs = [CompileCost(c.impl, c.policy, layers, [], [], [], {}) for c in cs]
  inputs = [(abstract(c.state), abstract(c.batch)) for c in cs]
  for rep in range(reps + trace_reps):
    for i in (rep + k for k in range(len(cs))):
      i %= len(cs)
      c, cost, (state, batch) = cs[i], costs[i], inputs[i]
      if cost.error:
        continue
      try:
        jax.clear_caches()
        gc.collect()  # a collection the previous repetition left due lands on no one
        with _precision(c.matmul_precision):
          start = clock()
          traced = c.traced(state, batch)
          traced_at = clock()
          cost.trace_s.append(traced_at - start)
          if rep >= reps:
            continue
          lowered = traced.lower()
          lowered_at = clock()
          compiled = lowered.compile()
          done = clock()
        cost.lower_s.append(lowered_at - traced_at)
        cost.compile_s.append(done - lowered_at)
        cost.memory = memory_figures(compiled)
      except Exception as e:  # pylint: disable=broad-except
        cost.error = _error(e)
  return costs
