"""Model families whose structure once kept them in float32, unmodified, under jaxamp.

Hugging Face's Flax Wav2Vec2 and RoBERTa-PreLayerNorm name whole encoders after the
norm they place (``FlaxWav2Vec2StableLayerNormEncoder``, every ``FlaxRobertaPreLayerNorm*``
class): a norm is what holds no submodule and runs no matmul, never a name alone. Llama
picks its float32 softmax in ``setup()`` from ``self.dtype``, so ``setup`` reads the
policy as the calls do. RoBERTa's tied LM head and Wav2Vec2's weight-normed positional
conv run a submodule through its own ``apply``: rules, the summary and FP8 reach it at
its path in the model. Tiny random configurations, traced or lowered, never trained.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp

# Heavier checks: the slow tier (pytest -m slow), which CI runs after the main suite.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
w2v = pytest.importorskip("transformers.models.wav2vec2.modeling_flax_wav2vec2")
rpl = pytest.importorskip(
    "transformers.models.roberta_prelayernorm.modeling_flax_roberta_prelayernorm")
llama = pytest.importorskip("transformers.models.llama.modeling_flax_llama")

HALF = "mixed_bfloat16"
F32_NORM = "params=float32,compute=float32,output=bfloat16"
IDS = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 60 + 2


def wav2vec2():
  config = transformers.Wav2Vec2Config(
      vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
      num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
      do_stable_layer_norm=True, feat_extract_norm="layer")
  return w2v.FlaxWav2Vec2Module(config), (jnp.zeros((2, 400)),)


def roberta_prelayernorm():
  config = transformers.RobertaPreLayerNormConfig(
      vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=64, max_position_embeddings=32)
  positions = jnp.broadcast_to(jnp.arange(8) + 2, IDS.shape)
  return (rpl.FlaxRobertaPreLayerNormForMaskedLMModule(config),
          (IDS, jnp.ones_like(IDS), jnp.zeros_like(IDS), positions, None))


def llama_lm(dtype=jnp.float32):
  config = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
  positions = jnp.broadcast_to(jnp.arange(8), IDS.shape)
  return llama.FlaxLlamaForCausalLMModule(config, dtype=dtype), (IDS, jnp.ones_like(IDS),
                                                                 positions)


FAMILIES = {"wav2vec2": wav2vec2, "roberta_prelayernorm": roberta_prelayernorm}


def abstract_params(module, args):
  return jax.eval_shape(lambda: module.init(jax.random.key(0), *args))["params"]


def loss_of(apply, args):
  return lambda params: apply({"params": params}, *args)[0].astype(jnp.float32).mean()


def primitives(fn, *args, name):
  """The output dtypes of every ``name`` equation of ``fn``'s jaxpr, nested ones included."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == name:
        found.append(eqn.outvars[0].aval.dtype.name)
      for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
          inner = getattr(item, "jaxpr", item)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


# --- 1. a norm is recognised by what it is --------------------------------------------


class StableLayerNormEncoder(nn.Module):
  """Named after the norm it places, but holds the layers."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(nn.LayerNorm()(x))


class WeightNormConv(nn.Module):
  """No submodule, named like a norm, runs a convolution of its own."""

  @nn.compact
  def __call__(self, x):
    v = self.param("weight_v", nn.initializers.lecun_normal(), (3, x.shape[-1], 8))
    kernel = v / jnp.linalg.norm(v, axis=(0, 1), keepdims=True)
    return jax.lax.conv_general_dilated(x, kernel.astype(x.dtype), (1,), "SAME",
                                        dimension_numbers=("NWC", "WIO", "NWC"))


class RMSNormGated(nn.Module):
  """A norm: no submodule, no matmul."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class NamedLikeNorms(nn.Module):

  @nn.compact
  def __call__(self, x):
    return RMSNormGated()(WeightNormConv()(StableLayerNormEncoder()(x)))


def test_only_modules_without_submodules_or_matmuls_are_named_norms():
  x = jax.ShapeDtypeStruct((2, 5, 4), jnp.float32)
  rows = {path: p.name for path, _, p in
          jaxamp.linen.module_policies(NamedLikeNorms(), None, x, policy=HALF)}
  assert rows == {"": HALF, "StableLayerNormEncoder_0": HALF,
                  "StableLayerNormEncoder_0/LayerNorm_0": F32_NORM,
                  "StableLayerNormEncoder_0/Dense_0": HALF,
                  "WeightNormConv_0": HALF, "RMSNormGated_0": F32_NORM}
  # Traced: every matmul of the model runs in half precision, no warning.
  model = jaxamp.linen.with_policy(NamedLikeNorms(), HALF)
  variables = jax.eval_shape(lambda x: NamedLikeNorms().init(jax.random.key(0), x), x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = jaxamp.precision_report(lambda v, x: model.apply(v, x).astype(jnp.float32).sum(),
                                  variables, jnp.ones(x.shape), backward=True)
  assert got.half_share == 1.0, str(got)


def test_nnx_container_named_like_a_norm_is_no_norm():

  class PreLayerNormBlock(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(4, rngs=rngs)
      self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.linear(self.norm(x))

  rows = {path: p.name for path, _, p in
          jaxamp.nnx.module_policies(PreLayerNormBlock(nnx.Rngs(0)), HALF)}
  assert rows == {"": HALF, "norm": F32_NORM, "linear": HALF}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_runs_in_half_with_float32_norms(family):
  module, args = FAMILIES[family]()
  params = abstract_params(module, args)
  model = jaxamp.linen.with_policy(module, HALF)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing left in float32, silently or not
    got = jaxamp.precision_report(loss_of(model.apply, args), params, backward=True)
  assert got.half_share >= 0.99, str(got)
  # Norms (Flax's LayerNorm) and nothing else compute in float32; their statistics
  # (lax.rsqrt of the variance, used by LayerNorm alone here) are float32.
  rows = jaxamp.linen.module_policies(module, {"params": params}, *args, policy=HALF)
  assert {cls for _, cls, p in rows if p.compute_dtype == jnp.float32} == {nn.LayerNorm}
  assert {p.name for _, cls, p in rows if cls is nn.LayerNorm} == {F32_NORM}
  assert set(primitives(loss_of(model.apply, args), params, name="rsqrt")) == {"float32"}


# --- 2. setup() reads the policy ------------------------------------------------------


class ChoosesInSetup(nn.Module):
  """Derives a choice from ``self.dtype`` in ``setup``, as Hugging Face's Llama does."""

  dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.dense = nn.Dense(4, dtype=self.dtype)
    self.softmax_in_float32 = self.dtype != jnp.float32

  def __call__(self, x):
    dtype = jnp.float32 if self.softmax_in_float32 else self.dtype
    return jax.nn.softmax(self.dense(x).astype(dtype))


def test_setup_sees_the_resolved_policy():
  x = jnp.ones((2, 3))
  variables = ChoosesInSetup().init(jax.random.key(0), x)
  model = jaxamp.linen.with_policy(ChoosesInSetup(), HALF)
  assert model.apply(variables, x).dtype == jnp.bfloat16  # the output dtype
  assert primitives(lambda v: model.apply(v, x), variables, name="exp") == ["float32"]
  assert primitives(lambda v: ChoosesInSetup(dtype=jnp.bfloat16).apply(v, x), variables,
                    name="exp") == ["float32"]


def test_llama_attention_softmax_in_float32_as_under_its_own_bfloat16():
  module, args = llama_lm()
  params = abstract_params(module, args)
  model = jaxamp.linen.with_policy(module, HALF)
  native = loss_of(llama_lm(jnp.bfloat16)[0].apply, args)
  with pytest.warns(RuntimeWarning, match=r"% of the matmul FLOPs of FlaxLlamaForCausalLM"
                    r"Module still run in float32.*'model/layers/0/self_attn'"):
    # Not silent: the float32 softmax takes the query-key product with it (as HF's own
    # dtype=bfloat16 does), and the census names where.
    got = jaxamp.precision_report(loss_of(model.apply, args), params)
  assert primitives(native, params, name="exp") == ["float32"] * 2  # one per layer
  assert primitives(loss_of(model.apply, args), params, name="exp") == ["float32"] * 2
  assert got.half_share >= 0.95, str(got)
  assert got.half_share == jaxamp.precision_report(native, params).half_share
  rows = {path: p for path, _, p in
          jaxamp.linen.module_policies(module, {"params": params}, *args, policy=HALF)}
  assert rows["model/norm"].name == F32_NORM  # FlaxLlamaRMSNorm: a norm


# --- 3. submodules run through their own apply --------------------------------------------


class Tied(nn.Module):
  """An LM head tied to the embedding the way Hugging Face ties it: ``head.apply``."""

  def setup(self):
    self.embed = nn.Embed(16, 8)
    self.proj = nn.Dense(8)
    self.head = nn.Dense(16, use_bias=False)

  def __call__(self, ids):
    x = self.proj(self.embed(ids))
    return self.head.apply({"params": {"kernel": self.embed.embedding.T}}, x)


class Outer(nn.Module):

  @nn.compact
  def __call__(self, ids):
    return Tied(name="tied")(ids)


def test_nested_apply_takes_its_path_rules_and_summary_row():
  ids = IDS % 16
  variables = Outer().init(jax.random.key(0), ids)
  paths = [path for path, _, _ in jaxamp.linen.module_policies(Outer(), variables, ids)]
  assert paths == ["", "tied", "tied/embed", "tied/proj", "tied/head"]
  s = jaxamp.summary((Outer(), variables), ids, policy=HALF)
  rows = {r.path: r for r in s.rows}
  assert rows[""].matmul_dtypes == "" and rows["tied"].matmul_dtypes == ""
  assert rows["tied/head"].matmul_dtypes == "bfloat16"
  assert rows["tied/head"].matmul_flops == 2 * 2 * 8 * 8 * 16
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no "match no module" warning
    with jaxamp.policy_rules({"tied/head": "float32"}):
      model = jaxamp.linen.with_policy(Outer(), HALF)
      got = jaxamp.precision_report(lambda v: model.apply(v, ids).astype(jnp.float32).sum(),
                                    variables)
  assert {(op.lhs_dtype, op.rhs_dtype, op.result_shape) for op in got.ops} == {
      ("float32", "float32", (2, 8, 16)), ("bfloat16", "bfloat16", (2, 8, 8))}


def test_nested_apply_gets_fp8_state_and_a_rule_keeps_it_out():
  ids = IDS % 16
  variables = Outer().init(jax.random.key(0), ids)
  loss = lambda apply, ids: apply(ids).astype(jnp.float32).mean()
  for rules, fp8 in (({}, {"tied/head", "tied/proj"}),
                     ({"tied/head": HALF}, {"tied/proj"})):
    with jaxamp.policy_rules(rules), warnings.catch_warnings():
      warnings.simplefilter("error")  # no fallback to current scaling for an unnamed layer
      warnings.filterwarnings("ignore", "jaxamp: policy 'mixed_fp8' runs FP8 matmuls, but "
                              "XLA on CPU")
      train = jaxamp.make_train_step(loss, optax.sgd(0.1), policy="mixed_fp8",
                                     memory=jaxamp.MemoryConfig(donate=False))
      state = train.init(Outer(), variables, ids)
      assert set(state.fp8) == fp8
      got = jaxamp.precision_report(train.step_fn, state, ids)
    head = [op for op in got.ops if 16 in op.rhs_shape]
    assert {op.rhs_dtype for op in head} == (
        {"float8_e4m3fn"} if "tied/head" in fp8 else {"bfloat16"})


@pytest.mark.parametrize("family,path,cls", [
    ("roberta_prelayernorm", "lm_head/decoder", "Dense"),  # the tied LM head
    ("wav2vec2", "encoder/pos_conv_embed/conv/conv", "Conv"),  # the weight-normed conv
])
def test_family_summary_attributes_nested_apply(family, path, cls):
  module, args = FAMILIES[family]()
  params = abstract_params(module, args)
  s = jaxamp.summary((module, {"params": params}), *args, policy=HALF)
  rows = {r.path: r for r in s.rows}
  assert rows[path].cls == cls and rows[path].matmul_dtypes == "bfloat16"
  assert rows[path].matmul_flops > 0 and rows[""].matmul_dtypes == ""
  assert s.mismatched == ()
  with jaxamp.policy_rules({path: "float32"}):
    assert {p: pol.name for p, _, pol in jaxamp.linen.module_policies(
        module, {"params": params}, *args, policy=HALF)}[path] == "float32"


def test_an_nnx_leaf_module_named_like_a_norm_that_holds_a_kernel_is_no_norm():
  """NNX: a weight-normed linear layer (a leaf module named like a norm, holding a raw
  kernel it multiplies by) was pinned to float32 by its name; a module holding only
  vectors, named like a norm, and Flax's LayerNorm stay float32."""
  import jax.numpy as jnp
  from flax import nnx

  class WeightNormLinear(nnx.Module):
    def __init__(self, rngs):
      self.kernel = nnx.Param(jax.random.normal(rngs.params(), (4, 4)))
      self.g = nnx.Param(jnp.ones(4))

    def __call__(self, x):
      return x @ (self.kernel[...] / jnp.linalg.norm(self.kernel[...], axis=0) * self.g[...])

  class ScaleNorm(nnx.Module):
    def __init__(self):
      self.scale = nnx.Param(jnp.ones(4))

    def __call__(self, x):
      return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.wn, self.norm, self.ln = WeightNormLinear(rngs), ScaleNorm(), nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
      return self.ln(self.norm(self.wn(x)))

  dtypes = {path: p.compute_dtype.name
            for path, _, p in jaxamp.nnx.module_policies(Net(nnx.Rngs(0)), "mixed_bfloat16")}
  assert dtypes == {"": "bfloat16", "wn": "bfloat16", "norm": "float32", "ln": "float32"}
