"""jaxamp: Keras-style mixed precision for JAX, Flax and optax."""

from jaxamp.autocast import autocast
from jaxamp.casting import cast_floating
from jaxamp.clipping import clip_by_global_norm
from jaxamp.fp8 import CurrentScaling, DelayedScaling, Fp8Meta
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
from jaxamp.sharding import annotated, fsdp
from jaxamp.report import MatmulOp, PrecisionReport, precision_report
from jaxamp.inference import convert_for_inference
from jaxamp.summary import Summary, SummaryRow, summary
from jaxamp.train import MasterWeightsState, TrainState, TrainStep, abstract_state, make_train_step
from jaxamp.rules import (
    NAMED_NORMS,
    NORM_CLASSES,
    clear_policies,
    float32_compute,
    policy_rules,
    resolve_policy,
    set_policy,
)

from jaxamp import fp8, linen, nnx

__version__ = "0.1.0"

__all__ = [
    "fp8",
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
    "dynamic_loss_scale",
    "get_loss_scale",
    "loss_scale_for",
    "no_loss_scale",
    "scale_loss",
    "skip_nonfinite",
    "static_loss_scale",
    "MasterWeightsState",
    "TrainState",
    "TrainStep",
    "abstract_state",
    "make_train_step",
    "annotated",
    "fsdp",
    "Summary",
    "SummaryRow",
    "convert_for_inference",
    "summary",
    "AutocastLists",
    "OPT_LEVELS",
    "OptLevel",
    "ReductionSize",
    "autocast",
    "opt_level",
]
