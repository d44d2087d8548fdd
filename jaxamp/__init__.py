"""Keras-style mixed precision for JAX, Flax and optax.

jaxamp trains unmodified Flax models (NNX and Linen) and plain JAX functions in float16 or
bfloat16: a policy names the param, compute and output dtypes; rules attach policies to
modules; loss scaling is an optax transformation; one compiled train step does the rest.

Entry points:
  policies       ``get_policy('mixed_bfloat16')``, ``set_global_policy``, ``policy_scope``
  rules          ``set_policy(cls_or_path_glob, policy)``, ``policy_rules({...})``; norms
                 compute in float32 by default (``float32_compute``)
  models         ``with_policy(model, policy)`` for Flax NNX, Flax Linen and Equinox models
                 (``jaxamp.nnx`` / ``linen`` / ``equinox.with_policy`` take each one's options)
  train step     ``make_train_step(loss_fn, optimizer, policy=...)``: a ``TrainStep`` with
                 ``init``, ``step``, ``eval_step``, ``model``, ``trace``, ``lower``; loss
                 scaling, exact skips, accumulation; grouped options ``ShardingConfig``
                 (mesh, FSDP), ``MemoryConfig``, ``DebugConfig``;
                 ``half_residuals(fn)``: the backward pass keeps half values and statistics
  your own step  ``optax.chain(dynamic_loss_scale(), ...)`` inside ``skip_nonfinite``, with
                 ``scale_loss`` and ``get_loss_scale``
  8 bytes/param  bfloat16 storage without a float32 master: ``stochastic_rounding``,
                 ``kahan_summation``, ``opt_state_dtype(tx, jnp.bfloat16)``
  per operation  ``autocast(fn, policy)``; Apex levels ``opt_level('O1')``
  FP8            the ``'mixed_fp8'`` policies; recipes in ``jaxamp.fp8``; rowwise scales
                 (``'mixed_fp8_rowwise'``) in ``jaxamp.rowwise``; OCP MX blocks
                 (``'mixed_mxfp8'``) in ``jaxamp.mxfp8``; DeepSeek-V3's 1x128 /
                 128x128 blocks (``'mixed_fp8_block'``) in ``jaxamp.block``; a format per
                 matmul (``PerMatmulScaling``) in ``jaxamp.per_matmul``; other scaled
                 formats plug in through ``jaxamp.scaled``
  inspection     ``precision_report``, ``summary``, ``convert_for_inference``

``set_global_policy`` is read by the entry points above that take ``policy=None``, when
they are called (a Flax model called directly ignores it, and a warning says so). Guides and the API reference: ``docs/`` in the repository.

Example:
  >>> import jax.numpy as jnp, optax, jaxamp
  >>> from flax import nnx
  >>> train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b) ** 2), optax.adam(1e-3),
  ...                                policy='mixed_bfloat16')
  >>> state = train.init(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> state, metrics = train.step(state, jnp.ones((8, 4)))
  >>> int(metrics['skipped_steps']), state.params['kernel'].dtype
  (0, dtype('float32'))
"""

from jaxamp.autocast import autocast
from jaxamp.casting import cast_floating
from jaxamp.clipping import clip_by_global_norm
from jaxamp.fp8 import CurrentScaling, DelayedScaling, Fp8Meta
from jaxamp.rowwise import RowwiseScaling
from jaxamp.mxfp8 import MXFP8Scaling
from jaxamp.block import BlockScaling
from jaxamp.per_matmul import PerMatmulScaling
from jaxamp.loss_scale import (
    LossScaleState,
    SkipNonfiniteState,
    all_finite,
    check_loss_scale_placement,
    dynamic_loss_scale,
    get_loss_scale,
    loss_scale_for,
    no_loss_scale,
    scale_loss,
    skip_nonfinite,
    static_loss_scale,
)
from jaxamp.op_lists import AutocastLists, ReductionSize
from jaxamp.opt_levels import OPT_LEVELS, OptLevel, opt_level
from jaxamp.policy import (
    POLICY_NAMES,
    Policy,
    get_policy,
    global_policy,
    policy_scope,
    set_global_policy,
)
from jaxamp.numerics import Numerics
from jaxamp.numerics_log import NumericsLog, PolicySuggestion, suggest_policy
from jaxamp.residuals import half_residuals
from jaxamp.rounding import (
    ApplyUpdates,
    KahanState,
    OptStateDtypeState,
    StochasticRoundingState,
    kahan_summation,
    opt_state_dtype,
    stochastic_round,
    stochastic_rounding,
)
from jaxamp.sharding import annotated, fsdp
from jaxamp.report import MatmulOp, PrecisionReport, precision_report
from jaxamp.adapters import with_policy
from jaxamp.inference import convert_for_inference
from jaxamp.summary import Summary, SummaryRow, summary
from jaxamp.train import (
    DebugConfig,
    MasterWeightsState,
    MemoryConfig,
    RoundingState,
    ShardingConfig,
    TrainState,
    TrainStep,
    abstract_state,
    make_train_step,
)
from jaxamp.rules import (
    NAMED_NORMS,
    NORM_CLASSES,
    clear_policies,
    float32_compute,
    policy_rules,
    resolve_policy,
    set_policy,
)

from jaxamp import block, fp8, linen, mxfp8, nnx, per_matmul, rowwise, scaled

__version__ = "0.1.0"

__all__ = [
    "Numerics",
    "NumericsLog",
    "PolicySuggestion",
    "suggest_policy",
    "fp8",
    "scaled",
    "RowwiseScaling",
    "MXFP8Scaling",
    "BlockScaling",
    "PerMatmulScaling",
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Meta",
    "linen",
    "nnx",
    "POLICY_NAMES",
    "MatmulOp",
    "Policy",
    "PrecisionReport",
    "cast_floating",
    "get_policy",
    "global_policy",
    "policy_scope",
    "precision_report",
    "set_global_policy",
    "NAMED_NORMS",
    "NORM_CLASSES",
    "clear_policies",
    "float32_compute",
    "policy_rules",
    "resolve_policy",
    "set_policy",
    "LossScaleState",
    "SkipNonfiniteState",
    "all_finite",
    "check_loss_scale_placement",
    "clip_by_global_norm",
    "ApplyUpdates",
    "KahanState",
    "OptStateDtypeState",
    "StochasticRoundingState",
    "kahan_summation",
    "opt_state_dtype",
    "stochastic_round",
    "stochastic_rounding",
    "dynamic_loss_scale",
    "get_loss_scale",
    "loss_scale_for",
    "no_loss_scale",
    "scale_loss",
    "skip_nonfinite",
    "static_loss_scale",
    "DebugConfig",
    "MasterWeightsState",
    "MemoryConfig",
    "RoundingState",
    "ShardingConfig",
    "TrainState",
    "TrainStep",
    "abstract_state",
    "half_residuals",
    "make_train_step",
    "annotated",
    "fsdp",
    "Summary",
    "SummaryRow",
    "convert_for_inference",
    "with_policy",
    "summary",
    "AutocastLists",
    "OPT_LEVELS",
    "OptLevel",
    "ReductionSize",
    "autocast",
    "opt_level",
]
