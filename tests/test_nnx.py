"""Tests for jaxamp.nnx: per-module policies on unmodified Flax NNX models.

Tolerances (error relative to the float32 result's largest magnitude): bfloat16 keeps
8 significant bits (rounding error 2**-9 per value) and float16 11 bits (2**-12); a
layer rounds its inputs and weights and sums a few dozen products, so a layer's output
is held to 2**-5 (bfloat16) and 2**-8 (float16) of its scale, a two-block model's loss
and gradients to 2**-4 and 2**-7.
"""

import functools
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp.nnx import PolicyModule, module_policies, with_policy
from nnx_models import CNN, TransformerLM, image_batch, lm_batch, set_dtype

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
HALF = {"mixed_bfloat16": BF16, "mixed_float16": F16}
LAYER_TOL = {BF16: 2.0**-5, F16: 2.0**-8}
MODEL_TOL = {BF16: 2.0**-4, F16: 2.0**-7}


@pytest.fixture(autouse=True)
def _default_rules():
  with jaxamp.policy_rules():  # whatever a test sets is undone
    yield


def close(actual, expected, tol):
  """Asserts ``actual`` is within ``tol`` of ``expected``, relative to its largest value."""
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  scale = max(float(np.abs(expected).max()), 1e-6)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=tol * scale)


def normal(*shape, seed=0):
  # numpy's generator: jax.random would compile a sampler for every shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def params_dtypes(model):
  return {str(v.dtype) for v in jax.tree.leaves(nnx.state(model, nnx.Param))}


def matmul_dtypes(fn, *args):
  """{(lhs, rhs)} operand dtypes of every matmul/convolution ``fn`` lowers to."""
  return {(op.lhs_dtype, op.rhs_dtype) for op in jaxamp.precision_report(fn, *args).ops}


MODELS = {
    "lm": (lambda: TransformerLM(rngs=nnx.Rngs(0)), lambda: lm_batch(4, 16)),
    "cnn": (lambda: CNN(rngs=nnx.Rngs(0, dropout=1)),
            lambda: image_batch(8, 16)),
}


@functools.cache
def _built(kind):
  return nnx.jit(MODELS[kind][0])()  # one compile, not one per op


def make(kind, dtype=None):
  """A fresh copy of a model, with every layer's ``dtype`` set to ``dtype`` if given
  (built once: initialization is slow on CPU)."""
  model = nnx.clone(_built(kind))
  return model if dtype is None else set_dtype(model, dtype)


@functools.cache
def batch(kind):
  return MODELS[kind][1]()


@functools.cache
def float32_loss_and_grads(kind):
  loss, params = train_loss(make(kind), batch(kind))
  return jax.jit(jax.value_and_grad(loss))(params)


# --- every built-in layer ----------------------------------------------------------------

MASK = jnp.tril(jnp.ones((5, 5), bool))[None, None]  # [batch, heads, q, k]

# name: (constructor, inputs, call, runs a matmul)
LAYERS = {
    "Linear": (lambda r: nnx.Linear(6, 5, rngs=r), lambda: (normal(3, 6),), None, True),
    "LinearGeneral": (lambda r: nnx.LinearGeneral(6, (2, 3), rngs=r),
                      lambda: (normal(3, 6),), None, True),
    "Einsum": (lambda r: nnx.Einsum("ab,bc->ac", (6, 5), (5,), rngs=r),
               lambda: (normal(3, 6),), None, True),
    "Conv": (lambda r: nnx.Conv(3, 4, (3, 3), rngs=r), lambda: (normal(2, 6, 6, 3),), None,
             True),
    "ConvTranspose": (lambda r: nnx.ConvTranspose(3, 4, (3, 3), rngs=r),
                      lambda: (normal(2, 6, 6, 3),), None, True),
    "Embed": (lambda r: nnx.Embed(10, 6, rngs=r),
              lambda: (jnp.array([[1, 2, 3], [4, 5, 9]]),), None, False),
    "Embed.attend": (lambda r: nnx.Embed(10, 6, rngs=r), lambda: (normal(3, 6),),
                     lambda m, x: m.attend(x), True),
    "MultiHeadAttention": (lambda r: nnx.MultiHeadAttention(2, 8, decode=False, rngs=r),
                           lambda: (normal(2, 5, 8),),
                           lambda m, x: m(x, mask=MASK), True),
    "LayerNorm": (lambda r: nnx.LayerNorm(8, rngs=r), lambda: (normal(2, 4, 8),), None, False),
    "RMSNorm": (lambda r: nnx.RMSNorm(8, rngs=r), lambda: (normal(2, 4, 8),), None, False),
    "GroupNorm": (lambda r: nnx.GroupNorm(8, num_groups=2, rngs=r), lambda: (normal(2, 4, 8),),
                  None, False),
    "BatchNorm": (lambda r: nnx.BatchNorm(8, use_running_average=False, rngs=r),
                  lambda: (normal(4, 8) + 3.0,), None, False),
    "Dropout": (lambda r: nnx.Dropout(0.5, rngs=r), lambda: (normal(4, 8),),
                lambda m, x: m(x, deterministic=False), False),
    "Sequential": (lambda r: nnx.Sequential(nnx.Linear(6, 8, rngs=r), nnx.relu,
                                            nnx.Linear(8, 3, rngs=r)),
                   lambda: (normal(3, 6),), None, True),
}
NORMS = {"LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"}


@functools.cache
def layer_reference(name):
  """The float32 layer's output and, after the call, its state."""
  build, inputs, call, _ = LAYERS[name]
  layer = build(nnx.Rngs(0))
  out = (call or (lambda m, *a: m(*a)))(layer, *inputs())
  return out, nnx.state(layer)


# float16 where it differs in kind: matmuls and convolutions (XLA on CPU), attention,
# a norm and BatchNorm's statistics; the other layers' casts are the same as bfloat16's.
FLOAT16_LAYERS = ("Linear", "Conv", "Embed.attend", "MultiHeadAttention", "LayerNorm",
                  "BatchNorm")


@pytest.mark.parametrize("name, policy", [(n, "mixed_bfloat16") for n in LAYERS] +
                         [(n, "mixed_float16") for n in FLOAT16_LAYERS])
def test_builtin_layer(name, policy):
  build, inputs, call, matmul = LAYERS[name]
  call = call or (lambda m, *a: m(*a))
  half = HALF[policy]
  expected, ref_state = layer_reference(name)
  layer = build(nnx.Rngs(0))  # the same parameters and RNG streams as the reference
  amp = with_policy(layer, policy)
  args = inputs()
  out = call(amp, *args)
  assert out.dtype == half  # norms too: they return the surrounding compute dtype
  assert params_dtypes(layer) <= {"float32"}  # Dropout has none
  if name in NORMS:  # computed in float32, then rounded once
    np.testing.assert_array_equal(out, expected.astype(half))
  else:
    close(out, expected, LAYER_TOL[half])
  if matmul:
    assert matmul_dtypes(lambda *a: call(amp, *a), *args) == {(half.name, half.name)}
  if name == "BatchNorm":  # statistics stay float32 and are updated in float32
    for stat in ("mean", "var"):
      got, want = getattr(layer, stat), ref_state[stat]
      assert got.dtype == F32
      assert not np.allclose(got[...], 0.0 if stat == "mean" else 1.0)
      np.testing.assert_array_equal(got[...], want[...])


def test_float32_policy_leaves_layers_alone():
  layer = nnx.Linear(6, 5, rngs=nnx.Rngs(0))
  x = normal(3, 6)
  np.testing.assert_array_equal(with_policy(layer, "float32")(x), layer(x))


def snapshot(model):
  """Every node's class and attributes (Variables and modules by identity), and every
  Variable's metadata and stored dtype."""
  nodes, variables = [], []
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable):
      variables.append((path, dict(node.get_metadata()), node.dtype))
    elif isinstance(node, nnx.Pytree):
      attrs = {k: id(v) if isinstance(v, (nnx.Variable, nnx.Pytree)) else v
               for k, v in vars(node).items() if not k.startswith("_pytree__")}
      nodes.append((path, type(node), attrs))
  return nodes, variables


@pytest.mark.slow
def test_state_is_restored_after_call_and_error():
  model = make("lm")
  tokens, _ = batch("lm")
  before = snapshot(model)
  amp = with_policy(model, "mixed_float16")
  jax.eval_shape(lambda t: amp(t), tokens)
  assert snapshot(model) == before
  with pytest.raises(TypeError):
    jax.eval_shape(lambda t: amp(t, unexpected=1), tokens)
  assert snapshot(model) == before


# --- user-defined modules ---------------------------------------------------------------


class Raw(nnx.Module):
  """Uses its parameters directly, has no ``dtype`` attribute."""

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (6, 4)))
    self.extra = nnx.List([nnx.Param(jnp.ones((4,)))])  # held directly, in a list

  def __call__(self, x):
    return jnp.tanh(x @ self.w[...]) * self.extra[0][...]


@pytest.mark.slow
def test_user_module_with_raw_param_computes_in_half_and_grads_are_float32():
  model = Raw(nnx.Rngs(0))
  amp = with_policy(model, "mixed_bfloat16")
  x = normal(3, 6)
  out = amp(x)
  assert out.dtype == BF16
  close(out, model(x), LAYER_TOL[BF16])
  assert matmul_dtypes(lambda x: amp(x), x) == {("bfloat16", "bfloat16")}
  loss = lambda m: m(x).astype(jnp.float32).sum()
  grads = nnx.grad(loss)(amp)
  assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"float32"}
  want = nnx.grad(loss)(model)
  close(grads["module"]["w"][...], want["w"][...], MODEL_TOL[BF16])
  assert params_dtypes(model) == {"float32"}


def test_inputs_that_are_not_floating_pass_through():
  seen = {}

  class Probe(nnx.Module):
    def __call__(self, x, ids, mask, key, rngs, scale=1.0):
      seen.update(x=x.dtype, ids=ids.dtype, mask=mask.dtype, key=key.dtype, rngs=rngs,
                  scale=scale)
      return x, ids, mask

  rngs = nnx.Rngs(0)
  key = jax.random.key(1)
  x, ids, mask = with_policy(Probe(), "mixed_float16")(
      jnp.ones(3), jnp.arange(3), jnp.ones(3, bool), key, rngs, scale=2.0)
  assert seen.pop("rngs") is rngs
  assert seen == dict(x=F16, ids=np.dtype("int32"), mask=np.dtype(bool), key=key.dtype,
                      scale=2.0)
  assert (x.dtype, ids.dtype, mask.dtype) == (F16, np.dtype("int32"), np.dtype(bool))


def test_forwarded_methods_run_under_the_policy():

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)
      self.w = nnx.Param(jnp.ones((4, 2)))

    def __call__(self, x):
      return self.lin(x)

    def project(self, x):
      return self.lin(x) @ self.w[...]

  amp = with_policy(Model(nnx.Rngs(0)), "mixed_bfloat16")
  assert amp.project(jnp.ones((1, 4))).dtype == BF16
  assert matmul_dtypes(lambda x: amp.project(x), jnp.ones((1, 4))) == {("bfloat16", "bfloat16")}
  # Submodules come back as views that run under the policy and share the Variables.
  assert amp.lin(jnp.ones((1, 4))).dtype == BF16
  assert amp.lin.kernel is amp.module.lin.kernel
  assert isinstance(amp.module.lin, nnx.Linear)  # the plain module is still at hand


# --- rules: classes, paths, precedence, defaults -----------------------------------------


class MyLinear(nnx.Linear):
  pass


class Pair(nnx.Module):

  def __init__(self, rngs):
    self.plain = nnx.Linear(4, 4, rngs=rngs)
    self.mine = MyLinear(4, 4, rngs=rngs)
    self.norm = nnx.LayerNorm(4, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.mine(self.plain(x)))


def names(model, policy="mixed_bfloat16"):
  return {path: p.name for path, _, p in module_policies(model, policy)}


def test_class_rules_cover_subclasses_and_most_specific_wins():
  model = Pair(nnx.Rngs(0))
  jaxamp.set_policy(nnx.Linear, "float32")
  assert names(model)["plain"] == names(model)["mine"] == "float32"
  jaxamp.set_policy(MyLinear, "mixed_float16")
  got = names(model)
  assert (got["plain"], got["mine"], got[""]) == ("float32", "mixed_float16", "mixed_bfloat16")
  amp = with_policy(model, "mixed_bfloat16")
  ops = jaxamp.precision_report(lambda x: amp(x), jnp.ones((2, 4))).ops
  assert [(op.lhs_dtype, op.rhs_dtype) for op in ops] == [("float32", "float32"),
                                                         ("float16", "float16")]


def test_path_rules_are_globs_relative_to_the_model_and_cover_submodules():
  model = nnx.eval_shape(lambda: TransformerLM(layers=3, rngs=nnx.Rngs(0)))  # structure only
  with jaxamp.policy_rules({"blocks/0": "float32", "blocks/*/mlp/up": "mixed_float16"}):
    got = names(with_policy(model, "mixed_bfloat16"))
  assert got["blocks/0"] == got["blocks/0/attn/query"] == got["blocks/0/mlp/down"] == "float32"
  assert got["blocks/1/attn/query"] == got["blocks/2/mlp/down"] == "mixed_bfloat16"
  assert got["blocks/0/mlp/up"] == got["blocks/2/mlp/up"] == "mixed_float16"
  with jaxamp.policy_rules({re.compile(r"blocks/[12]/attn"): "float32"}):
    got = names(model)
  assert got["blocks/1/attn/key"] == "float32" and got["blocks/0/attn/key"] == "mixed_bfloat16"


def test_path_rule_makes_a_block_run_in_float32():
  amp = with_policy(make("lm"), "mixed_bfloat16")
  tokens, _ = batch("lm")
  jaxamp.set_policy("blocks/0", "float32")
  ops = jaxamp.precision_report(lambda t: amp(t), tokens).ops
  f32 = sum(op.total_flops for op in ops if op.lhs_dtype == "float32")
  half = sum(op.total_flops for op in ops if op.is_half)
  # Block 0 (4 projections + 2 attention matmuls + MLP) in float32, block 1 and head bf16.
  assert f32 > 0 and half > f32
  assert {(op.lhs_dtype, op.rhs_dtype) for op in ops} == {("float32", "float32"),
                                                          ("bfloat16", "bfloat16")}


def test_precedence_path_over_class_over_model():
  model = Pair(nnx.Rngs(0))
  with jaxamp.policy_rules({nnx.Linear: "mixed_float16", "plain": "float32"}):
    got = names(model)
  assert (got["plain"], got["mine"], got[""]) == ("float32", "mixed_float16", "mixed_bfloat16")


def test_norm_default_is_float32_compute_and_overridable():
  assert names(Pair(nnx.Rngs(0)))["norm"] == "params=float32,compute=float32,output=bfloat16"
  norm = nnx.LayerNorm(8, rngs=nnx.Rngs(0))
  amp = with_policy(norm, "mixed_bfloat16")
  x = normal(2, 8).astype(jnp.bfloat16)
  out = amp(x)  # in float32 from the bf16 input, returned in bf16
  np.testing.assert_array_equal(out, norm(x.astype(jnp.float32)).astype(jnp.bfloat16))
  jaxamp.set_policy(nnx.LayerNorm, "float32")
  assert amp(x).dtype == F32
  jaxamp.set_policy(nnx.LayerNorm, None)  # no rule: the norm follows the model
  assert names(norm)[""] == "mixed_bfloat16"
  jaxpr = str(jax.make_jaxpr(lambda x: amp(x))(x))
  assert "bf16[8] = convert_element_type" in jaxpr  # the scale is read in bf16


def test_policy_none_takes_the_global_policy_at_wrap_time():
  layer = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 4))
  with jaxamp.policy_scope("mixed_float16"):
    amp = with_policy(layer)
  assert amp.policy.name == "mixed_float16"
  assert amp(x).dtype == F16  # outside the scope: the wrapper kept its policy
  jitted = nnx.jit(lambda m, x: m(x))
  assert jitted(amp, x).dtype == F16
  try:
    jaxamp.set_global_policy("mixed_bfloat16")
    # Eager and jitted calls agree: neither follows a later global change.
    assert amp(x).dtype == F16
    assert jitted(amp, x).dtype == F16
    assert with_policy(layer)(x).dtype == BF16  # a new wrapper takes the new global
  finally:
    jaxamp.set_global_policy("float32")


def test_scopes_are_per_thread():
  layer = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  other = []
  with jaxamp.policy_scope("mixed_bfloat16"):
    t = threading.Thread(target=lambda: other.append(with_policy(layer)(jnp.ones((1, 4))).dtype))
    t.start()
    t.join()
    assert with_policy(layer)(jnp.ones((1, 4))).dtype == BF16
  assert other == [F32]


# --- sharing with the model, NNX transforms ---------------------------------------------


def test_wrapper_shares_variables_with_the_model():
  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  amp = with_policy(model, "mixed_bfloat16")
  assert isinstance(amp, PolicyModule) and isinstance(amp, nnx.Module)
  x = normal(3, 4)
  optimizer = nnx.Optimizer(amp, optax.sgd(0.1), wrt=nnx.Param)
  before = model.kernel[...]
  grads = nnx.grad(lambda m: m(x).astype(jnp.float32).sum())(amp)
  optimizer.update(amp, grads)
  assert not np.allclose(model.kernel[...], before)
  assert model.kernel.dtype == F32
  model.bias[...] = jnp.full((2,), 7.0)  # and the other way round
  assert np.all(np.asarray(amp.module.bias[...]) == 7.0)
  assert np.allclose(amp(jnp.zeros((1, 4))).astype(jnp.float32), 7.0)


def test_wrapper_splits_and_merges():
  model = make("cnn")
  amp = with_policy(model, "mixed_bfloat16")
  graphdef, state = nnx.split(amp)
  copy = nnx.merge(graphdef, state)
  assert isinstance(copy, PolicyModule) and copy.policy == amp.policy
  x, _ = batch("cnn")
  out = nnx.eval_shape(lambda m, x: m(x), copy, x)
  assert out.dtype == BF16 and out.shape == (8, 10)


class Layer(nnx.Module):

  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.lin = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return x + self.lin(self.norm(x))


class Scanned(nnx.Module):
  """Layers stacked with nnx.vmap, run with nnx.scan; a block under nnx.remat."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Layer(rngs)

    self.layers = make(rngs)
    self.last = Layer(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return layer(x)

    return nnx.remat(lambda layer, x: layer(x))(self.last, body(x, self.layers))


@pytest.mark.slow
def test_modules_recreated_by_nnx_transforms_keep_their_policy():
  model = Scanned(nnx.Rngs(0))
  amp = with_policy(model, "mixed_bfloat16")
  x = normal(4, 8)
  out, want = nnx.jit(lambda amp, model, x: (amp(x), model(x)))(amp, model, x)
  assert out.dtype == BF16
  close(out, want, MODEL_TOL[BF16])
  graphdef, params, rest = nnx.split(amp, nnx.Param, ...)
  loss = lambda p: nnx.merge(graphdef, p, rest, copy=True)(x).astype(jnp.float32).sum()
  report = jaxamp.precision_report(loss, params, backward=True)
  # Forward and the two gradients of the scanned layers' and the last layer's matmuls.
  assert report.half_share == 1.0
  assert report.total_flops == 3 * 2 * (4 * 8 * 8) * (3 + 1)
  assert params_dtypes(model) == {"float32"}


# --- whole models: train step FLOPs, activation memory, float16 on CPU --------------------


def train_loss(model, batch):
  """A loss of the parameters alone (what a train step differentiates), and them."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  inputs, labels = batch

  def loss(params):
    logits = nnx.merge(graphdef, params, rest, copy=True)(inputs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss, params


@pytest.mark.parametrize("policy", list(HALF))
@pytest.mark.parametrize("kind", list(MODELS))
def test_train_step_matmul_flops_are_half_precision(kind, policy):
  loss, params = train_loss(with_policy(make(kind), policy), batch(kind))
  report = jaxamp.precision_report(loss, params, backward=True)
  assert report.half_share >= 0.99, report.table()
  # The backward pass is there: twice as many matmuls as the forward pass, or more.
  assert len(report.ops) >= 2 * (17 if kind == "lm" else 3)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MODELS))
def test_activation_memory_is_below_hand_set_bfloat16(kind):
  data = batch(kind)
  saved = {}
  for name, model in [("float32", make(kind)), ("hand", make(kind, jnp.bfloat16)),
                      ("mixed", with_policy(make(kind), "mixed_bfloat16")),
                      ("recompute", with_policy(make(kind), "mixed_bfloat16",
                                                recompute_norms=True)),
                      ("plain", with_policy(make(kind), "mixed_bfloat16",
                                            half_residuals=False))]:
    loss, params = train_loss(model, data)
    saved[name] = jaxamp.precision_report(loss, params, backward=True).residual_bytes
  # Measured (jax 0.10.2, flax 0.12.8), as a fraction of float32: the LM keeps 0.77 with
  # dtype=bfloat16 set by hand, 0.34 with the policy (half_residuals: float32 norms keep
  # their bf16 input and statistics, parameters no half copy), 0.63 without
  # half_residuals; the CNN 0.83, 0.41, 0.83. recompute_norms adds nothing to it.
  assert saved["mixed"] <= 0.5 * saved["float32"], saved
  assert saved["mixed"] < saved["hand"] < saved["float32"], saved
  assert saved["mixed"] < saved["plain"] <= saved["hand"], saved
  assert saved["recompute"] == saved["mixed"], saved


@pytest.mark.slow
def test_norms_are_recomputed_only_when_asked():
  """recompute_norms=True puts each float32 norm under jax.checkpoint (its policy
  jaxamp.residuals.recompute_all); the default and make_train_step's default do not."""
  def remats(model):
    loss, params = train_loss(model, batch("lm"))
    return str(jax.make_jaxpr(jax.grad(loss))(params)).count("recompute_all")

  assert remats(with_policy(make("lm"), "mixed_bfloat16")) == 0
  assert remats(with_policy(make("lm"), "mixed_bfloat16", recompute_norms=True)) > 0
  # Norms that do not widen (a float32 policy) are never recomputed.
  assert remats(with_policy(make("lm"), "float32", recompute_norms=True)) == 0

  def step_remats(**kw):
    train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b[0]).astype(jnp.float32)),
                                   optax.sgd(0.1), policy="mixed_bfloat16", **kw)
    state = train.init(make("lm"))
    return str(jax.make_jaxpr(train.step_fn)(state, batch("lm"))).count("recompute_all")

  assert step_remats() == 0
  assert step_remats(memory=jaxamp.MemoryConfig(recompute_norms=True)) > 0
  # A wrapped model's request holds for its init only, not for a later plain one.
  train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b[0]).astype(jnp.float32)),
                                 optax.sgd(0.1), policy="mixed_bfloat16")
  train.init(with_policy(make("lm"), "mixed_bfloat16", recompute_norms=True))
  assert train.recompute_norms
  train.init(make("lm"))
  assert not train.recompute_norms


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(HALF))
def test_transformer_forward_backward_runs_and_matches_float32(policy):
  # float16 included: XLA on CPU rejects the float16 dots with float32 accumulation of
  # jax.nn.dot_product_attention, which with_policy replaces for half compute dtypes.
  half = HALF[policy]
  want_loss, want_grads = float32_loss_and_grads("lm")
  loss, params = train_loss(with_policy(make("lm"), policy), batch("lm"))
  got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(params)
  assert np.isfinite(got_loss)
  close(got_loss, want_loss, MODEL_TOL[half])
  assert {str(g.dtype) for g in jax.tree.leaves(got_grads)} == {"float32"}
  got_grads, want_grads = jax.tree.leaves(got_grads["module"]), jax.tree.leaves(want_grads)
  # Per parameter, in L2 norm, relative to its gradient's norm; gradients tiny next to
  # the largest (the key projection's bias, zero in exact arithmetic) relative to 1/100
  # of the largest: their rounding noise is set by the scale of the whole computation.
  floor = 1e-2 * max(np.linalg.norm(w) for w in want_grads)
  for got, want in zip(got_grads, want_grads):
    assert np.all(np.isfinite(got))
    err = np.linalg.norm(np.asarray(got) - np.asarray(want))
    assert err <= MODEL_TOL[half] * max(np.linalg.norm(want), floor)


@pytest.mark.slow
def test_cnn_nnx_jit_train_step_keeps_batch_stats_float32():
  images, labels = batch("cnn")
  ref, model = make("cnn"), make("cnn")
  for m in (ref, model):
    m.dropout.rate = 0.0
  amp = with_policy(model, "mixed_bfloat16")

  @nnx.jit
  def step(m):
    loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(
        m(images).astype(jnp.float32), labels).mean()
    return nnx.value_and_grad(loss)(m)

  want, _ = step(ref)
  got, grads = step(amp)
  close(got, want, MODEL_TOL[BF16])
  for norm, ref_norm in zip(model.norms, ref.norms):
    assert norm.mean.dtype == norm.var.dtype == F32
    np.testing.assert_allclose(norm.var[...], ref_norm.var[...], rtol=2.0**-6)
  assert params_dtypes(model) == {"float32"}
  assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"float32"}


def test_attention_decoding_cache_keeps_its_dtype():
  layer = nnx.MultiHeadAttention(2, 8, decode=True, rngs=nnx.Rngs(0))
  layer.init_cache((2, 4, 8))
  ref = nnx.clone(layer)
  amp = with_policy(layer, "mixed_bfloat16")
  step = nnx.jit(lambda m, x: m(x))
  for i in range(3):
    x = normal(2, 1, 8, seed=i)
    out, want = step(amp, x), step(ref, x)
    assert out.dtype == BF16
    close(out, want, LAYER_TOL[BF16])
  assert layer.cached_key.dtype == F32 and int(layer.cache_index[...]) == 3
  close(layer.cached_value[...], ref.cached_value[...], LAYER_TOL[BF16])


@pytest.mark.slow
def test_a_cache_the_module_accumulates_into_keeps_its_dtype_while_computing():
  class Running(nnx.Module):  # a float32 running sum and count, as a streaming decoder keeps
    def __init__(self):
      self.proj = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
      self.total = nnx.Cache(jnp.zeros((4,), F32))
      self.count = nnx.Cache(jnp.zeros((), F32))

    def __call__(self, x):
      self.total[...] = self.total[...] + self.proj(x).sum(0)
      self.count[...] = self.count[...] + x.shape[0]
      return self.total[...] / self.count[...]

  x = jnp.ones((1, 4))
  for policy in ("mixed_bfloat16", "mixed_float16"):
    model = Running()
    amp, step = with_policy(model, policy), nnx.jit(lambda m, x: m(x))
    for _ in range(2100):  # a half count stalls: at 256 in bfloat16, at 2048 in float16
      out = step(amp, x)
    assert float(model.count[...]) == 2100.0 and model.total.dtype == F32
    close(model.total[...] / 2100, Running().proj(x)[0], LAYER_TOL[np.dtype(out.dtype)])


def test_half_dot_product_attention_matches_flax():
  # Grouped-query (4 query heads, 2 key/value heads), a mask, a bias and causality.
  is_causal = True
  q, k, v = normal(2, 5, 4, 8, seed=0), normal(2, 5, 2, 8, seed=1), normal(2, 5, 2, 8, seed=2)
  mask = jnp.asarray(np.random.default_rng(3).random((2, 1, 5, 5)) < 0.7).at[..., 0].set(True)
  bias = normal(2, 1, 5, 5, seed=4)
  half = jaxamp.nnx.half_dot_product_attention

  def loss(f, **kw):
    return lambda q: f(q, k, v, bias=bias, mask=mask, is_causal=is_causal, **kw).astype(
        F32).sum()

  @jax.jit
  def run(q):
    want = nnx.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal)
    outs = [half(q, k, v, bias=bias, mask=mask, is_causal=is_causal, dtype=d)
            for d in (F32, BF16)]
    grads = [jax.grad(f)(q) for f in (loss(nnx.dot_product_attention), loss(half, dtype=F32))]
    return want, outs, grads

  want, (out32, out16), (want_grad, grad) = run(q)
  close(out32, want, 1e-6)
  close(grad, want_grad, 1e-5)
  assert out16.dtype == BF16
  close(out16, want, LAYER_TOL[BF16])
  report = jaxamp.precision_report(loss(half, dtype=BF16), q, backward=True)
  # Two forward matmuls; for q's gradient, the probabilities' (from v) and the logits'.
  assert report.half_share == 1.0 and len(report.ops) == 4


@pytest.mark.slow
def test_submodules_reached_through_the_wrapper_run_under_the_policy():
  model = TransformerLM(vocab=16, d=8, heads=2, hidden=16, layers=2, max_len=8,
                        rngs=nnx.Rngs(0))
  amp = jaxamp.nnx.with_policy(model, "mixed_bfloat16")
  x = jnp.ones((2, 4, 8))
  assert amp.head(x).dtype == jnp.bfloat16
  assert amp.embed.attend(x).dtype == jnp.bfloat16
  assert [b(x).dtype for b in amp.blocks] == [jnp.bfloat16, jnp.bfloat16]
  assert len(amp.blocks) == 2 and amp.blocks[1].ln1(x).dtype == jnp.bfloat16
  with jaxamp.policy_rules({"blocks/1": "float32"}):  # paths still count from the root
    assert amp.blocks[1].mlp.up(x).dtype == jnp.float32
    assert amp.blocks[0].mlp.up(x).dtype == jnp.bfloat16
  assert model.head.kernel.get_value().dtype == jnp.float32
  assert model.head(x).dtype == jnp.float32  # the model itself is untouched


def test_an_indexable_model_is_indexed_through_the_wrapper_under_the_policy():
  layers = nnx.List([nnx.Linear(8, 8, rngs=nnx.Rngs(i)) for i in range(2)])
  amp = jaxamp.nnx.with_policy(layers, "mixed_bfloat16")
  x = jnp.ones((2, 8))
  assert amp[0](x).dtype == jnp.bfloat16 and amp[1].kernel.get_value().dtype == jnp.float32
  with jaxamp.policy_rules({"1": "float32"}):  # the view's paths count from the root
    assert (amp[0](x).dtype, amp[1](x).dtype) == (jnp.bfloat16, jnp.float32)
  assert layers[0](x).dtype == jnp.float32
  plain = jaxamp.nnx.with_policy(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), "mixed_bfloat16")
  with pytest.raises(TypeError, match="Linear .wrapped by with_policy. cannot be indexed"):
    plain[0]  # pylint: disable=pointless-statement


@pytest.mark.slow
def test_census_gives_matmuls_inside_nnx_scan_to_their_modules():
  """nnx.scan re-creates the layers inside the call: the census still finds their module
  (it was the root before, so a float32 rule warned of a hard-coded float32 matmul)."""
  x = normal(4, 8)
  with jaxamp.policy_rules({"layers/lin": "float32"}):
    with warnings.catch_warnings():
      warnings.filterwarnings("error", message=".*still run in float32.*")
      out = with_policy(Scanned(nnx.Rngs(0)), "mixed_bfloat16")(x)
    s = jaxamp.summary(Scanned(nnx.Rngs(0)), x, policy="mixed_bfloat16")
  assert out.dtype == BF16
  assert {r.path: r.matmul_dtypes for r in s.rows if r.matmul_dtypes} == {
      "layers/lin": "float32", "last/lin": "bfloat16"}
  assert not s.mismatched


def test_module_walk_matches_iter_graph():
  """The wrapper's own module walk (it runs on every call; nnx.iter_graph also walks
  every Variable) yields exactly iter_graph's modules: same paths, order, sharing."""
  from jaxamp.nnx import _iter_modules  # pylint: disable=g-import-not-at-top

  rngs = nnx.Rngs(0)
  shared = nnx.Linear(2, 2, rngs=rngs)
  models_ = [make("lm"), make("cnn"),
             nnx.Sequential(shared, shared, nnx.List([shared, nnx.LayerNorm(2, rngs=rngs)])),
             nnx.Dict(a=nnx.Linear(2, 2, rngs=rngs), b=nnx.BatchNorm(2, rngs=rngs))]
  for model in models_:
    expected = [(p, id(n)) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.Module)]
    assert [(p, id(n)) for p, n in _iter_modules(model)] == expected
    assert len(expected) > 1
