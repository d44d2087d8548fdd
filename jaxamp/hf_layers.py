"""Layers of other libraries that FP8 reaches by class name, without importing them.

Hugging Face's ``FlaxConv1D`` (GPT-2's attention and MLP projections: most of its
matmul FLOPs) reads its kernel and calls ``lax.dot_general`` itself, so no field of it
takes a ``dot_general``. The Linen wrapper runs its call as :func:`fp8_call` gives it:
the same parameters, read with ``self.param`` (so casts and FSDP gathers apply as to any
layer), and the same product through the format's dot, keyed by the module's path
(:func:`jaxamp.scaled.dot_for`). Which classes are known: :data:`jaxamp.fp8.NAMED_LAYERS`.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxamp
  >>> class FlaxConv1D(nn.Module):  # transformers' layer, known by module and name
  ...   features: int
  ...   use_bias: bool = False
  ...   dtype: jnp.dtype = jnp.float32
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     k = self.param('kernel', nn.initializers.ones, (self.features, x.shape[-1]))
  ...     return jax.lax.dot_general(x, k.T, (((1,), (0,)), ((), ())))
  >>> FlaxConv1D.__module__ = 'transformers.models.gpt2.modeling_flax_gpt2'
  >>> layer, x = FlaxConv1D(3), jnp.ones((2, 4))
  >>> v = layer.init(jax.random.key(0), x)
  >>> f = lambda x: jaxamp.with_policy(layer, 'mixed_fp8').apply(v, x)
  >>> 'f8E4M3FN' in jax.jit(f).lower(x).as_text()
  True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp import fp8 as fp8_lib
from jaxamp import fp8_stacked, scaled

__all__ = ["fp8_call"]


def _conv1d(module: Any, dot: Callable[..., Any], inputs: jax.Array) -> jax.Array:
  """``transformers``' ``FlaxConv1D.__call__`` with its matmul ``dot``: kernel
  ``[features, in]``, contracted on its last dimension (the original transposes it and
  contracts the first: the same product)."""
  inputs = jnp.asarray(inputs, module.dtype)
  kernel = module.param("kernel", jax.nn.initializers.normal(stddev=0.02),
                        (module.features, inputs.shape[-1]))
  kernel = jnp.asarray(kernel, module.dtype)
  y = dot(inputs, kernel, (((inputs.ndim - 1,), (1,)), ((), ())))
  if module.use_bias:
    bias = module.param("bias", jax.nn.initializers.zeros, (module.features,))
    y = y + jnp.asarray(bias, module.dtype)
  return y


_CALLS = {"FlaxConv1D": _conv1d}


def fp8_call(module: Any, path: tuple[str, ...], policy: Any,
             next_fun: Callable[..., Any] | None, lifted: bool) -> Callable[..., Any] | None:
  """The call a Linen ``module``'s ``__call__`` runs under ``policy``: for a layer of
  :data:`jaxamp.fp8.NAMED_LAYERS` whose format runs it, its product through the format's
  dot (where ``lifted``, inside ``nn.scan`` & co., with the state the transform lifts:
  :func:`jaxamp.fp8_stacked.linen_reads`); else ``next_fun``."""
  if not fp8_lib.runs_fp8(type(module), policy) or not fp8_lib.named_layer(type(module)):
    return next_fun
  name = next(c.__name__ for c in type(module).__mro__
              if (c.__module__, c.__name__) in fp8_lib.NAMED_LAYERS)
  where = "/".join(path)
  key, own = fp8_stacked.linen_reads(module, where, policy.fp8, lifted)
  dot = scaled.dot_for(key, policy.fp8, f"{name} {where}", own)
  return lambda inputs: _CALLS[name](module, dot, inputs)
