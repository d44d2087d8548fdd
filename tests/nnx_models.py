"""Tiny Flax NNX models shared by the tests: a transformer LM and a CNN with BatchNorm.

Both are written the ordinary way, with no mixed-precision code. ``dtype=`` sets every
layer's computation dtype by hand (the baseline jaxamp's policies are measured
against); the default ``None`` lets each layer follow its inputs and parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nnx.Module):

  def __init__(self, d: int, hidden: int, *, dtype=None, rngs: nnx.Rngs):
    self.up = nnx.Linear(d, hidden, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(hidden, d, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.gelu(self.up(x)))


class Block(nnx.Module):
  """Pre-norm transformer block: LayerNorm + attention, RMSNorm + MLP."""

  def __init__(self, d: int, heads: int, hidden: int, *, dtype=None, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False,
                                       dtype=dtype, rngs=rngs)
    self.ln2 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
    self.mlp = MLP(d, hidden, dtype=dtype, rngs=rngs)

  def __call__(self, x, mask=None):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.mlp(self.ln2(x))


class TransformerLM(nnx.Module):
  """Token ids ``[batch, length]`` (int) to logits ``[batch, length, vocab]``.

  Token embedding (``nnx.Embed``), a learned position table used as a raw
  ``nnx.Param``, ``layers`` blocks, a final LayerNorm, and a ``nnx.Linear`` head, or
  the embedding's ``attend`` with ``tied=True``. A boolean causal mask is built from
  the ids unless one is passed.
  """

  def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, hidden: int = 64,
               layers: int = 2, max_len: int = 16, *, tied: bool = False, dtype=None,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, d)))
    self.blocks = nnx.List([Block(d, heads, hidden, dtype=dtype, rngs=rngs)
                            for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    self.head = None if tied else nnx.Linear(d, vocab, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, mask=None):
    x = self.embed(tokens)
    x = (x + self.pos[:tokens.shape[-1]]).astype(x.dtype)
    if mask is None:
      mask = nnx.make_causal_mask(tokens, dtype=jnp.bool_)
    for block in self.blocks:
      x = block(x, mask=mask)
    x = self.ln_f(x)
    return self.embed.attend(x) if self.head is None else self.head(x)


class CNN(nnx.Module):
  """Images ``[batch, height, width, channels]`` to logits; Conv, BatchNorm, Dropout, Linear.

  Starts in training mode (batch statistics, dropout on); call ``.eval()`` for
  inference.
  """

  def __init__(self, channels: tuple[int, ...] = (8, 16), num_classes: int = 10,
               in_channels: int = 3, dropout: float = 0.1, *, dtype=None,
               rngs: nnx.Rngs):
    convs, norms = [], []
    for i, c in enumerate(channels):
      convs.append(nnx.Conv(in_channels, c, (3, 3), strides=1 if i == 0 else 2,
                            use_bias=False, dtype=dtype, rngs=rngs))
      norms.append(nnx.BatchNorm(c, use_running_average=False, dtype=dtype, rngs=rngs))
      in_channels = c
    self.convs = nnx.List(convs)
    self.norms = nnx.List(norms)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.fc = nnx.Linear(in_channels, num_classes, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    for conv, norm in zip(self.convs, self.norms):
      x = nnx.relu(norm(conv(x)))
    x = self.dropout(x.mean(axis=(1, 2)))
    return self.fc(x)


def set_dtype(model: nnx.Module, dtype) -> nnx.Module:
  """Sets every layer's ``dtype`` attribute, as passing ``dtype=`` to the constructors does.

  Quicker than building the model again (no second initialization).
  """
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and "dtype" in vars(node):
      node.dtype = dtype
  return model


# Batches come from numpy's generator: jax.random would compile a sampler per shape.


def lm_batch(batch: int = 2, length: int = 8, vocab: int = 64, seed: int = 0):
  """Integer token ids and next-token targets for :class:`TransformerLM`."""
  tokens = np.random.default_rng(seed).integers(0, vocab, (batch, length + 1), np.int32)
  return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def image_batch(batch: int = 4, size: int = 8, channels: int = 3, classes: int = 10,
                seed: int = 0):
  """Float images and integer labels for :class:`CNN`."""
  rng = np.random.default_rng(seed)
  images = rng.standard_normal((batch, size, size, channels), np.float32)
  return jnp.asarray(images), jnp.asarray(rng.integers(0, classes, (batch,), np.int32))


def scan_stack(layers: int = 2, remat: bool = False, axes=0) -> nnx.Module:
  """``layers`` NNX ``Linear(8, 8)`` blocks stacked by ``nnx.vmap`` and run by ``nnx.scan``
  (``axes``: the scan's ``in_axes`` for the blocks; ``remat``: each block under
  ``nnx.remat``), then a ``Linear(8, 2)`` head."""
  class Stack(nnx.Module):
    def __init__(self):
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return nnx.Linear(8, 8, rngs=rngs)

      self.blocks = make(nnx.Rngs(0))
      self.head = nnx.Linear(8, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, axes), out_axes=nnx.Carry)
      def body(x, block):
        return nnx.relu(nnx.remat(lambda b, x: b(x))(block, x) if remat else block(x))

      return self.head(body(x, self.blocks))

  return Stack()
