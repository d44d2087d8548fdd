"""jaxamp.rounding: stochastic rounding to bfloat16, Kahan-compensated apply,
opt_state_dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.rounding import stochastic_round

BF16 = jnp.bfloat16


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32))


def _values(n, seed=0):
  """float32 values of many magnitudes and both signs, most not bfloat16-exact."""
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)


def test_stochastic_round_picks_only_the_two_neighbours():
  x = _values(512)
  draws = 256
  out = stochastic_round(jnp.broadcast_to(x, (draws, x.size)), jax.random.key(0))
  got = _bits(out.astype(jnp.float32))
  lo = _bits(x) & 0xFFFF0000  # toward zero: the lower-magnitude neighbour
  hi = lo + 0x10000  # the next bfloat16 away from zero
  assert np.all((got == lo) | (got == hi))
  # Both neighbours are picked (of a value an eighth of a gap or more from each: missed
  # in all draws with probability (7/8)**256 < 1e-14), and an exact value stays.
  low = _bits(x) & 0xFFFF
  inexact = (low >= 0x2000) & (low <= 0xE000)
  assert np.all((got == hi).any(0)[inexact]) and np.all((got == lo).any(0)[inexact])
  exact = jnp.asarray(x).astype(BF16).astype(jnp.float32)
  again = stochastic_round(exact, jax.random.key(1)).astype(jnp.float32)
  np.testing.assert_array_equal(_bits(again), _bits(exact))


def test_stochastic_round_is_unbiased():
  # n draws per value; a draw's deviation from x is at most one gap, so the mean's
  # standard deviation is at most gap / (2 sqrt(n)): allow five of them.
  x = _values(8, seed=1)
  n = 10_000
  out = stochastic_round(jnp.broadcast_to(x, (n, x.size)), jax.random.key(2))
  mean = np.asarray(out.astype(jnp.float32), np.float64).mean(0)
  gap = np.abs(np.asarray(jnp.asarray(x).astype(BF16).astype(jnp.float32), np.float64)) * 2.0 ** -7
  np.testing.assert_array_less(np.abs(mean - x.astype(np.float64)), 5 * gap / (2 * np.sqrt(n)) + 1e-45)
  # Round to nearest is biased on the same values (its error does not average out).
  nearest = np.asarray(jnp.asarray(x).astype(BF16).astype(jnp.float32), np.float64)
  assert np.mean(np.abs(nearest - x) > 5 * gap / (2 * np.sqrt(n))) > 0.5


def test_stochastic_round_keeps_non_finite_values_non_finite():
  nan_all_ones = jax.lax.bitcast_convert_type(jnp.uint32(0xFFFFFFFF), jnp.float32)
  x = jnp.stack([jnp.float32(jnp.nan), nan_all_ones, jnp.float32(jnp.inf),
                 jnp.float32(-jnp.inf), jnp.float32(-0.0), jnp.float32(3e38)])
  out = stochastic_round(jnp.broadcast_to(x, (256, x.size)), jax.random.key(3))
  out = np.asarray(out.astype(jnp.float32))
  assert np.isnan(out[:, :2]).all()
  assert (out[:, 2] == np.inf).all() and (out[:, 3] == -np.inf).all()
  assert (out[:, 4] == 0).all() and np.signbit(out[:, 4]).all()
  assert np.isfinite(out[:, 5]).all()  # below bfloat16's largest: never inf
  assert out.dtype == np.float32  # (the bfloat16 results, widened exactly)


@pytest.mark.slow
def test_stochastic_round_takes_key_data_and_refuses_other_dtypes():
  key = jax.random.key(4)
  x = jnp.full((16,), 1.0 + 2 ** -9)
  np.testing.assert_array_equal(stochastic_round(x, key), stochastic_round(x, jax.random.key_data(key)))
  assert stochastic_round(x.astype(BF16), key).dtype == BF16
  with pytest.raises(ValueError, match="rounds float32 values to bfloat16, got float16"):
    stochastic_round(x.astype(jnp.float16), key)


def _accumulate(apply, n, update, start=1.0):
  params = {"w": jnp.full((8,), start, BF16), "b": jnp.full((8,), start, jnp.float32)}
  updates = {"w": jnp.full((8,), update), "b": jnp.full((8,), update)}

  @jax.jit
  def run(params):
    body = lambda carry, _: (apply.apply(*carry[:1], updates, carry[1]), None)
    return jax.lax.scan(body, (params, apply.init(params)), None, length=n)[0]
  return run(params)


def test_kahan_reproduces_float32_accumulation_where_bfloat16_stalls():
  n, u = 1000, 1e-3  # each update under half a bfloat16 ulp of the weight (2**-8)
  reference = np.float32(1.0)
  for _ in range(n):
    reference = np.float32(reference + np.float32(u))
  params, state = _accumulate(jaxamp.kahan_summation(), n, u)
  w = np.asarray(params["w"].astype(jnp.float32))
  compensated = w - np.asarray(state.compensation["w"].astype(jnp.float32))
  # The stored weight is within one bfloat16 ulp of the float32 sum, the compensated
  # sum within bfloat16's resolution (2**-8 relative) of it: what is left is the
  # rounding of the bfloat16 compensation itself, step after step.
  ulp = 2.0 ** -7 * 2 ** np.floor(np.log2(reference))
  np.testing.assert_array_less(np.abs(w - reference), ulp + 1e-12)
  np.testing.assert_array_less(np.abs(compensated - reference), 2.0 ** -8 * reference)
  # Naive bfloat16 (round to nearest) never moves; float32 leaves are plain sums.
  naive = jax.lax.fori_loop(0, n, lambda _, p: (p.astype(jnp.float32) + u).astype(BF16),
                            jnp.ones((), BF16))
  assert float(naive) == 1.0
  np.testing.assert_array_equal(params["b"], np.full(8, reference))
  assert state.compensation["b"].shape == (0,) and state.compensation["w"].dtype == BF16


@pytest.mark.slow
def test_stochastic_rounding_apply_moves_small_updates_on_average_and_keys_advance():
  apply = jaxamp.stochastic_rounding(seed=0)
  n, u = 200, 1e-3
  params, state = _accumulate(apply, n, u)
  w = np.asarray(params["w"].astype(jnp.float32))
  # 1 + n u on average: each rounding's error is at most one ulp (2**-7 at 1, 2**-6 past 2).
  assert abs(w.mean() - (1 + n * u)) < 0.02, w
  assert state.key.dtype == jnp.uint32 and state.key.shape == (2,)
  assert not np.array_equal(state.key, apply.init(params).key)
  again, again_state = _accumulate(jaxamp.stochastic_rounding(seed=0), n, u)
  np.testing.assert_array_equal(again["w"], params["w"])  # the seed decides every draw
  np.testing.assert_array_equal(again_state.key, state.key)


def test_opt_state_dtype_stores_moments_narrow_and_leaves_counts_and_scalars():
  tx = jaxamp.opt_state_dtype(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
                              BF16, rounding="stochastic", seed=1)
  params = {"w": jnp.ones((4, 3)), "s": jnp.ones(())}
  state = tx.init(params)
  inner = state.inner_state
  assert inner.inner_state[0].mu["w"].dtype == BF16 and inner.inner_state[0].nu["w"].dtype == BF16
  assert inner.inner_state[0].mu["s"].dtype == jnp.float32  # a 0-d parameter's moment
  assert inner.count.dtype == jnp.int32 and inner.hyperparams["learning_rate"].dtype == jnp.float32


@pytest.mark.slow
def test_opt_state_dtype_updates_keep_the_stored_dtypes_and_advance_the_key():
  tx = jaxamp.opt_state_dtype(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
                              BF16, rounding="stochastic", seed=1)
  params = {"w": jnp.ones((4, 3)), "s": jnp.ones(())}
  state = tx.init(params)
  grads = {"w": jnp.full((4, 3), 0.5), "s": jnp.ones(())}
  updates, new = jax.jit(tx.update)(grads, state, params)
  assert jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(lambda x: x.dtype, state)
  assert int(new.inner_state.count) == 1 and not np.array_equal(new.key, state.key)
  # The first Adam step from zero moments is lr * sign(g): the same as plain Adam's.
  ref, _ = optax.adam(1e-3).update(grads, optax.adam(1e-3).init(params), params)
  np.testing.assert_allclose(updates["w"], ref["w"], rtol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda: optax.adamw(1e-2), lambda: optax.lion(1e-3),
                                  lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4)],
                         ids=["adamw", "lion", "adafactor"])
def test_opt_state_dtype_is_the_float32_optimizer_with_its_state_rounded_each_step(make):
  """AdamW's and Lion's moments and Adafactor's factored statistics are stored in
  bfloat16 (counts stay int32), and each update equals the float32 optimizer's run on
  the bfloat16 state widened, its new state rounded to nearest: a hand reference."""
  params = {"w": jnp.linspace(-1, 1, 48).reshape(8, 6), "b": jnp.linspace(0, 1, 6)}
  inner, tx = make(), jaxamp.opt_state_dtype(make(), BF16)
  narrow = lambda t: jax.tree.map(
      lambda x: x.astype(BF16) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x, t)
  wide = lambda t: jax.tree.map(
      lambda x: x.astype(jnp.float32) if x.dtype == BF16 else x, t)
  ref, state = narrow(inner.init(params)), tx.init(params)
  floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)
            and x.ndim]
  assert floats and all(x.dtype == BF16 for x in floats)
  assert all(x.dtype == jnp.int32 for x in jax.tree.leaves(state)
             if jnp.issubdtype(x.dtype, jnp.integer))
  for i in range(3):
    g = jax.tree.map(lambda p: jnp.sin(p * (i + 2)), params)
    want, ref = inner.update(g, wide(ref), params)
    ref = narrow(ref)
    got, state = tx.update(g, state, params)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, ref)


@pytest.mark.slow
def test_opt_state_dtype_float32_is_the_inner_transformation_bit_for_bit():
  params = {"w": jnp.linspace(-1, 1, 12).reshape(4, 3)}
  inner = optax.adamw(1e-2)
  tx = jaxamp.opt_state_dtype(inner, jnp.float32)
  s, t = inner.init(params), tx.init(params)
  for i in range(3):
    g = {"w": jnp.sin(params["w"] * (i + 1))}
    u, s = inner.update(g, s, params)
    v, t = tx.update(g, t, params)
    np.testing.assert_array_equal(u["w"], v["w"])
  assert t.key is None


@pytest.mark.slow
def test_opt_state_dtype_nearest_rounds_each_store_to_nearest():
  params = {"w": jnp.ones((5,))}
  tx = jaxamp.opt_state_dtype(optax.adam(1e-3, b1=0.9), BF16)
  g = {"w": jnp.asarray([0.3, 1e-3, 7.0, -2.5, 1e5], jnp.float32)}
  _, state = tx.update(g, tx.init(params), params)
  mu = state.inner_state[0].mu["w"]
  np.testing.assert_array_equal(mu, (0.1 * g["w"]).astype(BF16))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=BF16, rounding="up"), r"rounding must be one of 'nearest', 'stochastic', got 'up'"),
    (dict(dtype=jnp.int8), r"dtype must be a floating dtype .* got dtype\('int8'\)"),
    (dict(dtype=jnp.float16, rounding="stochastic"),
     r"rounds to bfloat16; got dtype float16. Use jnp.bfloat16, or rounding='nearest'"),
])
def test_opt_state_dtype_refuses_bad_arguments_naming_what_is_valid(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxamp.opt_state_dtype(optax.adam(1e-3), **kwargs)
