"""Tests for jaxamp.linen: per-module policies for unmodified Flax Linen models.

Tolerances for parity with float32: outputs agree within ``TOL[dtype]`` times the
float32 output's largest magnitude (bfloat16 keeps 8 significant bits, float16 11), and
losses within the same relative tolerance.
"""

import re

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
import linen_models as models
from jaxamp import linen as jl

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
MIXED = {"mixed_bfloat16": BF16, "mixed_float16": F16}
TOL = {BF16: 4e-2, F16: 5e-3}
KEY = jax.random.key(0)


# --- helpers ---------------------------------------------------------------------------------


def _sub_jaxprs(params):
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jax.extend.core.Jaxpr):
        yield v


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _sub_jaxprs(eqn.params):
      yield from _eqns(sub)


def op_dtypes(fn, *args, prims=("dot_general", "conv_general_dilated")):
  """The operand dtypes of every ``prims`` equation in ``fn``'s jaxpr, nested ones included."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [tuple(v.aval.dtype for v in eqn.invars[:2])
          for eqn in _eqns(jaxpr) if eqn.primitive.name in prims]


def jit(fn):
  """``jax.jit`` without LLVM's optimizations: these tiny programs compile twice as fast."""
  return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0})


def init(model, *args, **kwargs):
  """``model.init(KEY, *args, **kwargs)``, jitted: one compile beats op-by-op dispatch."""
  return jit(lambda *a: model.init(KEY, *a, **kwargs))(*args)


def dtypes(tree):
  return set(x.dtype for x in jax.tree.leaves(tree))


def assert_close(actual, expected, dtype):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  scale = max(1.0, float(np.abs(expected).max()))
  np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL[dtype] * scale)


def policies_by_path(module, variables, *args, **kwargs):
  return {path: policy.name for path, _, policy in
          jl.module_policies(module, variables, *args, **kwargs)}


# --- every built-in layer -------------------------------------------------------------------

X2 = jax.random.normal(KEY, (2, 5))
X3 = jax.random.normal(KEY, (2, 4, 8))
IMG = jax.random.normal(KEY, (2, 6, 6, 3))
IDS = jnp.array([[1, 2, 3, 9], [0, 4, 4, 7]])
MASK = nn.make_causal_mask(jnp.ones((2, 4)), dtype=jnp.bool_)

# id -> (module, args, apply kwargs, has matmuls, rngs)
LAYERS = {
    "Dense": (nn.Dense(8), (X2,), {}, True, None),
    "DenseGeneral": (nn.DenseGeneral((2, 4), axis=-1), (X3,), {}, True, None),
    "Einsum": (nn.Einsum((5, 2, 3), "bi,ijk->bjk"), (X2,), {}, True, None),
    "Conv": (nn.Conv(4, (3, 3)), (IMG,), {}, True, None),
    "ConvTranspose": (nn.ConvTranspose(4, (3, 3)), (IMG,), {}, True, None),
    "Embed": (nn.Embed(10, 6), (IDS,), {}, False, None),
    "Embed.attend": (nn.Embed(10, 5), (X2,), {"method": "attend"}, True, None),
    "MultiHeadDotProductAttention": (
        nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8), (X3,),
        {"mask": MASK}, True, None),
    "LayerNorm": (nn.LayerNorm(), (X3,), {}, False, None),
    "RMSNorm": (nn.RMSNorm(), (X3,), {}, False, None),
    "GroupNorm": (nn.GroupNorm(num_groups=2), (X3,), {}, False, None),
    "BatchNorm": (nn.BatchNorm(use_running_average=False, momentum=0.5), (X3,), {}, False,
                  None),
    "Dropout": (nn.Dropout(0.5, deterministic=False), (X3,), {}, False,
                {"dropout": jax.random.key(3)}),
    "Sequential": (nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)]), (X2,), {}, True, None),
}


@pytest.mark.parametrize("policy", list(MIXED))
@pytest.mark.parametrize("name", list(LAYERS))
def test_builtin_layer(name, policy):
  module, args, kwargs, has_matmul, rngs = LAYERS[name]
  half = MIXED[policy]
  mutable = ["batch_stats"] if name == "BatchNorm" else False
  model = jl.with_policy(module, policy)
  init_kwargs = {"method": kwargs["method"]} if "method" in kwargs else {}
  # One compile for the wrapped and the plain layer together.
  variables, plain = jit(lambda *a: tuple(m.init(KEY, *a, **init_kwargs)
                                          for m in (model, module)))(*args)
  assert dtypes(variables) <= {F32}
  jax.tree.map(np.testing.assert_array_equal, variables, plain)

  def run(m, v):
    return m.apply(v, *args, rngs=rngs, mutable=mutable, **kwargs)

  result, expected = jit(lambda v: (run(model, v), run(module, v)))(variables)
  out, ref = (result[0], expected[0]) if mutable else (result, expected)
  # Norms compute in float32 but return the enclosing compute dtype, like every layer.
  assert out.dtype == half
  assert_close(out, ref, half)
  if has_matmul:
    ops = op_dtypes(lambda v: run(model, v), variables)
    assert ops and all(op == (half, half) for op in ops), ops
  if name in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"):
    assert all(op == (F32,) for op in
               op_dtypes(lambda v: run(model, v), variables, prims=("rsqrt",)))
  if mutable:
    stats = result[1]["batch_stats"]
    assert dtypes(stats) == {F32}
    assert not np.allclose(stats["mean"], variables["batch_stats"]["mean"])  # it updated
    jax.tree.map(lambda a, b: assert_close(a, b, half), stats, expected[1]["batch_stats"])


@pytest.mark.parametrize("init_by", ["wrapper", "plain module"])
def test_attention_decoding_cache_takes_the_compute_dtype(init_by):
  module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, decode=True)
  model = jl.with_policy(module, "mixed_bfloat16")
  variables = init(model if init_by == "wrapper" else module, X3)
  cache_dtype = BF16 if init_by == "wrapper" else F32  # as init stored it
  assert dtypes(variables["params"]) == {F32}
  assert dtypes(variables["cache"]) == {cache_dtype, jnp.dtype(jnp.int32)}

  def step(m, v, token):
    out, state = m.apply(v, token, mutable=["cache"])
    return out, {**v, **state}

  both = jit(lambda v, ref_v, x: (step(model, v, x), step(module, ref_v, x)))
  ours, ref = variables, jaxamp.cast_floating(variables, F32)  # the plain module's own
  for t in range(2):
    (out, ours), (expected, ref) = both(ours, ref, X3[:, t:t + 1])
    assert out.dtype == BF16
    assert_close(out, expected, BF16)
    assert ours["cache"]["cached_key"].dtype == cache_dtype
    assert ours["cache"]["cache_index"] == t + 1


class RunningSum(nn.Module):
  """A float32 running sum and count in the ``cache`` collection, as a streaming module
  might keep them: not an attention layer's decoding cache."""

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(4)(x)
    total = self.variable("cache", "total", jnp.zeros, (4,), jnp.float32)
    count = self.variable("cache", "count", jnp.zeros, (), jnp.float32)
    if not self.is_initializing():
      total.value = total.value + y.sum(0)
      count.value = count.value + x.shape[0]
    return total.value / jnp.maximum(count.value, 1.0)


def test_a_cache_entry_of_a_module_that_is_not_attention_keeps_its_dtype():
  model = jl.with_policy(RunningSum(), "mixed_bfloat16")
  x = jnp.ones((1, 4))
  variables = model.init(jax.random.key(0), x)
  assert dtypes(variables["cache"]) == {F32}  # not stored in the compute dtype

  @jax.jit
  def step(v):
    _, state = model.apply(v, x, mutable=["cache"])
    return {**v, **state}

  for _ in range(300):  # a bfloat16 count stalls at 256
    variables = step(variables)
  assert float(variables["cache"]["count"]) == 300.0
  assert dtypes(variables["cache"]) == {F32}


def test_param_dtype_of_policy_is_what_init_stores():
  model = jl.with_policy(models.Mlp(4), "bfloat16")
  variables = init(model, X2)
  assert dtypes(variables["params"]) == {BF16}
  assert jit(model.apply)(variables, X2).dtype == BF16


# --- user modules -----------------------------------------------------------------------------


class RawParam(nn.Module):
  """Uses its parameter directly and has no dtype attribute."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 3))
    return jnp.tanh(x @ w)


class MyDense(nn.Dense):
  pass


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = MyDense(8, name="mine")(x)
    x = nn.LayerNorm(name="ln")(x)
    x = models.Mlp(8, name="mlp")(x)
    return nn.Dense(3, name="head")(x)


@pytest.mark.parametrize("policy", list(MIXED))
def test_user_module_with_raw_param_computes_in_half(policy):
  half = MIXED[policy]
  model = jl.with_policy(RawParam(), policy)
  variables = init(model, X2)
  loss = lambda v: model.apply(v, X2).astype(jnp.float32).sum()
  assert op_dtypes(loss, variables) == [(half, half)]
  # Forward and backward on the lowered StableHLO: operands and results all half.
  hlo = jit(jax.value_and_grad(loss)).lower(variables).as_text()
  dots = re.findall(r"stablehlo\.dot_general.*", hlo)
  types = [t for d in dots for t in re.findall(r"tensor<[^>]*>", d)]
  short = {BF16: "bf16", F16: "f16"}[half]
  assert len(dots) == 2 and len(types) == 6 and all(t.endswith(f"x{short}>") for t in types)
  grads, ref = (jit(jax.grad(f))(variables)
                for f in (loss, lambda v: RawParam().apply(v, X2).sum()))
  assert grads["params"]["w"].dtype == F32
  assert_close(grads["params"]["w"], ref["params"]["w"], half)


class Probe(nn.Module):
  """Returns what it gets and counts calls in an integer state variable."""

  @nn.compact
  def __call__(self, x, ids, mask, key, raw_key, scale=2):
    count = self.variable("state", "count", lambda: jnp.zeros((), jnp.int32))
    count.value += 1
    y = x * scale + nn.Dense(2)(x).sum()
    return y, ids, mask, key, raw_key


def test_ints_bools_keys_and_nonfloat_state_pass_through():
  model = jl.with_policy(Probe(), "mixed_bfloat16")
  args = (X2, IDS, IDS > 2, jax.random.key(1), jax.random.PRNGKey(1))
  variables = init(model, *args)
  (y, ids, mask, key, raw_key), state = jit(
      lambda v: model.apply(v, *args, mutable=["state"]))(variables)
  assert y.dtype == BF16
  assert ids.dtype == IDS.dtype and (ids == IDS).all()
  assert mask.dtype == jnp.bool_ and (mask == (IDS > 2)).all()
  assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  assert (jax.random.key_data(key) == jax.random.key_data(args[3])).all()
  assert raw_key.dtype == jnp.uint32 and (raw_key == args[4]).all()
  assert state["state"]["count"].dtype == jnp.int32
  assert state["state"]["count"] == variables["state"]["count"] + 1


def test_frozen_dict_variables_and_method_by_function():
  module = nn.Embed(10, 5)
  model = jl.with_policy(module, "mixed_bfloat16")
  variables = flax.core.freeze(model.init(KEY, X2, method="attend"))
  out = model.apply(variables, X2, method=lambda m, x: m.attend(x))
  assert out.dtype == BF16
  assert_close(out, module.apply(variables, X2, method="attend"), BF16)


def test_mutable_true_gives_parameters_back_bit_for_bit():
  model = jl.with_policy(Net(), "mixed_bfloat16")
  variables = init(model, X2)
  out, state = jit(lambda v: model.apply(v, X2, mutable=True))(variables)
  assert out.dtype == BF16 and dtypes(state) == {F32}
  # Not a round trip through bfloat16: every bit of the float32 parameters is kept.
  jax.tree.map(np.testing.assert_array_equal, state["params"], variables["params"])


def test_with_policy_rejects_what_is_not_a_linen_module():
  with pytest.raises(TypeError, match="got function; for an NNX module use jaxamp.nnx"):
    jl.with_policy(lambda x: x, "mixed_bfloat16")
  with pytest.raises(ValueError, match="mixed_bf16"):
    jl.with_policy(nn.Dense(2), "mixed_bf16")


# --- rules -------------------------------------------------------------------------------------


def test_class_rule_covers_subclasses():
  with jaxamp.policy_rules({nn.Dense: "float32"}):
    found = policies_by_path(Net(), None, X2, policy="mixed_bfloat16")
    model = jl.with_policy(Net(), "mixed_bfloat16")
    variables = init(model, X2)
    ops = op_dtypes(lambda v: model.apply(v, X2), variables)
  assert found == {"": "mixed_bfloat16", "mine": "float32", "ln":
                   "params=float32,compute=float32,output=bfloat16", "mlp": "mixed_bfloat16",
                   "mlp/up": "float32", "mlp/down": "float32", "head": "float32"}
  assert ops == [(F32, F32)] * 4


@pytest.mark.slow
def test_path_glob_rules_and_precedence():
  rules = {nn.Dense: "mixed_float16", "mlp/**": "float32", "head": "mixed_bfloat16"}
  with jaxamp.policy_rules(rules):
    found = policies_by_path(Net(), None, X2, policy="mixed_bfloat16")
    model = jl.with_policy(Net(), "mixed_bfloat16")
    variables = init(model, X2)
    ops = op_dtypes(lambda v: model.apply(v, X2), variables)
    out = model.apply(variables, X2)
  # Path beats class beats the enclosing (model-level) policy.
  assert found["mine"] == "mixed_float16"
  assert found["mlp"] == found["mlp/up"] == found["mlp/down"] == "float32"
  assert found["head"] == "mixed_bfloat16"
  assert ops == [(F16, F16), (F32, F32), (F32, F32), (BF16, BF16)]
  assert out.dtype == BF16


@pytest.mark.slow
def test_norm_default_is_overridable():
  x = X3.astype(jnp.bfloat16)
  default = jl.with_policy(nn.LayerNorm(), "mixed_bfloat16")
  variables = default.init(KEY, x)

  def casts(model):  # (shape, from, to) of each cast in the forward pass
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x))(variables).jaxpr
    return {(e.invars[0].aval.shape, e.invars[0].aval.dtype, e.params["new_dtype"])
            for e in _eqns(jaxpr) if e.primitive.name == "convert_element_type"}

  # Default: the bfloat16 input goes up to float32, the float32 scale and bias stay.
  assert ((2, 4, 8), BF16, F32) in casts(default)
  assert ((8,), F32, BF16) not in casts(default)
  with jaxamp.policy_rules({nn.LayerNorm: "mixed_bfloat16"}):
    overridden = jl.with_policy(nn.LayerNorm(), "mixed_bfloat16")
    assert policies_by_path(nn.LayerNorm(), variables, x, policy="mixed_bfloat16") == {
        "": "mixed_bfloat16"}
    assert ((8,), F32, BF16) in casts(overridden)  # scale and bias read in bfloat16
    assert overridden.apply(variables, x).dtype == BF16


@pytest.mark.slow
def test_policy_none_takes_the_global_policy_at_wrap_time():
  with jaxamp.policy_scope("mixed_bfloat16"):
    model = jl.with_policy(Net())
    assert policies_by_path(Net(), init(model, X2), X2)["head"] == "mixed_bfloat16"
  variables = init(model, X2)
  jitted = jax.jit(model.apply)
  assert model.apply(variables, X2).dtype == BF16  # kept outside the scope
  assert jitted(variables, X2).dtype == BF16
  try:
    jaxamp.set_global_policy("mixed_float16")
    # Eager and jitted agree; neither follows a later global change.
    assert model.apply(variables, X2).dtype == BF16
    assert jitted(variables, X2).dtype == BF16
    assert jl.with_policy(Net()).apply(variables, X2).dtype == F16  # a new wrapper does
  finally:
    jaxamp.set_global_policy("float32")


def test_module_policies_lists_each_module_once_in_call_order():
  ids = models.token_batch()
  module = models.TransformerLM(num_layers=1)
  found = jl.module_policies(module, None, ids, policy="mixed_bfloat16")
  paths = [p for p, _, _ in found]
  assert paths[:2] == ["", "embed"] and paths[-1] == "head"
  assert len(paths) == len(set(paths))
  classes = {p: c for p, c, _ in found}
  assert classes["block_0/attn"] is nn.MultiHeadDotProductAttention
  assert classes["block_0/attn/query"] is nn.DenseGeneral
  assert classes["block_0/ln_mlp"] is nn.RMSNorm
  variables = init(module, ids)
  abstract_ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype)
  assert [(p, c) for p, c, _ in jl.module_policies(module, variables, abstract_ids)] == [
      (p, c) for p, c, _ in found]


# --- lifted transforms ---------------------------------------------------------------------


LIFTED = {
    "scan+remat, float32 carry": (models.ScanModel(embed_offset=True), None),
    "scan+batchnorm": (models.ScanModel(remat=False, norm="batch"), ["batch_stats"]),
    "vmap": (models.VmapModel(), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LIFTED))
def test_lifted_transforms_under_jit(name):
  module, mutable = LIFTED[name]
  model = jl.with_policy(module, "mixed_bfloat16")
  variables = init(model, X2)
  assert dtypes(variables) == {F32}

  def loss(params, m):
    result = m.apply({**variables, "params": params}, X2, mutable=mutable or False)
    out, state = result if mutable else (result, {})
    value = sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in jax.tree.leaves(out))
    return value, (out, state)

  ours_and_plain = lambda p: (jax.value_and_grad(lambda p: loss(p, model), has_aux=True)(p),
                              loss(p, module))
  ((value, (out, state)), grads), (ref, (ref_out, ref_state)) = jit(ours_and_plain)(
      variables["params"])
  assert dtypes(out) == {BF16}
  assert dtypes(grads) == {F32}
  assert_close(value, ref, BF16)
  jax.tree.map(lambda a, b: assert_close(a, b, BF16), out, ref_out)
  ops = op_dtypes(lambda p: loss(p, model)[0], variables["params"])
  assert ops and all(op == (BF16, BF16) for op in ops)
  if mutable:
    assert dtypes(state) == {F32}
    assert state["batch_stats"]["layers"]["norm"]["mean"].shape == (3, 16)
    jax.tree.map(lambda a, b: assert_close(a, b, BF16), state, ref_state)


class FunctionalScan(nn.Module):
  """``nn.scan`` in function form over a submodule, a float32 carry and ``@nn.remat``."""

  @nn.compact
  def __call__(self, x):
    cell = models.Mlp(8, name="cell")
    body = lambda mdl, c, _: (c + mdl(c), None)
    carry = x + jnp.zeros(x.shape, jnp.float32)
    carry, _ = nn.scan(body, variable_broadcast="params", split_rngs={"params": False},
                       length=3)(cell, carry, None)
    return RematDense(name="out")(carry)


class RematDense(nn.Module):

  @nn.remat
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x)


def test_function_form_scan_with_enclosing_float32_and_half_body():
  model = jl.with_policy(FunctionalScan(), "float32")
  variables = init(model, X2)
  with jaxamp.policy_rules({models.Mlp: "mixed_bfloat16", RematDense: "mixed_bfloat16"}):
    out = jit(lambda v: model.apply(v, X2))(variables)
    ops = op_dtypes(lambda v: model.apply(v, X2), variables)
  assert out.dtype == F32  # the top module is float32
  assert ops == [(BF16, BF16)] * 3
  assert_close(out, jit(FunctionalScan().apply)(variables, X2), BF16)


def test_scan_body_under_a_rule_in_a_float32_model():
  with jaxamp.policy_rules({models.ScanBlock: "mixed_bfloat16"}):
    model = jl.with_policy(models.ScanModel(), "float32")
    variables = init(model, X2)
    out, ys = jit(lambda v: model.apply(v, X2))(variables)
    ops = op_dtypes(lambda v: model.apply(v, X2), variables)
  assert out.dtype == ys.dtype == F32  # what the float32 top module returns
  assert ops == [(F32, F32), (BF16, BF16), (BF16, BF16), (F32, F32)]


# --- the two test models: FLOPs in half precision, residuals, float16 on CPU ---------------


def lm_loss(model, ids):
  return lambda params: models.lm_loss(model.apply({"params": params}, ids), ids)


def cnn_loss(model, images, labels, batch_stats):
  def loss(params):
    logits, _ = model.apply({"params": params, "batch_stats": batch_stats}, images, train=True,
                            mutable=["batch_stats"], rngs={"dropout": jax.random.key(1)})
    return models.classification_loss(logits, labels)
  return loss


@pytest.fixture(scope="module")
def lm_setup():
  ids = models.token_batch(batch=4, length=16)
  return ids, init(models.TransformerLM(), ids)["params"]


@pytest.fixture(scope="module")
def lm_float32(lm_setup):
  """The float32 loss and gradients of the plain model."""
  ids, params = lm_setup
  return jit(jax.value_and_grad(lm_loss(models.TransformerLM(), ids)))(params)


@pytest.fixture(scope="module")
def cnn_setup():
  images, labels = models.image_batch(batch=4), jnp.arange(4)
  return images, labels, init(models.CNN(), images)


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(MIXED))
def test_half_flop_share_forward_and_backward(policy, lm_setup, cnn_setup):
  ids, params = lm_setup
  lm = jaxamp.precision_report(
      lm_loss(jl.with_policy(models.TransformerLM(), policy), ids), params, backward=True)
  images, labels, variables = cnn_setup
  cnn = jaxamp.precision_report(
      cnn_loss(jl.with_policy(models.CNN(), policy), images, labels, variables["batch_stats"]),
      variables["params"], backward=True)
  for report in (lm, cnn):
    assert len(report.ops) >= 8
    assert report.half_share >= 0.99, str(report)
    assert {op.lhs_dtype for op in report.ops} == {MIXED[policy].name}


@pytest.mark.slow
def test_residual_bytes_no_more_than_hand_set_bfloat16(lm_setup, cnn_setup):
  ids, params = lm_setup
  saved = lambda loss, p: jaxamp.precision_report(loss, p, backward=True).residual_bytes
  f32 = saved(lm_loss(models.TransformerLM(), ids), params)
  hand = saved(lm_loss(models.TransformerLM(dtype=jnp.bfloat16), ids), params)
  ours = saved(lm_loss(jl.with_policy(models.TransformerLM(), "mixed_bfloat16"), ids), params)
  assert ours <= hand and ours <= 0.6 * f32, (ours / f32, hand / f32)

  images, labels, variables = cnn_setup
  args = (images, labels, variables["batch_stats"])
  f32 = saved(cnn_loss(models.CNN(), *args), variables["params"])
  hand = saved(cnn_loss(models.CNN(dtype=jnp.bfloat16), *args), variables["params"])
  ours = saved(cnn_loss(jl.with_policy(models.CNN(), "mixed_bfloat16"), *args),
               variables["params"])
  assert ours <= hand and ours <= 0.6 * f32, (ours / f32, hand / f32)

  # nn.remat inside nn.scan: the parameter casts happen inside the rematerialized body,
  # so no half-precision copy of the stacked parameters is kept for the backward pass.
  x = jax.random.normal(KEY, (16, 5))
  params = init(models.ScanModel(dim=32), x)["params"]
  loss = lambda m: lambda p: sum(jnp.sum(o.astype(jnp.float32) ** 2)
                                 for o in m.apply({"params": p}, x))
  f32 = saved(loss(models.ScanModel(dim=32)), params)
  hand = saved(loss(models.ScanModel(dim=32, dtype=jnp.bfloat16)), params)
  ours = saved(loss(jl.with_policy(models.ScanModel(dim=32), "mixed_bfloat16")), params)
  assert ours <= hand < f32, (ours / f32, hand / f32)


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(MIXED))
def test_transformer_trains_in_half_and_matches_float32(policy, lm_setup, lm_float32):
  # float16 runs on CPU too: the layers' dots take float16 operands and return float16
  # (XLA CPU rejects float16 dots accumulating into float32, which jaxamp never asks for).
  ids, params = lm_setup
  half = MIXED[policy]
  model = jl.with_policy(models.TransformerLM(), policy)
  loss, grads = jit(jax.value_and_grad(lm_loss(model, ids)))(params)
  ref, ref_grads = lm_float32
  assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert dtypes(grads) == {F32}
  np.testing.assert_allclose(loss, ref, rtol=TOL[half])
  flat, ref_flat = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
                    for t in (grads, ref_grads))
  cosine = flat @ ref_flat / (jnp.linalg.norm(flat) * jnp.linalg.norm(ref_flat))
  assert cosine > 0.99


def test_cnn_batch_stats_stay_float32_under_jit(cnn_setup):
  images, _, variables = cnn_setup
  model = jl.with_policy(models.CNN(), "mixed_bfloat16")
  step = lambda m, v: m.apply(v, images, train=True, mutable=["batch_stats"],
                             rngs={"dropout": jax.random.key(1)})
  (logits, state), (ref_logits, ref_state) = jit(
      lambda v: (step(model, v), step(models.CNN(), v)))(variables)
  assert logits.dtype == BF16 and dtypes(state) == {F32}
  assert_close(logits, ref_logits, BF16)
  jax.tree.map(lambda a, b: assert_close(a, b, BF16), state, ref_state)
