"""Watching a training run: warnings for streaks of skipped steps, and tracing's cost.

:class:`SkipStreaks` samples the step's metrics off the hot path and warns when
training stopped moving; :data:`deferred_full_collections` keeps Python's full garbage
collections out of a step's trace.
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import jax

__all__ = ["SkipStreaks", "deferred_full_collections"]


class DeferredFullCollections:
  """While active, Python's cyclic garbage collector makes no full (oldest-generation)
  collections; the young generations are collected as usual.

  Tracing a train step allocates container objects by the hundred thousand (tracers,
  equations, pytree nodes), and every few hundred thousand the collector walks the
  whole heap, which is slow with a large model, a compiled program or a dataset alive,
  and a large model's trace sets off several such walks (``benchmarks/compile``). A
  change proposed for PyTorch's dynamo (pytorch/pytorch#193289) defers them while it
  compiles, as this does while jaxamp traces a step. Garbage that reached the oldest
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


deferred_full_collections = DeferredFullCollections()


class SkipStreaks:
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
               "weights (make_train_step(..., memory=jaxamp.MemoryConfig("
               "master_weights=True))) or give Adam eps=1e-4 or more.")
      else:
        why = (f"their gradients were not finite (inf or NaN), so the parameters did not "
               f"change (loss scale {scale:g}). Find the overflowing parameters with "
               "make_train_step(..., debug=jaxamp.DebugConfig(nonfinite_grads=True)) "
               "(metrics['nonfinite_grads']). "
               "Common causes: NaN in the inputs or the loss, a learning rate that "
               "diverged, or an op that overflows in float16 whatever the scale "
               "(jax.nn.gelu's backward pass; see the README).")
      warnings.warn(
          f"jaxamp: the last {self.window} train steps were all skipped: {why} "
          "DebugConfig(warn_skipped_steps=None) turns this warning off.", RuntimeWarning,
          stacklevel=3)
