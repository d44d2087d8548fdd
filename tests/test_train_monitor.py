"""Tests for jaxamp.train.monitor: the skipped-steps warning."""

import warnings

import jax
import numpy as np
import optax
import pytest

import jaxamp

from train_helpers import init, loss_fn, make_batches


def _skip_warnings(record):
  return [w for w in record if "train steps were all skipped" in str(w.message)]


def test_a_streak_of_skipped_steps_warns_once_per_streak():
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), memory=jaxamp.MemoryConfig(donate=False),
                                 debug=jaxamp.DebugConfig(warn_skipped_steps=2))
  state = init(train, "nnx", batchnorm=False)
  good = make_batches(1)[0]
  bad = {"x": np.full_like(good["x"], np.nan), "y": good["y"]}
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for batch in [good, bad] * 4:  # every other step skipped: no streak
      state, _ = train.step(state, batch)
    assert not _skip_warnings(record)
    for _ in range(8):  # a streak: one warning, from the window of calls 9-10
      state, metrics = train.step(state, bad)
    (warning,) = _skip_warnings(record)
  assert warning.category is RuntimeWarning
  assert "last 2 train steps" in str(warning.message)
  assert "DebugConfig(nonfinite_grads=True)" in str(warning.message)
  assert int(metrics["skipped_steps"]) == 4 + 8
  jax.jit(train.step)(state, bad)  # inside a user's jit, metrics are tracers: not read


def test_the_skip_warning_watches_windows_of_100_calls_by_default():
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1))
  assert train._streaks.window == 100  # pylint: disable=protected-access


def test_the_skip_warning_names_float16_updates_when_the_gradients_were_finite():
  """Pure float16 without master weights, Adam's default eps (0 in float16): zero
  gradients give 0/0 updates, every step is skipped for its parameters, not its
  gradients, and the warning says so."""
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="float16",
                                 memory=jaxamp.MemoryConfig(master_weights=False),
                                 debug=jaxamp.DebugConfig(warn_skipped_steps=2))
  state = init(train, "nnx", batchnorm=False)
  batch = make_batches(1)[0]
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for _ in range(6):
      state, metrics = train.step(state, batch)
    (warning,) = _skip_warnings(record)
  assert bool(metrics["grads_finite"]) and not bool(metrics["params_finite"])
  assert "gradients were finite" in str(warning.message)
  assert "MemoryConfig(master_weights=True)" in str(warning.message)


def test_the_skip_warning_can_be_turned_off():
  good = make_batches(1)[0]
  bad = {"x": np.full_like(good["x"], np.nan), "y": good["y"]}
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), memory=jaxamp.MemoryConfig(donate=False),
                                 debug=jaxamp.DebugConfig(warn_skipped_steps=None))
  state = init(train, "nnx", batchnorm=False)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for _ in range(400):
      state, metrics = train.step(state, bad)
  assert not _skip_warnings(record)
  assert int(metrics["skipped_steps"]) == 400
  for wrong in (0, -3, True, 2.5, "100"):
    with pytest.raises(ValueError, match="warn_skipped_steps must be a positive int"):
      jaxamp.make_train_step(loss_fn, optax.sgd(0.1),
                             debug=jaxamp.DebugConfig(warn_skipped_steps=wrong))


@pytest.mark.parametrize("api,accum", [("nnx", 1), ("linen", 2)])
def test_full_garbage_collections_wait_while_a_step_is_traced_and_resume_after(api, accum):
  import gc
  import threading
  seen = []

  def loss(model, batch):
    seen.append(gc.get_threshold())
    if "fail" in batch:
      raise RuntimeError("the user's loss failed")
    return loss_fn(model, batch)

  found = gc.get_threshold()
  gc.set_threshold(found[0], found[1], 7)  # a user's own setting, put back after
  try:
    train = jaxamp.make_train_step(loss, optax.sgd(0.1), memory=jaxamp.MemoryConfig(donate=False),
                                   grad_accum_steps=accum)
    state = init(train, api, batchnorm=False)
    batch, = make_batches(1)
    train.step(state, batch)
    assert seen[-1][:2] == found[:2] and seen[-1][2] >= 2**30  # deferred while tracing
    assert gc.get_threshold() == (found[0], found[1], 7)  # and put back
    with pytest.raises(RuntimeError, match="the user's loss failed"):
      train.trace(state, dict(batch, fail=np.zeros(len(batch["x"]))))
    assert gc.get_threshold() == (found[0], found[1], 7)  # put back on an error too
    # Threads tracing at once: the last one out puts the threshold back.
    errors = []

    def trace(n):
      try:
        train.trace(state, jax.tree.map(lambda x: np.concatenate([x] * n), batch))
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)

    threads = [threading.Thread(target=trace, args=(n,)) for n in (2, 4, 5)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert not errors and gc.get_threshold() == (found[0], found[1], 7)
  finally:
    gc.set_threshold(*found)
