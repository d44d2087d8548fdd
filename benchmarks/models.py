"""The benchmark models, each written for Flax and, as a twin, for Keras 3.

Every Flax layer takes ``dtype``: left at None the model is unmodified (jaxamp runs it
under a policy); set to a half dtype it is the hand-written mixed-precision baseline,
the dtype set by hand on every layer with float32 parameters. The Keras twins have
the same layers, shapes and initial-value scales, built under a Keras dtype policy.

- :class:`GPT`: a pre-norm decoder-only transformer LM (Flax NNX), token ids
  ``(batch, length)`` to logits ``(batch, length, vocab)``; :class:`LinenGPT`, the
  same LM in Flax Linen (for the FSDP benchmark's Linen rows).
- :class:`ResNet`: ResNet v1.5 with bottleneck blocks and BatchNorm (Flax Linen), as
  in Flax's ImageNet example; ``stage_sizes=(3, 4, 6, 3)`` is ResNet-50.
- :func:`keras_gpt`, :func:`keras_resnet`: the Keras functional twins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from examples.resnet import ResNet, synthetic_batch  # its dtype= makes the hand-written twin

Dtype = Any


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Sizes of the transformer LM benchmark and its token batch."""

  vocab: int
  dim: int
  heads: int
  layers: int
  seq_len: int
  batch: int

  @property
  def tokens(self) -> int:
    return self.batch * self.seq_len


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """Sizes of the ResNet benchmark and its image batch (NHWC)."""

  stage_sizes: tuple[int, ...]
  num_filters: int
  num_classes: int
  image_size: int
  batch: int

  @property
  def name(self) -> str:
    depth = 3 * sum(self.stage_sizes) + 2
    return f"ResNet-{depth}"


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """Sizes of the parameter-heavy MLP (the overhead section's worst case) and its batch."""

  dims: tuple[int, ...]
  batch: int


# --- a parameter-heavy MLP (Flax NNX) --------------------------------------------------


class MLP(nnx.Module):
  """Linear layers with ReLU between them: optimizer work dominates its step."""

  def __init__(self, cfg: MLPConfig, *, dtype: Dtype = None, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(a, b, dtype=dtype, rngs=rngs)
                            for a, b in zip(cfg.dims, cfg.dims[1:])])

  def __call__(self, x: jax.Array) -> jax.Array:
    for layer in self.layers[:-1]:
      x = jax.nn.relu(layer(x))
    return self.layers[-1](x)


def mlp_loss(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
  return cross_entropy(model(batch["x"]), batch["label"])


def mlp_batch(cfg: MLPConfig, seed: int = 0) -> dict[str, jax.Array]:
  kx, ky = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(kx, (cfg.batch, cfg.dims[0])),
          "label": jax.random.randint(ky, (cfg.batch,), 0, cfg.dims[-1])}


# --- the transformer LM (Flax NNX) -------------------------------------------------------


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal softmax attention over ``(batch, length, heads, head_dim)``; the softmax
  runs in float32, the two matmuls in the dtype of ``q``/``k``/``v``."""
  q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)  # before the dot: keeps float16 in range
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
  length = q.shape[1]
  causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
  scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Attention(nnx.Module):
  """Multi-head causal self-attention with a fused QKV projection."""

  def __init__(self, dim: int, heads: int, *, dtype: Dtype = None, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv = nnx.Linear(dim, 3 * dim, dtype=dtype, rngs=rngs)
    self.proj = nnx.Linear(dim, dim, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, length, d = x.shape
    qkv = self.qkv(x).reshape(b, length, 3, self.heads, d // self.heads)
    out = _causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    return self.proj(out.reshape(b, length, d))


class Block(nnx.Module):
  """Pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` with a 4x GELU MLP."""

  def __init__(self, dim: int, heads: int, *, dtype: Dtype = None, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.attn = Attention(dim, heads, dtype=dtype, rngs=rngs)
    self.ln2 = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x))
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
  """Decoder-only transformer LM: token and position embeddings, blocks, LayerNorm, head."""

  def __init__(self, cfg: LMConfig, *, dtype: Dtype = None, rngs: nnx.Rngs):
    self.tok = nnx.Embed(cfg.vocab, cfg.dim, dtype=dtype, rngs=rngs)
    self.pos = nnx.Embed(cfg.seq_len, cfg.dim, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg.dim, cfg.heads, dtype=dtype, rngs=rngs)
                            for _ in range(cfg.layers)])
    self.ln = nnx.LayerNorm(cfg.dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(cfg.dim, cfg.vocab, dtype=dtype, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))


class ScanGPT(nnx.Module):
  """:class:`GPT` with its blocks stacked (``nnx.vmap``) and run by ``nnx.scan``: one
  block's program, its parameters and optimizer state with a leading layer axis."""

  def __init__(self, cfg: LMConfig, *, dtype: Dtype = None, rngs: nnx.Rngs):
    self.tok = nnx.Embed(cfg.vocab, cfg.dim, dtype=dtype, rngs=rngs)
    self.pos = nnx.Embed(cfg.seq_len, cfg.dim, dtype=dtype, rngs=rngs)

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs: nnx.Rngs) -> Block:
      return Block(cfg.dim, cfg.heads, dtype=dtype, rngs=rngs)

    self.blocks = blocks(rngs)
    self.ln = nnx.LayerNorm(cfg.dim, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(cfg.dim, cfg.vocab, dtype=dtype, rngs=rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x: jax.Array, block: Block) -> jax.Array:
      return block(x)

    x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))
    return self.head(self.ln(run(x, self.blocks)))


class LinenBlock(nn.Module):
  """:class:`Block` in Flax Linen (``(x, None) -> (x, None)``, an ``nn.scan`` body)."""

  dim: int
  heads: int
  dtype: Dtype = None

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
    b, length, d = x.shape
    dense = functools.partial(nn.Dense, dtype=self.dtype)
    qkv = dense(3 * self.dim, name="qkv")(nn.LayerNorm(dtype=self.dtype, name="ln1")(x))
    qkv = qkv.reshape(b, length, 3, self.heads, d // self.heads)
    out = _causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    x = x + dense(self.dim, name="proj")(out.reshape(b, length, d))
    h = dense(4 * self.dim, name="up")(nn.LayerNorm(dtype=self.dtype, name="ln2")(x))
    return x + dense(self.dim, name="down")(jax.nn.gelu(h)), None


class LinenGPT(nn.Module):
  """:class:`GPT` in Flax Linen; ``scan=True``: :class:`ScanGPT`'s stacked blocks, run
  by ``nn.scan``."""

  cfg: LMConfig
  scan: bool = False
  dtype: Dtype = None

  @nn.compact
  def __call__(self, ids: jax.Array) -> jax.Array:
    cfg = self.cfg
    x = (nn.Embed(cfg.vocab, cfg.dim, dtype=self.dtype, name="tok")(ids)
         + nn.Embed(cfg.seq_len, cfg.dim, dtype=self.dtype, name="pos")(
             jnp.arange(ids.shape[1])))
    if self.scan:
      blocks = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=cfg.layers)
      x, _ = blocks(cfg.dim, cfg.heads, self.dtype, name="blocks")(x, None)
    else:
      for i in range(cfg.layers):
        x, _ = LinenBlock(cfg.dim, cfg.heads, self.dtype, name=f"blocks_{i}")(x)
    x = nn.LayerNorm(dtype=self.dtype, name="ln")(x)
    return nn.Dense(cfg.vocab, dtype=self.dtype, name="head")(x)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy over the last axis, in float32 whatever the logits' dtype."""
  logits = logits.astype(jnp.float32)
  return jnp.mean(jax.nn.logsumexp(logits, -1)
                  - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])


def lm_loss(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean next-token cross-entropy of ``model`` on an :func:`lm_batch`."""
  return cross_entropy(model(batch["ids"]), batch["targets"])


def lm_batch(cfg: LMConfig, seed: int = 0) -> dict[str, jax.Array]:
  """Random token ids and their shifted targets (the timing does not depend on text)."""
  ids = jax.random.randint(jax.random.key(seed), (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab)
  return {"ids": ids[:, :-1], "targets": ids[:, 1:]}


# --- ResNet v1.5 (Flax Linen) --------------------------------------------------------------


def resnet_module(cfg: ResNetConfig, dtype: Dtype = None) -> ResNet:
  return ResNet(cfg.stage_sizes, cfg.num_filters, cfg.num_classes, dtype=dtype)


def image_batch(cfg: ResNetConfig, seed: int = 0) -> dict[str, jax.Array]:
  """Synthetic ImageNet-shaped data, as the classic AMP tutorials use."""
  return synthetic_batch(cfg.batch, cfg.image_size, cfg.num_classes, seed)


# --- Keras 3 twins -----------------------------------------------------------------------------


def import_keras() -> Any:
  """Keras 3 on the JAX backend, or an ImportError that says why not."""
  backend = os.environ.setdefault("KERAS_BACKEND", "jax")
  if backend != "jax":
    raise ImportError(f"KERAS_BACKEND is {backend!r}; the benchmark needs 'jax'.")
  import keras  # pylint: disable=g-import-not-at-top
  if keras.backend.backend() != "jax":
    raise ImportError(f"keras was already imported with the {keras.backend.backend()!r} "
                      "backend; the benchmark needs 'jax'.")
  return keras


def _keras_attention_layer(keras: Any) -> type:
  ops = keras.ops

  class KerasAttention(keras.layers.Layer):
    """The twin of :class:`Attention`: fused QKV Dense, float32 softmax, output Dense."""

    def __init__(self, dim: int, heads: int, **kwargs: Any):
      super().__init__(**kwargs)
      self.dim, self.heads = dim, heads
      self.qkv = keras.layers.Dense(3 * dim)
      self.proj = keras.layers.Dense(dim)

    def call(self, x: Any) -> Any:
      length = x.shape[1]
      qkv = ops.reshape(self.qkv(x), (-1, length, 3, self.heads, self.dim // self.heads))
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
      q = q * ops.cast((self.dim // self.heads) ** -0.5, q.dtype)
      scores = ops.cast(ops.einsum("bqhd,bkhd->bhqk", q, k), "float32")
      causal = ops.tril(ops.ones((length, length), "bool"))
      scores = ops.where(causal, scores, float(jnp.finfo(jnp.float32).min))
      weights = ops.cast(ops.softmax(scores, axis=-1), v.dtype)
      out = ops.einsum("bhqk,bkhd->bqhd", weights, v)
      return self.proj(ops.reshape(out, (-1, length, self.dim)))

  return KerasAttention


@contextlib.contextmanager
def _keras_dtype_policy(keras: Any, policy: str) -> Iterator[None]:
  """Keras' global dtype policy set to ``policy`` while layers are built, then restored."""
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy(policy)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(previous)


def keras_gpt(cfg: LMConfig, policy: str) -> Any:
  """The Keras functional twin of :class:`GPT`, built under the Keras dtype policy."""
  keras = import_keras()
  layers = keras.layers
  with _keras_dtype_policy(keras, policy):
    attention = _keras_attention_layer(keras)
    gelu = functools.partial(keras.activations.gelu, approximate=True)  # jax.nn.gelu's
    ids = keras.Input((cfg.seq_len,), batch_size=cfg.batch, dtype="int32")
    positions = keras.ops.arange(cfg.seq_len)
    x = layers.Embedding(cfg.vocab, cfg.dim)(ids) + layers.Embedding(cfg.seq_len,
                                                                     cfg.dim)(positions)
    for _ in range(cfg.layers):
      x = x + attention(cfg.dim, cfg.heads)(layers.LayerNormalization(epsilon=1e-6)(x))
      h = layers.Dense(4 * cfg.dim, activation=gelu)(layers.LayerNormalization(epsilon=1e-6)(x))
      x = x + layers.Dense(cfg.dim)(h)
    logits = layers.Dense(cfg.vocab)(layers.LayerNormalization(epsilon=1e-6)(x))
    return keras.Model(ids, logits)


def keras_resnet(cfg: ResNetConfig, policy: str) -> Any:
  """The Keras functional twin of :class:`ResNet` (v1.5, no conv bias, same BatchNorm)."""
  keras = import_keras()
  layers = keras.layers
  with _keras_dtype_policy(keras, policy):
    def conv(filters, kernel, strides=1):
      return layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)

    def norm(zero=False):
      return layers.BatchNormalization(momentum=0.9, epsilon=1e-5,
                                       gamma_initializer="zeros" if zero else "ones")

    images = keras.Input((cfg.image_size, cfg.image_size, 3), batch_size=cfg.batch)
    x = layers.ReLU()(norm()(conv(cfg.num_filters, 7, 2)(images)))
    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
    for i, size in enumerate(cfg.stage_sizes):
      filters = cfg.num_filters * 2**i
      for j in range(size):
        strides = 2 if i > 0 and j == 0 else 1
        y = layers.ReLU()(norm()(conv(filters, 1)(x)))
        y = layers.ReLU()(norm()(conv(filters, 3, strides)(y)))
        y = norm(zero=True)(conv(4 * filters, 1)(y))
        if x.shape[1:] != y.shape[1:]:
          x = norm()(conv(4 * filters, 1, strides)(x))
        x = layers.ReLU()(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, layers.Dense(cfg.num_classes)(x))

