"""Tests for jaxamp.casting: only floating array leaves are cast."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp.casting import cast_floating, is_floating_array


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
