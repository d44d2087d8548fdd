"""The candidates the harness compares: one step per (implementation, model, policy).

- ``jaxamp``: the unmodified Flax model through :func:`jaxamp.make_train_step`. The LM's
  chain clips with :func:`jaxamp.clip_by_global_norm` (optax's rule, reusing the step's
  gradient norm), as the README recommends; the compile section also measures it with
  ``optax.clip_by_global_norm``.
- ``hand-written Flax``: the same model with ``dtype`` set by hand on every layer
  (parameters float32), the same optax chain, and for float16 the loss scaling written
  out with :func:`jaxamp.scale_loss`, :func:`jaxamp.dynamic_loss_scale` and
  :func:`jaxamp.skip_nonfinite` (BatchNorm statistics kept on a skipped step), as a
  careful user would write it. bfloat16 and float32 get a plain step.
- ``hand-written Flax + skip`` (overhead section, float32 and bfloat16): that plain step
  with the exact skip jaxamp's step always has (a float32 sum of squares of the
  gradients, then the update under ``lax.cond``; BatchNorm statistics kept on a skipped
  step), to tell the skip's cost from the rest of jaxamp's.
- ``Keras 3``: the Keras twin of the model (``benchmarks.models``) on the JAX backend
  under the Keras dtype policy, stepped the way Keras' own JAX trainer steps it
  (``stateless_call``, ``optimizer.scale_loss`` in a ``StatelessScope``,
  ``stateless_apply``; ``LossScaleOptimizer`` for ``mixed_float16``).
- ``jax.numpy`` / ``jaxamp.autocast``: a bare matmul, on inputs already in the dtype,
  or on float32 inputs that :func:`jaxamp.autocast` casts.

Policy labels: ``'float32'`` (default matmul precision: TF32 on Ampere and newer GPUs),
``'float32 HIGHEST'`` (``jax.default_matmul_precision('highest')``),
``'mixed_bfloat16'`` and ``'mixed_float16'`` (float32 params, half compute);
``'mixed_fp8'`` (:mod:`jaxamp.fp8`: FP8 Linear matmuls with delayed scaling, the rest as
``'mixed_bfloat16'``), jaxamp only, for the LM at ``--size gpu``: its speed needs a GPU
of compute capability >= 8.9, and it is compared with the ``'mixed_bfloat16'`` rows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxamp
from benchmarks import models
from benchmarks.measure import Candidate

POLICIES = ("float32", "float32 HIGHEST", "mixed_bfloat16", "mixed_float16")
IMPLS = ("jaxamp", "hand-written Flax", "Keras 3")
# The overhead section's third step under float32/bfloat16: the hand-written step with the
# exact skip jaxamp's step always has (float16's hand-written step has its own already).
HAND_SKIP = "hand-written Flax + skip"
# FP8: jaxamp's candidate only (a hand-written FP8 step is flax's fp8_ops, another design).
FP8_POLICIES = ("mixed_fp8",)
MATMUL_POLICIES = ("float32", "float32 HIGHEST", "bfloat16", "float16", "mixed_bfloat16",
                   "mixed_float16")

_COMPUTE = {"float32": None, "float32 HIGHEST": None, "mixed_bfloat16": jnp.bfloat16,
            "mixed_float16": jnp.float16, "mixed_fp8": jnp.bfloat16}


def _policy_name(label: str) -> str:
  return label.split()[0]


def _precision(label: str) -> str | None:
  return "highest" if label.endswith("HIGHEST") else None


def lm_optimizer(clip: Any = optax.clip_by_global_norm) -> optax.GradientTransformation:
  """AdamW after clipping by global norm; jaxamp's candidates pass
  ``jaxamp.clip_by_global_norm`` (the same rule, reusing the step's gradient norm)."""
  return optax.chain(clip(1.0), optax.adamw(3e-4, weight_decay=1e-4))


def resnet_optimizer() -> optax.GradientTransformation:
  return optax.sgd(0.1, momentum=0.9, nesterov=True)


def _hand_optimizer(tx: optax.GradientTransformation, label: str
                    ) -> tuple[optax.GradientTransformation, bool]:
  """The hand-written chain: dynamic loss scaling and skipping for float16 only."""
  if _COMPUTE[label] == jnp.float16:
    return jaxamp.skip_nonfinite(optax.chain(jaxamp.dynamic_loss_scale(), tx)), True
  return tx, False


def _wanted(impls: Sequence[str], impl: str, label: str) -> bool:
  # HIGHEST is a property of float32 matmuls, not of who wrote the step: one row does.
  if impl == HAND_SKIP and _COMPUTE[label] == jnp.float16:
    return False  # the float16 hand-written step skips already
  return impl in impls and (impl == "jaxamp" or not (label.endswith("HIGHEST")
                                                     or label in FP8_POLICIES))


def _exact_skip(finite_update: Any, grads: Any, old: Any) -> Any:
  """``finite_update()`` where every gradient is finite, else ``old`` unchanged: the
  exact skip of jaxamp's step written by hand (one float32 sum of squares, lax.cond)."""
  total = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
  return jax.lax.cond(jnp.isfinite(total), finite_update, lambda: old)


# --- the transformer LM ---------------------------------------------------------------------


def _jaxamp_nnx(make_model: Any, loss_fn: Any, tx: optax.GradientTransformation, label: str,
                batch: Any, items: int) -> Candidate:
  """An unmodified NNX model (``make_model(dtype=None)``) through ``make_train_step``."""
  policy = _policy_name(label)
  train = jaxamp.make_train_step(loss_fn, tx, policy=policy)
  state = train.init(make_model(dtype=None))

  def report() -> jaxamp.PrecisionReport:
    graphdef, params, rest = nnx.split(train.model(state), nnx.Param, ...)

    def loss(params, rest, batch):
      model = jaxamp.nnx.with_policy(nnx.merge(graphdef, params, rest), policy)
      return loss_fn(model, batch)

    return jaxamp.precision_report(loss, params, rest, batch, backward=True)

  return Candidate("jaxamp", label, train.step, state, batch, report, _precision(label),
                   items, call=train.step, trace=train.trace)


def _hand_nnx(make_model: Any, loss_fn: Any, tx: optax.GradientTransformation, label: str,
              batch: Any, items: int, skip: bool = False) -> Candidate:
  """The NNX model with ``dtype`` set by hand on every layer, in a hand-written step
  (``skip``: with jaxamp's exact skip, :func:`_exact_skip`)."""
  model = make_model(dtype=_COMPUTE[label])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx, scaled = _hand_optimizer(tx, label)

  def loss(params, rest, batch):
    return loss_fn(nnx.merge(graphdef, params, rest), batch)

  def step(state, batch):
    params, opt_state, rest = state
    if scaled:
      def scaled_loss(p):
        value = loss(p, rest, batch)
        return jaxamp.scale_loss(value, opt_state), value
      (_, value), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
    else:
      value, grads = jax.value_and_grad(loss)(params, rest, batch)

    def update():
      updates, new_opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), new_opt_state

    params, opt_state = _exact_skip(update, grads, (params, opt_state)) if skip else update()
    return (params, opt_state, rest), value

  report = lambda: jaxamp.precision_report(loss, params, rest, batch, backward=True)
  return Candidate(HAND_SKIP if skip else "hand-written Flax", label, step,
                   (params, tx.init(params), rest), batch, report, None, items)


def _jaxamp_lm(cfg: models.LMConfig, label: str, batch: Any, seed: int,
               clip: Any = jaxamp.clip_by_global_norm) -> Candidate:
  make = lambda dtype: models.GPT(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  return _jaxamp_nnx(make, models.lm_loss, lm_optimizer(clip), label, batch, cfg.tokens)


def _hand_lm(cfg: models.LMConfig, label: str, batch: Any, seed: int,
             skip: bool = False) -> Candidate:
  make = lambda dtype: models.GPT(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  return _hand_nnx(make, models.lm_loss, lm_optimizer(), label, batch, cfg.tokens, skip)


def _keras_step(keras: Any, model: Any, optimizer: Any, loss_of: Any):
  """Keras' JAX trainer step, written with public API: forward, scaled loss, apply."""

  def forward(trainable, non_trainable, batch):
    out, non_trainable = model.stateless_call(trainable, non_trainable, batch[0],
                                              training=True)
    return loss_of(out, batch[1]), non_trainable

  def step(state, batch):
    trainable, non_trainable, opt_vars = state

    def scaled_loss(trainable):
      loss, new_non_trainable = forward(trainable, non_trainable, batch)
      with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, opt_vars))):
        scaled = optimizer.scale_loss(loss)
      return scaled, (loss, new_non_trainable)

    (_, (loss, non_trainable)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(trainable)
    trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
    return (trainable, non_trainable, opt_vars), loss

  optimizer.build(model.trainable_variables)
  state = ([v.value for v in model.trainable_variables],
           [v.value for v in model.non_trainable_variables],
           [v.value for v in optimizer.variables])
  return step, state, forward


def _keras_candidate(keras, model, optimizer, label, batch, loss_of, items) -> Candidate:
  if _policy_name(label) == "mixed_float16":
    optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
  step, state, forward = _keras_step(keras, model, optimizer, loss_of)
  trainable, non_trainable, _ = state
  report = lambda: jaxamp.precision_report(lambda t, n, b: forward(t, n, b)[0], trainable,
                                           non_trainable, batch, backward=True)
  return Candidate("Keras 3", label, step, state, batch, report, None, items)


def _keras_lm(cfg: models.LMConfig, label: str, batch: Any, seed: int) -> Candidate:
  keras = models.import_keras()
  keras.utils.set_random_seed(seed)
  model = models.keras_gpt(cfg, _policy_name(label))
  optimizer = keras.optimizers.AdamW(3e-4, weight_decay=1e-4, global_clipnorm=1.0)
  return _keras_candidate(keras, model, optimizer, label, (batch["ids"], batch["targets"]),
                          models.cross_entropy, cfg.tokens)


def lm_candidates(cfg: models.LMConfig, impls: Sequence[str] = IMPLS,
                  policies: Sequence[str] = POLICIES, seed: int = 0, *,
                  jaxamp_clip: Any = jaxamp.clip_by_global_norm) -> list[Candidate]:
  """Every wanted (policy, implementation) pair for the transformer LM; ``jaxamp_clip``
  is the clipping element of jaxamp's chain (``optax.clip_by_global_norm`` to measure
  an unchanged optax chain)."""
  batch = models.lm_batch(cfg, seed)
  build = {"jaxamp": functools.partial(_jaxamp_lm, clip=jaxamp_clip),
           "hand-written Flax": _hand_lm, "Keras 3": _keras_lm,
           HAND_SKIP: functools.partial(_hand_lm, skip=True)}
  return [build[impl](cfg, label, batch, seed)
          for label in policies for impl in (*IMPLS, HAND_SKIP) if _wanted(impls, impl, label)]


def eager_candidates(cfg: models.LMConfig, policies: Sequence[str] = POLICIES,
                     seed: int = 0) -> list[Candidate]:
  """The LM's forward pass called eagerly (no ``jit``): ``jaxamp.nnx.with_policy(model)``
  against the model with ``dtype`` set by hand, one pair per policy. Each op dispatches
  on its own, so this measures the wrapper's per-call Python work."""
  batch = models.lm_batch(cfg, seed)
  out = []
  for label in policies:
    if label not in _COMPUTE or _precision(label):
      continue
    amp = jaxamp.nnx.with_policy(models.GPT(cfg, dtype=None, rngs=nnx.Rngs(seed)),
                                 _policy_name(label))
    hand = models.GPT(cfg, dtype=_COMPUTE[label], rngs=nnx.Rngs(seed))
    for impl, model in (("jaxamp", amp), ("hand-written Flax", hand)):
      forward = lambda state, batch, model=model: (state, model(batch["ids"]))
      out.append(Candidate(impl, label, forward, (), batch, None, None, cfg.tokens,
                           call=forward))
  return out


# --- the parameter-heavy MLP (overhead only) -------------------------------------------------


def mlp_candidates(cfg: models.MLPConfig, impls: Sequence[str] = IMPLS,
                   policies: Sequence[str] = POLICIES, seed: int = 0) -> list[Candidate]:
  """jaxamp and hand-written steps for the MLP (Adam: optimizer work dominates the step)."""
  batch = models.mlp_batch(cfg, seed)
  make = lambda dtype: models.MLP(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  build = {"jaxamp": _jaxamp_nnx, "hand-written Flax": _hand_nnx,
           HAND_SKIP: functools.partial(_hand_nnx, skip=True)}
  return [build[impl](make, models.mlp_loss, optax.adam(1e-3), label, batch, cfg.batch)
          for label in policies for impl in (*IMPLS, HAND_SKIP) if impl in build
          and _wanted(impls, impl, label)]


# --- ResNet -----------------------------------------------------------------------------------


_INIT_CACHE: dict[Any, Any] = {}


def _resnet_variables(cfg: models.ResNetConfig, batch: Any, seed: int) -> Any:
  """The float32 variables of the unmodified module, made once per config: ``dtype``
  changes no parameter, so every Flax candidate starts from the same values."""
  key = (cfg, seed)
  if key not in _INIT_CACHE:
    module = models.resnet_module(cfg)
    init = jax.jit(lambda key, x: module.init(key, x, train=False))
    _INIT_CACHE.clear()  # one config at a time: keep memory flat
    _INIT_CACHE[key] = init(jax.random.key(seed), batch["image"][:1])
  return jax.tree.map(jnp.copy, _INIT_CACHE[key])  # a step donates its state: no sharing


def _resnet_loss(model: Any, batch: Any) -> jax.Array:
  return models.cross_entropy(model(batch["image"], train=True), batch["label"])


def _jaxamp_resnet(cfg: models.ResNetConfig, label: str, batch: Any, seed: int) -> Candidate:
  policy = _policy_name(label)
  module = models.resnet_module(cfg)
  train = jaxamp.make_train_step(_resnet_loss, resnet_optimizer(), policy=policy)
  state = train.init(module, _resnet_variables(cfg, batch, seed))
  amp = jaxamp.linen.with_policy(module, policy)

  def loss(params, other, batch):
    logits, _ = amp.apply({"params": params, **other}, batch["image"], train=True,
                          mutable=list(other))
    return models.cross_entropy(logits, batch["label"])

  report = lambda: jaxamp.precision_report(loss, state.params, state.model_state, batch,
                                           backward=True)
  return Candidate("jaxamp", label, train.step, state, batch, report, _precision(label),
                   cfg.batch, call=train.step, trace=train.trace)


def _hand_resnet(cfg: models.ResNetConfig, label: str, batch: Any, seed: int,
                 skip: bool = False) -> Candidate:
  module = models.resnet_module(cfg, dtype=_COMPUTE[label])
  variables = _resnet_variables(cfg, batch, seed)
  params, stats = variables["params"], variables["batch_stats"]
  tx, scaled = _hand_optimizer(resnet_optimizer(), label)

  def loss(params, stats, batch):
    logits, updates = module.apply({"params": params, "batch_stats": stats}, batch["image"],
                                   train=True, mutable=["batch_stats"])
    return models.cross_entropy(logits, batch["label"]), updates["batch_stats"]

  def step(state, batch):
    params, opt_state, stats = state
    if scaled:
      def scaled_loss(p):
        value, new_stats = loss(p, stats, batch)
        return jaxamp.scale_loss(value, opt_state), (value, new_stats)
      (_, (value, new_stats)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
    else:
      (value, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(params, stats, batch)
    if skip:  # a skipped step keeps the BatchNorm statistics too
      def update():
        updates, new_opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state, new_stats
      return _exact_skip(update, grads, (params, opt_state, stats)), value
    updates, opt_state = tx.update(grads, opt_state, params)
    if scaled:  # an overflow step must not move the BatchNorm statistics either
      finite = optax.tree_utils.tree_get(opt_state, "LossScaleState").finite
      new_stats = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_stats, stats)
    return (optax.apply_updates(params, updates), opt_state, new_stats), value

  report = lambda: jaxamp.precision_report(lambda p, s, b: loss(p, s, b)[0], params, stats,
                                           batch, backward=True)
  return Candidate(HAND_SKIP if skip else "hand-written Flax", label, step,
                   (params, tx.init(params), stats), batch, report, None, cfg.batch)


def _keras_resnet(cfg: models.ResNetConfig, label: str, batch: Any, seed: int) -> Candidate:
  keras = models.import_keras()
  keras.utils.set_random_seed(seed)
  model = models.keras_resnet(cfg, _policy_name(label))
  optimizer = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)
  return _keras_candidate(keras, model, optimizer, label, (batch["image"], batch["label"]),
                          models.cross_entropy, cfg.batch)


def resnet_candidates(cfg: models.ResNetConfig, impls: Sequence[str] = IMPLS,
                      policies: Sequence[str] = POLICIES, seed: int = 0) -> list[Candidate]:
  """Every wanted (policy, implementation) pair for ResNet."""
  batch = models.image_batch(cfg, seed)
  build = {"jaxamp": _jaxamp_resnet, "hand-written Flax": _hand_resnet,
           "Keras 3": _keras_resnet, HAND_SKIP: functools.partial(_hand_resnet, skip=True)}
  return [build[impl](cfg, label, batch, seed)
          for label in policies for impl in (*IMPLS, HAND_SKIP) if _wanted(impls, impl, label)]


# --- a large matmul -----------------------------------------------------------------------------


def matmul_candidates(n: int, policies: Sequence[str] = MATMUL_POLICIES,
                      seed: int = 0) -> list[Candidate]:
  """``(n, n) @ (n, n)``: pure dtypes on inputs already cast, and ``mixed_*`` through
  :func:`jaxamp.autocast` on float32 inputs (it casts them to the half dtype and asks
  for a half-precision result; XLA chooses the accumulation type)."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  a32 = jax.random.normal(k1, (n, n), jnp.float32)
  b32 = jax.random.normal(k2, (n, n), jnp.float32)
  out = []
  for label in policies:
    if label.startswith("mixed_"):
      fn, impl, dtype = jaxamp.autocast(jnp.matmul, label), "jaxamp.autocast", jnp.float32
    else:
      fn, impl, dtype = jnp.matmul, "jax.numpy", jnp.dtype(_policy_name(label))
    batch = (a32.astype(dtype), b32.astype(dtype))

    def step(state, batch, fn=fn):
      return state, fn(*batch)

    report = lambda fn=fn, batch=batch: jaxamp.precision_report(fn, *batch)
    out.append(Candidate(impl, label, step, jnp.zeros(()), batch, report, _precision(label),
                         None))
  return out
