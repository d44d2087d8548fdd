"""Tests for jaxamp.report: FLOPs, dtypes, multiplicities, casts and residuals."""

import collections
import contextlib
import io
import json
import math
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.ad_checkpoint import print_saved_residuals

import jaxamp
from jaxamp import report as report_lib

BF16, F32 = jnp.bfloat16, jnp.float32


def _ones(*shape, dtype=F32):
  return jnp.ones(shape, dtype)


def _matmul(x, w):
  return x @ w


def _conv_nhwc(img, k, groups=1):
  return lax.conv_general_dilated(img, k, (1, 1), "SAME",
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                  feature_group_count=groups)


def _scan_layers(ws, x):
  return lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]


# --- FLOPs ------------------------------------------------------------------------------


def test_matmul_flops_dtypes_and_shapes():
  r = jaxamp.precision_report(_matmul, _ones(4, 8, dtype=BF16), _ones(8, 16, dtype=BF16))
  (op,) = r.ops
  assert op == jaxamp.MatmulOp("dot_general", "bfloat16", "bfloat16", "bfloat16", (4, 8),
                               (8, 16), (4, 16), 2 * 4 * 16 * 8, 1, "main")
  assert r.total_flops == 1024


def test_einsum_with_batch_dims_flops():
  r = jaxamp.precision_report(lambda a, b: jnp.einsum("bhij,bhjk->bhik", a, b),
                              _ones(2, 3, 4, 5), _ones(2, 3, 5, 6))
  (op,) = r.ops
  assert op.result_shape == (2, 3, 4, 6)
  assert op.flops == 2 * (2 * 3 * 4 * 6) * 5


def test_outer_product_has_no_contracting_dims():
  r = jaxamp.precision_report(lambda a, b: jnp.einsum("i,j->ij", a, b), _ones(3), _ones(4))
  assert r.total_flops == 2 * 3 * 4


def test_preferred_element_type_result_dtype():
  f = lambda x, w: jnp.dot(x, w, preferred_element_type=F32)
  (op,) = jaxamp.precision_report(f, _ones(4, 8, dtype=BF16), _ones(8, 16, dtype=BF16)).ops
  assert (op.lhs_dtype, op.rhs_dtype, op.result_dtype) == ("bfloat16", "bfloat16", "float32")
  assert op.is_half


@pytest.mark.parametrize("layout, img, kernel, stride, padding, out", [
    (("NHWC", "HWIO", "NHWC"), (2, 9, 9, 3), (3, 3, 3, 7), 1, "SAME", (2, 9, 9, 7)),
    (("NCHW", "OIHW", "NCHW"), (2, 3, 9, 9), (7, 3, 3, 3), 2, "VALID", (2, 7, 4, 4)),
])
def test_conv_flops(layout, img, kernel, stride, padding, out):
  f = lambda i, k: lax.conv_general_dilated(i, k, (stride, stride), padding,
                                            dimension_numbers=layout)
  (op,) = jaxamp.precision_report(f, _ones(*img), _ones(*kernel)).ops
  assert op.kind == "convolution"
  assert op.result_shape == out
  # Each output element is a dot over kernel height * width * input channels (3 * 3 * 3).
  assert op.flops == 2 * math.prod(out) * 27


@pytest.mark.parametrize("groups, channels", [(1, 3), (3, 6)])
def test_conv_gradient_convs_have_the_forward_flops(groups, channels):
  # Input grad, and weight grad (batch_group_count > 1 when grouped), cost what forward does.
  img, k = _ones(2, 9, 9, channels), _ones(3, 3, channels // groups, 6)
  f = lambda i, k: _conv_nhwc(i, k, groups).sum()
  r = jaxamp.precision_report(f, img, k, backward=True, argnums=(0, 1))
  forward = 2 * (2 * 9 * 9 * 6) * (3 * 3 * channels // groups)
  assert [op.kind for op in r.ops] == ["convolution"] * 3
  assert [op.flops for op in r.ops] == [forward] * 3


# --- half share -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, share", [(BF16, 1.0), (jnp.float16, 1.0), (F32, 0.0)])
def test_half_share_of_one_matmul(dtype, share):
  r = jaxamp.precision_report(_matmul, _ones(4, 8, dtype=dtype), _ones(8, 16, dtype=dtype))
  assert r.half_share == share
  assert r.half_flops == share * 1024


def test_half_share_of_equal_bf16_and_f32_matmuls():
  def f(x, w):
    return (x.astype(BF16) @ w.astype(BF16)).astype(F32) + x @ w

  r = jaxamp.precision_report(f, _ones(4, 8), _ones(8, 8))
  assert r.half_share == 0.5
  assert r.flops_by_dtype == {("bfloat16", "bfloat16"): 512, ("float32", "float32"): 512}


def test_no_matmul_gives_zero_share_not_nan():
  r = jaxamp.precision_report(lambda x: jnp.sin(x).sum(), _ones(3))
  assert (r.ops, r.total_flops, r.half_share) == ([], 0, 0.0)


# --- backward ---------------------------------------------------------------------------


def test_backward_finds_forward_and_two_gradient_dots():
  f = lambda x, w: (x.astype(BF16) @ w.astype(BF16)).astype(F32).sum()
  r = jaxamp.precision_report(f, _ones(4, 8), _ones(8, 16), backward=True, argnums=(0, 1))
  assert len(r.ops) == 3
  assert {(op.lhs_dtype, op.rhs_dtype, op.result_dtype) for op in r.ops} == {
      ("bfloat16", "bfloat16", "bfloat16")}
  # y = x @ w, dx = dy @ w.T, dw = x.T @ dy (jax may emit dw transposed).
  assert sorted(math.prod(op.result_shape) for op in r.ops) == [4 * 8, 4 * 16, 8 * 16]
  assert [op.flops for op in r.ops] == [1024] * 3
  assert r.total_flops == 3 * 1024 and r.half_share == 1.0


def test_backward_only_differentiates_argnums():
  f = lambda x, w: (x @ w).sum()
  r = jaxamp.precision_report(f, _ones(4, 8), _ones(8, 16), backward=True)
  assert sorted(math.prod(op.result_shape) for op in r.ops) == [4 * 8, 4 * 16]  # no dw


def test_forward_only_by_default():
  f = lambda x, w: (x @ w).sum()
  assert len(jaxamp.precision_report(f, _ones(4, 8), _ones(8, 16)).ops) == 1


# --- multiplicity -----------------------------------------------------------------------


def test_scan_ops_are_multiplied_by_the_trip_count():
  r = jaxamp.precision_report(_scan_layers, _ones(5, 8, 8), _ones(4, 8))
  (op,) = r.ops
  assert op.multiplicity == 5
  assert r.total_flops == 5 * 2 * 4 * 8 * 8
  assert r.unknown_trip_loops == 0


def test_scan_backward_loop_is_counted_too():
  r = jaxamp.precision_report(lambda ws, x: _scan_layers(ws, x).sum(), _ones(5, 8, 8),
                              _ones(4, 8), backward=True, argnums=(0, 1))
  assert [op.multiplicity for op in r.ops] == [5, 5, 5]


@pytest.mark.parametrize("unroll", [1, 2])
def test_reverse_and_unrolled_scan(unroll):
  f = lambda ws, x: lax.scan(lambda c, w: (c @ w, None), x, ws, reverse=True, unroll=unroll)[0]
  r = jaxamp.precision_report(f, _ones(5, 8, 8), _ones(4, 8))
  assert sum(op.multiplicity for op in r.ops) == 5


def test_fori_loop_with_offset_bounds():
  f = lambda x, w: lax.fori_loop(2, 7, lambda i, c: c @ w, x)
  (op,) = jaxamp.precision_report(f, _ones(4, 8), _ones(8, 8)).ops
  assert op.multiplicity == 5


def test_nested_scans_multiply():
  f = lambda ws, x: lax.scan(lambda c, _: (_scan_layers(ws, c), None), x, None, length=3)[0]
  (op,) = jaxamp.precision_report(f, _ones(5, 8, 8), _ones(4, 8)).ops
  assert op.multiplicity == 15


def test_loop_with_traced_bound_counts_once_and_says_so():
  f = lambda n, x, w: lax.fori_loop(0, n, lambda i, c: c @ w, x)
  r = jaxamp.precision_report(f, 3, _ones(4, 8), _ones(8, 8), argnums=1)
  assert [op.multiplicity for op in r.ops] == [1]
  assert r.unknown_trip_loops == 1
  assert "unknown trip count" in r.table()


def test_function_called_twice_counts_twice():
  inner = jax.jit(_matmul)
  r = jaxamp.precision_report(lambda x, w: inner(inner(x, w), w), _ones(4, 8), _ones(8, 8))
  (op,) = r.ops
  assert op.multiplicity == 2 and op.function != "main"
  assert r.total_flops == 2 * 512


# --- casts ------------------------------------------------------------------------------


def test_float_casts_are_counted_and_int_casts_are_not():
  f = lambda x, w, i: (x.astype(BF16) @ w.astype(BF16)).astype(F32) + i.astype(F32)
  r = jaxamp.precision_report(f, _ones(4, 8), _ones(8, 8), _ones(4, 8, dtype=jnp.int32))
  assert r.casts == 3
  assert r.cast_bytes == (4 * 8 + 8 * 8) * 2 + 4 * 8 * 4  # x, w to bfloat16; x @ w back


def test_casts_inside_a_loop_count_per_iteration():
  f = lambda ws, x: lax.scan(lambda c, w: ((c.astype(BF16) @ w).astype(F32), None), x, ws)[0]
  r = jaxamp.precision_report(f, _ones(5, 8, 8, dtype=BF16), _ones(4, 8))
  assert r.casts == 2 * 5
  assert r.cast_bytes == 5 * (4 * 8 * 2 + 4 * 8 * 4)


# --- residuals --------------------------------------------------------------------------


def _mlp(params, x, dtype=F32):
  params, x = jaxamp.cast_floating((params, x), dtype)
  h = jnp.tanh(x @ params["w1"])
  return (h @ params["w2"]).astype(F32).sum()


_PARAMS = {"w1": _ones(8, 16), "w2": _ones(16, 2)}
_X = _ones(4, 8)


def test_residual_bytes_of_an_f32_mlp_exclude_arguments():
  r = jaxamp.precision_report(_mlp, _PARAMS, _X)
  # tanh(x @ w1) for dw2, and 1 - tanh^2 for dw1: two f32[4,16]. x and w2 are arguments.
  assert sorted(r.residuals) == [((4, 16), "float32")] * 2
  assert r.residual_bytes == 2 * 4 * 16 * 4
  assert r.residual_bytes_with_args == r.residual_bytes + (4 * 8 + 16 * 2) * 4


def test_bf16_compute_saves_fewer_residual_bytes():
  f32 = jaxamp.precision_report(_mlp, _PARAMS, _X)
  bf16 = jaxamp.precision_report(lambda p, x: _mlp(p, x, BF16), _PARAMS, _X)
  assert bf16.residual_bytes < f32.residual_bytes
  assert all(dtype == "bfloat16" for _, dtype in bf16.residuals)
  # The bf16 copies of x and w2 are new buffers, so they count as activations here.
  assert bf16.residual_bytes == (2 * 4 * 16 + 4 * 8 + 16 * 2) * 2


def _parse_saved_residuals(fn, *args):
  """jax's own account: ([activation avals], [argument avals]) as 'f32[4,16]' strings."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(fn, *args)
  lines = out.getvalue().splitlines()
  args_ = sorted(line.split()[0] for line in lines if "from the argument" in line)
  acts = sorted(line.split()[0] for line in lines if "from the argument" not in line)
  return acts, args_


def test_residuals_agree_with_print_saved_residuals():
  fn = lambda p, x: _mlp(p, x, BF16)
  r = jaxamp.precision_report(fn, _PARAMS, _X, argnums=(0, 1))
  short = {"float32": "f32", "bfloat16": "bf16"}
  mine = sorted(f"{short[d]}[{','.join(map(str, s))}]" for s, d in r.residuals)
  acts, args_ = _parse_saved_residuals(fn, _PARAMS, _X)
  assert mine == acts
  arg_bytes = sum(math.prod(map(int, a[a.index("[") + 1:-1].split(","))) * 4 for a in args_)
  assert r.residual_bytes_with_args - r.residual_bytes == arg_bytes


def test_residuals_none_when_vjp_cannot_be_traced():
  @jax.custom_vjp
  def f(x):
    return x

  def fwd(x):
    raise NotImplementedError("no reverse mode here")

  f.defvjp(fwd, lambda res, g: (g,))
  with pytest.warns(RuntimeWarning, match="residuals not computed"):
    r = jaxamp.precision_report(lambda x, w: f(x) @ w, _ones(4, 8), _ones(8, 8))
  assert r.residual_bytes is None and r.residuals is None
  assert "n/a" in r.table()


# --- output and arguments ---------------------------------------------------------------


def test_table_has_header_rows_and_percentages():
  f = lambda x, w: (x.astype(BF16) @ w.astype(BF16)).astype(F32) + x @ w
  table = str(jaxamp.precision_report(f, _ones(4, 8), _ones(8, 8)))
  lines = table.splitlines()
  assert lines[0].split() == ["op", "lhs", "rhs", "out", "count", "FLOPs", "share"]
  assert "bf16[4,8]" in lines[1] or "bf16[4,8]" in lines[2]
  assert "half-precision share: 50.0% of 1.02K matmul FLOPs" in table
  assert "3 casts" in table
  assert "residuals:" in table


def test_to_dict_is_json_serializable():
  r = jaxamp.precision_report(_mlp, _PARAMS, _X)
  d = json.loads(json.dumps(r.to_dict()))
  assert d["total_flops"] == r.total_flops
  assert d["flops_by_dtype"] == {"float32 x float32": r.total_flops}
  assert d["ops"][0]["lhs_shape"] == [4, 8]


def test_kwargs_are_static_and_pytrees_are_args():
  def f(params, x, *, train):
    return x @ params["w1"] if train else x

  assert len(jaxamp.precision_report(f, _PARAMS, _X, train=True).ops) == 1
  assert jaxamp.precision_report(f, _PARAMS, _X, train=False).ops == []


def test_bad_argnums_is_an_error():
  with pytest.raises(ValueError, match="argnums"):
    jaxamp.precision_report(_matmul, _ones(2, 2), _ones(2, 2), argnums=2)


# --- the module is read as MLIR objects, not as text ------------------------------------


def test_function_names_are_symbols_not_printed_text():
  # Printed, this name reads as an op to a text parser (and its quote as an escape);
  # as a symbol it is just a name: one dot, run twice, in a function called that.
  def layer(x, w):
    return x @ w

  layer.__name__ = 'stablehlo.dot_general "layer"'
  inner = jax.jit(layer)
  r = jaxamp.precision_report(lambda x, w: inner(inner(x, w), w), _ones(4, 8), _ones(8, 8))
  (op,) = r.ops
  assert (op.function, op.multiplicity, op.flops) == (layer.__name__, 2, 512)


def test_composite_decomposition_counts_per_call():
  # lax.composite lowers to stablehlo.composite naming its decomposition, a function.
  matmul = lax.composite(_matmul, name="my.matmul")
  f = lambda ws, x: lax.scan(lambda c, w: (matmul(c, w), None), x, ws)[0]
  with warnings.catch_warnings():  # composites may have no JVP rule: no residuals then
    warnings.simplefilter("ignore", RuntimeWarning)
    (op,) = jaxamp.precision_report(f, _ones(3, 8, 8), _ones(4, 8)).ops
  assert (op.function, op.multiplicity) == ("my.matmul", 3)


def _jaxpr_dots(jaxpr, runs=1):
  """jax's own account: each ``dot_general`` eqn's dtypes, shapes, FLOPs and runs, in
  sub-jaxprs too (a scan body runs ``length`` times)."""
  dots = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs, rhs), (out,) = [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars]
      (contracting, _), _ = eqn.params["dimension_numbers"]
      flops = 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contracting)
      dots.append(((lhs.dtype.name, rhs.dtype.name, out.dtype.name, lhs.shape, rhs.shape,
                    out.shape, flops), runs))
    inner = runs * eqn.params["length"] if eqn.primitive.name == "scan" else runs
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", param)
      if isinstance(sub, jax.extend.core.Jaxpr):
        dots += _jaxpr_dots(sub, inner)
  return dots


def _mlp_then_scan(params, x):
  h = jnp.tanh(x.astype(BF16) @ params["w1"].astype(BF16))
  h = lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, params["ws"].astype(BF16))[0]
  # No preferred_element_type: its backward dots mix dtypes in the jaxpr, and lowering
  # converts their operands to a common one first.
  return (h @ params["w2"].astype(BF16)).astype(F32).sum()


@pytest.mark.parametrize("backward", [False, True])
def test_ops_agree_with_the_jaxprs_dot_generals(backward):
  params = {"w1": _ones(8, 16), "ws": _ones(3, 16, 16), "w2": _ones(16, 4)}
  fn = jax.value_and_grad(_mlp_then_scan) if backward else _mlp_then_scan
  r = jaxamp.precision_report(_mlp_then_scan, params, _ones(2, 8), backward=backward)
  mine = collections.Counter()
  for op in r.ops:
    mine[(op.lhs_dtype, op.rhs_dtype, op.result_dtype, op.lhs_shape, op.rhs_shape,
          op.result_shape, op.flops)] += op.multiplicity
  jaxs = collections.Counter()
  for key, runs in _jaxpr_dots(jax.make_jaxpr(fn)(params, _ones(2, 8)).jaxpr):
    jaxs[key] += runs
  assert mine == jaxs
  assert sum(jaxs.values()) == (5 if not backward else 5 + 9)  # 2 + 3 scanned; dx, dw


# --- parser details on text, for formats other jax versions print ----------------------


@pytest.mark.parametrize("mlir, name", [
    ("f16", "float16"), ("bf16", "bfloat16"), ("f32", "float32"), ("f64", "float64"),
    ("i8", "int8"), ("ui8", "uint8"), ("i1", "bool"), ("f8E4M3FN", "float8_e4m3fn"),
    ("f8E5M2", "float8_e5m2"), ("complex<f32>", "complex64"),
])
def test_mlir_dtype_names(mlir, name):
  assert report_lib._mlir_dtype(mlir) == name


def test_tensor_types():
  assert report_lib._tensor("tensor<f32>") == ((), "float32")
  assert report_lib._tensor("tensor<4x8xbf16>") == ((4, 8), "bfloat16")
  assert report_lib._tensor("tensor<?x8xf32>") == ((-1, 8), "float32")


_TEXT = """\
module @m {
  func.func public @main(%arg0: tensor<4x8xbf16>) -> (tensor<4x8xbf16>) {
    %c = stablehlo.constant dense<10> : tensor<i64>
    %0:2 = stablehlo.while(%iterArg = %c, %iterArg_0 = %arg0) : tensor<i64>, tensor<4x8xbf16>
    cond {
      %c_1 = stablehlo.constant dense<0> : tensor<i64>
      %1 = stablehlo.compare  GT, %iterArg, %c_1,  SIGNED : (tensor<i64>, tensor<i64>) -> tensor<i1>
      stablehlo.return %1 : tensor<i1>
    } do {
      %1 = func.call @"my fn"(%iterArg_0) : (tensor<4x8xbf16>) -> tensor<4x8xbf16>
      %c_1 = stablehlo.constant dense<2> : tensor<i64>
      %2 = stablehlo.subtract %iterArg, %c_1 : tensor<i64>
      stablehlo.return %2, %1 : tensor<i64>, tensor<4x8xbf16>
    }
    return %0#1 : tensor<4x8xbf16>
  }
  func.func private @"my fn"(%arg0: tensor<4x8xbf16>) -> tensor<4x8xbf16> {
    %0 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT], algorithm = <lhs_precision_type = bf16, rhs_precision_type = bf16, accumulation_type = f32, lhs_component_count = 1, rhs_component_count = 1, num_primitive_operations = 1, allow_imprecise_accumulation = false> : (tensor<4x8xbf16>, tensor<4x8xbf16>) -> tensor<4x4xf32> loc(#loc3)
    %1 = stablehlo.convert %0 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
    return %arg0 : tensor<4x8xbf16>
  }
}
#loc3 = loc("model.py":12:3)
"""


def test_parser_on_a_counting_down_loop_quoted_names_and_locations():
  ops, casts, cast_bytes, unknown = report_lib._parse_module(_TEXT)
  (op,) = ops
  assert (op.multiplicity, op.function, op.flops) == (5, "my fn", 2 * 16 * 8)
  assert (op.lhs_dtype, op.result_dtype) == ("bfloat16", "float32")
  assert (casts, cast_bytes, unknown) == (5, 5 * 4 * 4 * 2, 0)


@pytest.mark.parametrize("direction, start, limit, step, trips", [
    ("LT", 0, 5, 1, 5), ("LT", 2, 7, 2, 3), ("LT", 5, 0, 1, 0), ("LE", 0, 5, 1, 6),
    ("GT", 10, 0, -2, 5), ("GE", 10, 0, -2, 6), ("NE", 0, 6, 2, 3), ("NE", 0, 5, 2, None),
    ("LT", 0, 5, -1, None),
])
def test_loop_trip_counts(direction, start, limit, step, trips):
  loop = report_lib._Loop({"%i": start})
  loop.compare, loop.step = (direction, "%i", limit), step
  assert loop.trips == trips
