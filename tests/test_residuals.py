"""jaxamp.residuals: what reverse mode saves under half_residuals, and that the gradients
are the ones plain reverse mode computes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp.residuals import (gathers, half_residuals, save_all_but_gathers,
                               save_half_and_statistics)
from jaxamp.gather import Shard, gathered

BF16, F32 = jnp.bfloat16, jnp.float32
# Bit-identical comparisons need XLA to round as the program says: with excess precision
# it may skip a float32 -> bfloat16 -> float32 round trip in one program and not the other.
EXACT = {"xla_allow_excess_precision": False}


def _aval(shape, dtype):
  return jax.core.ShapedArray(shape, dtype)


@pytest.mark.parametrize("prim, dtypes, saved", [
    (jax.lax.convert_element_type_p, [F32, BF16], False),  # a parameter's half copy
    (jax.lax.convert_element_type_p, [BF16, F32], False),  # a norm's upcast input
    # ... but a float16 value's upcast is saved (XLA:CPU's compile time), not its downcast
    (jax.lax.convert_element_type_p, [jnp.float16, F32], True),
    (jax.lax.convert_element_type_p, [F32, jnp.float16], False),
    (jax.lax.mul_p, [F32, F32], False),  # a float32 norm's insides
    (jax.lax.rsqrt_p, [F32], False),
    (jax.lax.mul_p, [BF16, BF16], True),  # half-precision values
    (jax.lax.dot_general_p, [F32, F32], True),  # matmuls, whatever their dtype
    (jax.lax.reduce_sum_p, [F32], True),  # a norm's statistics
    (jax.lax.select_n_p, [jnp.bool_, F32, F32], False),
    (jax.lax.add_p, [jnp.int32, jnp.int32], True),
])
def test_the_policy_saves_half_values_and_statistics(prim, dtypes, saved):
  params = {}
  if prim is jax.lax.convert_element_type_p:  # [operand's dtype, the new one]
    dtypes, params = dtypes[:1], {"new_dtype": np.dtype(dtypes[1])}
  avals = [_aval((4, 4), d) for d in dtypes]
  assert save_half_and_statistics(prim, *avals, **params) is saved


def test_gathered_parameters_and_barriers_are_recomputed_by_every_jaxamp_policy():
  mesh = jax.make_mesh((1,), ("fsdp",))
  shard = Shard.of(jax.P("fsdp"), (8,), mesh, ("fsdp",), F32)

  def eqns(fn, *args):
    closed = jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(),
                                          check_vma=False))(*args)
    return closed.jaxpr.eqns[0].params["jaxpr"].eqns

  read = eqns(lambda x: gathered(x, None, shard, BF16), jnp.ones(8))[0]
  other = eqns(lambda x: jax.nn.relu(x), jnp.ones(8))[0]  # a custom_jvp, no gather
  barrier = eqns(lambda x: jax.lax.optimization_barrier(x) * 2, jnp.ones(8))[0]
  assert gathers(read.primitive, read.params) and not gathers(other.primitive, other.params)
  for policy in (save_half_and_statistics, save_all_but_gathers):
    for eqn in (read, barrier):
      avals = [v.aval for v in eqn.invars]
      assert policy(eqn.primitive, *avals, **eqn.params) is False, (policy, eqn)
  assert save_all_but_gathers(jax.lax.mul_p, _aval((4,), F32), _aval((4,), F32))


def _norm_net(w, x):
  """A bfloat16 matmul, a float32 layer norm on it, a bfloat16 matmul."""
  h = (x.astype(BF16) @ w.astype(BF16)).astype(F32)
  h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
  h = jax.nn.relu(h).astype(BF16) @ w.astype(BF16)
  return jnp.sum(h.astype(F32) ** 2)


def test_gradients_are_plain_reverse_modes_bit_for_bit_with_half_residuals():
  w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
  x = jax.random.normal(jax.random.key(1), (32, 64))
  plain = jax.jit(jax.grad(_norm_net)).lower(w, x).compile(EXACT)(w, x)
  ours = jax.jit(jax.grad(half_residuals(_norm_net))).lower(w, x).compile(EXACT)(w, x)
  np.testing.assert_array_equal(ours, plain)
  before = jaxamp.precision_report(_norm_net, w, x, backward=True)
  after = jaxamp.precision_report(half_residuals(_norm_net), w, x, backward=True)
  # Plain: the bf16 copy of w, the float32 normalised values, the relu's mask and more;
  # ours: the two matmuls' bf16 outputs and the norm's per-row statistics (the mean, and
  # jnp.var's own mean and sum of squares).
  assert sorted(after.residuals) == [((32,), "float32")] * 3 + [((32, 64), "bfloat16")] * 2
  assert after.residual_bytes < 0.5 * before.residual_bytes


def test_arguments_and_results_of_any_kind_pass_through():
  calls = []

  def fn(x, flag, name=None):
    calls.append(name)
    return {"y": jnp.sin(x.astype(F32)) if flag else x, "same": x, "name": name, "n": 3}

  x = jnp.ones(3, BF16)
  out = half_residuals(fn)(x, True, name="a")
  assert out["name"] == "a" and out["n"] == 3 and out["same"] is x
  assert out["y"].dtype == F32 and calls == ["a"]  # traced once
  # A result that is an argument comes back as that argument under a trace too (the train
  # step tells changed model state by identity).
  seen = []
  jax.make_jaxpr(lambda x: seen.append(half_residuals(fn)(x, True)["same"] is x))(x)
  assert seen == [True]


def _remats(fn, *args):
  return str(jax.make_jaxpr(jax.grad(fn))(*args)).count("remat")


def test_nested_calls_checkpoint_once_and_a_rematerializing_function_keeps_its_own():
  w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
  assert _remats(half_residuals(half_residuals(_norm_net)), w, x) == 1
  # The function's own checkpoint (nothing saveable) stays in charge: an outer policy
  # would override it.
  own = lambda w, x: jax.checkpoint(_norm_net)(w, x)
  report = lambda f: jaxamp.precision_report(f, w, x, backward=True).residual_bytes
  assert report(half_residuals(own)) == report(own)
  assert _remats(half_residuals(own), w, x) == 1


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    return nn.Dense(4)(jax.nn.relu(x).mean((1, 2)))


class _NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.norm(self.conv(x))).mean((1, 2))
    self.sow(nnx.Intermediate, "features", h)
    return self.head(h)


@pytest.mark.slow
@pytest.mark.parametrize("api, policy", [("linen", "mixed_bfloat16"),
                                         ("nnx", "mixed_float16")])
def test_the_train_step_trains_as_plain_reverse_mode_bit_for_bit(api, policy):
  # Differential: the default step (half_residuals) against half_residuals=False, three
  # steps of Adam on a conv + BatchNorm model, params and statistics bit for bit.
  rng = np.random.default_rng(0)
  batches = [{"x": rng.standard_normal((4, 8, 8, 3)).astype(np.float32),
              "y": rng.integers(0, 4, 4).astype(np.int32)} for _ in range(3)]

  def loss_fn(model, b):
    logits = model(b["x"])
    if api == "nnx":
      nnx.pop(model, nnx.Intermediate)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  def run(half):
    train = jaxamp.make_train_step(loss_fn, optax.adam(1e-2), policy=policy,
                                   memory=jaxamp.MemoryConfig(half_residuals=half),
                                   compiler_options=EXACT)
    if api == "nnx":
      state = train.init(_NNXBlock(nnx.Rngs(0)))
    else:
      x = jnp.zeros((1, 8, 8, 3))
      state = train.init(_Block(), _Block().init(jax.random.key(0), x), x)
    for b in batches:
      state, _ = train.step(state, b)
    return state, train

  (ours, train), (plain, _) = run(True), run(False)
  assert train.plan.half_residuals
  assert "remat" in str(jax.make_jaxpr(train.step_fn)(ours, batches[0]))
  for a, b in zip(jax.tree.leaves((ours.params, ours.model_state)),
                  jax.tree.leaves((plain.params, plain.model_state))):
    np.testing.assert_array_equal(a, b)


def test_a_float32_step_does_not_recompute():
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.sgd(0.1))
  state = train.init(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
  assert not train.plan.half_residuals
  assert "remat" not in str(jax.make_jaxpr(train.step_fn)(state, jnp.ones((2, 4))))


def test_nnx_with_policy_keeps_state_updates_and_sown_values_under_grad():
  model = _NNXBlock(nnx.Rngs(0))
  amp = jaxamp.nnx.with_policy(model, "mixed_bfloat16")
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 8, 3)), F32)

  def loss(m):
    return jnp.mean(m(x).astype(F32) ** 2)

  grads = nnx.jit(nnx.grad(loss))(amp)
  assert not np.allclose(model.norm.mean[...], 0.0)  # BatchNorm's statistics moved
  features = nnx.pop(model, nnx.Intermediate)
  assert jax.tree.leaves(features)[0].shape == (4, 8)
  assert jax.tree.leaves(grads)[0].dtype == F32


@pytest.mark.parametrize("half", [True, False])
def test_a_linen_module_inside_an_nnx_model_follows_the_nnx_wrappers_choice(half):
  # Flax's bridge runs the Linen module through jaxamp.linen.with_policy; half_residuals
  # is the NNX wrapper's to apply (the train step's, inside a step), once, for the call.
  x = jnp.ones((4, 8))
  model = nnx.bridge.lazy_init(nnx.bridge.ToNNX(_LinenNorm(), rngs=nnx.Rngs(0)), x)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):  # Variables rebuilt at this trace level: the bridge counts its RNG calls
    m = nnx.merge(graphdef, p, jax.tree.map(lambda v: v, rest))
    amp = jaxamp.nnx.with_policy(m, "mixed_bfloat16", half_residuals=half)
    return jnp.sum(amp(x).astype(F32) ** 2)

  assert _remats(loss, params) == int(half)


class _LinenNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(nn.LayerNorm()(nn.Dense(8)(x)))


def test_a_typed_key_argument_passes_through():
  """A typed PRNG key among the arguments: the policy asked NumPy whether ``key<fry>``
  was floating, and raised TypeError."""
  def noisy(w, key):
    return jnp.sum((w.astype(BF16) * jax.random.normal(key[0], (4,), BF16)).astype(F32) ** 2)

  w, keys = jnp.ones(4), jax.random.split(jax.random.key(0), 2)
  np.testing.assert_array_equal(jax.grad(half_residuals(noisy))(w, keys),
                                jax.grad(noisy)(w, keys))
