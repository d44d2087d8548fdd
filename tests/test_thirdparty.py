"""Real third-party Flax models from pip, unmodified, under jaxamp's policies.

Both families hard-code float32 the way published models do: Hugging Face's Flax GPT-2
(``transformers``) passes ``dtype=self.dtype`` (float32 by default) to every layer and
casts its kernels with ``jnp.asarray(kernel, self.dtype)``; ``flaxmodels``' ResNet-18
does the same and brings its own ``BatchNorm`` class (not Flax's). Each runs as Linen
(``jaxamp.linen.with_policy``) and as NNX (``nnx.bridge.ToNNX``, wrapped by
``jaxamp.nnx.with_policy``). The packages come with the ``thirdparty`` extra.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp

# Heavier checks: the slow tier (pytest -m slow), which CI runs after the main suite.
pytestmark = pytest.mark.slow

flaxmodels = pytest.importorskip("flaxmodels")
gpt2 = pytest.importorskip("transformers.models.gpt2.modeling_flax_gpt2")
transformers = pytest.importorskip("transformers")

LENGTH = 16


def gpt2_module():
  config = transformers.GPT2Config(vocab_size=128, n_positions=LENGTH, n_embd=64, n_layer=2,
                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  return gpt2.FlaxGPT2LMHeadModule(config)


def gpt2_inputs(ids):
  return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)


def token_ids(batch=4, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 128, (batch, LENGTH), np.int32))


def resnet_module():
  return flaxmodels.ResNet18(pretrained=None, num_classes=10)


def images(batch=4, size=32, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((batch, size, size, 3), np.float32)),
          jnp.asarray(rng.integers(0, 10, (batch,), np.int32)))


def lm_loss(logits, ids):
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
  return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()


def xent(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


@pytest.fixture(scope="module")
def gpt2_variables():
  return jax.jit(lambda ids: gpt2_module().init(jax.random.key(0), *gpt2_inputs(ids)))(
      token_ids())


# ResNet-18 is only traced: lowering costs the same at any size, and large images make
# activations, not the half-precision copies of the weights, what backward keeps.
BIG_IMAGES = jax.ShapeDtypeStruct((16, 128, 128, 3), jnp.float32)
SMALL_IMAGES = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)


@pytest.fixture(scope="module")
def resnet_variables():
  return jax.eval_shape(lambda x: resnet_module().init(jax.random.key(0), x, train=False),
                        SMALL_IMAGES)


def bridged(module, *args, abstract=False, **kwargs):
  """The Linen module as an NNX module (Flax's bridge), initialized for ``args``."""
  make = lambda: nnx.bridge.lazy_init(nnx.bridge.ToNNX(module, rngs=nnx.Rngs(0)), *args,
                                      **kwargs)
  return nnx.eval_shape(make) if abstract else make()


def nnx_loss(model, policy, loss, **options):
  """``(loss of (params, state, *args), params, state)`` for an NNX model under ``policy``."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def fn(p, r, *args):
    # Variables rebuilt at this trace level, so the model may update its RNG counts.
    m = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, r))
    return loss(m if policy is None else jaxamp.nnx.with_policy(m, policy, **options), *args)

  return fn, params, rest


def gpt2_apply_loss(apply, ids):
  return lm_loss(apply(*gpt2_inputs(ids))[0], ids)


def resnet_apply_loss(apply, x):
  out = apply(x, train=True, mutable=["batch_stats"])
  return (out[0] if isinstance(out, tuple) else out).astype(jnp.float32).mean()


def report(fn, *args):
  return jaxamp.precision_report(fn, *args, backward=True)


@pytest.mark.parametrize("family", ["gpt2", "resnet"])
def test_half_flops_and_residuals_linen_and_nnx(family, request):
  if family == "gpt2":
    module, loss, x = gpt2_module(), gpt2_apply_loss, token_ids()
    variables = request.getfixturevalue("gpt2_variables")
    nnx_model = bridged(module, *gpt2_inputs(x), abstract=True)
  else:
    module, loss, x = resnet_module(), resnet_apply_loss, BIG_IMAGES
    variables = request.getfixturevalue("resnet_variables")
    nnx_model = bridged(module, jnp.zeros(SMALL_IMAGES.shape), train=False, abstract=True)
  params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}

  def linen_loss(policy, **options):
    m = module if policy is None else jaxamp.linen.with_policy(module, policy, **options)
    return lambda p, r, x: loss(lambda *a, **k: m.apply({"params": p, **r}, *a, **k), x)

  f32 = report(linen_loss(None), params, rest, x)
  assert f32.half_share == 0.0  # the model hard-codes float32
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no float32-matmul warning: the policy reached them
    linen = report(linen_loss("mixed_bfloat16"), params, rest, x)
    nnx_report = report(*nnx_loss(nnx_model, "mixed_float16", loss), x)
    plain = report(linen_loss("mixed_bfloat16", half_residuals=False), params, rest, x)
  # Residuals as a fraction of float32 (jax 0.10.2), Linen: without half_residuals GPT-2
  # 0.58, ResNet-18 0.87 (BatchNorm saves float32 intermediates, each conv its half
  # kernel); with it (the default), float32 norms keep their half-precision input and
  # statistics and parameters no half copy: GPT-2 0.44, ResNet-18 0.41 (0.41 too at
  # batch 32 of 32x32 images, where plain reverse mode keeps 1.58x float32).
  for got, half in ((linen, "bfloat16"), (nnx_report, "float16"), (plain, "bfloat16")):
    assert got.half_share >= 0.99, str(got)
    assert {op.lhs_dtype for op in got.ops} == {half}
  for got in (linen, nnx_report):
    assert got.residual_bytes <= 0.6 * f32.residual_bytes, (
        got.residual_bytes / f32.residual_bytes)
  assert linen.residual_bytes < plain.residual_bytes


def test_third_party_batchnorm_is_detected_and_computes_in_float32(resnet_variables):
  plan = lambda: jaxamp.linen.module_policies(resnet_module(), resnet_variables, SMALL_IMAGES,
                                              train=False, policy="mixed_bfloat16")
  norm_cls = flaxmodels.resnet.ops.BatchNorm
  assert not issubclass(norm_cls, jaxamp.NORM_CLASSES)
  norms = [p for _, cls, p in plan() if cls is norm_cls]
  convs = [p for _, cls, p in plan() if cls is nn.Conv]
  assert len(norms) == len(convs) == 20
  assert {p.name for p in norms} == {"params=float32,compute=float32,output=bfloat16"}
  assert {p.compute_dtype.name for p in convs} == {"bfloat16"}
  # Overridable like any rule: the NAMED_NORMS target, or the class itself.
  with jaxamp.policy_rules({jaxamp.NAMED_NORMS: None}):
    assert {p.name for _, cls, p in plan() if cls is norm_cls} == {"mixed_bfloat16"}
  with jaxamp.policy_rules({norm_cls: "float32"}):
    assert {p.name for _, cls, p in plan() if cls is norm_cls} == {"float32"}


def test_summary_reports_what_runs(resnet_variables):
  s = jaxamp.summary((resnet_module(), resnet_variables), SMALL_IMAGES, train=False,
                     policy="mixed_bfloat16")
  rows = {r.path: r for r in s.rows}
  assert rows["Conv_0"].matmul_dtypes == "bfloat16" and rows["Conv_0"].runs_as_policy
  assert rows["BatchNorm_0"].matmul_dtypes == ""  # no matmul of its own
  assert s.checked and s.mismatched == ()
  assert "matmuls ran in" in str(s)


def train_losses(train, state, batches):
  losses = []
  for batch in batches:
    state, metrics = train.step(state, batch)
    losses.append(float(metrics["loss"]))
  return state, losses


def test_gpt2_linen_trains_like_float32_and_skips_exactly(gpt2_variables):
  module = gpt2_module()

  def loss_fn(apply, batch):
    ids, scale = batch  # scale: 1.0, or inf to overflow the step
    return gpt2_apply_loss(apply, ids) * scale

  ids = token_ids()
  runs = {}
  for policy in ("float32", "mixed_float16"):  # float16: dynamic loss scaling, skips
    train = jaxamp.make_train_step(loss_fn, optax.adam(3e-3), policy=policy,
                                   memory=jaxamp.MemoryConfig(donate=False))
    state = train.init(module, gpt2_variables, *gpt2_inputs(ids))
    runs[policy] = (train, *train_losses(train, state, [(ids, jnp.float32(1.0))] * 4))
  (_, _, ref), (train, state, got) = runs["float32"], runs["mixed_float16"]
  np.testing.assert_allclose(got[-1], ref[-1], rtol=0.02)
  assert got[-1] < got[0] - 0.05
  # An overflowing step changes nothing but the loss scale and the skip count.
  new, metrics = train.step(state, (ids, jnp.float32(jnp.inf)))
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == float(jaxamp.get_loss_scale(state.opt_state)) / 2
  kept = lambda s: (s.params, s.model_state, jax.random.key_data(s.rng),
                    [optax.tree_utils.tree_get(s.opt_state, k) for k in ("count", "mu", "nu")])
  for a, b in zip(jax.tree.leaves(kept(new)), jax.tree.leaves(kept(state))):
    np.testing.assert_array_equal(a, b)


def test_gpt2_skip_holds_half_gradients_and_steps_as_the_float32_held_program(
    gpt2_variables, monkeypatch):
  # Hugging Face's GPT-2 (tied input/output embedding, fused QKV, float32 LayerNorms):
  # under mixed_bfloat16 the skip's cond holds most gradients in bfloat16, and the steps
  # are the bits of the program that held them all in float32 (patched back in), once
  # XLA rounds as the program says; SGD by a power of two, an overflow at step 3.
  module, ids = gpt2_module(), token_ids()

  def loss_fn(apply, batch):
    ids, scale = batch
    return gpt2_apply_loss(apply, ids) * scale

  def run(patched):
    with monkeypatch.context() as m:
      if patched:
        m.setattr(jaxamp.train.update, "_held", lambda grad, opt_grad, found: (opt_grad, None))
      train = jaxamp.make_train_step(loss_fn, optax.sgd(2.0**-6), policy="mixed_bfloat16",
                                     memory=jaxamp.MemoryConfig(donate=False))
      state = train.init(module, gpt2_variables, *gpt2_inputs(ids))
      batch = (ids, jnp.float32(1.0))
      traced = train.trace(state, batch)
      cond, = [e for e in traced.jaxpr.eqns if e.primitive.name == "cond"]
      half = sum(v.aval.dtype == jnp.bfloat16 for v in cond.invars[1:])
      step = traced.lower().compile({"xla_allow_excess_precision": False})
      states = []
      for scale in (1.0, 1.0, np.inf, 1.0):
        state, _ = step(state, (ids, jnp.float32(scale)))
        states.append(state.params)
      return half, states

  (half, new), (old_half, old) = run(False), run(True)
  # Every gradient but the float32 LayerNorms' (embeddings, tied wte included, kernels,
  # biases): each is read once in bfloat16 (Linen casts a module's parameters once).
  paths = jax.tree_util.tree_flatten_with_path(gpt2_variables["params"])[0]
  assert old_half == 0
  assert half == sum("ln_" not in jax.tree_util.keystr(p) for p, _ in paths) == 18
  for a, b in zip(new, old):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for x, y in zip(jax.tree.leaves(new[2]), jax.tree.leaves(new[1])):  # the skipped step
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_gpt2_nnx_trains_like_float32():
  ids = token_ids()
  model = bridged(gpt2_module(), *gpt2_inputs(ids))

  def loss_fn(m, ids):
    return gpt2_apply_loss(m, ids)

  losses = {}
  for policy in ("float32", "mixed_bfloat16"):
    train = jaxamp.make_train_step(loss_fn, optax.adam(3e-3), policy=policy,
                                   memory=jaxamp.MemoryConfig(donate=False))
    _, losses[policy] = train_losses(train, train.init(nnx.clone(model)), [ids] * 4)
  np.testing.assert_allclose(losses["mixed_bfloat16"][-1], losses["float32"][-1], rtol=0.02)
  assert losses["mixed_bfloat16"][-1] < losses["mixed_bfloat16"][0] - 0.05


class HardCast(nn.Module):
  """A model casting to float32 inside its function: no dtype field jaxamp could set."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 8))
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))


def test_function_level_float32_cast_warns_once_naming_the_module():
  model = jaxamp.linen.with_policy(HardCast(), "mixed_bfloat16")
  x = jnp.ones((2, 4))
  variables = model.init(jax.random.key(0), x)
  with pytest.warns(RuntimeWarning, match=r"100.0% of the matmul FLOPs of HardCast.*"
                                          r"'\(model\)'.*autocast.*opt_level='O1'"):
    model.apply(variables, x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model.apply(variables, x)  # once
  # The answer the warning gives works.
  fast = jaxamp.autocast(lambda v, x: HardCast().apply(v, x), "mixed_bfloat16")
  assert jaxamp.precision_report(fast, variables, x).half_share == 1.0


@pytest.mark.parametrize("api,policy", [("linen", "mixed_float16"), ("nnx", "mixed_bfloat16")])
def test_resnet_trains_like_float32_and_skips_exactly(api, policy):
  # The CNN family with its own BatchNorm, trained a few steps: the loss tracks float32,
  # and an overflowing step leaves params, BatchNorm statistics, RNG and momentum as
  # they were. At batch 16 and 32x32 this ResNet-18 is touchy: rounding its input alone
  # to bfloat16 moves its first gradient by 27 % (benchmarks/fidelity). Largest relative
  # loss difference over 6 steps, nnx mixed_bfloat16: 1.1 % (jax 0.10) and 2.2 % (jax
  # 0.11) with half_residuals, 0.85 % without it on jax 0.11 (XLA's excess precision lets
  # the forward pass use unrounded values the backward pass recomputes from rounded ones).
  x, y = images(batch=16, size=32)

  def loss_fn(model, batch):
    images_, labels, scale = batch  # scale: 1.0, or inf to overflow the step
    # Linen: the train step's adapter makes batch_stats mutable; Flax's ToNNX bridge needs
    # to be told.
    out = model(images_, train=True, mutable=["batch_stats"]) if api == "nnx" else model(
        images_, train=True)
    logits = (out[0] if isinstance(out, tuple) else out).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean() * scale

  module = resnet_module()
  if api == "linen":
    variables = jax.jit(lambda x: module.init(jax.random.key(0), x, train=False))(x[:2])
  else:
    model = bridged(module, x[:2], train=False)
  batch = (x, y, jnp.float32(1.0))
  runs = {}
  for p in ("float32", policy):
    # Compiled at XLA's default level: this test mostly runs convolutions, which the
    # suite's fast-compile level (tests/conftest.py) slows down.
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.01, momentum=0.9), policy=p,
                                   memory=jaxamp.MemoryConfig(donate=False),
                                   compiler_options={"xla_backend_optimization_level": 3})
    state = (train.init(module, variables, x[:2], train=False) if api == "linen"
             else train.init(nnx.clone(model)))
    runs[p] = (train, *train_losses(train, state, [batch] * 6))
  (_, _, ref), (train, state, got) = runs["float32"], runs[policy]
  np.testing.assert_allclose(got, ref, rtol=0.03)
  assert got[-1] < got[0] - 0.3
  new, metrics = train.step(state, (x, y, jnp.float32(jnp.inf)))
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  kept = lambda s: jax.tree.map(data, (s.params, s.model_state, s.rng,
                                       optax.tree_utils.tree_get(s.opt_state, "trace")))
  for a, b in zip(jax.tree.leaves(kept(new)), jax.tree.leaves(kept(state))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_census_agrees_with_the_lowered_program(gpt2_variables, policy):
  # summary's matmul column and the float32 warning read a jaxpr census; it must count
  # what the lowered StableHLO (precision_report) runs: same matmul FLOPs, same half share.
  from jaxamp.census import module_matmuls

  amp = jaxamp.linen.with_policy(gpt2_module(), policy)
  ids = token_ids()
  fwd = lambda v: gpt2_apply_loss(lambda *a: amp.apply(v, *a), ids)
  ops = module_matmuls(jax.make_jaxpr(fwd)(gpt2_variables))
  lowered = report(fwd, gpt2_variables)  # forward and backward
  fwd_only = jaxamp.precision_report(fwd, gpt2_variables)
  assert sum(op.flops for op in ops) == fwd_only.total_flops
  assert sum(op.flops for op in ops if op.is_half) == fwd_only.half_flops
  assert (fwd_only.half_share == 1.0) == (policy != "float32") == (lowered.half_share >= 0.99)


class HardCodedNNX(nnx.Module):
  """An NNX model written like published ones: every layer built with dtype=float32, and a
  home-made norm class (not Flax's)."""

  class RMSNormGated(nnx.Module):
    def __init__(self, dim):
      self.scale = nnx.Param(jnp.ones(dim))

    def __call__(self, x):
      self.seen = x.dtype  # what the norm computes in
      return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]

  def __init__(self, rngs):
    f32 = jnp.float32
    self.embed = nnx.Embed(64, 32, dtype=f32, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(4, 32, dtype=f32, decode=False, rngs=rngs)
    self.norm = HardCodedNNX.RMSNormGated(32)
    self.ln = nnx.LayerNorm(32, dtype=f32, rngs=rngs)
    self.head = nnx.Linear(32, 64, dtype=f32, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    x = x + self.attn(self.norm(x))
    return self.head(self.ln(x))


def test_native_nnx_model_with_hard_coded_float32_runs_in_half():
  model = HardCodedNNX(nnx.Rngs(0))
  ids = token_ids(batch=2)[:, :16] % 64

  def loss(m):
    return lm_loss(m(ids), ids)

  fn, params, rest = nnx_loss(model, None, loss)
  assert report(fn, params, rest).half_share == 0.0  # float32 as written
  fn, params, rest = nnx_loss(model, "mixed_bfloat16", loss)
  got = report(fn, params, rest)
  assert got.half_share >= 0.99, str(got)
  jaxamp.nnx.with_policy(model, "mixed_bfloat16")(ids)
  assert model.norm.seen == jnp.float32  # found by its name: computes in float32


def test_fp8_policy_reaches_gpt2_projections_and_trains(gpt2_variables, fresh_warnings):
  """Hugging Face GPT-2's projections are FlaxConv1D (lax.dot_general called directly, most
  of its matmul FLOPs): 'mixed_fp8' runs them in FP8 (jaxamp.hf_layers), each with its
  delayed-scaling state, as its tied LM head (a Dense run through ``lm_head.apply``); no
  unreached-matmul warning; two steps train."""
  ids = token_ids()
  train = jaxamp.make_train_step(lambda m, b: lm_loss(m(*gpt2_inputs(b))[0], b),
                                 optax.adam(3e-3), policy="mixed_fp8")
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*XLA on CPU runs FP8.*")
    warnings.simplefilter("error")  # no unreached-matmul warning, no fallback
    state = train.init(gpt2_module(), gpt2_variables, *gpt2_inputs(ids))
    losses = []
    for _ in range(2):
      state, metrics = train.step(state, ids)
      losses.append(float(metrics["loss"]))
  projections = {f"transformer/h/{i}/{p}" for i in range(2)
                 for p in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")}
  assert set(state.fp8) == projections | {"lm_head"}
  assert all(np.asarray(state.fp8[p].amax_history)[:, :2].all() for p in projections)
  assert np.isfinite(losses).all() and losses[1] < losses[0]
  # 8 projections and the LM head: E4M3 forward dots, two E5M2 backward dots each
  dots = [line for line in train.lower(state, ids, platforms=("cuda",)).as_text().splitlines()
          if "stablehlo.dot_general" in line]
  assert sum(line.count("f8E4M3FN>") == 2 for line in dots) == 9
  assert sum("f8E5M2" in line for line in dots) == 18
  # the census: every projection's matmul has FP8 operands
  ops, names, _ = jaxamp.linen.with_policy(gpt2_module(), "mixed_fp8").matmul_census(
      gpt2_variables, *gpt2_inputs(ids))
  conv = [op for op in ops if op.module is not None
          and names[op.module].rsplit("/", 1)[-1] in ("c_attn", "c_proj", "c_fc")]
  assert len(conv) == 8 and all(op.lhs_dtype == "float8_e4m3fn" for op in conv)


def test_gpt2_clip_reuses_the_step_norm_through_optax_combinators(gpt2_variables):
  """jaxamp.clip_by_global_norm on a model it was not written for (HF GPT-2, Linen):
  directly or inside inject_hyperparams it adds no reduction (the step's norm serves);
  inside MultiSteps, whose updates are new arrays, it takes its own, as optax's does.
  Lowering only; the results' parity with optax is in tests/test_clipping.py."""
  ids = token_ids()

  def reductions(tx):
    train = jaxamp.make_train_step(lambda apply, b: gpt2_apply_loss(apply, b), tx,
                                   policy="mixed_bfloat16",
                                   memory=jaxamp.MemoryConfig(donate=False))
    state = train.init(gpt2_module(), gpt2_variables, *gpt2_inputs(ids))
    text = train.lower(state, ids).as_text()
    return len(re.findall(r"stablehlo\.reduce\b", text)), len(jax.tree.leaves(state.params))

  sgd = optax.sgd(1e-2)
  none, n_params = reductions(sgd)
  assert reductions(optax.chain(jaxamp.clip_by_global_norm(0.1), sgd))[0] == none
  injected = optax.inject_hyperparams(jaxamp.clip_by_global_norm)(max_norm=0.1)
  assert reductions(optax.chain(injected, sgd))[0] == none
  assert reductions(optax.chain(optax.clip_by_global_norm(0.1), sgd))[0] == none + n_params
  multi = lambda clip: optax.MultiSteps(optax.chain(clip(0.1), sgd), 2)
  assert (reductions(multi(jaxamp.clip_by_global_norm))[0]
          == reductions(multi(optax.clip_by_global_norm))[0])


def test_gpt2_skip_nonfinite_false_applies_the_step_the_default_skips(gpt2_variables):
  """skip_nonfinite=False on a model it was not written for (HF GPT-2, Linen, bfloat16):
  no cond in the program, and an inf step reaches the parameters, where the default
  step leaves them bit-identical."""
  def loss_fn(apply, batch):
    ids, scale = batch
    return gpt2_apply_loss(apply, ids) * scale

  ids = token_ids()
  bad = (ids, jnp.float32(jnp.inf))
  for skip in (True, False):
    train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="mixed_bfloat16",
                                   memory=jaxamp.MemoryConfig(donate=False), skip_nonfinite=skip)
    state = train.init(gpt2_module(), gpt2_variables, *gpt2_inputs(ids))
    conds = [e.primitive.name for e in train.trace(state, bad).jaxpr.eqns].count("cond")
    new, metrics = train.step(state, bad)
    assert not bool(metrics["grads_finite"])
    after = [np.asarray(x) for x in jax.tree.leaves(new.params)]
    if skip:
      assert conds == 1 and int(metrics["skipped_steps"]) == 1
      for a, b in zip(after, jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    else:
      assert conds == 0 and int(metrics["skipped_steps"]) == 0
      assert not all(np.isfinite(a).all() for a in after)  # applied, as optax would


def test_beit_with_stochastic_depth_traces_with_its_droppath_stream():
  """Hugging Face's Flax BEiT draws stochastic depth from a 'droppath' RNG stream, which
  the step did not give (only 'dropout'): it could not be trained. Named in rng_streams,
  its step traces; left out, the error names the stream and the option. (Two layers: the
  rates rise linearly from 0 at the first.)"""
  beit = pytest.importorskip("transformers.models.beit.modeling_flax_beit")
  config = transformers.BeitConfig(image_size=8, patch_size=4, hidden_size=16,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=32, drop_path_rate=0.5, num_labels=3)
  module = beit.FlaxBeitForImageClassificationModule(config)
  batch = {"x": jax.ShapeDtypeStruct((4, 8, 8, 3), jnp.float32),
           "y": jax.ShapeDtypeStruct((4,), jnp.int32)}
  variables = jax.eval_shape(lambda x: module.init(jax.random.key(0), x), batch["x"])

  def loss(model, b):
    return xent(model(b["x"], deterministic=False).logits, b["y"])

  for streams in [("dropout",), ("dropout", "droppath")]:
    train = jaxamp.make_train_step(loss, optax.sgd(0.1), policy="mixed_bfloat16",
                                   rng_streams=streams)
    state = jax.eval_shape(lambda v: train.init(module, v), variables)
    if streams == ("dropout",):
      with pytest.raises(ValueError, match=r"'droppath'.*rng_streams=\('dropout', 'droppath'\)"):
        train.trace(state, batch)
    else:
      assert "random_bits" in str(train.trace(state, batch).jaxpr)
