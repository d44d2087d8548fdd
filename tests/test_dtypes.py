"""Tests for jaxamp.dtypes: the one table of floating formats, and those that read it."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp import census, dtypes, sharding


@pytest.mark.parametrize("name", sorted(dtypes.FORMATS))
def test_each_row_is_what_ml_dtypes_says_of_the_format(name):
  fmt, info = dtypes.FORMATS[name], ml_dtypes.finfo(getattr(jnp, name))
  assert (fmt.bits, fmt.max, fmt.smallest_normal) == (
      info.bits, float(info.max), float(info.smallest_normal))
  assert fmt.itemsize == np.dtype(getattr(jnp, name)).itemsize
  assert dtypes.format_of(getattr(jnp, name)) is fmt


def test_roles():
  assert dtypes.HALF == {"float16", "bfloat16"}
  assert {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"} <= dtypes.FP8
  assert "float8_e8m0fnu" not in dtypes.FP8  # a scale format: no mantissa
  assert census.HALF_DTYPES is dtypes.HALF and census.FP8_DTYPES is dtypes.FP8
  assert dtypes.is_half(jnp.bfloat16) and not dtypes.is_half(jnp.float32)
  assert dtypes.format_of(jnp.int32) is None and dtypes.format_of("nope") is None


def test_policies_read_the_table():
  assert jaxamp.get_policy("mixed_bfloat16").is_mixed
  assert not jaxamp.get_policy("float32").is_mixed
  assert jaxamp.Policy("float32", "float16").name == "mixed_float16"


@pytest.mark.parametrize("spelling,size", [("bf16", 2), ("f8E4M3FN", 1), ("f8e5m2", 1),
                                           ("float8_e4m3fn", 1), ("s32", 4), ("pred", 1),
                                           ("f64", 8)])
def test_itemsize_of_each_spelling(spelling, size):
  assert dtypes.itemsize(spelling) == size


def test_an_unknown_element_type_is_named_not_guessed():
  with pytest.raises(ValueError, match=r"Unknown element type 'x9'.*bf16"):
    dtypes.itemsize("x9")


@pytest.mark.parametrize("text", [
    "%ag = f8e4m3fn[8,4]{1,0} all-gather(f8e4m3fn[1,4]{1,0} %p), dimensions={0}",
    '%0 = "stablehlo.all_gather"(%arg0) <{all_gather_dim = 0 : i64}> : '
    "(tensor<1x4xf8E4M3FN>) -> tensor<8x4xf8E4M3FN>"])
def test_an_fp8_collective_counts_one_byte_per_element(text):
  # Counted as 4 bytes per element (the old fallback for a dtype the table lacked).
  [found] = sharding.collectives(text)
  assert found.bytes == 32, found


def test_each_format_has_its_own_short_name():
  # precision_report's shape strings: two formats printed alike would be told apart by
  # nobody (float8_e4m3 and float8_e4m3fn are different formats).
  shorts = [f.short for f in dtypes.FORMATS.values()]
  assert len(set(shorts)) == len(shorts), shorts
  assert dtypes.FORMATS["bfloat16"].short == "bf16"
  assert dtypes.FORMATS["float8_e4m3fn"].short == "e4m3fn"
