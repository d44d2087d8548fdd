"""Converting a trained model for serving: parameters stored in each module's compute dtype.

Like MXNet's ``convert_hybrid_block``: under ``'mixed_bfloat16'`` every matmul weight is
stored in bfloat16 (half the memory) while modules that compute in float32 — the
normalization layers by default — keep float32 parameters. Non-trainable state
(BatchNorm statistics) is left as it is. Call the converted model under the same policy
(``jaxamp.nnx.with_policy`` / ``jaxamp.linen.with_policy`` / ``jaxamp.equinox.with_policy``)
to compute in half precision.

Example:
  >>> import jax.numpy as jnp, jaxamp
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
  >>> served = jaxamp.convert_for_inference(model, policy='mixed_bfloat16')
  >>> served.layers[0].kernel.get_value().dtype, served.layers[1].scale.get_value().dtype
  (dtype(bfloat16), dtype('float32'))
  >>> model.layers[0].kernel.get_value().dtype  # the original is untouched
  dtype('float32')
"""

from __future__ import annotations

from typing import Any

from jaxamp import adapters
from jaxamp.policy import PolicyLike

__all__ = ["convert_for_inference"]


def convert_for_inference(model_or_variables: Any, *example_inputs: Any,
                          policy: PolicyLike | None = None, module: Any = None) -> Any:
  """Stores each module's parameters in its compute dtype, for serving.

  Args:
    model_or_variables: an NNX module (or ``jaxamp.nnx.with_policy`` wrapper), an
      Equinox model (or ``jaxamp.equinox`` view), or Linen variables (then pass
      ``module`` and ``example_inputs``).
    *example_inputs: for Linen, inputs to trace the module with (arrays or
      ``jax.ShapeDtypeStruct``), to learn which module owns which parameter.
    policy: the model-level policy; None for the global policy (or the wrapper's).
    module: the Linen module the variables belong to.

  Returns:
    A converted copy: a new NNX module, new Linen variables, or a new Equinox model (a
    plain one: call it under the policy with ``jaxamp.equinox.with_policy``). The input
    is unchanged.

  Example:
    >>> import jax, equinox as eqx, jaxamp
    >>> mlp = eqx.nn.Sequential([eqx.nn.Linear(4, 8, key=jax.random.key(0)),
    ...                          eqx.nn.LayerNorm(8)])
    >>> served = jaxamp.convert_for_inference(mlp, policy='mixed_bfloat16')
    >>> served.layers[0].weight.dtype, served.layers[1].weight.dtype
    (dtype(bfloat16), dtype('float32'))
  """
  # Linen variables are a plain dict: the module names the library.
  library = adapters.library_of(model_or_variables)
  if library is None and module is not None:
    library = adapters.library_of(module)
  if library is None:
    raise ValueError("convert_for_inference takes an NNX module, an Equinox model, or "
                     "Linen variables with module=<the Linen module> and example inputs; "
                     f"got {type(model_or_variables).__name__} and module={module!r}.")
  return library.convert_for_inference(model_or_variables, example_inputs, policy, module)
