"""Small CNNs of the three libraries for the FP8 convolution tests (test_fp8_conv,
test_patch_conv): a strided 2-d Conv, a grouped and dilated Conv, a Linear head; with
``transpose=True`` a strided ConvTranspose between the two convolutions (the image
doubled again)."""

import equinox as eqx
import flax.linen as nn
import jax
from flax import nnx


class NNXCNN(nnx.Module):
  """3 input channels (NHWC); layers ``c1``, ``c2``, (``up``,) ``out``."""

  def __init__(self, rngs, transpose=False):
    self.c1 = nnx.Conv(3, 8, (3, 3), strides=(2, 2), rngs=rngs)
    self.c2 = nnx.Conv(8, 8, (3, 3), feature_group_count=4, kernel_dilation=(2, 2), rngs=rngs)
    self.up = nnx.ConvTranspose(8, 8, (3, 3), strides=(2, 2), rngs=rngs) if transpose else None
    self.out = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.c2(nnx.relu(self.c1(x))))
    if self.up is not None:
      x = nnx.relu(self.up(x))
    return self.out(x.mean((1, 2)))


class LinenCNN(nn.Module):
  """3 input channels (NHWC); the second convolution 1-d, causal, 2 groups."""
  transpose: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
    if self.transpose:
      x = nn.relu(nn.ConvTranspose(8, (3, 3), strides=(2, 2), padding="CIRCULAR")(x))
    x = nn.relu(nn.Conv(8, (3,), feature_group_count=2, padding="CAUSAL")(
        x.reshape(x.shape[0], -1, 8)))
    return nn.Dense(4)(x.mean(1))


class EqxCNN(eqx.Module):
  """One example, channels first (3); the second convolution 1-d, 4 groups, dilated."""
  c1: eqx.nn.Conv2d
  up: eqx.nn.ConvTranspose2d | None
  c2: eqx.nn.Conv1d
  out: eqx.nn.Linear

  def __init__(self, key, transpose=False):
    if transpose:
      k1, k2, k3, k4 = jax.random.split(key, 4)
      self.up = eqx.nn.ConvTranspose2d(8, 8, 3, stride=2, padding="SAME", key=k2)
    else:
      k1, k3, k4 = jax.random.split(key, 3)
      self.up = None
    self.c1 = eqx.nn.Conv2d(3, 8, 3, stride=2, padding=1, key=k1)
    self.c2 = eqx.nn.Conv1d(8, 8, 3, groups=4, dilation=2, key=k3)
    self.out = eqx.nn.Linear(8, 4, key=k4)

  def __call__(self, x):
    x = jax.nn.relu(self.c1(x))
    if self.up is not None:
      x = jax.nn.relu(self.up(x))
    x = jax.nn.relu(self.c2(x.reshape(8, -1)))
    return self.out(x.mean(1))
