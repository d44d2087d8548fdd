"""Dot-product attention whose matmuls take half-precision operands forward and backward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scores(query, key, precision):
  """Float32 logits ``[..., K, G, T, S]`` of ``query [..., T, K, G, D]`` and
  ``key [..., S, K, D]`` (K key/value heads, G query heads per key/value head)."""
  return jnp.einsum("...tkgd,...skd->...kgts", query, key, precision=precision,
                    preferred_element_type=jnp.float32)


def _scores_fwd(query, key, precision):
  return _scores(query, key, precision), (query, key)


def _scores_bwd(precision, residuals, grad):
  # The float32 cotangent is rounded to the operands' dtype first, so the two
  # backward matmuls run on half-precision operands too (as for any half matmul).
  query, key = residuals
  grad = grad.astype(query.dtype)
  d_query = jnp.einsum("...kgts,...skd->...tkgd", grad, key, precision=precision)
  d_key = jnp.einsum("...kgts,...tkgd->...skd", grad, query, precision=precision)
  return d_query.astype(query.dtype), d_key.astype(key.dtype)


_scores.defvjp(_scores_fwd, _scores_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(logits, keep, dtype):
  """``softmax(where(keep, logits, -inf))`` over the last axis in float32, cast to ``dtype``."""
  if keep is not None:
    logits = jnp.where(keep, logits, jnp.finfo(logits.dtype).min)
  return jax.nn.softmax(logits, axis=-1).astype(dtype)


def _softmax_fwd(logits, keep, dtype):
  probs = _softmax(logits, keep, dtype)
  return probs, (probs, keep)


def _softmax_bwd(dtype, residuals, grad):
  # The backward pass needs the probabilities, which the second matmul keeps anyway
  # in ``dtype``: reuse them rather than also saving them in float32.
  del dtype
  probs, keep = residuals
  probs = probs.astype(jnp.float32)
  grad = grad.astype(jnp.float32)
  d_logits = probs * (grad - jnp.sum(grad * probs, axis=-1, keepdims=True))
  if keep is not None:
    d_logits = jnp.where(keep, d_logits, 0.0)
  return d_logits, None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _by_group(x, groups: int):
  """``[..., H, T, S]`` masks and biases to the grouped ``[..., K, G, T, S]`` layout."""
  if x.ndim < 3:
    return x
  if x.shape[-3] == 1:
    return x[..., None, :, :]
  return x.reshape(x.shape[:-3] + (x.shape[-3] // groups, groups) + x.shape[-2:])


def half_dot_product_attention(query, key, value, bias=None, mask=None,
                               broadcast_dropout: bool = True, dropout_rng=None,
                               dropout_rate: float = 0.0, deterministic: bool = False,
                               dtype=None, precision=None, module=None,
                               is_causal: bool = False, **kwargs):
  """Dot-product attention whose matmuls take ``dtype`` operands forward and backward.

  A drop-in ``attention_fn`` for ``nnx.MultiHeadAttention`` (same arguments and
  semantics as ``nnx.dot_product_attention``, grouped-query attention included):
  logits are accumulated and returned in float32 and the softmax runs in float32, as
  in ``jax.nn.dot_product_attention``; the probabilities are cast to ``dtype`` for the
  second matmul. Unlike ``jax.nn.dot_product_attention`` it asks for no
  ``F16_F16_F32``/``BF16_BF16_F32`` dot algorithm (XLA on CPU rejects the float16
  one) and the logits' gradient is rounded to ``dtype`` before the backward matmuls,
  so those run in half precision too. :func:`with_policy` uses it for
  ``nnx.MultiHeadAttention`` layers that keep the default ``attention_fn`` and compute
  in float16 or bfloat16.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxamp.nnx import half_dot_product_attention
    >>> q = jnp.ones((2, 5, 4, 8), jnp.float16)  # [batch, length, heads, head_dim]
    >>> half_dot_product_attention(q, q, q).dtype
    dtype('float16')
  """
  del kwargs  # promote_dtype: the inputs are cast to ``dtype`` here
  dtype = query.dtype if dtype is None else dtype
  query, key, value = (jnp.asarray(t, dtype) for t in (query, key, value))
  heads, kv_heads = query.shape[-2], key.shape[-2]
  if heads % kv_heads:
    raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads "
                     f"({kv_heads}).")
  groups = heads // kv_heads
  *batch, length, _, depth = query.shape
  query = query / jnp.sqrt(depth).astype(dtype)
  query = query.reshape(*batch, length, kv_heads, groups, depth)
  logits = _scores(query, key, precision)  # [..., K, G, T, S] float32
  if bias is not None:
    logits = logits + _by_group(jnp.asarray(bias, jnp.float32), groups)
  keep = None if mask is None else _by_group(jnp.asarray(mask, bool), groups)
  if is_causal:
    causal = jnp.tril(jnp.ones(logits.shape[-2:], bool))
    keep = causal if keep is None else jnp.logical_and(keep, causal)
  weights = _softmax(logits, keep, np.dtype(dtype))  # [..., K, G, T, S]
  dropout = not deterministic and dropout_rate > 0.0
  if module is not None or dropout:
    # Reshaped only when needed: the backward pass would keep both layouts.
    weights = weights.reshape(weights.shape[:-4] + (heads,) + weights.shape[-2:])
    if module is not None:
      module.sow(nnx.Intermediate, "attention_weights", weights)
    if dropout:  # as nnx.dot_product_attention_weights does
      keep_prob = 1.0 - dropout_rate
      shape = ((1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast_dropout
               else weights.shape)
      kept = jax.random.bernoulli(dropout_rng, keep_prob, shape)
      weights = weights * (kept.astype(dtype) / jnp.asarray(keep_prob, dtype))
    weights = weights.reshape(weights.shape[:-3] + (kv_heads, groups) + weights.shape[-2:])
  out = jnp.einsum("...kgts,...skd->...tkgd", weights, value, precision=precision)
  return out.reshape(*batch, length, heads, value.shape[-1])
