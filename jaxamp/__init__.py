"""jaxamp: Keras-style mixed precision for JAX, Flax and optax."""

from jaxamp.casting import cast_floating
from jaxamp.policy import (
    POLICY_NAMES,
    Policy,
    get_policy,
    global_policy,
    policy_scope,
    set_global_policy,
)

__version__ = "0.1.0"

__all__ = [
    "POLICY_NAMES",
    "Policy",
    "cast_floating",
    "get_policy",
    "global_policy",
    "policy_scope",
    "set_global_policy",
]
