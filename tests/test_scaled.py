"""The scaled-format protocol (jaxamp.scaled) as a plug-in: a toy format defined here,
registered, and trained through make_train_step, touching no jaxamp file.

The toy format ("grid") rounds both operands of a layer's matmul to multiples of
``1 / scale`` (a fixed scale of 2: halves) and keeps per module how many times its
matmul ran in a step and the largest input magnitude it saw. Its state moves the way
FP8's does: the dot's ``custom_vjp`` hands what the pass saw out as the state's
cotangent, and the format's ``update`` folds it in. Every value is checked against a
NumPy hand computation.
"""

import dataclasses
import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxamp
from jaxamp import scaled


@dataclasses.dataclass(frozen=True)
class Grid:
  """The toy recipe: operands rounded to multiples of ``1 / scale``."""

  scale: float = 2.0


class Seen(NamedTuple):
  calls: jax.Array  # how many times the module's matmul ran (float: it is differentiated)
  amax: jax.Array  # the largest |input| seen


def _q(x, s):
  return jnp.round(x * s) / s


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grid_dot(lhs, rhs, seen, dims, s):
  return lax.dot_general(_q(lhs, s), _q(rhs, s), dims)


def _grid_dot_fwd(lhs, rhs, seen, dims, s):
  ql, qr = _q(lhs, s), _q(rhs, s)
  return lax.dot_general(ql, qr, dims), (ql, qr, jnp.max(jnp.abs(lhs)))


def _grid_dot_bwd(dims, s, residuals, g):
  ql, qr, amax = residuals
  _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), ql, qr)
  d_lhs, d_rhs = vjp(g)  # straight through the rounding
  return d_lhs, d_rhs, Seen(jnp.ones([], jnp.float32), amax.astype(jnp.float32))


_grid_dot.defvjp(_grid_dot_fwd, _grid_dot_bwd)


class GridFormat(scaled.ScaledFormat):
  name = "grid"

  def init_state(self, recipe):
    return Seen(jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, *, state, recipe):
    if state is None:  # outside a train step
      return lax.dot_general(_q(lhs, recipe.scale), _q(rhs, recipe.scale), dimension_numbers)
    return _grid_dot(lhs, rhs, state, dimension_numbers, recipe.scale)

  def update(self, state, cotangent, recipe):
    return Seen(state.calls + cotangent.calls, jnp.maximum(state.amax, cotangent.amax))


class CountingSkips(GridFormat):
  """Keeps the new state even on a skipped step (the protocol's ``kept_on_skip``)."""

  def kept_on_skip(self, old, new, recipe):
    return new


@dataclasses.dataclass(frozen=True)
class GridCountingSkips(Grid):
  pass


@pytest.fixture(autouse=True)
def _registered():
  scaled.register(Grid, GridFormat(), names={"grid": Grid}, policies={"mixed_grid": Grid})
  scaled.register(GridCountingSkips, CountingSkips())
  with warnings.catch_warnings():
    # The policy asks for FP8-like matmuls on CPU: known, warned once per process.
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    yield
  scaled.unregister(Grid)
  scaled.unregister(GridCountingSkips)


LR = 0.25


def _train(recipe, **kwargs):
  model = nnx.Linear(4, 3, use_bias=False, rngs=nnx.Rngs(0))
  kernel = np.asarray(model.kernel[...])
  c = np.random.RandomState(1).randn(5, 3).astype(np.float32)
  train = jaxamp.make_train_step(
      lambda m, b: jnp.sum(m(b["x"]) * c), optax.sgd(LR),
      policy=jaxamp.Policy(jnp.float32, jnp.float32, fp8=recipe),
      eval_fn=lambda m, b: m(b["x"]), **kwargs)
  return train, train.init(model), kernel, c


def _batches(steps):
  rng = np.random.RandomState(0)
  return [(rng.randn(5, 4) * (1.0 + t)).astype(np.float32) for t in range(steps)]


def _hand(kernel, c, xs, s=2.0):
  """NumPy: (losses, kernels) of SGD steps on sum((q(x) @ q(W)) * c)."""
  q = lambda a: (np.round(a * s) / s).astype(np.float32)
  losses, w = [], kernel.copy()
  for x in xs:
    losses.append(float(np.sum((q(x) @ q(w)) * c)))
    w = (w - np.float32(LR) * (q(x).T @ c)).astype(np.float32)
  return losses, w


def test_a_registered_format_is_a_policy_recipe():
  p = jaxamp.Policy(jnp.float32, jnp.bfloat16, fp8=Grid())
  assert p.fp8 == Grid() and scaled.format_of(p.fp8).name == "grid"
  assert jaxamp.get_policy("p=f32,c=bf16,fp8=grid").fp8 == Grid()
  named = jaxamp.get_policy("mixed_grid")
  assert named == jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, Grid())
  assert named.name == "mixed_grid"
  assert jaxamp.Policy(jnp.float32, jnp.float32, fp8=Grid(3.0)).name == (
      "params=float32,compute=float32,output=float32,fp8=Grid(scale=3.0)")
  scaled.unregister(Grid)
  with pytest.raises(ValueError, match="Grid"):
    jaxamp.Policy(jnp.float32, jnp.bfloat16, fp8=Grid())
  with pytest.raises(ValueError, match="mixed_grid"):
    jaxamp.get_policy("mixed_grid")


def test_a_toy_format_trains_through_the_step_with_its_state_updated():
  train, state, kernel, c = _train(Grid())
  assert set(state.scaled) == {""} and state.fp8 is state.scaled  # the older name reads it
  np.testing.assert_array_equal(np.asarray(state.scaled[""].calls), 0.0)
  xs = _batches(2)
  losses = []
  for x in xs:
    state, metrics = train.step(state, {"x": jnp.asarray(x)})
    losses.append(float(metrics["loss"]))
  want_losses, want_kernel = _hand(kernel, c, xs)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(state.params["kernel"]), want_kernel, rtol=1e-6)
  seen = state.scaled[""]
  assert isinstance(seen, Seen)
  assert float(seen.calls) == 2.0  # one matmul per step, each step recorded once
  assert float(seen.amax) == max(float(np.abs(x).max()) for x in xs)
  # The eval step runs the format too (the state is read, not updated).
  q = lambda a: np.round(a * 2.0) / 2.0
  y = np.asarray(train.eval_step(state, {"x": jnp.asarray(xs[0])}))
  np.testing.assert_allclose(y, q(xs[0]) @ q(want_kernel), rtol=1e-6)


def test_micro_batches_update_the_state_after_each_one():
  train, state, kernel, c = _train(Grid(), grad_accum_steps=2)
  a = _batches(1)[0]
  x = np.concatenate([a, a * 3.0])  # two micro-batches of 5 rows
  state, _ = train.step(state, {"x": jnp.asarray(x)})
  assert float(state.scaled[""].calls) == 2.0  # one record per micro-batch
  assert float(state.scaled[""].amax) == float(np.abs(x).max())
  q = lambda v: (np.round(v * 2.0) / 2.0).astype(np.float32)
  grad = (q(a).T @ c + q(a * 3.0).T @ c) / 2  # the micro-batches' mean
  np.testing.assert_allclose(np.asarray(state.params["kernel"]), kernel - LR * grad,
                             rtol=1e-6)


@pytest.mark.parametrize("recipe, kept_calls", [(Grid(), 1.0), (GridCountingSkips(), 2.0)])
def test_a_skipped_step_keeps_what_the_format_says(recipe, kept_calls):
  train, state, _, _ = _train(recipe)
  x = _batches(1)[0]
  state, _ = train.step(state, {"x": jnp.asarray(x)})
  params = np.asarray(state.params["kernel"])
  bad = x.copy()
  bad[0, 0] = np.inf
  state, metrics = train.step(state, {"x": jnp.asarray(bad)})
  assert not bool(metrics["grads_finite"])
  np.testing.assert_array_equal(np.asarray(state.params["kernel"]), params)
  assert float(state.scaled[""].calls) == kept_calls


_MESH_SCRIPT = """
import sys, warnings
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
warnings.simplefilter('ignore')
import jax, jax.numpy as jnp, numpy as np
import jaxamp
from jaxamp import scaled
import test_scaled as t
assert jax.device_count() == 4, jax.devices()
scaled.register(t.Grid, t.GridFormat())
xs = [np.concatenate([x, x * 0.5, x * 0.25, x * 2.0]) for x in t._batches(2)]  # 20 rows
c = np.tile(np.random.RandomState(1).randn(5, 3).astype(np.float32), (4, 1))
out = {{}}
for name, kw in [('one', {{}}), ('mesh', dict(sharding=jaxamp.ShardingConfig(mesh=jax.make_mesh((4,), ('data',)))))]:
  from flax import nnx
  import optax
  model = nnx.Linear(4, 3, use_bias=False, rngs=nnx.Rngs(0))
  train = jaxamp.make_train_step(
      lambda m, b: jnp.sum(m(b['x']) * b['c']) / b['x'].shape[0], optax.sgd(t.LR),
      policy=jaxamp.Policy(jnp.float32, jnp.float32, fp8=t.Grid()), **kw)
  state = train.init(model)
  for x in xs:
    state, _ = train.step(state, {{'x': jnp.asarray(x), 'c': jnp.asarray(c)}})
  out[name] = (np.asarray(state.params['kernel']), float(state.scaled[''].calls),
               float(state.scaled[''].amax))
# Each device saw a quarter of the batch: its calls (1 per step) and amax are maxed over
# the devices (the protocol's default reduce), so the state is one device's.
assert out['mesh'][1:] == out['one'][1:] == (2.0, max(float(np.abs(x).max()) for x in xs)), out
np.testing.assert_allclose(out['mesh'][0], out['one'][0], rtol=1e-6)
print('MESH-OK')
"""


@pytest.mark.slow  # a subprocess with 4 CPU devices, as tests/test_train_devices.py's
def test_a_toy_format_on_a_mesh_reduces_its_state_across_devices(tmp_path):
  import os
  from train_helpers import ROOT, run_script

  script = _MESH_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
  out = run_script(script, tmp_path, "mesh.py",
                   {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                                 + os.environ.get("XLA_FLAGS", ""),
                    "JAX_PLATFORMS": "cpu"})
  assert "MESH-OK" in out


def test_a_toy_format_trains_a_linen_dense_too():
  import flax.linen as nn

  dense = nn.Dense(3, use_bias=False)
  x = _batches(1)[0]
  variables = dense.init(jax.random.key(0), jnp.asarray(x))
  kernel = np.asarray(variables["params"]["kernel"])
  c = np.random.RandomState(1).randn(5, 3).astype(np.float32)
  train = jaxamp.make_train_step(
      lambda m, b: jnp.sum(m(b["x"]) * c), optax.sgd(LR),
      policy=jaxamp.Policy(jnp.float32, jnp.float32, fp8=Grid()))
  state = train.init(dense, variables, jnp.asarray(x))
  assert set(state.scaled) == {""}  # the model itself is the Dense
  state, metrics = train.step(state, {"x": jnp.asarray(x)})
  want_losses, want_kernel = _hand(kernel, c, [x])
  np.testing.assert_allclose(float(metrics["loss"]), want_losses[0], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(state.params["kernel"]), want_kernel, rtol=1e-6)
  (seen,) = state.scaled.values()
  assert float(seen.calls) == 1.0 and float(seen.amax) == float(np.abs(x).max())


@pytest.mark.parametrize("recipe", [
    jaxamp.CurrentScaling(), jaxamp.DelayedScaling(), jaxamp.RowwiseScaling(),
    jaxamp.BlockScaling(), jaxamp.MXFP8Scaling(),
    jaxamp.PerMatmulScaling(fwd=jaxamp.CurrentScaling(), dgrad=None, wgrad=None)],
    ids=lambda r: type(r).__name__)
def test_each_formats_dot_refuses_an_out_sharding_and_unknown_keywords(recipe):
  fmt = scaled.format_of(recipe)
  x, w = jnp.ones((4, 128)), jnp.ones((128, 8))
  dims = (((1,), (0,)), ((), ()))
  state = fmt.init_state(recipe)
  call = functools.partial(fmt.dot_general, x, w, dims, None, None, state=state, recipe=recipe)
  mesh = jax.make_mesh((1,), ("data",))
  with pytest.raises(NotImplementedError, match="takes no out_sharding; shard its inputs"):
    call(out_sharding=jax.sharding.NamedSharding(mesh, jax.P()))
  with pytest.raises(TypeError, match=r"got unexpected arguments \['bogus'\]"):
    call(bogus=1)
  # Flax layers pass None: accepted (traced only: the refusals need no computation)
  assert jax.eval_shape(lambda: call(out_sharding=None)).shape == (4, 8)
