"""Convolutions as an im2col GEMM (jaxamp.patch_conv, the scaled formats' default
convolution): the patches against lax's, the GEMM against lax.conv_general_dilated, each
format's convolution against its own dot on the patches, and conv layers training under
the rowwise, block and MXFP8 policies."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import conv_models
import jaxamp
from jaxamp import patch_conv, scaled

HIGHEST = lax.Precision.HIGHEST


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*XLA on CPU runs FP8.*", category=RuntimeWarning)
    yield


def _plain_dot(lhs, rhs, dims, precision=None, preferred_element_type=None):
  del precision
  return lax.dot_general(lhs, rhs, dims, precision=HIGHEST,
                         preferred_element_type=preferred_element_type)


_NHWC, _NCHW = ("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW")
# (input shape, kernel shape, conv arguments): 1-, 2- and 3-d, both layouts, strides,
# named and explicit padding, lhs and rhs dilation, feature and batch groups.
CASES = [
    ((2, 11, 4), (3, 4, 6), dict(window_strides=(2,), padding="SAME",
                                 dimension_numbers=("NWC", "WIO", "NWC"))),
    ((2, 4, 11), (6, 4, 3), dict(window_strides=(1,), padding="VALID", rhs_dilation=(3,),
                                 dimension_numbers=("NCW", "OIW", "NCW"))),
    ((2, 9, 9, 4), (3, 3, 2, 6), dict(window_strides=(2, 1), padding=((1, 0), (2, 1)),
                                      rhs_dilation=(1, 2), feature_group_count=2,
                                      dimension_numbers=_NHWC)),
    ((4, 4, 7, 6), (6, 4, 3, 2), dict(window_strides=(3, 2), padding=((1, 2), (0, 1)),
                                      lhs_dilation=(2, 1), batch_group_count=2,
                                      dimension_numbers=_NCHW)),
    ((2, 7, 6, 3), (3, 2, 3, 5), dict(window_strides=(1, 1), padding=((-1, 2), (0, 1)),
                                      lhs_dilation=(1, 2), dimension_numbers=_NHWC)),
    ((1, 3, 5, 6, 4), (8, 3, 2, 3, 3), dict(window_strides=(1, 1, 2),
                                            padding=((0, 0), (1, 1), (0, 1)),
                                            lhs_dilation=(1, 2, 1),
                                            dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))),
]
GRID = [((2, 7, 6, 4), (3, 2, 4 // fg, 6), dict(
    window_strides=s, padding=pad, lhs_dilation=ld, rhs_dilation=rd,
    feature_group_count=fg, dimension_numbers=_NHWC))
        for s in [(1, 1), (2, 3)] for pad in ["SAME", "VALID", ((2, 1), (0, 2))]
        for ld in [(1, 1), (2, 1)] for rd in [(1, 1), (1, 2)] for fg in [1, 2]
        if not (isinstance(pad, str) and ld != (1, 1))]


def _check_against_lax(cases):
  rng = np.random.RandomState(0)
  args = [(rng.randn(*xs).astype(np.float32), rng.randn(*ws).astype(np.float32))
          for xs, ws, _ in cases]

  @jax.jit
  def both(args):  # one program: one compilation
    return [(patch_conv.conv_general_dilated(_plain_dot, x, w, **kw),
             lax.conv_general_dilated(x, w, **kw, precision=HIGHEST))
            for (x, w), (_, _, kw) in zip(args, cases)]

  for case, (got, want) in zip(cases, both(args)):
    assert got.shape == want.shape and got.dtype == want.dtype == jnp.float32, case
    # float32 summation order only
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max(),
                               err_msg=str(case[2]))


def test_the_gemm_of_the_patches_is_lax_conv_general_dilated():
  _check_against_lax([CASES[i] for i in (2, 3, 5)])  # a few, each argument, for the main tier


@pytest.mark.slow
def test_the_gemm_of_the_patches_is_lax_conv_general_dilated_on_a_grid():
  _check_against_lax(CASES + GRID)


def test_patches_are_lax_patches_channel_major():
  """The same values as lax.conv_general_dilated_patches, bit for bit, its feature
  dimension moved last: channel-major, (C, *window)."""
  x = jnp.asarray(np.random.RandomState(1).randn(2, 3, 7, 6), jnp.float32)  # NCHW
  args = ((3, 2), (2, 1), ((1, 1), (0, 2)), (1, 2), (2, 1))
  got, want = jax.jit(lambda x: (patch_conv.patches(x, *args), lax.conv_general_dilated_patches(
      x, *args, precision=HIGHEST)))(x)
  np.testing.assert_array_equal(got, jnp.moveaxis(want, 1, -1))
  # feature c * 6 + (i * 2 + j) of output position (0, 0) is channel c at window (i, j)
  np.testing.assert_array_equal(got[0, 0, 0, 6 + 1], jnp.pad(x, ((0, 0), (0, 0), (1, 1),
                                                                   (0, 0)))[0, 1, 0, 0])


def test_bad_padding_is_refused_naming_what_is_valid():
  x, k = jnp.ones((1, 5, 2)), jnp.ones((3, 2, 4))
  dn = ("NWC", "WIO", "NWC")
  with pytest.raises(ValueError, match="String padding is not implemented"):  # lax's check
    patch_conv.conv_general_dilated(_plain_dot, x, k, (1,), "SAME", (2,), None, dn)
  with pytest.raises(ValueError, match=r"padding 'SAME' \(a string\) with lhs_dilation"):
    patch_conv.patches(jnp.ones((1, 2, 5)), (3,), (1,), "SAME", (2,))
  with pytest.raises(ValueError, match=r"one \(low, high\) pair per spatial dimension"):
    patch_conv.patches(jnp.ones((1, 2, 5)), (3,), (1,), ((1, 1), (1, 1)))


# --- each format's convolution -------------------------------------------------------------

FORMATS = {
    "rowwise": jaxamp.RowwiseScaling(),
    "block": jaxamp.BlockScaling(),
    "mxfp8": jaxamp.MXFP8Scaling(),
    "per_matmul": jaxamp.PerMatmulScaling(fwd=jaxamp.RowwiseScaling(),
                                          dgrad=jaxamp.BlockScaling()),
}


@pytest.mark.parametrize("name", [n if n == "rowwise" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FORMATS])
def test_a_format_runs_its_dot_on_the_patches(name):
  """The convolution is the format's dot on the explicit patches, bit for bit (grouped:
  a batch dimension of the dot); its gradients are near the float32 convolution's and
  the input gradient is bfloat16."""
  recipe = FORMATS[name]
  fmt = scaled.format_of(recipe)
  assert scaled.runs_conv(recipe)
  rng = np.random.RandomState(2)
  x = jnp.asarray(rng.randn(2, 6, 6, 8), jnp.bfloat16)
  w = jnp.asarray(rng.randn(3, 3, 4, 16), jnp.bfloat16)
  g = jnp.asarray(rng.randn(2, 3, 3, 16), jnp.float32)
  kw = dict(window_strides=(2, 2), padding="SAME", dimension_numbers=_NHWC,
            feature_group_count=2)
  state = fmt.init_state(recipe)

  @jax.jit
  def run(x, w, g):
    conv = lambda x, w: fmt.conv_general_dilated(x, w, **kw, state=state, recipe=recipe)
    y, pull = jax.vjp(conv, x, w)
    p = patch_conv.patches(x.astype(jnp.float32), (3, 3), (2, 2), "SAME",
                           lhs_spec=(0, 3, 1, 2)).astype(x.dtype)
    p = p.reshape(2, 3, 3, 2, 36)  # N, H, W, group, (C / 2) * 9
    k = jnp.transpose(w, (2, 0, 1, 3)).reshape(36, 2, 8).swapaxes(0, 1)  # group, K, O / 2
    dot = fmt.dot_general(p, k, (((4,), (1,)), ((3,), (0,))), state=state, recipe=recipe)
    want = jnp.moveaxis(dot, 0, -2).reshape(2, 3, 3, 16)
    ref, ref_pull = jax.vjp(lambda x, w: lax.conv_general_dilated(
        x, w, **kw, precision=HIGHEST), x.astype(jnp.float32), w.astype(jnp.float32))
    return y, want, pull(g.astype(y.dtype)), ref_pull(g)

  y, want, (dx, dw), (rx, rw) = run(x, w, g)
  assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
  # E4M3 rounds a value by up to 2**-4 and E5M2 by 2**-3, the bfloat16 result by 2**-8:
  # normwise, within 10 % of the float32 gradients (measured: 2 % to 6 %).
  for got, ref in ((dx, rx), (dw, rw)):
    err = np.linalg.norm(np.asarray(got, np.float32) - ref) / np.linalg.norm(ref)
    assert err < 0.10, (name, err)


class _Declines(jaxamp.RowwiseScaling):
  """A recipe whose format declines convolutions."""


class _DecliningFormat(type(scaled.format_of(jaxamp.RowwiseScaling()))):
  name = "no-conv rowwise"
  runs_convolutions = False


def test_a_format_can_decline_convolutions():
  scaled.register(_Declines, _DecliningFormat())
  try:
    assert not scaled.runs_conv(_Declines()) and scaled.runs_conv(jaxamp.RowwiseScaling())
    with pytest.raises(NotImplementedError, match="no-conv rowwise format runs no conv"):
      scaled.format_of(_Declines()).conv_general_dilated(
          jnp.ones((1, 4, 2)), jnp.ones((3, 2, 2)), (1,), "SAME", state=None,
          recipe=_Declines())
  finally:
    scaled.unregister(_Declines)


def test_precision_report_and_summary_show_the_conv_under_the_format():
  """The three GEMMs of a convolution (forward, input and kernel gradients) run with E4M3
  operands in the format's scope, each with the convolution's FLOPs; no convolution op
  is left."""
  layer = nn.Conv(16, (4,), strides=2, padding="SAME")  # K = 32 * 4 = 128: no padding
  x = jnp.ones((2, 10, 32))
  v = layer.init(jax.random.key(0), x)
  amp = jaxamp.with_policy(layer, "mixed_fp8_rowwise")
  r = jaxamp.precision_report(lambda v, x: (amp.apply(v, x).astype(jnp.float32) ** 2).sum(),
                              v, x, backward=True, argnums=(0, 1))
  conv_flops = 2 * (2 * 5 * 16) * 32 * 4
  assert all(op.kind == "dot_general" for op in r.ops), r.ops
  assert r.flops_by_format == {"fp8 e4m3fn/e5m2 rowwise": 3 * conv_flops}
  assert r.fp8_flops == r.total_flops == 3 * conv_flops
  row = jaxamp.summary((layer, v), x, policy="mixed_fp8_rowwise").rows[0]
  assert row.scaled_format == "fp8 e4m3fn/e5m2 rowwise", row
  assert "float8_e4m3fn" in str(row.matmul_dtypes), row


# --- conv layers training -------------------------------------------------------------------


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _setup(library, policy):
  """(train step, state, batch, the paths of the FP8 layers)"""
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8, 8, 3), jnp.float32)
  y = jnp.arange(4) % 4
  loss = lambda m, b: _xent(m(b[0]), b[1])
  if library == "equinox":
    x = jnp.transpose(x, (0, 3, 1, 2))
    loss = lambda m, b: _xent(jax.vmap(m)(b[0]), b[1])
  train = jaxamp.make_train_step(loss, optax.adam(1e-2), policy=policy)
  if library == "nnx":
    model = conv_models.NNXCNN(nnx.Rngs(0), transpose=True)
    return train, train.init(model), (x, y), {"c1", "c2", "up", "out"}
  if library == "linen":
    model = conv_models.LinenCNN(transpose=True)
    state = train.init(model, model.init(jax.random.key(0), x), x)
    return train, state, (x, y), {"Conv_0", "ConvTranspose_0", "Conv_1", "Dense_0"}
  model = conv_models.EqxCNN(jax.random.key(0), transpose=True)
  return train, train.init(model), (x, y), {"c1", "up", "c2", "out"}


def _fp8_gemms(text):
  return [line for line in text.splitlines()
          if ("stablehlo.dot_general" in line or '"xla.scaled_dot"' in line)
          and "f8E4M3FN" in line]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_fp8_rowwise", "mixed_fp8_block", "mixed_mxfp8"])
@pytest.mark.parametrize("library", ["nnx", "linen", "equinox"])
def test_conv_layers_train_in_the_format_and_skip_a_nonfinite_batch(library, policy,
                                                                    fresh_warnings):
  train, state, batch, paths = _setup(library, policy)
  assert set(state.fp8) == paths  # every conv layer runs the format, with its state
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for _ in range(2):
      state, metrics = train.step(state, batch)
  assert not [w for w in seen if "XLA on CPU" not in str(w.message)], [
      str(w.message) for w in seen]  # no "convolution layers ... compute dtype" warning
  loss = float(metrics["loss"])
  ref_train, ref_state, _, _ = _setup(library, "float32")
  for _ in range(2):
    ref_state, ref_metrics = ref_train.step(ref_state, batch)
  # two Adam steps of 1e-2 on FP8 GEMMs: the loss within 1 % of float32's (measured 0.1 %)
  assert np.isfinite(loss) and abs(loss - float(ref_metrics["loss"])) < 0.01 * loss
  text = train.lower(state, batch).as_text()
  assert "stablehlo.convolution" not in text  # no convolution left in the compute dtype
  # 3 GEMMs (forward, input and kernel gradients) per conv layer and the dense layer,
  # less the first layer's input gradient, which nothing needs
  assert len(_fp8_gemms(text)) >= 3 * len(paths) - 1, len(_fp8_gemms(text))
  before = jax.tree.map(np.asarray, (state.params, state.fp8))
  nan = batch[0].at[(0,) * batch[0].ndim].set(jnp.nan)
  state, metrics = train.step(state, (nan, batch[1]))
  assert not bool(metrics["grads_finite"]) and int(metrics["skipped_steps"]) == 1
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, (state.params, state.fp8)), before)
