"""Tests for jaxamp.loss_scale: the update rule, unscaling, skipping and helpers."""

import functools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.skip import select_tree as _select_tree

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


def _grads(value: float = 1.0) -> dict[str, jax.Array]:
  """A gradient tree of mixed dtypes, every floating element equal to ``value``."""
  return {"h": jnp.full((3,), value, F16), "b": jnp.full((2,), value, BF16),
          "f": jnp.full((2, 2), value, F32), "i": jnp.arange(3, dtype=jnp.int32)}


def _bad(value: float) -> dict[str, jax.Array]:
  """``_grads(1.0)`` with one float16 element replaced by ``value``."""
  g = _grads()
  g["h"] = g["h"].at[1].set(value)
  return g


def _bits(tree: Any) -> list[tuple[str, bytes]]:
  return [(str(x.dtype), np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def _run(opt: optax.GradientTransformation, grads_seq: list[Any]) -> list[Any]:
  """Runs jitted ``opt.update`` over ``grads_seq``; returns the state after each step."""
  update = jax.jit(opt.update)
  state, states = opt.init(_grads()), []
  for g in grads_seq:
    _, state = update(g, state)
    states.append(state)
  return states


def _scales(states: list[jaxamp.LossScaleState]) -> list[float]:
  return [float(s.scale) for s in states]


# --- the update rule ------------------------------------------------------------------


def test_four_overflows_from_400_give_25():  # Keras' sequence
  states = _run(jaxamp.dynamic_loss_scale(initial_scale=400.0), [_bad(jnp.inf)] * 4)
  assert _scales(states) == [200.0, 100.0, 50.0, 25.0]
  assert [int(s.overflow_steps) for s in states] == [1, 2, 3, 4]
  assert not any(bool(s.finite) for s in states)
  assert all(int(s.growth_count) == 0 for s in states)


def test_growth_every_two_steps_from_2_gives_32():  # Keras' sequence
  states = _run(jaxamp.dynamic_loss_scale(initial_scale=2.0, growth_interval=2), [_grads()] * 8)
  assert _scales(states) == [2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]
  assert [int(s.growth_count) for s in states] == [1, 0, 1, 0, 1, 0, 1, 0]
  assert all(bool(s.finite) for s in states)
  assert int(states[-1].overflow_steps) == 0


def test_min_scale_floor_holds():
  opt = jaxamp.dynamic_loss_scale(initial_scale=8.0, min_scale=2.0)
  assert _scales(_run(opt, [_bad(jnp.nan)] * 4)) == [4.0, 2.0, 2.0, 2.0]


def test_max_scale_ceiling_holds():
  opt = jaxamp.dynamic_loss_scale(initial_scale=4.0, growth_interval=1, max_scale=16.0)
  assert _scales(_run(opt, [_grads()] * 4)) == [8.0, 16.0, 16.0, 16.0]


@pytest.mark.parametrize("make", [
    jaxamp.dynamic_loss_scale,
    lambda: jaxamp.dynamic_loss_scale(initial_scale=2.0, growth_interval=1),
    lambda: jaxamp.static_loss_scale(1024.0),
    jaxamp.no_loss_scale,
])
def test_state_dtypes_stay_fixed_with_float16_gradients(make):
  grads = {"h": jnp.ones(3, F16)}
  opt = make()
  update = jax.jit(opt.update)
  state = opt.init(grads)
  for g in [grads, {"h": jnp.array([jnp.inf, 1, 1], F16)}, grads, grads]:
    _, state = update(g, state)
    assert state.scale.dtype == jnp.float32 and state.scale.shape == ()
    assert state.growth_count.dtype == jnp.int32
    assert state.overflow_steps.dtype == jnp.int32
    assert state.finite.dtype == jnp.bool_


def _reference(finite_seq, initial, growth, backoff, interval, low, high):
  """torch GradScaler's rule with a floor and a ceiling, in plain Python."""
  scale, count, overflows, out = initial, 0, 0, []
  for finite in finite_seq:
    if finite:
      count += 1
      if count == interval:
        scale, count = min(scale * growth, high), 0
    else:
      scale, count, overflows = max(scale * backoff, low), 0, overflows + 1
    out.append((scale, count, overflows, finite))
  return out


def test_random_sequence_matches_python_reference():
  rng = np.random.default_rng(0)
  p_bad = np.repeat([0.5, 0.05, 0.3], 100)  # phases that reach the floor, then the ceiling
  finite_seq = [bool(x) for x in rng.random(300) > p_bad]
  hp = dict(initial_scale=2.0**6, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
            min_scale=0.25, max_scale=2.0**9)
  opt = jaxamp.dynamic_loss_scale(**hp)
  update = jax.jit(opt.update)
  state = opt.init(_grads())
  expected = _reference(finite_seq, *hp.values())
  assert {s for s, *_ in expected} >= {0.25, 2.0**9}  # the run reaches floor and ceiling
  for i, (finite, want) in enumerate(zip(finite_seq, expected)):
    grads = _grads(0.5)
    if not finite:
      leaf = ["h", "b", "f"][i % 3]
      grads[leaf] = grads[leaf].at[0].set([jnp.inf, -jnp.inf, jnp.nan][rng.integers(3)])
    scale_before = float(state.scale)
    updates, state = update(grads, state)
    got = (float(state.scale), int(state.growth_count), int(state.overflow_steps),
           bool(state.finite))
    assert got == want, f"step {i}"
    if finite:
      assert float(updates["f"][0, 0]) == 0.5 / scale_before
    else:
      assert all(not np.any(np.asarray(updates[k], np.float32)) for k in "hbf")


# --- unscaling ------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 400.0, 2.0**15, 0.5])
def test_unscaled_updates_are_grads_over_scale_in_each_dtype(scale):
  rng = np.random.default_rng(1)
  grads = {"h": jnp.asarray(rng.normal(size=5) * 100, F16),
           "b": jnp.asarray(rng.normal(size=5) * 100, BF16),
           "f": jnp.asarray(rng.normal(size=(2, 3)) * 100, F32),
           "i": jnp.arange(4, dtype=jnp.int32)}
  opt = jaxamp.static_loss_scale(scale)
  updates, state = jax.jit(opt.update)(grads, opt.init(grads))
  assert bool(state.finite)
  for k in "hbf":
    want = (np.asarray(grads[k], np.float32) / np.float32(scale)).astype(grads[k].dtype)
    assert updates[k].dtype == grads[k].dtype
    np.testing.assert_array_equal(np.asarray(updates[k]), want)
  assert updates["i"].dtype == jnp.int32
  np.testing.assert_array_equal(updates["i"], grads["i"])


def test_finite_gradient_that_overflows_when_unscaled_is_an_overflow_step():
  opt = jaxamp.static_loss_scale(0.5)
  updates, state = jax.jit(opt.update)({"h": jnp.array([60000.0], F16)}, opt.init(None))
  assert not bool(state.finite)
  assert float(updates["h"][0]) == 0.0


def test_no_loss_scale_passes_gradients_through_and_still_zeroes_overflow():
  opt = jaxamp.no_loss_scale()
  update = jax.jit(opt.update)
  state = opt.init(_grads())
  grads = {"h": jnp.array([1e-7, 65504.0], F16), "b": jnp.array([3e38], BF16)}
  updates, state = update(grads, state)
  assert _bits(updates) == _bits(grads)
  updates, state = update({"h": jnp.array([jnp.nan, 1.0], F16), "b": jnp.array([1.0], BF16)},
                          state)
  assert _bits(updates) == _bits({"h": jnp.zeros(2, F16), "b": jnp.zeros(1, BF16)})
  assert (float(state.scale), int(state.overflow_steps), bool(state.finite)) == (1.0, 1, False)


def test_static_loss_scale_never_changes():
  seq = [_grads(), _bad(jnp.inf), _grads(), _grads(), _grads()]
  states = _run(jaxamp.static_loss_scale(64.0), seq)
  assert _scales(states) == [64.0] * 5
  assert [int(s.growth_count) for s in states] == [1, 0, 1, 2, 3]
  assert int(states[-1].overflow_steps) == 1


# --- inside optax.chain -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_overflow_step_leaves_parameters_unchanged(bad):
  opt = optax.chain(jaxamp.dynamic_loss_scale(), optax.sgd(0.1))
  params = {k: v for k, v in _grads(3.0).items() if k != "i"}
  grads = {k: v for k, v in _bad(bad).items() if k != "i"}

  @jax.jit
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), updates, state

  new_params, updates, state = step(params, opt.init(params), grads)
  assert _bits(new_params) == _bits(params)
  for u in jax.tree.leaves(updates):  # sgd turns the +0 it receives into -0
    np.testing.assert_array_equal(np.asarray(u, np.float32), 0.0)
  assert float(jaxamp.get_loss_scale(state)) == 2.0**14


class _SpyState(NamedTuple):
  seen: Any


def _spy() -> optax.GradientTransformation:
  """Records in its state the updates it receives."""
  return optax.GradientTransformation(
      lambda params: _SpyState(jax.tree.map(jnp.zeros_like, params)),
      lambda updates, state, params=None: (updates, _SpyState(updates)))


def test_overflow_step_emits_positive_zeros_of_each_dtype():
  opt = optax.chain(jaxamp.dynamic_loss_scale(), _spy())
  grads = _bad(jnp.nan)
  _, state = jax.jit(opt.update)(grads, opt.init(grads))
  assert _bits(state[1].seen) == _bits(jax.tree.map(jnp.zeros_like, grads))  # ints too


def test_later_elements_see_unscaled_gradients():
  true_grads = {"w": jnp.array([3.0, 4.0], F32)}  # global norm 5
  scale = 2.0**10
  scaled = jax.tree.map(lambda g: g * scale, true_grads)
  opt = optax.chain(jaxamp.dynamic_loss_scale(initial_scale=scale), _spy(),
                    optax.clip_by_global_norm(10.0))
  updates, state = jax.jit(opt.update)(scaled, opt.init(true_grads))
  np.testing.assert_array_equal(state[1].seen["w"], true_grads["w"])
  # Norm 5 < 10: left alone. Had clipping seen the scaled norm (5120) it would have cut
  # the gradients to norm 10, i.e. [6, 8].
  np.testing.assert_array_equal(updates["w"], true_grads["w"])


def test_a_loss_scale_inside_multisteps_is_refused():
  # What it did: MultiSteps multiplies its accumulator by (1 - emit), so after one overflow
  # window 0 * inf = NaN poisons every later window and the scale only ever backs off.
  opt = optax.MultiSteps(optax.chain(jaxamp.dynamic_loss_scale(initial_scale=8.0),
                                     optax.sgd(1.0)), every_k_schedule=2)
  update = jax.jit(opt.update)
  params = {"w": jnp.zeros(2)}
  state = opt.init(params)
  for g in ([jnp.inf, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]):  # one bad micro-batch
    _, state = update({"w": jnp.array(g)}, state, params)
  assert float(jaxamp.get_loss_scale(state)) == 2.0  # backed off twice: window 2 poisoned
  with pytest.raises(ValueError, match="inside.*MultiSteps|MultiSteps hands it"):
    jaxamp.scale_loss(1.0, opt.init(params))


def test_loss_scale_outside_multisteps_skips_only_the_bad_micro_batch():
  # The composition the error points to: each micro-batch is unscaled with the scale it
  # was computed with; an overflowing one is dropped whole (skip_nonfinite) and the scale
  # backs off once; the next windows are clean.
  def run(grads):
    opt = jaxamp.skip_nonfinite(optax.chain(jaxamp.dynamic_loss_scale(initial_scale=8.0),
                                            optax.MultiSteps(optax.sgd(1.0), 2)))
    params = {"w": jnp.zeros(2)}
    state = opt.init(params)
    update = jax.jit(opt.update)
    scales = []
    for g in grads:
      jaxamp.scale_loss(1.0, state)  # placement accepted
      scale = jaxamp.get_loss_scale(state)
      updates, state = update({"w": jnp.array(g) * scale}, state, params)
      params = optax.apply_updates(params, updates)
      scales.append(float(jaxamp.get_loss_scale(state)))
    return params, scales

  params, scales = run([[1.0, 2.0], [jnp.inf, 1.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
  assert scales == [8.0, 4.0, 4.0, 4.0, 4.0]
  control, _ = run([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])  # never saw it
  assert _bits(params) == _bits(control)
  np.testing.assert_array_equal(params["w"], [-(1 + 3 + 5 + 7) / 2, -(2 + 4 + 6 + 8) / 2])


def _misplaced():
  ls = lambda: jaxamp.dynamic_loss_scale(initial_scale=64.0)
  return {
      "after clipping": optax.chain(optax.clip_by_global_norm(1.0), ls(), optax.sgd(0.1)),
      "after adamw": optax.chain(optax.adamw(1e-3), ls()),
      "named_chain, second": optax.named_chain(("z_clip", optax.clip_by_global_norm(1.0)),
                                               ("a_scale", ls()), ("sgd", optax.sgd(0.1))),
      "masked": optax.masked(optax.chain(ls(), optax.sgd(0.1)), {"w": True, "b": False}),
      "multi_transform": optax.multi_transform(
          {"a": optax.chain(ls(), optax.sgd(0.1)), "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}),
      "apply_if_finite": optax.apply_if_finite(optax.chain(ls(), optax.sgd(0.1)), 3),
      "multisteps": optax.MultiSteps(optax.chain(ls(), optax.sgd(0.1)), 2),
  }


@pytest.mark.parametrize("name", list(_misplaced()))
def test_scale_loss_refuses_a_misplaced_loss_scale(name):
  params = {"w": jnp.ones(2), "b": jnp.ones(1)}
  state = _misplaced()[name].init(params)
  with pytest.raises(ValueError, match="loss scale at .* is misplaced"):
    jaxamp.scale_loss(jnp.float32(1.0), state)
  with pytest.raises(ValueError, match="misplaced"):  # under jit too: the check is static
    jax.jit(jaxamp.scale_loss)(jnp.float32(1.0), state)


@pytest.mark.parametrize("name", ["named_chain, first", "skip(chain)", "inject_hyperparams",
                                  "chain(chain)", "outside multisteps"])
def test_scale_loss_accepts_a_loss_scale_that_comes_first(name):
  ls = jaxamp.dynamic_loss_scale(initial_scale=64.0)
  opt = {
      "named_chain, first": optax.named_chain(("z_scale", ls), ("a_clip", optax.clip(1.0))),
      "skip(chain)": jaxamp.skip_nonfinite(optax.chain(ls, optax.adam(1e-3))),
      "inject_hyperparams": optax.inject_hyperparams(
          lambda learning_rate: optax.chain(ls, optax.sgd(learning_rate)))(learning_rate=0.1),
      "chain(chain)": optax.chain(optax.chain(ls, optax.clip(1.0)), optax.sgd(0.1)),
      "outside multisteps": optax.chain(ls, optax.MultiSteps(optax.sgd(0.1), 2)),
  }[name]
  assert float(jaxamp.scale_loss(jnp.float32(2.0), opt.init({"w": jnp.ones(2)}))) == 128.0


def test_a_fixed_scale_divides_by_the_scale_its_state_holds():
  # A state restored from a float16 run (scale 32768) meets no_loss_scale (a bfloat16
  # step): the loss was multiplied by 32768, so the update must divide by it, once, and
  # then return the scale to 1. Before, no_loss_scale never divided: updates 32768x.
  restored = jaxamp.dynamic_loss_scale().init(None)
  assert float(restored.scale) == 32768.0
  for opt in (jaxamp.no_loss_scale(), jaxamp.static_loss_scale(4.0)):
    scaled = {"w": jnp.array([32768.0, -65536.0])}
    updates, state = jax.jit(opt.update)(scaled, restored)
    np.testing.assert_array_equal(updates["w"], [1.0, -2.0])
    assert float(state.scale) == float(opt.init(None).scale)  # back to its own rule
  # A dynamic scale clamps a restored scale into its own [min_scale, max_scale].
  _, state = jaxamp.dynamic_loss_scale(max_scale=1024.0, initial_scale=2.0).update(
      {"w": jnp.ones(1)}, restored)
  assert float(state.scale) == 1024.0


# --- skip_nonfinite ---------------------------------------------------------------------


def _non_loss_scale_bits(state: Any) -> list[tuple[str, bytes]]:
  is_ls = lambda x: isinstance(x, jaxamp.LossScaleState)
  return _bits([x for x in jax.tree.leaves(state, is_leaf=is_ls) if not is_ls(x)])


def test_skip_nonfinite_keeps_adam_state_bit_identical_on_overflow():
  opt = jaxamp.skip_nonfinite(optax.chain(jaxamp.dynamic_loss_scale(initial_scale=1024.0),
                                          optax.adam(1e-3)))
  update = jax.jit(opt.update)
  params = {k: v for k, v in _grads(1.0).items() if k != "i"}
  good = {k: v * 1024 for k, v in params.items()}
  bad = {k: v for k, v in _bad(jnp.nan).items() if k != "i"}
  state = opt.init(params)
  assert isinstance(state, jaxamp.SkipNonfiniteState)
  _, state = update(good, state, params)  # non-zero moments first
  adam = optax.tree_utils.tree_get(state, "ScaleByAdamState")
  assert int(adam.count) == 1 and float(adam.nu["f"][0, 0]) > 0

  updates, after = update(bad, state, params)
  assert _bits(updates) == _bits(jax.tree.map(jnp.zeros_like, params))
  assert _non_loss_scale_bits(after) == _non_loss_scale_bits(state)
  ls = optax.tree_utils.tree_get(after, "LossScaleState")
  assert (float(ls.scale), int(ls.overflow_steps), bool(ls.finite)) == (512.0, 1, False)

  updates, after2 = update(good, after, params)
  adam2 = optax.tree_utils.tree_get(after2, "ScaleByAdamState")
  assert int(adam2.count) == 2
  assert not np.array_equal(adam2.mu["f"], adam.mu["f"])
  assert bool(jaxamp.all_finite(updates)) and float(jnp.abs(updates["f"]).min()) > 0
  assert bool(optax.tree_utils.tree_get(after2, "LossScaleState").finite)


def test_skip_nonfinite_without_loss_scale_checks_incoming_gradients():
  opt = jaxamp.skip_nonfinite(optax.adam(1e-3))
  update = jax.jit(opt.update)
  params = {"w": jnp.ones(3)}
  state = opt.init(params)
  _, state = update({"w": jnp.ones(3)}, state, params)
  updates, after = update({"w": jnp.array([1.0, jnp.inf, 1.0])}, state, params)
  assert _bits(after) == _bits(state)
  np.testing.assert_array_equal(updates["w"], np.zeros(3))
  _, after = update({"w": jnp.ones(3)}, after, params)
  assert int(optax.tree_utils.tree_get(after, "count")) == 2


def test_select_tree():
  new = {"a": jnp.array([jnp.nan, 1.0]), "b": jnp.int32(3)}
  old = {"a": jnp.array([2.0, 2.0]), "b": jnp.int32(4)}
  pick = jax.jit(_select_tree)
  assert _bits(pick(jnp.array(False), new, old)) == _bits(old)
  assert _bits(pick(jnp.array(True), new, old)) == _bits(new)


# --- helpers ----------------------------------------------------------------------------


def test_a_schedule_inside_skip_nonfinite_does_not_advance_on_a_skipped_step():
  """inject_hyperparams keeps its own count, what its schedules read: inside
  skip_nonfinite a skipped step leaves it; outside, it advances (as the README says)."""
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  inner = lambda lr: optax.chain(jaxamp.dynamic_loss_scale(initial_scale=2.0), optax.sgd(lr))
  injected = lambda: optax.inject_hyperparams(inner)(lr=schedule)
  params = {"w": jnp.ones(2)}
  counts = {}
  for name, opt, injected_state in [
      ("skip(inject)", jaxamp.skip_nonfinite(injected()), lambda s: s.inner_state),
      ("inject(skip)", optax.inject_hyperparams(
          lambda lr: jaxamp.skip_nonfinite(inner(lr)))(lr=schedule), lambda s: s)]:
    state = opt.init(params)
    for g in (1.0, np.inf, 1.0):
      _, state = opt.update({"w": jnp.full(2, g)}, state, params)
    counts[name] = int(injected_state(state).count)
  assert counts == {"skip(inject)": 2, "inject(skip)": 3}


def test_dynamic_loss_scale_defaults_are_the_documented_ones():
  """2**15 at first; doubled after 2,000 finite steps; halved per overflow down to 1;
  at most 2**24 (the README's and torch's GradScaler's defaults, ceiling aside)."""
  ls = jaxamp.dynamic_loss_scale()
  finite, inf = jnp.ones(2), jnp.full(2, jnp.inf)

  @functools.partial(jax.jit, static_argnums=1)
  def steps(state, n, grads):
    return jax.lax.fori_loop(0, n, lambda _, s: ls.update(grads, s)[1], state)

  state = ls.init(None)
  assert float(state.scale) == 2.0**15
  state = steps(state, 1999, finite)
  assert float(state.scale) == 2.0**15
  state = steps(state, 1, finite)
  assert float(state.scale) == 2.0**16
  state = steps(state, 2000 * 12, finite)  # 12 more growths would pass 2**24
  assert float(state.scale) == 2.0**24
  state = steps(state, 40, inf)
  assert float(state.scale) == 1.0


def _nested_states():
  params = {"w": jnp.ones(2)}
  chain = lambda: optax.chain(jaxamp.dynamic_loss_scale(initial_scale=64.0), optax.adam(1e-3))
  injected = optax.inject_hyperparams(
      lambda learning_rate: optax.chain(jaxamp.dynamic_loss_scale(initial_scale=64.0),
                                        optax.adam(learning_rate)))(learning_rate=1e-3)
  opts = {
      "chain": chain(),
      "bare": jaxamp.dynamic_loss_scale(initial_scale=64.0),
      "inject_hyperparams": injected,
      "skip_nonfinite": jaxamp.skip_nonfinite(chain()),
      "skip(inject)": jaxamp.skip_nonfinite(injected),
      "multisteps(skip)": optax.MultiSteps(jaxamp.skip_nonfinite(chain()), 2),
  }
  return {k: (o, params) for k, o in opts.items()}


@pytest.mark.parametrize("name", list(_nested_states()))
def test_loss_scale_state_found_in_nested_wrappers(name):
  opt, params = _nested_states()[name]
  state = opt.init(params)
  found = optax.tree_utils.tree_get(state, "LossScaleState")
  assert isinstance(found, jaxamp.LossScaleState)
  assert float(jaxamp.get_loss_scale(state)) == 64.0
  _, state = jax.jit(opt.update)({"w": jnp.array([jnp.nan, 0.0])}, state, params)
  if name != "multisteps(skip)":  # that one only accumulated
    assert float(jaxamp.get_loss_scale(state)) == 32.0


def test_get_loss_scale_is_one_without_a_loss_scale():
  state = optax.adam(1e-3).init({"w": jnp.ones(2)})
  scale = jaxamp.get_loss_scale(state)
  assert scale.dtype == jnp.float32 and float(scale) == 1.0
  assert float(jaxamp.scale_loss(jnp.float16(3.0), state)) == 3.0


def test_get_loss_scale_rejects_two_loss_scales():
  opt = optax.chain(jaxamp.dynamic_loss_scale(), jaxamp.dynamic_loss_scale())
  with pytest.raises(ValueError, match="2 LossScaleStates"):
    jaxamp.get_loss_scale(opt.init(None))


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_scale_loss_multiplies_in_float32(dtype):
  state = jaxamp.dynamic_loss_scale().init(None)
  out = jax.jit(jaxamp.scale_loss)(jnp.asarray(4.0, dtype), state)
  assert out.dtype == jnp.float32 and float(out) == 4.0 * 2.0**15  # beyond float16's range


def test_gradient_of_scaled_float16_loss_round_trips():
  opt = optax.chain(jaxamp.dynamic_loss_scale(initial_scale=2.0**12), optax.sgd(1.0))
  params = {"w": jnp.array([1e-4, 2e-4], F16)}
  state = opt.init(params)
  loss = lambda p: jnp.sum(p["w"] ** 2) / 4  # float16 throughout

  @jax.jit
  def step(params, state):
    grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p), state))(params)
    return grads, opt.update(grads, state, params)[0]

  grads, updates = step(params, state)
  assert grads["w"].dtype == F16
  want = (np.asarray(grads["w"], np.float32) / 2.0**12).astype(np.float16)
  np.testing.assert_array_equal(-np.asarray(updates["w"]), want)
  np.testing.assert_allclose(-np.asarray(updates["w"], np.float32), [5e-5, 1e-4], rtol=1e-2)


@pytest.mark.parametrize("tree, finite", [
    ({}, True),
    (None, True),
    ({"i": jnp.arange(3), "m": jnp.array([True, False])}, True),
    (_grads(), True),
    ({"h": jnp.array([1.0, jnp.inf], F16)}, False),
    ({"b": jnp.array([jnp.nan], BF16), "f": jnp.ones(2)}, False),
    ([jnp.ones(2), (jnp.ones(1), {"deep": jnp.array([-jnp.inf])})], False),
    ({"h": jnp.array([65504.0], F16)}, True),
])
def test_all_finite(tree, finite):
  result = jax.jit(jaxamp.all_finite)(tree)
  assert result.dtype == jnp.bool_ and result.shape == ()
  assert bool(result) is finite


@pytest.mark.parametrize("policy, initial", [
    ("mixed_float16", 2.0**15),
    ("float16", 2.0**15),
    ("params=float32,compute=float16,output=float32", 2.0**15),
    (jnp.float16, 2.0**15),
    ("mixed_bfloat16", 1.0),
    ("bfloat16", 1.0),
    ("float32", 1.0),
    (jaxamp.Policy(F32, BF16), 1.0),
    (jmp.get_policy("params=float32,compute=float16"), 2.0**15),
])
def test_loss_scale_for(policy, initial):
  opt = jaxamp.loss_scale_for(policy)
  state = opt.init(None)
  assert float(state.scale) == initial
  _, state = opt.update(jnp.array([jnp.inf]), state)
  assert float(state.scale) == max(initial / 2, 1.0)


def test_loss_scale_for_rejects_bad_policy():
  with pytest.raises(ValueError, match="float17"):
    jaxamp.loss_scale_for("float17")


def test_hyperparameters_survive_flatten_unflatten_and_jit():
  opt = jaxamp.dynamic_loss_scale(initial_scale=8.0, min_scale=4.0, growth_interval=2,
                                  max_scale=16.0)
  state = opt.init(None)
  assert len(jax.tree.leaves(state)) == 4  # the state holds no hyperparameters
  update = jax.jit(opt.update)
  _, state = update(jnp.array([jnp.inf]), state)
  leaves, treedef = jax.tree.flatten(state)
  state = jax.jit(lambda s: s)(jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves]))
  assert isinstance(state, jaxamp.LossScaleState)
  scales = []
  for g in [jnp.array([jnp.inf])] * 2 + [jnp.ones(1)] * 6:
    _, state = update(g, state)
    scales.append(float(state.scale))
  assert scales == [4.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 16.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(initial_scale=0.0), "initial_scale must be > 0.*0.0"),
    (dict(initial_scale=-8.0), "initial_scale.*-8.0"),
    (dict(initial_scale=float("inf")), "initial_scale must be finite.*inf"),
    (dict(initial_scale="big"), "initial_scale must be a number.*'big'"),
    (dict(initial_scale=1e39, max_scale=1e40), "initial_scale.*float32 maximum.*1e\\+39"),
    (dict(growth_factor=0.5), "growth_factor must be >= 1.*0.5"),
    (dict(backoff_factor=1.0), "backoff_factor must be in \\(0, 1\\).*1.0"),
    (dict(backoff_factor=0.0), "backoff_factor.*0.0"),
    (dict(backoff_factor=float("nan")), "backoff_factor must be finite.*nan"),
    (dict(growth_interval=0), "growth_interval must be an integer >= 1.*0"),
    (dict(growth_interval=2.5), "growth_interval.*2.5"),
    (dict(growth_interval=2**31), "growth_interval must be <= 2147483647.*2147483648"),
    (dict(min_scale=0.0), "min_scale must be > 0.*0.0"),
    # Positive as Python floats, but 0 in the float32 state: refused (were accepted).
    (dict(min_scale=1e-50), "min_scale must be > 0 and float32 must hold it.*1e-50"),
    (dict(initial_scale=1e-46, min_scale=1e-47),
     "initial_scale must be > 0 and float32 must hold it.*1e-46"),
    (dict(initial_scale=1.0, min_scale=2.0), "min_scale=2.0, initial_scale=1.0"),
    (dict(initial_scale=64.0, max_scale=32.0), "initial_scale=64.0, max_scale=32.0"),
])
def test_bad_hyperparameters_raise(kwargs, message):
  with pytest.raises(ValueError, match=message):
    jaxamp.dynamic_loss_scale(**kwargs)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), None, 1e-50, 1e39])
def test_bad_static_scale_raises(scale):
  with pytest.raises(ValueError, match=f"scale must be .*{re.escape(str(scale))}"):
    jaxamp.static_loss_scale(scale)


def test_traced_hyperparameter_raises_clear_error():
  with pytest.raises(TypeError, match="initial_scale must be a concrete number"):
    jax.jit(lambda s: jaxamp.dynamic_loss_scale(initial_scale=s).init(None))(2.0)


def test_unscaled_norm_and_finite_reads_the_verdict_off_the_norm():
  # The sum of squares must have one consumer (the square root): with more (the verdict,
  # the cond's index), XLA:CPU keeps every leaf's reduction a kernel of its own on the
  # way to the skip's branch instead of fusing them into the one that takes the root.
  grads = {"a": jnp.ones((3, 2)), "b": jnp.ones(4, jnp.bfloat16), "c": jnp.ones(())}
  jaxpr = jax.make_jaxpr(lambda g: jaxamp.loss_scale.unscaled_norm_and_finite(g, None))(
      grads).jaxpr
  (sqrt,) = [e for e in jaxpr.eqns if e.primitive.name == "sqrt"]
  (is_finite,) = [e for e in jaxpr.eqns if e.primitive.name == "is_finite"]
  total = sqrt.invars[0]
  assert [e.primitive.name for e in jaxpr.eqns if total in e.invars] == ["sqrt"]
  assert total not in jaxpr.outvars
  assert is_finite.invars == sqrt.outvars
  assert jaxpr.outvars[-2:] == [sqrt.outvars[0], is_finite.outvars[0]]


@pytest.mark.parametrize("scale", [None, 4.0])
def test_unscaled_norm_and_finite_verdict_is_a_finite_float32_norm(scale):
  # One sum of squares decides: finite exactly when every element is finite and the
  # norm fits float32. Huge but finite values whose squares leave float32's range count
  # as an overflow (clipping would zero them, Adam's second moment would hold inf).
  cases = {
      "finite": ({"a": jnp.ones((3, 2)), "b": jnp.arange(4, dtype=jnp.bfloat16)}, True),
      "largest finite float16": ({"a": jnp.full((64,), 65504.0, jnp.float16)}, True),
      "norm just inside float32": ({"a": jnp.full((4,), 9e18)}, True),
      "squares past float32": ({"a": jnp.full((2,), 1e30), "b": jnp.ones(3, jnp.bfloat16)},
                               False),
      "inf in bfloat16": ({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf], jnp.bfloat16)},
                          False),
      "nan in float32": ({"a": jnp.array([[jnp.nan]]), "b": jnp.ones(1, jnp.bfloat16)}, False),
      "ints pass": ({"a": jnp.ones(2), "ids": jnp.arange(3)}, True),
  }
  fn = jax.jit(lambda g: jaxamp.loss_scale.unscaled_norm_and_finite(
      g, None if scale is None else jnp.float32(scale)))
  for name, (grads, want_finite) in cases.items():
    unscaled, norm, finite = fn(grads)
    expected = grads if scale is None else jaxamp.loss_scale.unscale(grads, jnp.float32(scale))
    assert bool(finite) is want_finite, name
    assert bool(finite) == bool(np.isfinite(norm)), name
    for got, want in zip(jax.tree.leaves(unscaled), jax.tree.leaves(expected)):
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    if want_finite:
      leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(expected)
                if jnp.issubdtype(x.dtype, jnp.floating)]
      np.testing.assert_allclose(float(norm), np.sqrt(sum((x**2).sum() for x in leaves)),
                                 rtol=1e-6)
