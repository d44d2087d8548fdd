"""Models, losses and batches the train-step tests share."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

import jaxamp



POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NNXNet(nnx.Module):
  """Linear -> BatchNorm -> ReLU -> Dropout -> Linear."""

  def __init__(self, rngs, *, dropout=0.0, batchnorm=True):
    self.l1 = nnx.Linear(8, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs) if batchnorm else None
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.l2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    h = self.l1(x)
    if self.bn is not None:
      h = self.bn(h)
    return self.l2(self.drop(jax.nn.relu(h)))


class LinenNet(nn.Module):
  dropout: float = 0.0
  batchnorm: bool = True

  @nn.compact
  def __call__(self, x, train=True):
    h = nn.Dense(16)(x)
    if self.batchnorm:
      h = nn.BatchNorm(use_running_average=not train)(h)
    h = nn.Dropout(self.dropout, deterministic=not train)(jax.nn.relu(h))
    return nn.Dense(4)(h)


def xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def loss_fn(model, batch):
  return xent(model(batch["x"]), batch["y"])


def make_batches(n, size=16, seed=0):
  rng = np.random.RandomState(seed)
  return [{"x": rng.randn(size, 8).astype(np.float32),
           "y": rng.randint(0, 4, size).astype(np.int32)} for _ in range(n)]


def init(train, api, *, example_inputs=True, **kw):
  """``train.init`` of NNXNet or LinenNet (with the Linen module's example inputs)."""
  if api == "nnx":
    return train.init(NNXNet(nnx.Rngs(0, dropout=1), **kw))
  module = LinenNet(**kw)
  x = jnp.zeros((2, 8))
  variables = module.init(jax.random.key(0), x, train=False)
  if example_inputs:
    return train.init(module, variables, x, train=False)
  return train.init(module, variables)


def param_dtypes(params):
  """``{'norm': {...}, 'other': {...}}``: the dtypes of BatchNorm's and the rest's params."""
  out = {"norm": set(), "other": set()}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    out["norm" if "bn" in name or "BatchNorm" in name else "other"].add(jnp.dtype(leaf.dtype))
  return out


def leaves(tree):
  def host(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  return [host(x) for x in jax.tree.leaves(tree)]


def assert_trees_equal(a, b):
  la, lb = leaves(a), leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


def orbax_round_trip(state, folder):
  """``state`` saved with orbax's ``StandardCheckpointer`` in ``folder`` and restored
  against ``jaxamp.abstract_state(state)``, as a user resumes."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(folder, state)
    ckpt.wait_until_finished()
    return ckpt.restore(folder, jaxamp.abstract_state(state))


def counting_loss(model, batch):
  """The loss, with a count, a flag and a mean of the batch as aux."""
  logits = model(batch["x"])
  right = logits.argmax(-1) == batch["y"]
  return xent(logits, batch["y"]), {"n_right": jnp.sum(right), "rows": jnp.int32(len(right)),
                                    "saw_3": jnp.any(batch["y"] == 3),
                                    "accuracy": jnp.mean(right.astype(jnp.float32))}


def run_script(source, tmp_path, name, env=None):
  path = tmp_path / name
  path.write_text(source)
  full_env = dict(os.environ, **(env or {}))
  proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                        env=full_env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout


def stepped(train, state, batches):
  """``train.step`` over ``batches`` from ``state``: the last state and, per step, the
  state before it, the state after it and its metrics."""
  history = []
  for b in batches:
    before = state
    state, metrics = train.step(state, b)
    history.append((before, state, metrics))
  return state, history


def _train_dense(model_kind, policy, xs, features):
  """A Linear (NNX) or Dense (Linen) of ``features`` inputs and 4 outputs trained with
  SGD on ``xs``, one step each: the first params, then per step the metrics, params and
  scaled-format state (numpy copies: the step donates its input state)."""
  c = np.random.RandomState(4).randn(8, 4).astype(np.float32)
  loss = lambda m, b: jnp.mean((m(b["x"]).astype(jnp.float32) - c) ** 2)
  train = jaxamp.make_train_step(loss, optax.sgd(0.1), policy=policy)
  if model_kind == "nnx":
    state = train.init(nnx.Linear(features, 4, rngs=nnx.Rngs(0)))
  else:
    dense = nn.Dense(4)
    state = train.init(dense, dense.init(jax.random.key(0), jnp.asarray(xs[0])),
                       jnp.asarray(xs[0]))
  first = jax.tree.map(np.asarray, state.params)
  out = []
  for x in xs:
    state, metrics = train.step(state, {"x": jnp.asarray(x)})
    out.append((metrics, jax.tree.map(np.asarray, state.params),
                jax.tree.map(np.asarray, state.scaled)))
  return first, out


def check_scaled_recipe_trains_and_skips(policy, model_kind, against_bf16, features, seed):
  """A scaled FP8 recipe's policy on an NNX Linear or a Linen Dense: two steps train
  (finite, params move; with ``against_bf16`` within E4M3's rounding of
  ``mixed_bfloat16``: E4M3 keeps 3 mantissa bits, a relative error up to 2**-4 per
  operand, against bfloat16's 8: 5 % on the loss, on each parameter 5 % or 5e-3), the
  state records the input's amax (in bfloat16, as the layer saw it), and a batch with a
  NaN is skipped with params and state bit-identical."""
  rng = np.random.RandomState(seed)
  xs = [rng.randn(8, features).astype(np.float32) for _ in range(2)]
  bad = xs[1].copy()
  bad[3, 2] = np.nan
  first, fp8 = _train_dense(model_kind, policy, xs + [bad], features)
  for m, _, _ in fp8[:2]:
    assert np.isfinite(float(m["loss"])) and bool(m["grads_finite"])
  if against_bf16:
    _, bf16 = _train_dense(model_kind, "mixed_bfloat16", xs, features)
    for (m, params, _), (m16, params16, _) in zip(fp8[:2], bf16):
      np.testing.assert_allclose(float(m["loss"]), float(m16["loss"]), rtol=0.05)
      for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params16)):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=5e-3)
  assert all(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(fp8[1][1]), jax.tree.leaves(first)))
  (state_amax,) = fp8[1][2].values()  # the last pass's amaxes, for inspection
  assert float(state_amax[0]) == float(np.abs(xs[1].astype(ml_dtypes.bfloat16)).max())
  m, params, scaled_state = fp8[2]  # the NaN batch: skipped, everything bit-identical
  assert not bool(m["grads_finite"]) and int(m["skipped_steps"]) == 1
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(fp8[1][1])):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
  np.testing.assert_array_equal(scaled_state[""], state_amax)


def check_contractions_match_the_2d_dot(dot, k_axes, batch_k, seed):
  """``dot(lhs, rhs, dimension_numbers)`` (a scaled format's) with two contracted axes
  ``k_axes`` (a DenseGeneral's) equals, value and gradients, the 2-D dot on the reshaped
  operands; with a batch dimension (an Einsum's ``'bmk,bkn->bmn'``, contraction
  ``batch_k``), the 2-D dot per batch entry (``jax.vmap``): a format quantizing along
  the flattened contraction, per batch entry, gives the same numbers."""
  dims_2d = (((1,), (0,)), ((), ()))
  rng = np.random.RandomState(seed)
  c = jnp.asarray(rng.randn(4, 5).astype(np.float32))
  k1, k2 = k_axes
  x = jnp.asarray((rng.randn(4, k1, k2) * np.logspace(-2, 2, 4)[:, None, None]).astype(
      np.float32))
  w = jnp.asarray(rng.randn(k1, k2, 5).astype(np.float32))
  f_nd = lambda x, w: jnp.sum(dot(x, w, (((1, 2), (0, 1)), ((), ()))) * c)
  f_2d = lambda x, w: jnp.sum(dot(x.reshape(4, k1 * k2), w.reshape(k1 * k2, 5), dims_2d) * c)
  for got, want in zip(jax.jit(jax.value_and_grad(f_nd, (0, 1)))(x, w),
                       jax.jit(jax.value_and_grad(f_2d, (0, 1)))(x, w)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b).reshape(np.shape(a)),
                                 rtol=1e-6, atol=1e-6)
  a = jnp.asarray(rng.randn(2, 4, batch_k).astype(np.float32)) * jnp.asarray([[[1.0]], [[1e3]]])
  b = jnp.asarray(rng.randn(2, batch_k, 5).astype(np.float32))
  cb = jnp.stack([c, -c])
  f_b = lambda a, b: jnp.sum(dot(a, b, (((2,), (1,)), ((0,), (0,)))) * cb)
  f_v = lambda a, b: jnp.sum(jax.vmap(lambda a, b: dot(a, b, dims_2d))(a, b) * cb)
  for got, want in zip(jax.jit(jax.value_and_grad(f_b, (0, 1)))(a, b),
                       jax.jit(jax.value_and_grad(f_v, (0, 1)))(a, b)):
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-6)
