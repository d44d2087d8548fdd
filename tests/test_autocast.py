"""Tests for jaxamp.autocast: per-op precision on lowered StableHLO, AD, control flow."""

import collections
import pathlib
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax import lax

import jaxamp
import nnx_models
from jaxamp.autocast import _HIGHER_ORDER
from jaxamp.op_lists import HIGHER_ORDER, ReductionSize

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
HALF = ("bf16", "f16")
# Relative L2 error of autocast results against float32 (tiny, well-scaled models):
# bfloat16 keeps 8 significant bits, float16 11.
TOL = {"mixed_bfloat16": 3e-2, "mixed_float16": 5e-3}


def _rel_err(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  num = sum(float(jnp.sum((x.astype(F32) - y.astype(F32)) ** 2)) for x, y in zip(a, b))
  den = sum(float(jnp.sum(y.astype(F32) ** 2)) for y in b)
  return (num / den) ** 0.5


def _grad(fn):
  return jax.jit(jax.grad(fn))


def _value_and_grad(fn):
  return jax.jit(jax.value_and_grad(fn))


def _lowered(fn, *args):
  return jax.jit(fn).lower(*args).as_text()


def _element_type(line):
  return re.findall(r"tensor<([^>]*)>", line)[-1].split("x")[-1]


def _result_types(text, op):
  """Element types of every ``stablehlo.<op>`` result (the last tensor on its line)."""
  return [_element_type(l) for l in text.splitlines() if re.search(rf"stablehlo\.{op}\b", l)]


def _sum_types(text):
  return [_element_type(l) for l in text.splitlines() if "applies stablehlo.add" in l]


def _half_sum_shapes(text):
  """Result shapes of the sums that do not run in float32."""
  shapes = []
  for line in text.splitlines():
    if "applies stablehlo.add" in line and _element_type(line) != "f32":
      result = re.findall(r"tensor<([^>]*)>", line)[-1].split("x")[:-1]
      shapes.append(tuple(int(d) for d in result))
  return shapes


def _dot_operand_types(text):
  types = []
  for line in text.splitlines():
    if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
      lhs, rhs = re.findall(r"tensor<([^>]*)>", line)[:2]
      types.append((lhs.split("x")[-1], rhs.split("x")[-1]))
  return types


def _half_share(fn, *args, backward):
  return jaxamp.precision_report(fn, *args, backward=backward).half_share


# --- models written with raw jax.numpy ---------------------------------------------------

def _init_mlp(key, sizes=(16, 32, 32, 8)):
  keys = jax.random.split(key, len(sizes))
  return [(jax.random.normal(k, (m, n)) / m ** 0.5, jnp.full((n,), 0.1))
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def mlp(params, x):
  for w, b in params[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = params[-1]
  return x @ w + b


def mlp_loss(params, x, y):
  logits = mlp(params, x)
  return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


def _mlp_data(key=0):
  kp, kx, ky = jax.random.split(jax.random.key(key), 3)
  x = jax.random.normal(kx, (4, 16))
  y = jax.nn.one_hot(jax.random.randint(ky, (4,), 0, 8), 8)
  return _init_mlp(kp), x, y


def layer_norm(x, g, b, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + eps) * g + b


def attention(p, x, heads=2):
  t, d = x.shape
  q, k, v = (jnp.reshape(x @ p[n], (t, heads, d // heads)) for n in ("wq", "wk", "wv"))
  scores = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(d // heads)
  mask = jnp.tril(jnp.ones((t, t), bool))
  probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
  return jnp.einsum("hts,shd->thd", probs, v).reshape(t, d) @ p["wo"]


def block(p, x):
  x = x + attention(p, layer_norm(x, p["ln1_g"], p["ln1_b"]))
  h = jax.nn.gelu(layer_norm(x, p["ln2_g"], p["ln2_b"]) @ p["w1"] + p["b1"])
  return x + h @ p["w2"] + p["b2"]


def _init_block(key, d=16):
  ks = jax.random.split(key, 6)
  normal = lambda k, shape: jax.random.normal(k, shape) / shape[0] ** 0.5
  return {"wq": normal(ks[0], (d, d)), "wk": normal(ks[1], (d, d)),
          "wv": normal(ks[2], (d, d)), "wo": normal(ks[3], (d, d)),
          "w1": normal(ks[4], (d, 4 * d)), "b1": jnp.zeros(4 * d),
          "w2": normal(ks[5], (4 * d, d)), "b2": jnp.zeros(d),
          "ln1_g": jnp.ones(d), "ln1_b": jnp.zeros(d), "ln2_g": jnp.ones(d), "ln2_b": jnp.zeros(d)}


def block_loss(p, x):
  return jnp.mean(block(p, x) ** 2)


# --- pure jax.numpy MLP and transformer block ------------------------------------------------

@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mlp_matmuls_half_forward_and_backward(policy):
  params, x, y = _mlp_data()
  loss = jaxamp.autocast(mlp_loss, policy)
  assert _half_share(loss, params, x, y, backward=False) == 1.0
  assert _half_share(loss, params, x, y, backward=True) == 1.0
  text = _lowered(jax.value_and_grad(loss), params, x, y)
  half = "bf16" if policy == "mixed_bfloat16" else "f16"
  assert set(_dot_operand_types(text)) == {(half, half)}
  # log_softmax: exp, log and the sums in float32, forward and backward...
  assert _result_types(text, "exponential") and set(_result_types(text, "exponential")) == {"f32"}
  assert _result_types(text, "log") and set(_result_types(text, "log")) == {"f32"}
  assert _sum_types(text) and set(_sum_types(_lowered(loss, params, x, y))) == {"f32"}
  # ...but for the biases' gradients: a bias is added in half precision (follow_compute),
  # so its gradient is summed over the batch in it, as with Flax's dtype=.
  assert sorted(_half_sum_shapes(text)) == sorted(b.shape for _, b in params)


def mlp_loss_cast_by_hand(params, x, y, dtype):
  """``mlp_loss`` with each matmul and bias add in ``dtype``, log_softmax's exp, log and
  sums in float32 (the op lists, written out)."""
  for w, b in params[:-1]:
    x = (x.astype(dtype) @ w.astype(dtype) + b.astype(dtype)).astype(F32)  # relu: custom_jvp
    x = jax.nn.relu(x)
  w, b = params[-1]
  logits = x.astype(dtype) @ w.astype(dtype) + b.astype(dtype)
  shifted = logits - lax.stop_gradient(logits.max(-1, keepdims=True))
  lse = jnp.log(jnp.sum(jnp.exp(shifted.astype(F32)), -1, keepdims=True))
  return -jnp.mean(jnp.sum((shifted.astype(F32) - lse) * y, axis=-1))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mlp_matches_float32(policy):
  params, x, y = _mlp_data()
  loss = jaxamp.autocast(mlp_loss, policy)
  value, grads = _value_and_grad(loss)(params, x, y)
  ref_value, ref_grads = _value_and_grad(mlp_loss)(params, x, y)
  assert value.dtype == F32 and all(g.dtype == F32 for g in jax.tree.leaves(grads))
  assert _rel_err(value, ref_value) < TOL[policy]
  # Gradients equal the hand-cast model's. Against float32 they differ by more than the
  # value does: a ReLU whose pre-activation changes sign under rounding moves a whole
  # row (0.052 for bfloat16 on jax 0.11, where XLA:CPU rounds each matmul result to
  # bfloat16; 0.004 on jax 0.10, which kept those results in float32).
  half = jnp.dtype(jaxamp.get_policy(policy).compute_dtype)
  hand = jax.jit(jax.grad(mlp_loss_cast_by_hand), static_argnums=3)(params, x, y, half)
  assert _rel_err(grads, hand) < 1e-6
  assert _rel_err(grads, ref_grads) < 0.1
  assert _rel_err(jaxamp.autocast(mlp, policy)(params, x), mlp(params, x)) < TOL[policy]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_transformer_block(policy):
  p = _init_block(jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (8, 16))
  loss = jaxamp.autocast(block_loss, policy)
  assert _half_share(loss, p, x, backward=True) == 1.0
  text = _lowered(jax.value_and_grad(loss), p, x)
  assert len(_dot_operand_types(text)) >= 18  # 8 forward matmuls, 2 per matmul backward
  # softmax's exp, the layer norms' sums and rsqrt, and every sum but the bias
  # gradients' run in float32.
  assert _result_types(text, "exponential") and set(_result_types(text, "exponential")) == {"f32"}
  assert _result_types(text, "rsqrt") and set(_result_types(text, "rsqrt")) == {"f32"}
  assert sorted(_half_sum_shapes(text)) == [(16,), (64,)]  # b2, b1
  value, grads = _value_and_grad(loss)(p, x)
  ref_value, ref_grads = _value_and_grad(block_loss)(p, x)
  assert _rel_err(value, ref_value) < TOL[policy]
  assert _rel_err(grads, ref_grads) < TOL[policy]


@pytest.mark.slow
def test_mixed_float16_runs_on_cpu():
  params, x, y = _mlp_data()
  loss = jaxamp.autocast(mlp_loss, "mixed_float16")
  value, grads = loss(params, x, y), jax.grad(loss)(params, x, y)  # eagerly
  assert np.isfinite(value) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert _rel_err(value, mlp_loss(params, x, y)) < TOL["mixed_float16"]
  # Convolutions too.
  conv = lambda w, x: jnp.sum(lax.conv_general_dilated(x, w, (1, 1), "SAME") ** 2)
  w, img = jnp.ones((3, 2, 3, 3)) / 9, jax.random.normal(jax.random.key(0), (1, 2, 6, 6))
  g = _grad(jaxamp.autocast(conv, "mixed_float16"))(w, img)
  assert g.dtype == F32 and np.isfinite(g).all()
  assert _rel_err(g, _grad(conv)(w, img)) < TOL["mixed_float16"]
  assert set(_dot_operand_types(_lowered(jax.grad(jaxamp.autocast(conv, F16)), w, img))) == {
      ("f16", "f16")}


# --- Flax models ---------------------------------------------------------------------------

class LinenNet(nn.Module):
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, dtype=self.dtype)(x)
    x = nn.gelu(nn.LayerNorm(dtype=self.dtype)(x))
    x = nn.Conv(8, (3,), dtype=self.dtype)(x[..., None, :])[..., 0, :]
    return nn.Dense(8, dtype=self.dtype)(x)


class NNXNet(nnx.Module):

  def __init__(self, rngs, dtype=None):
    self.l1 = nnx.Linear(16, 32, dtype=dtype, rngs=rngs)
    self.ln = nnx.LayerNorm(32, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 32, dtype=dtype, decode=False, rngs=rngs)
    self.l2 = nnx.Linear(32, 8, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.ln(self.l1(x)))
    return self.l2(h + self.attn(h))


@pytest.mark.slow
def test_linen_same_profile_as_module_policy():
  x = jax.random.normal(jax.random.key(0), (4, 16))
  variables = LinenNet().init(jax.random.key(1), x)

  def loss(apply):
    return lambda v, x: jnp.mean(apply(v, x).astype(F32) ** 2)

  auto = loss(jaxamp.autocast(LinenNet().apply, "mixed_bfloat16"))
  module = loss(LinenNet(dtype=BF16).apply)  # Flax's own module-level compute dtype
  for backward in (False, True):
    share = _half_share(auto, variables, x, backward=backward)
    assert share >= max(0.99, _half_share(module, variables, x, backward=backward))
  assert _rel_err(_grad(auto)(variables, x), _grad(loss(LinenNet().apply))(variables, x)) < 3e-2


@pytest.mark.slow
def test_nnx_same_profile_as_module_policy():
  x = jax.random.normal(jax.random.key(0), (2, 4, 16))
  graphdef, state = nnx.split(NNXNet(nnx.Rngs(0)))
  graphdef_bf16, _ = nnx.split(NNXNet(nnx.Rngs(0), dtype=BF16))

  def loss(graphdef):
    return lambda state, x: jnp.mean(nnx.merge(graphdef, state)(x).astype(F32) ** 2)

  auto = jaxamp.autocast(loss(graphdef), "mixed_bfloat16")
  for backward in (False, True):
    # Flax's dtype= leaves a few backward matmuls of attention in float32; autocast none.
    share = _half_share(auto, state, x, backward=backward)
    assert share >= max(0.99, _half_share(loss(graphdef_bf16), state, x, backward=backward))
  grads = _grad(auto)(state, x)
  ref = _grad(loss(graphdef))(state, x)
  assert jax.tree.structure(grads) == jax.tree.structure(ref)
  assert _rel_err(grads, ref) < 3e-2


@pytest.mark.slow
def test_nnx_autocast_profile_matches_jaxamp_module_policies():
  x = jax.random.normal(jax.random.key(0), (2, 4, 16))
  graphdef, state = nnx.split(NNXNet(nnx.Rngs(0)))

  def plain(state, x):
    return jnp.mean(nnx.merge(graphdef, state)(x).astype(F32) ** 2)

  def module_policy(state, x):
    model = jaxamp.nnx.with_policy(nnx.merge(graphdef, state), "mixed_bfloat16")
    return jnp.mean(model(x).astype(F32) ** 2)

  auto = jaxamp.autocast(plain, "mixed_bfloat16")
  for backward in (False, True):
    by_op = jaxamp.precision_report(auto, state, x, backward=backward)
    by_module = jaxamp.precision_report(module_policy, state, x, backward=backward)
    assert by_op.total_flops == by_module.total_flops  # the same matmuls...
    assert by_op.half_share >= 0.99 and by_module.half_share >= 0.99  # ...in half precision
    assert abs(by_op.half_share - by_module.half_share) <= 0.01
  np.testing.assert_allclose(float(auto(state, x)), float(module_policy(state, x)), rtol=3e-2)


def test_nnx_state_updates_returned():
  model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.BatchNorm(8, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)

  def loss_fn(state, x):
    model = nnx.merge(graphdef, state)
    return jnp.mean(model(x) ** 2), nnx.state(model)  # BatchNorm statistics updated

  with jaxamp.policy_scope("mixed_bfloat16"):
    auto = jaxamp.autocast(loss_fn)
  x = jax.random.normal(jax.random.key(0), (16, 4)) + 3.0
  grads, new_state = jax.jit(jax.grad(auto, has_aux=True))(state, x)
  ref_grads, ref_state = jax.jit(jax.grad(loss_fn, has_aux=True))(state, x)
  assert not np.allclose(new_state["layers"][1]["mean"].get_value(), 0.0)
  assert _rel_err(new_state, ref_state) < 3e-2 and _rel_err(grads, ref_grads) < 5e-2


# --- control flow --------------------------------------------------------------------------

def scan_layers(ws, x):
  x, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
  return x


def cond_layer(w, x):
  return lax.cond(x.sum() > 0, lambda h: jnp.exp(h @ w), lambda h: h @ w.T, x)


def fori_layers(w, x):
  return lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)


@pytest.mark.parametrize("fn", [scan_layers, cond_layer, fori_layers])
def test_control_flow_bodies_autocast(fn):
  ws = jax.random.normal(jax.random.key(0), (3, 8, 8)) / 3
  w = ws if fn is scan_layers else ws[0]
  x = jax.random.normal(jax.random.key(1), (2, 8))
  loss = lambda w, x: jnp.sum(fn(w, x) ** 2)
  auto = jaxamp.autocast(loss, "mixed_bfloat16")
  assert _half_share(auto, w, x, backward=False) == 1.0
  assert _half_share(auto, w, x, backward=True) == 1.0
  assert _rel_err(_grad(auto)(w, x), _grad(loss)(w, x)) < 3e-2
  if fn is cond_layer:  # the float32 list holds inside bodies too
    text = _lowered(auto, w, x)
    assert set(_result_types(text, "exponential")) == {"f32"}


def test_while_loop_forward():
  def f(w, x):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                          (0, x))[1]

  w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
  auto = jaxamp.autocast(f, "mixed_bfloat16")
  assert set(_dot_operand_types(_lowered(auto, w, x))) == {("bf16", "bf16")}
  out = jax.jit(auto)(w, x)
  assert out.dtype == F32 and _rel_err(out, f(w, x)) < 3e-2


def test_carry_dtypes_kept():
  # The carry starts as a weakly typed Python float and stays float32 even though
  # the body's matmul result arrives in bfloat16.
  def f(w, x):
    return lax.fori_loop(0, 2, lambda i, c: c + jnp.sum(x @ w), 0.0)

  w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
  assert jaxamp.autocast(f, BF16)(w, x) == f(w, x) == 64.0


# --- composition with transformations ----------------------------------------------------------

@pytest.mark.slow
def test_composes_with_jit_grad_vmap():
  params, x, y = _mlp_data()
  auto = jaxamp.autocast(mlp, "mixed_bfloat16")
  ref = jax.jit(auto)(params, x)
  # Eager and compiled results differ by bfloat16 roundings XLA may skip
  # (xla_allow_excess_precision), so they are compared at bfloat16 tolerance.
  for out in (auto(params, x),
              jaxamp.autocast(jax.jit(mlp), "mixed_bfloat16")(params, x),
              jax.vmap(auto, in_axes=(None, 0))(params, x[:, None])[:, 0],
              jaxamp.autocast(jax.vmap(mlp, in_axes=(None, 0)), "mixed_bfloat16")(
                  params, x[:, None])[:, 0]):
    assert out.dtype == F32 and _rel_err(out, ref) < 1e-2
  assert _rel_err(ref, mlp(params, x)) < 3e-2
  # Gradient of autocast and autocast of the gradient: both run backward matmuls in half.
  loss = jaxamp.autocast(mlp_loss, "mixed_bfloat16")
  outer = _grad(loss)(params, x, y)
  inner = jax.jit(jaxamp.autocast(jax.grad(mlp_loss), "mixed_bfloat16"))(params, x, y)
  assert _rel_err(inner, outer) < 3e-2
  text = _lowered(jaxamp.autocast(jax.grad(mlp_loss), "mixed_bfloat16"), params, x, y)
  assert set(_dot_operand_types(text)) == {("bf16", "bf16")}


def test_traced_calls_are_inlined():
  # A called ``jax.jit(f).trace(...)`` binds ``eval_jaxpr`` on jax >= 0.11 (0.10 inlines it).
  w, x = jnp.ones((4, 4)) / 4, jnp.ones((2, 4))
  traced = jax.jit(lambda w, x: jnp.exp(x @ w)).trace(w, x)
  f = lambda w, x: jnp.sum(traced(w, x))
  auto = jaxamp.autocast(f, BF16)
  text = _lowered(jax.value_and_grad(auto), w, x)
  assert set(_dot_operand_types(text)) == {("bf16", "bf16")}
  assert set(_result_types(text, "exponential")) == {"f32"}
  assert _rel_err(_grad(auto)(w, x), _grad(f)(w, x)) < 1e-2

def test_vmap_with_axis_name():
  f = lambda w, x: lax.psum(x @ w, "batch")
  w, x = jnp.ones((4, 4)), jnp.ones((3, 2, 4))
  out = jax.vmap(jaxamp.autocast(f, BF16), in_axes=(None, 0), axis_name="batch")(w, x)
  np.testing.assert_array_equal(out, jax.vmap(f, in_axes=(None, 0), axis_name="batch")(w, x))


def test_checkpoint_keeps_policy():
  policy = jax.checkpoint_policies.nothing_saveable
  f = lambda w, x: jnp.sum(jax.checkpoint(lambda w, x: jnp.sin(x @ w), policy=policy)(w, x))
  w, x = jnp.ones((4, 4)) / 4, jnp.ones((2, 4))
  auto = jaxamp.autocast(f, BF16)
  eqns = [e for e in jax.make_jaxpr(auto)(w, x).eqns if e.primitive.name == "remat2"]
  assert len(eqns) == 1 and eqns[0].params["policy"] is policy
  assert set(_dot_operand_types(_lowered(jax.grad(auto), w, x))) == {("bf16", "bf16")}
  assert _rel_err(_grad(auto)(w, x), _grad(f)(w, x)) < 3e-2


def test_shard_map_body_autocast():
  mesh = jax.make_mesh((1,), ("d",))
  P = jax.sharding.PartitionSpec
  f = jax.shard_map(lambda w, x: lax.psum(jnp.exp(x @ w), "d"), mesh=mesh,
                    in_specs=(P(), P("d")), out_specs=P())
  w = jnp.ones((4, 4)) / 4
  x = jax.device_put(jnp.ones((2, 4)), jax.sharding.NamedSharding(mesh, P("d")))
  auto = jaxamp.autocast(f, BF16)
  text = _lowered(auto, w, x)
  assert set(_dot_operand_types(text)) == {("bf16", "bf16")}
  assert set(_result_types(text, "exponential")) == {"f32"}
  np.testing.assert_allclose(auto(w, x), f(w, x), rtol=1e-2)


# --- custom derivatives --------------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    jax.nn.gelu, lambda x: jax.nn.gelu(x, approximate=False), jax.nn.relu, jax.nn.silu,
    jax.nn.softplus, jax.nn.softmax, jax.nn.log_softmax,
    lambda x: jax.scipy.special.logsumexp(x, axis=0), jnp.linalg.norm,
], ids=["gelu", "gelu_exact", "relu", "silu", "softplus", "softmax", "log_softmax",
        "logsumexp", "norm"])
def test_grad_through_jax_nn(fn):
  w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
  x = jax.random.normal(jax.random.key(1), (4, 8))
  # A weighting passed in, not a constant: XLA:CPU in jaxlib 0.10.2 aborts in LLVM
  # ("Cannot select v16bf16 VPERM2X128") compiling this gradient with a constant
  # weighting on avx512_bf16 CPUs, with or without jaxamp.
  c = jax.random.normal(jax.random.key(2), (8,))
  loss = lambda w, x, c: jnp.sum(fn(x @ w) * c)
  auto = jaxamp.autocast(loss, "mixed_bfloat16")
  assert _rel_err(_grad(auto)(w, x, c), _grad(loss)(w, x, c)) < 3e-2
  assert set(_dot_operand_types(_lowered(jax.grad(auto), w, x, c))) == {("bf16", "bf16")}


def test_custom_jvp_rule_kept_and_primal_autocast():
  @jax.custom_jvp
  def f(x, w):
    return x @ w

  @f.defjvp
  def f_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return f(x, w), 3.0 * (dx @ w + x @ dw)  # three times the true derivative

  w, x = jnp.eye(4), jnp.ones((2, 4))
  loss = lambda w: jnp.sum(f(x, w))
  auto = jaxamp.autocast(loss, BF16)
  np.testing.assert_allclose(jax.grad(auto)(w), 3.0 * jnp.full((4, 4), 2.0))
  np.testing.assert_allclose(jax.grad(auto)(w), jax.grad(loss)(w))
  # The primal and the JVP rule's matmuls run in bfloat16.
  assert set(_dot_operand_types(_lowered(auto, w))) == {("bf16", "bf16")}
  assert set(_dot_operand_types(_lowered(jax.grad(auto), w))) == {("bf16", "bf16")}


def test_custom_vjp_rule_kept_and_forward_autocast():
  @jax.custom_vjp
  def f(x, w):
    return jnp.tanh(x @ w)

  def fwd(x, w):
    y = jnp.tanh(x @ w)
    return y, (x, w, y)

  def bwd(res, g):
    x, w, y = res
    g = 5.0 * g * (1 - y ** 2)  # five times the true cotangent
    return g @ w.T, x.T @ g

  f.defvjp(fwd, bwd)
  w, x = jnp.eye(4) / 2, jnp.ones((2, 4))
  loss = lambda w: jnp.sum(f(x, w))
  auto = jaxamp.autocast(loss, BF16)
  assert _rel_err(jax.grad(auto)(w), jax.grad(loss)(w)) < 3e-2
  np.testing.assert_allclose(jax.grad(loss)(w)[0, 0], 5.0 * 2 * (1 - np.tanh(0.5) ** 2),
                             rtol=1e-6)
  assert auto(w).dtype == F32
  # The primal and forward rule run in bfloat16; the backward rule runs as written.
  assert set(_dot_operand_types(_lowered(auto, w))) == {("bf16", "bf16")}
  assert ("bf16", "bf16") in _dot_operand_types(_lowered(jax.grad(auto), w))


# --- what is cast and what is not ------------------------------------------------------------

@pytest.mark.slow
def test_integers_bools_and_keys_are_never_cast():
  table = jax.random.normal(jax.random.key(0), (10, 4))

  def f(table, ids, mask, key, w):
    h = table[ids] @ w  # gather with int32 indices
    h = jnp.where(mask[:, None], h, 0.0)
    noise = jax.random.normal(key, h.shape)
    return h + noise, ids * 2, mask & True, jax.random.split(key)

  ids, mask, key = jnp.array([1, 3]), jnp.array([True, False]), jax.random.key(1)
  w = jnp.ones((4, 4))
  out = jaxamp.autocast(f, BF16)(table, ids, mask, key, w)
  ref = f(table, ids, mask, key, w)
  assert jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(lambda a: a.dtype, ref)
  np.testing.assert_array_equal(out[1], ref[1])
  np.testing.assert_array_equal(out[2], ref[2])
  np.testing.assert_array_equal(jax.random.key_data(out[3]), jax.random.key_data(ref[3]))
  np.testing.assert_allclose(out[0], ref[0], rtol=2e-2, atol=2e-2)
  grad = _grad(lambda t: jaxamp.autocast(f, BF16)(t, ids, mask, key, w)[0].sum())(table)
  assert grad.dtype == F32 and _rel_err(grad, _grad(lambda t: f(t, ids, mask, key, w)[0].sum())(table)) < 3e-2


def test_follow_compute_widest_and_literals():
  def f(x, w, b, s):
    h = x @ w  # bfloat16
    return (h * 2.0,                        # a literal follows the other operand
            h + b,                          # a float32 parameter follows the matmul
            (h + b) + x,                    # and so does a float32 residual stream
            h * s,                          # or scale
            h - jax.nn.logsumexp(h, -1, keepdims=True),  # pinned: float32 on purpose
            h / s,                          # div is widest
            lax.fori_loop(0, 2, lambda i, acc: acc + h, x))  # carries are pinned

  x, w, b, s = jnp.ones((2, 4)), jnp.ones((4, 4)), jnp.ones(4), jnp.full(4, 2.0)
  jaxpr = jax.make_jaxpr(jaxamp.autocast(f, BF16))(x, w, b, s).jaxpr
  eqns = jaxpr.eqns
  assert all(v.aval.dtype == F32 for v in jaxpr.outvars)  # the signature: cast back at the end
  made_by = {v: eqn for eqn in eqns for v in eqn.outvars}
  computed = []
  for v in jaxpr.outvars:  # each output's dtype before the final cast back to float32
    eqn = made_by[v]
    computed.append(eqn.invars[0].aval.dtype if eqn.primitive.name == "convert_element_type"
                    else v.aval.dtype)
  assert computed == [BF16, BF16, BF16, BF16, F32, F32, F32]
  (loop,) = [e for e in eqns if e.primitive.name in ("while", "scan")]
  body = loop.params["body_jaxpr" if loop.primitive.name == "while" else "jaxpr"].jaxpr
  (add,) = [e for e in body.eqns if e.primitive.name == "add" and e.outvars[0].aval.shape]
  assert add.outvars[0].aval.dtype == F32  # the accumulator is not added to in bfloat16
  # torch's rule (mixed inputs promote) is one edit away.
  widest = jaxamp.AutocastLists().add("add", "sub", "mul", to="widest")
  jaxpr = jax.make_jaxpr(jaxamp.autocast(lambda x, w, b: x @ w + b, BF16, lists=widest))(x, w, b)
  assert jaxpr.eqns[-1].primitive.name == "add" and jaxpr.eqns[-1].outvars[0].aval.dtype == F32


def test_pinned_arguments_keep_float32_data_float32():
  """A float32 target is data, not a bias: pinned, ``pred - y`` runs in float32 (the
  bias still follows the matmul); unpinned, it follows the compute dtype."""
  def loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)

  params = {"w": jnp.ones((4, 1)), "b": jnp.ones(1)}
  batch = {"x": jnp.ones((8, 4)), "y": jnp.full((8, 1), 1000.0)}

  def dtypes(**kw):
    eqns = jax.make_jaxpr(jaxamp.autocast(loss, BF16, **kw))(params, batch).jaxpr.eqns
    return [(e.primitive.name, e.outvars[0].aval.dtype) for e in eqns
            if e.primitive.name in ("add", "sub")]

  assert dtypes() == [("add", BF16), ("sub", BF16)]
  assert dtypes(pinned_argnums=(1,)) == [("add", BF16), ("sub", F32)]
  # A target bfloat16 cannot hold (spacing 4 at 1000) keeps its float32 value when
  # pinned: pred 1000 against y 1001 is the float32 loss, 1. Unpinned, y rounds to 1000
  # and the loss is 0.
  exact = {"w": jnp.zeros((4, 1)), "b": jnp.full(1, 1000.0)}
  near = dict(batch, y=jnp.full((8, 1), 1001.0))
  assert float(jaxamp.autocast(loss, BF16, pinned_argnums=(1,))(exact, near)) == 1.0
  assert float(jaxamp.autocast(loss, BF16)(exact, near)) == 0.0


def test_reduction_size_rule():
  f = lambda x: (x @ x.T).sum(-1)
  x = jnp.ones((2, 4))
  small = jaxamp.AutocastLists().add("reduce_sum", to=ReductionSize(more_than=2))
  large = jaxamp.AutocastLists().add("reduce_sum", to=ReductionSize(more_than=1))
  assert _sum_types(_lowered(jaxamp.autocast(f, BF16, lists=small), x)) == ["bf16"]
  assert _sum_types(_lowered(jaxamp.autocast(f, BF16, lists=large), x)) == ["f32"]
  assert _sum_types(_lowered(jaxamp.autocast(f, BF16), x)) == ["f32"]


def test_edited_lists_change_precision():
  f = lambda x, w: jnp.tanh(x @ w)
  x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
  no_low = jaxamp.AutocastLists().remove("dot_general")
  assert set(_dot_operand_types(_lowered(jaxamp.autocast(f, BF16, lists=no_low), x, w))) == {
      ("f32", "f32")}
  tanh32 = jaxamp.AutocastLists().add("tanh", to="float32")
  assert _result_types(_lowered(jaxamp.autocast(f, BF16), x, w), "tanh") == ["bf16"]
  assert _result_types(_lowered(jaxamp.autocast(f, BF16, lists=tanh32), x, w), "tanh") == ["f32"]
  with pytest.raises(TypeError, match="AutocastLists"):
    jaxamp.autocast(f, BF16, lists={"low_precision": ["dot_general"]})


def test_policy_none_takes_policy_in_force_when_made():
  matmul = lambda x, w: x @ w
  x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
  assert set(_dot_operand_types(_lowered(jaxamp.autocast(matmul), x, w))) == {("f32", "f32")}
  with jaxamp.policy_scope("mixed_bfloat16"):
    f = jaxamp.autocast(matmul)
  assert set(_dot_operand_types(_lowered(f, x, w))) == {("bf16", "bf16")}


def test_signature_preserved():
  def f(params, x, *, scale, name):
    assert name == "layer" and isinstance(scale, float)  # static values arrive as given
    return {"y": (x @ params["w"]) * scale, "n": jnp.int32(3)}, [x.astype(BF16)]

  params, x = {"w": jnp.ones((4, 4))}, jnp.ones((2, 4))
  out = jaxamp.autocast(f, F16)(params, x, scale=0.5, name="layer")
  ref = f(params, x, scale=0.5, name="layer")
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), out) == jax.tree.map(
      lambda a: (a.shape, a.dtype), ref)
  assert jaxamp.autocast(f).__name__ == "f"


# --- against the hand-set Flax model (issue 12) ----------------------------------------------

def _nnx_lm_losses():
  tokens, targets = nnx_models.lm_batch(batch=2, length=16)

  def loss_of(dtype):
    graphdef, params, rest = nnx.split(
        nnx_models.TransformerLM(max_len=16, dtype=dtype, rngs=nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, rest, tokens, targets):
      logits = nnx.merge(graphdef, params, rest)(tokens).astype(F32)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    return loss, (params, rest, tokens, targets)

  return loss_of


def _benchmark_gpt_losses():
  """The benchmarks' GPT (issue 12 measured O1 on it), small."""
  root = str(pathlib.Path(__file__).resolve().parent.parent)
  sys.path.insert(0, root)
  try:
    from benchmarks import models  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(root)
  cfg = models.LMConfig(vocab=64, dim=32, heads=2, layers=2, seq_len=16, batch=2)
  batch = models.lm_batch(cfg)

  def loss_of(dtype):
    graphdef, params, rest = nnx.split(models.GPT(cfg, dtype=dtype, rngs=nnx.Rngs(0)),
                                       nnx.Param, ...)
    loss = lambda params, rest, batch: models.lm_loss(nnx.merge(graphdef, params, rest), batch)
    return loss, (params, rest, batch)

  return loss_of


# Not Flax Linen's MultiHeadDotProductAttention: with dtype=bfloat16 it runs softmax in
# bfloat16, which autocast keeps in float32 (as torch does).
@pytest.mark.parametrize("losses", [
    pytest.param(_nnx_lm_losses, id="nnx_models"),
    pytest.param(_benchmark_gpt_losses, id="benchmarks_gpt", marks=pytest.mark.slow)])
def test_transformer_casts_and_residuals_at_most_hand_set(losses):
  """O1 (autocast of the float32 model) casts no more bytes and saves no more residuals
  than the same transformer with ``dtype=bfloat16`` set by hand on every Flax layer:
  bias and residual adds stay in bfloat16 (follow_compute), and so does GELU."""
  loss_of = losses()
  plain, args = loss_of(None)
  hand, _ = loss_of(BF16)
  auto = jaxamp.precision_report(jaxamp.autocast(plain, "mixed_bfloat16"), *args,
                                 backward=True)
  by_hand = jaxamp.precision_report(hand, *args, backward=True)
  assert auto.half_share == 1.0 and auto.total_flops == by_hand.total_flops
  assert 0 < auto.cast_bytes <= by_hand.cast_bytes
  assert 0 < auto.residual_bytes <= by_hand.residual_bytes


@pytest.mark.slow
def test_float16_gelu_keeps_its_powers_in_float32_so_gradients_stay_finite():
  """Why float16 O1 keeps ``jax.nn.gelu``'s ``x**3`` in float32 (and so casts more bytes
  than a hand-set float16 model): in float16 the backward pass of ``x**3`` overflows
  (3x² > 65504) while tanh' is exactly 0, and 0·inf gives a NaN gradient for any
  pre-activation |x| >= ~150. A hand-set float16 model has that NaN, which dynamic loss
  scaling cannot cure (it skips the step at every scale); autocast does not."""
  x = jnp.array([1.0, 150.0, -200.0, 300.0], jnp.float32)
  grad = lambda f, x: jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))(x)
  by_hand = grad(jax.nn.gelu, x.astype(jnp.float16))
  assert not bool(jnp.all(jnp.isfinite(by_hand)))  # the hazard, reproduced
  auto = grad(jaxamp.autocast(lambda x: jax.nn.gelu(x @ jnp.eye(4, dtype=x.dtype)),
                              "mixed_float16"), x[None])
  assert bool(jnp.all(jnp.isfinite(auto)))
  np.testing.assert_allclose(np.asarray(auto[0], np.float32),
                             np.asarray(grad(jax.nn.gelu, x), np.float32), atol=2e-3)


# --- overhead --------------------------------------------------------------------------------

def test_no_work_beyond_the_casts():
  """autocast lowers to the same ops as the same model cast by hand."""

  def model(params, x):
    for w, b in params[:-1]:
      x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    logits = x @ w + b
    return jnp.mean(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1))

  def bias(b):
    # jnp strips the weak type of b (jnp.full) with a no-op convert and ranks it up to
    # the activation's; autocast casts the float32 bias it finds there.
    return lax.expand_dims(b.astype(F32), (0,)).astype(BF16)

  def by_hand(params, x):  # matmuls, bias adds and tanh in bfloat16; exp and sums float32
    x = x.astype(BF16)
    for w, b in params[:-1]:
      x = jnp.tanh(x @ w.astype(BF16) + bias(b))
    w, b = params[-1]
    logits = x @ w.astype(BF16) + bias(b)
    shifted = (logits - logits.max(-1, keepdims=True)).astype(F32)
    return jnp.mean(jnp.sum(jnp.exp(shifted), -1))

  params, x, _ = _mlp_data()

  def histogram(fn):
    text = _lowered(jax.value_and_grad(fn), params, x)
    return collections.Counter(re.findall(r"= (stablehlo\.\w+)", text))

  auto = histogram(jaxamp.autocast(model, "mixed_bfloat16"))
  assert auto == histogram(by_hand)
  # 3 forward matmuls; backward: 3 weight gradients and 2 input gradients.
  assert auto["stablehlo.convert"] > 0 and auto["stablehlo.dot_general"] == 8
  np.testing.assert_allclose(jaxamp.autocast(model, "mixed_bfloat16")(params, x),
                             by_hand(params, x), rtol=1e-6)


def test_unlisted_primitive_warns_once_and_runs_as_traced(fresh_warnings):
  double = jax.extend.core.Primitive("jaxamp_test_double")
  double.def_impl(lambda x: x * 2)
  double.def_abstract_eval(lambda x: x)
  f = lambda w, x: double.bind(x @ w)
  w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
  auto = jaxamp.autocast(f, BF16)
  with pytest.warns(RuntimeWarning, match="'jaxamp_test_double' is in no op list"):
    jaxpr = jax.make_jaxpr(auto)(w, x)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is double]
  assert eqn.invars[0].aval.dtype == F32  # the bfloat16 matmul result, cast back as traced
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.make_jaxpr(auto)(w, x)  # once per primitive
    # Classified, it is silent and runs in half precision.
    lists = jaxamp.AutocastLists().add("jaxamp_test_double", to="passthrough")
    jaxpr = jax.make_jaxpr(jaxamp.autocast(f, BF16, lists=lists))(w, x)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive is double]
  assert eqn.invars[0].aval.dtype == BF16

def test_higher_order_handlers_match_the_list():
  assert set(_HIGHER_ORDER) == HIGHER_ORDER
