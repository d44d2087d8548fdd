"""Tests for resuming: checkpoints, a state from another step or policy (jaxamp.train.resume, state checks)."""

import itertools
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp

from train_helpers import ROOT, assert_trees_equal, init, leaves, loss_fn, make_batches


_RESUME_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    import jax, numpy as np, optax, orbax.checkpoint as ocp
    import jaxamp
    from train_helpers import loss_fn, init, make_batches, leaves
    mode, folder = sys.argv[1], sys.argv[2]
    batches = make_batches(5)
    checkpointer = ocp.StandardCheckpointer()
    for api in sys.argv[3:]:
      ckpt, out = f'{{folder}}/ckpt-{{api}}', f'{{folder}}/resumed-{{api}}.npz'
      tx = optax.chain(jaxamp.dynamic_loss_scale(2.0**4, growth_interval=2), optax.adam(1e-2))
      train = jaxamp.make_train_step(loss_fn, tx, policy='mixed_float16')
      state = init(train, api, dropout=0.2)
      if mode == 'first':
        for b in batches[:3]:
          state, _ = train.step(state, b)
        checkpointer.save(ckpt, state)
        checkpointer.wait_until_finished()
      else:
        state = checkpointer.restore(ckpt, jaxamp.abstract_state(state))
        for b in batches[3:]:
          state, _ = train.step(state, b)
        np.savez(out, *leaves(state.params), *leaves(state.model_state),
                 *leaves(state.opt_state),
                 scale=np.asarray(jaxamp.get_loss_scale(state.opt_state)))
""")


@pytest.fixture(scope="module")
def orbax_resumed(once_per_run):
  """Both APIs' runs, saved after 3 steps by one process and resumed for 2 more by a
  second, fresh one: two processes in all, once per test run (xdist workers included)."""
  def make(folder):
    path = folder / "resume.py"
    path.write_text(_RESUME_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    for mode in ("first", "second"):
      proc = subprocess.run([sys.executable, str(path), mode, str(folder), "nnx", "linen"],
                            capture_output=True, text=True, timeout=300)
      assert proc.returncode == 0, proc.stdout + proc.stderr

  return once_per_run("orbax_resume", make)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_orbax_resume_in_fresh_process_is_bit_identical(orbax_resumed, api):
  # Dropout on: NNX carries its RNG streams in model_state; a Linen step folds its key
  # from state.rng with the steps applied so far, which the checkpoint holds too.
  tx = optax.chain(jaxamp.dynamic_loss_scale(2.0**4, growth_interval=2), optax.adam(1e-2))
  train = jaxamp.make_train_step(loss_fn, tx, policy="mixed_float16")
  state = init(train, api, dropout=0.2)
  for b in make_batches(5):
    state, _ = train.step(state, b)
  resumed = np.load(orbax_resumed / f"resumed-{api}.npz")
  expected = leaves(state.params) + leaves(state.model_state) + leaves(state.opt_state)
  for i, x in enumerate(expected):
    np.testing.assert_array_equal(resumed[f"arr_{i}"], x)
  # growth every 2 finite steps from 16: 5 steps -> 16 * 2 * 2
  assert float(resumed["scale"]) == float(jaxamp.get_loss_scale(state.opt_state)) == 64.0


@pytest.mark.slow
@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_a_float16_state_resumes_correctly_under_a_bfloat16_step(skip_nonfinite):
  # Restoring a mixed_float16 checkpoint (scale 32768) into a mixed_bfloat16 step: the
  # loss is multiplied by the state's scale, so the update must divide by that scale.
  batch = make_batches(1)[0]
  f16 = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_float16")
  state, _ = f16.step(init(f16, "nnx", batchnorm=False), batch)
  assert float(jaxamp.get_loss_scale(state.opt_state)) == 2.0**15
  bf16 = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16",
                                memory=jaxamp.MemoryConfig(donate=False),
                                skip_nonfinite=skip_nonfinite)
  init(bf16, "nnx", batchnorm=False)
  with pytest.warns(RuntimeWarning, match="starts fresh at 1"):  # the scale bf16 uses
    resumed, metrics = bf16.step(state, batch)
  # Reference: the same state with the scale a bfloat16 run would have had (1).
  one = jax.tree.map(lambda x: x, state, is_leaf=lambda x: isinstance(x, jaxamp.LossScaleState))
  one = one._replace(opt_state=jax.tree.map(
      lambda x: x._replace(scale=jnp.ones_like(x.scale))
      if isinstance(x, jaxamp.LossScaleState) else x,
      state.opt_state, is_leaf=lambda x: isinstance(x, jaxamp.LossScaleState)))
  expected, _ = bf16.step(one, batch)
  assert_trees_equal(resumed.params, expected.params)  # not 32768x the update
  assert float(metrics["loss_scale"]) == 1.0  # the bfloat16 step's own rule from here on


RESUME_POLICIES = ["float32", "mixed_bfloat16", "mixed_float16", "mixed_fp8"]


def test_a_state_resumed_under_another_policy_gets_the_loss_scale_and_fp8_state_it_needs():
  """Each of 16 pairs: a state of policy A (its loss scale as a trained run leaves it)
  given to a step of policy B. Under a float16 B the dynamic scale starts fresh at 32768
  unless A was float16 too (then it is kept); other policies get their scale of 1; FP8
  state is made fresh or dropped; skipped_steps is kept; each change warns, naming B.
  The pairs run the fitting stage train.step runs first (no compile); one pair then
  runs through train.step."""
  from jaxamp.train import resume  # pylint: disable=g-import-not-at-top

  model = lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  trains = {p: jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy=p)
            for p in RESUME_POLICIES}
  fresh, restored = {}, {}
  is_scale = lambda x: isinstance(x, jaxamp.LossScaleState)
  for p, train in trains.items():
    state = train.init(model())
    fresh[p] = resume.fresh_of(train.plan, state)
    trained = lambda x: x._replace(scale=jnp.float32(1024.0 if p == "mixed_float16" else 1.0),
                                   growth_count=jnp.int32(5), overflow_steps=jnp.int32(3))
    restored[p] = state._replace(opt_state=jax.tree.map(
        lambda x: trained(x) if is_scale(x) else x, state.opt_state, is_leaf=is_scale))
  scale_of = lambda s: optax.tree_utils.tree_get(s.opt_state, "LossScaleState")
  for a, b in itertools.product(RESUME_POLICIES, RESUME_POLICIES):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      state = resume.fitted(fresh[b], restored[a])
    trains[b].check_state(state)  # fits B's step
    scales = b == "mixed_float16"
    new = scales != (a == "mixed_float16")  # the scale A left cannot serve B
    got = scale_of(state)
    want = ((32768.0 if scales else 1.0, 0) if new
            else (1024.0 if scales else 1.0, 5))
    assert (float(got.scale), int(got.growth_count), int(got.overflow_steps)) == (
        *want, 3), (a, b)
    assert (state.fp8 is not None) == (b == "mixed_fp8"), (a, b)
    if a == b:
      assert state is restored[a]
    messages = [str(w.message) for w in caught]
    assert len(messages) == new + ((a == "mixed_fp8") != (b == "mixed_fp8")), (a, b, messages)
    assert all(f"policy {b!r}" in m for m in messages), messages
    if new:
      assert any(f"fresh at {32768 if scales else 1}" in m for m in messages), messages
  # Through train.step: a bfloat16 state's first float16 step runs at 32768.
  f16 = trains["mixed_float16"]
  batch = make_batches(1, size=2)[0]
  with pytest.warns(RuntimeWarning, match="starts fresh at 32768"):
    state, metrics = f16.step(restored["mixed_bfloat16"], batch)
  assert float(metrics["loss_scale"]) == 32768.0 and int(metrics["skipped_steps"]) == 3


@pytest.mark.slow
def test_a_state_from_another_step_is_refused():
  adam = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="mixed_bfloat16")
  sgd = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16")
  half = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="float16",
                                memory=jaxamp.MemoryConfig(master_weights=False))
  batch = make_batches(1)[0]
  a, s, h = (init(t, "nnx", batchnorm=False) for t in (adam, sgd, half))
  with pytest.raises(ValueError, match="opt_state has another structure.*another optimizer"):
    sgd.step(a, batch)
  with pytest.raises(ValueError, match=r"params.*is float16\[.*this step's is float32"):
    sgd.step(h, batch)
  with pytest.raises(ValueError, match="not a jaxamp.TrainState"):
    sgd.eval_step((s.params, s.opt_state), batch)
  # init with another model rebinds the step: older states no longer run through it.
  old = s
  new = init(sgd, "nnx", batchnorm=True)
  with pytest.raises(ValueError, match="params has another structure.*another model"):
    sgd.step(old, batch)
  new, _ = sgd.step(new, batch)
  new, _ = sgd.step(new, batch)  # the step's own output passes (no check needed)


def test_a_state_laid_out_as_the_steps_own_skips_the_check(monkeypatch):
  """A state the step did not return, but with the structure, shapes, dtypes and
  placement of those it returns (the returned one with the user's own params), runs
  without the state check's tree walks; one that differs is still checked and refused."""
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16")
  batch = make_batches(1)[0]
  state, _ = train.step(init(train, "nnx", batchnorm=False), batch)
  checked, check = [], jaxamp.train.train_step.mismatch
  monkeypatch.setattr(jaxamp.train.train_step, "mismatch",
                      lambda s, e: checked.append(s) or check(s, e))
  ours = state._replace(params=jax.tree.map(lambda x: x * 2, state.params))
  state, _ = train.step(ours, batch)
  state, _ = train.step(state._replace(), batch)
  assert not checked and int(state.step) == 3
  half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.params)
  with pytest.raises(ValueError, match=r"params.*is bfloat16\[.*this step's is float32"):
    train.step(state._replace(params=half), batch)
  assert len(checked) == 1


@pytest.mark.slow
def test_a_scale_init_made_or_a_step_returned_is_never_read_on_the_host(monkeypatch):
  """Fitting a state to the policy reads its loss scale on the host (a sync) only for a
  scale no step made: not after init, nor when two steps take turns on one state."""
  from jaxamp.train import resume  # pylint: disable=g-import-not-at-top

  batches = make_batches(2)
  one, two = (jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_float16",
                                     grad_accum_steps=k) for k in (1, 2))
  state = init(one, "nnx")
  init(two, "nnx")
  reads = []  # counted from here: init copies its own state to the host once
  real = resume._value  # pylint: disable=protected-access
  monkeypatch.setattr(resume, "_value", lambda x: reads.append(1) or real(x))
  for b in batches:
    state, _ = one.step(state, b)
    state, _ = two.step(state, b)
  assert reads == []
  restored = jax.device_put(state)  # new arrays: read once, then known
  one.step(jax.tree.map(jnp.copy, restored), batches[0])
  assert len(reads) == 1
