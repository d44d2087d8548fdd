"""Complex parameters (issue 46, item 1): trained as plain optax trains them, under every
policy, through the loss scale, the finiteness check, the global norm, accumulation and
the optax elements used by hand. State-space models (LRU, S5) keep complex diagonals.

Sharded layouts with a complex parameter are rows of tests/test_differential.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp

LAMBDA = np.array([0.9 + 0.1j, 0.5 - 0.3j, -0.2 + 0.7j, 0.1 + 0.2j], np.complex64)
LR = 0.1


class LRU(nnx.Module):
  """A Linear and an LRU-like complex diagonal; the output is real."""

  def __init__(self):
    self.w = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    self.lam = nnx.Param(jnp.asarray(LAMBDA))

  def __call__(self, x, poison=None):
    lam = self.lam[...]
    if poison is not None:
      lam = _imaginary_nan_in_gradient(lam, poison)
    # lam ** 2: the loss depends on lam's imaginary part (h * lam alone would give it a
    # zero imaginary gradient).
    return jnp.real(self.w(x) * lam ** 2)


@jax.custom_vjp
def _imaginary_nan_in_gradient(x, poison):
  return x


def _fwd(x, poison):
  return x, poison


def _bwd(poison, ct):
  # The real part of the cotangent untouched, the imaginary part NaN when poisoned.
  imag = jnp.where(poison > 0, jnp.nan, jnp.imag(ct)).astype(jnp.real(ct).dtype)
  return jax.lax.complex(jnp.real(ct), imag), jnp.zeros_like(poison)


_imaginary_nan_in_gradient.defvjp(_fwd, _bwd)


def loss_fn(model, batch):
  out = model(batch["x"], batch.get("poison"))
  return jnp.mean((out - batch["y"]) ** 2)


def make_batch(size=8, poison=None):
  rng = np.random.RandomState(0)
  batch = {"x": rng.randn(size, 4).astype(np.float32),
           "y": rng.randn(size, 4).astype(np.float32)}
  if poison is not None:
    batch["poison"] = np.float32(poison)
  return batch


def reference_grads(batch):
  """The float32 gradients of a plain NNX model: what plain optax trains with."""
  return nnx.grad(loss_fn)(LRU(), batch)


def first_step(policy, **kw):
  """The params before and after one step of ``make_train_step`` (SGD), and the metrics."""
  batch = make_batch(poison=kw.pop("poison", None))
  train = jaxamp.make_train_step(loss_fn, optax.sgd(LR), policy=policy, **kw)
  state = train.init(LRU())
  before = jax.tree.map(np.asarray, state.params)
  state, metrics = train.step(state, batch)
  return before, jax.tree.map(np.asarray, state.params), metrics


def lam_update(before, after):
  return after["lam"] - before["lam"]


# Largest relative difference of an element of lam's first update from plain optax's
# (float32), the Linear computing in the compute dtype: measured 1.2e-6, 4.2e-3 and
# 1.3e-3 (grad_norm: 0, 1.4e-3, 3.7e-5). A gradient left multiplied by the loss scale
# is 1e3 and more away. float16 stores the Linear in float16 (master weights in float32);
# lam stays complex64, its own master weight.
TOLERANCE = {"float32": 5e-6, "mixed_bfloat16": 1e-2, "mixed_float16": 5e-3,
             "float16": 5e-3}


@pytest.mark.parametrize("policy", list(TOLERANCE))
def test_a_complex_parameter_trains_as_plain_optax(policy):
  """Under mixed_float16 the complex gradient was applied still multiplied by the loss
  scale; under mixed_bfloat16 the step failed to trace (jax.checkpoint cannot save the
  complex values half_residuals kept)."""
  before, after, metrics = first_step(policy)
  grads = reference_grads(make_batch())
  updates, _ = optax.sgd(LR).update(grads, optax.sgd(LR).init(grads))
  want = np.asarray(updates["lam"][...])
  got = lam_update(before, after)
  assert after["lam"].dtype == np.complex64
  np.testing.assert_allclose(got, want, rtol=TOLERANCE[policy],
                             atol=TOLERANCE[policy] * np.abs(want).max())
  assert np.abs(want.imag).min() > 1e-3  # the imaginary parts are trained, not zero
  # The norm counts the imaginary parts (it dropped them: 4.75 against 7.20 in the issue).
  assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)),
                                                      rel=TOLERANCE[policy])
  assert int(metrics["skipped_steps"]) == 0


def test_the_first_mixed_float16_update_of_a_complex_parameter_is_float32s():
  """Not 1,024 times it (the loss scale left in). Without half_residuals, whose
  checkpoint policy is tested above."""
  before16, after16, _ = first_step("mixed_float16",
                                    memory=jaxamp.MemoryConfig(half_residuals=False))
  before32, after32, _ = first_step("float32")
  ratio = np.abs(lam_update(before16, after16)) / np.abs(lam_update(before32, after32))
  np.testing.assert_allclose(ratio, 1.0, rtol=5e-3)


def test_grad_accum_steps_2_gives_a_complex_parameter_the_one_batch_gradient():
  """The micro-batches' gradients were summed in float32, dropping the imaginary part
  (relative error 1.0)."""
  before, one, _ = first_step("float32")
  _, two, _ = first_step("float32", grad_accum_steps=2)
  want = lam_update(before, one)
  np.testing.assert_allclose(lam_update(before, two), want, rtol=1e-5,
                             atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_a_nan_only_in_an_imaginary_part_skips_the_step(policy):
  """It was not detected: the step was applied and the parameter became NaN."""
  before, after, metrics = first_step(policy, poison=1.0,
                                      debug=jaxamp.DebugConfig(nonfinite_grads=True))
  assert not bool(metrics["grads_finite"])
  assert {k: bool(v) for k, v in metrics["nonfinite_grads"].items()} == {
      "lam": True, "w/bias": False, "w/kernel": False}
  assert int(metrics["skipped_steps"]) == 1
  for name in before:  # bit-identical
    for x, y in zip(jax.tree.leaves(before[name]), jax.tree.leaves(after[name])):
      assert x.tobytes() == y.tobytes(), name
  # The same batch unpoisoned is applied: the poison is what skipped it.
  _, clean, metrics = first_step(policy, poison=0.0)
  assert bool(metrics["grads_finite"]) and not np.array_equal(clean["lam"], before["lam"])


def _linen_and_equinox(kind):
  """``(model, init's extra arguments, lam of a params tree)`` of the LRU in ``kind``."""
  x = make_batch()["x"]
  if kind == "linen":
    import flax.linen as nn  # pylint: disable=g-import-not-at-top

    class LinenLRU(nn.Module):
      @nn.compact
      def __call__(self, x):
        lam = self.param("lam", lambda _: jnp.asarray(LAMBDA))
        return jnp.real(nn.Dense(4)(x) * lam ** 2)

    variables = LinenLRU().init(jax.random.key(0), x)
    return LinenLRU(), (variables, x), lambda p: p["lam"]
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class EqxLRU(eqx.Module):
    linear: eqx.nn.Linear
    lam: jax.Array

    def __init__(self):
      self.linear, self.lam = eqx.nn.Linear(4, 4, key=jax.random.key(0)), jnp.asarray(LAMBDA)

    def __call__(self, x):
      return jnp.real(jax.vmap(self.linear)(x) * self.lam ** 2)

  return EqxLRU(), (), lambda p: p.lam


@pytest.mark.parametrize("kind", ["linen", "equinox"])
def test_a_complex_parameter_of_a_linen_or_equinox_model_trains_as_plain_optax(kind):
  """The same under mixed_float16 (Linen: a step that draws keys, whose PRNG-key values
  the half-residual policy must also look at)."""
  model, extra, lam_of = _linen_and_equinox(kind)
  batch = make_batch()
  plain = lambda out: jnp.mean((out - batch["y"]) ** 2)
  if kind == "linen":
    variables = extra[0]
    grads = jax.grad(lambda p: plain(model.apply({"params": p}, batch["x"])))(
        variables["params"])
    extra = (jax.tree.map(jnp.copy, variables), batch["x"])  # the step donates them
  else:
    grads = jax.grad(lambda m: plain(m(batch["x"])), allow_int=True)(model)
  train = jaxamp.make_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                                 optax.sgd(LR), policy="mixed_float16")
  state = train.init(model, *extra)
  before = np.asarray(lam_of(state.params))
  state, metrics = train.step(state, batch)
  want = -LR * np.asarray(lam_of(grads))
  np.testing.assert_allclose(np.asarray(lam_of(state.params)) - before, want, rtol=5e-3,
                             atol=5e-3 * np.abs(want).max())
  assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)),
                                                      rel=5e-3)


# --- the optax elements used by hand ---------------------------------------------------------

GRADS = {"lam": jnp.asarray([3.0 + 4.0j, 0.0 - 2.0j], jnp.complex64),
         "w": jnp.asarray([1.0, -2.0], jnp.float32)}
IMAGINARY_NAN = {"lam": jnp.asarray([1.0 + 1.0j, jax.lax.complex(2.0, jnp.nan)]),
                 "w": jnp.ones(2, jnp.float32)}


def test_dynamic_loss_scale_unscales_complex_gradients():
  ls = jaxamp.dynamic_loss_scale(initial_scale=1024.0)
  scaled = jax.tree.map(lambda g: g * 1024, GRADS)
  updates, state = ls.update(scaled, ls.init(None))
  assert updates["lam"].dtype == jnp.complex64
  np.testing.assert_array_equal(updates["lam"], GRADS["lam"])
  np.testing.assert_array_equal(updates["w"], GRADS["w"])
  assert bool(state.finite)


@pytest.mark.parametrize("make", [jaxamp.dynamic_loss_scale, jaxamp.no_loss_scale])
def test_a_loss_scale_zeroes_a_step_with_a_nan_only_in_an_imaginary_part(make):
  ls = make()
  updates, state = ls.update(IMAGINARY_NAN, ls.init(None))
  assert not bool(state.finite) and int(state.overflow_steps) == 1
  np.testing.assert_array_equal(updates["lam"], np.zeros(2, np.complex64))


def test_all_finite_looks_at_imaginary_parts():
  assert bool(jaxamp.all_finite(GRADS))
  assert not bool(jaxamp.all_finite(IMAGINARY_NAN))
  assert not bool(jaxamp.all_finite([jnp.asarray([jax.lax.complex(1.0, jnp.inf)])]))


def test_skip_nonfinite_without_a_loss_scale_skips_an_imaginary_nan():
  opt = jaxamp.skip_nonfinite(optax.adam(1e-3))
  state = opt.init(GRADS)
  updates, new = opt.update(IMAGINARY_NAN, state, GRADS)
  np.testing.assert_array_equal(updates["lam"], np.zeros(2, np.complex64))
  assert int(optax.tree_utils.tree_get(new, "count")) == 0
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("max_norm", [1.0, 100.0])
def test_clip_by_global_norm_clips_complex_leaves_as_optax_does(max_norm):
  """The norm dropped imaginary parts (sqrt(9 + 1 + 4) = 3.74 here, against optax's
  sqrt(25 + 4 + 1 + 4) = 5.83) and complex leaves were never clipped."""
  clip, theirs = jaxamp.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
  got, _ = clip.update(GRADS, clip.init(GRADS))
  want, _ = theirs.update(GRADS, theirs.init(GRADS))
  for name in GRADS:
    assert got[name].dtype == GRADS[name].dtype
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
  norm = jaxamp.loss_scale.unscaled_norm_and_finite(GRADS, None)[1]
  assert float(norm) == pytest.approx(float(optax.tree.norm(GRADS)), rel=1e-7)


def test_real_or_complex_never_narrows_a_complex_dtype_to_a_real_one():
  from jaxamp.casting import real_or_complex  # pylint: disable=g-import-not-at-top
  for target in (jnp.float32, jnp.bfloat16, jnp.float16):
    assert real_or_complex(jnp.complex64, target) == np.complex64
    assert real_or_complex(jnp.float32, target) == np.dtype(target)
  # A policy casts no complex leaf.
  assert jaxamp.cast_floating(GRADS, jnp.bfloat16)["lam"].dtype == jnp.complex64
