"""Tests for jaxamp.casting: only floating array leaves are cast."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp.casting import cast_floating, is_floating_array, narrow_cotangents, read_as


def test_only_floating_arrays_are_cast():
  tree = [jnp.ones(2, jnp.float16), np.ones(2, np.float64), jnp.arange(2),
          jnp.array([True]), jax.random.key(0), jax.random.PRNGKey(0), None, 2.0, "s"]
  out = cast_floating(tree, jnp.bfloat16)
  assert [getattr(x, "dtype", None) for x in out[:2]] == [jnp.bfloat16, jnp.bfloat16]
  assert isinstance(out[1], np.ndarray)  # numpy stays numpy
  for before, after in zip(tree[2:], out[2:]):
    assert after is before


def test_same_dtype_is_not_cast_and_traces_no_convert():
  x = jnp.ones(3, jnp.float32)
  assert cast_floating(x, jnp.float32) is x
  text = jax.jit(lambda x: cast_floating(x, jnp.float32)).lower(x).as_text()
  assert "convert" not in text


def test_shape_structs_change_dtype_and_keep_shape():
  s = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  out = cast_floating({"s": s, "i": jax.ShapeDtypeStruct((2,), jnp.int32)}, jnp.float16)
  assert out["s"].shape == (2, 3) and out["s"].dtype == jnp.float16
  assert out["i"].dtype == jnp.int32
  assert is_floating_array(s) and not is_floating_array(out["i"]) and not is_floating_array(1.0)


def test_none_and_non_floating_targets_are_refused():
  import pytest

  with pytest.raises(ValueError, match="got None"):
    cast_floating(jnp.ones(2), None)  # np.dtype(None) would be float64
  with pytest.raises(ValueError, match="floating dtype, got int32"):
    cast_floating(jnp.ones(2), jnp.int32)


def _narrow_of_grads(loss, params, *args):
  """Under jit: the gradients of ``loss`` and what narrow_cotangents found for each."""
  @jax.jit
  def run(params, *args):
    with narrow_cotangents() as found:
      grads = jax.grad(loss)(params, *args)
    return grads, {k: found.narrow(g) for k, g in grads.items()}
  return run(params, *args)


@pytest.mark.parametrize("half", [jnp.bfloat16, jnp.float16])
def test_a_parameter_read_once_in_half_precision_has_its_cotangent_found(half):
  # w is read once (its float32 gradient is that read's cotangent widened, the same
  # bits); v twice (summed in float32: none); b never narrowed; u read in a checkpoint.
  def loss(p, x):
    h = x.astype(half) @ read_as(p["w"], half)
    h = h @ read_as(p["v"], half) + jnp.tanh(h) @ read_as(p["v"], half)
    h = jax.checkpoint(lambda h, u: h @ read_as(u, half))(h, p["u"])
    return jnp.sum(h.astype(jnp.float32) * read_as(p["b"], jnp.float32))
  rng = np.random.RandomState(0)
  p = {k: jnp.asarray(rng.randn(4, 4), jnp.float32) for k in "wvu"}
  p["b"] = jnp.ones(4)
  x = jnp.asarray(rng.randn(2, 4), jnp.float32)
  grads, narrow = _narrow_of_grads(loss, p, x)
  assert narrow["w"].dtype == half
  np.testing.assert_array_equal(np.asarray(narrow["w"].astype(jnp.float32)), grads["w"])
  assert narrow["v"] is None and narrow["u"] is None and narrow["b"] is None
  plain = jax.jit(jax.grad(loss))(p, x)  # no context: the same gradients, bit for bit
  for k in p:
    assert plain[k].dtype == grads[k].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(plain[k]), np.asarray(grads[k]))


def test_read_as_records_nothing_outside_the_context_and_casts_as_cast_floating():
  x = jnp.ones((2, 2))
  assert read_as(x, jnp.bfloat16).dtype == jnp.bfloat16
  assert read_as(jnp.arange(2), jnp.bfloat16).dtype == jnp.int32  # ints stay
  key = jax.random.key(0)
  assert read_as(key, jnp.bfloat16) is key
  # No custom_vjp traced outside narrow_cotangents, nor for a widening read inside it.
  plain = str(jax.make_jaxpr(lambda x: read_as(x, jnp.bfloat16))(x))
  assert "custom_vjp" not in plain

  def widening(x):
    with narrow_cotangents():
      return read_as(x.astype(jnp.bfloat16), jnp.float32)
  assert "custom_vjp" not in str(jax.make_jaxpr(widening)(x))

  def narrowing(x):
    with narrow_cotangents():
      return read_as(x, jnp.bfloat16)
  assert "custom_vjp" in str(jax.make_jaxpr(narrowing)(x))
