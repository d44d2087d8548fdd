"""Tiny Flax Linen models shared by the tests: a transformer LM, a CNN, scan/remat/vmap.

Every layer takes ``dtype`` (default None, as in an unmodified model) so a test can
build the hand-set baseline, every Flax layer with ``dtype=jnp.bfloat16``, from the
same code. Sizes are keyword arguments with tiny defaults; the batch helpers make
matching inputs (``TransformerLM()`` on ``token_batch()`` gives logits ``(2, 8, 32)``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any


class Mlp(nn.Module):
  """Dense -> gelu -> Dense."""

  hidden: int
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(self.hidden, dtype=self.dtype, name="up")(x))
    return nn.Dense(x.shape[-1], dtype=self.dtype, name="down")(h)


class Block(nn.Module):
  """Pre-norm transformer block: LayerNorm -> causal attention, RMSNorm -> MLP."""

  num_heads: int = 2
  mlp_dim: int = 32
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
    x = x + nn.MultiHeadDotProductAttention(self.num_heads, dtype=self.dtype,
                                            deterministic=True, name="attn")(h, mask=mask)
    h = nn.RMSNorm(dtype=self.dtype, name="ln_mlp")(x)
    return x + Mlp(self.mlp_dim, dtype=self.dtype, name="mlp")(h)


def causal_mask(ids):
  """A boolean causal mask for token ids of shape ``(batch, length)``."""
  return nn.make_causal_mask(ids, dtype=jnp.bool_)


class TransformerLM(nn.Module):
  """Token ids ``(batch, length)`` -> logits ``(batch, length, vocab)``."""

  vocab: int = 32
  dim: int = 16
  num_heads: int = 2
  num_layers: int = 2
  mlp_dim: int = 32
  dtype: Dtype = None

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(self.vocab, self.dim, dtype=self.dtype, name="embed")(ids)
    mask = causal_mask(ids)
    for i in range(self.num_layers):
      x = Block(self.num_heads, self.mlp_dim, dtype=self.dtype, name=f"block_{i}")(x, mask)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
    return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x)


class CNN(nn.Module):
  """Images ``(batch, h, w, c)`` -> logits: Conv-BatchNorm-relu twice, Dropout, Dense."""

  features: tuple[int, ...] = (8, 16)
  num_classes: int = 10
  dropout: float = 0.25
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    for i, f in enumerate(self.features):
      x = nn.Conv(f, (3, 3), dtype=self.dtype, name=f"conv_{i}")(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype,
                       name=f"bn_{i}")(x)
      x = nn.relu(x)
    x = nn.Dropout(self.dropout, deterministic=not train, name="dropout")(x)
    x = x.mean(axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


class ScanBlock(nn.Module):
  """A residual Dense block with a norm, shaped for ``nn.scan``: ``(carry, _) -> (carry, y)``."""

  norm: str = "layer"
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x, _):
    if self.norm == "batch":
      h = nn.BatchNorm(use_running_average=False, dtype=self.dtype, name="norm")(x)
    else:
      h = nn.LayerNorm(dtype=self.dtype, name="norm")(x)
    h = Mlp(2 * x.shape[-1], dtype=self.dtype, name="mlp")(h)
    return x + h, h.sum(-1)


class ScanModel(nn.Module):
  """Dense in, ``nn.scan`` over ``num_layers`` (optionally ``nn.remat``-ed) blocks, Dense out.

  ``norm='batch'`` puts a BatchNorm in each block: its ``batch_stats`` are scanned too.
  ``embed_offset`` adds a float32 constant before the scan, as a positional encoding
  would, so the carry enters in float32 whatever the dense layer returned.
  """

  dim: int = 16
  num_layers: int = 3
  remat: bool = True
  norm: str = "layer"
  embed_offset: bool = False
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.dim, dtype=self.dtype, name="proj")(x)
    if self.embed_offset:
      x = x + jnp.linspace(0.0, 1.0, self.dim, dtype=jnp.float32)
    block = nn.remat(ScanBlock) if self.remat else ScanBlock
    axes = {"params": 0, "batch_stats": 0}
    x, ys = nn.scan(block, variable_axes=axes, split_rngs={"params": True},
                    length=self.num_layers)(self.norm, self.dtype, name="layers")(x, None)
    return nn.Dense(4, dtype=self.dtype, name="head")(x), ys


class VmapModel(nn.Module):
  """An ensemble of ``members`` MLPs with ``nn.vmap`` over their parameters."""

  members: int = 3
  dim: int = 8
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x):
    ensemble = nn.vmap(Mlp, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=None, out_axes=0, axis_size=self.members)
    y = ensemble(self.dim, dtype=self.dtype, name="ensemble")(x)
    return y.mean(axis=0)


def token_batch(batch: int = 2, length: int = 8, vocab: int = 32, seed: int = 0) -> jax.Array:
  """Random token ids of shape ``(batch, length)``."""
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)


def image_batch(batch: int = 2, size: int = 8, channels: int = 3, seed: int = 0) -> jax.Array:
  """Random float32 images of shape ``(batch, size, size, channels)``."""
  return jax.random.normal(jax.random.key(seed), (batch, size, size, channels))


def lm_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
  """Next-token cross-entropy in float32."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
  return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Cross-entropy in float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()
