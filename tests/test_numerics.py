"""The numerics monitor (jaxamp.numerics, make_train_step(numerics=...)): each statistic
against a NumPy recomputation from activations, cotangents and gradients captured
separately, for NNX, Linen and Equinox; the every-N schedule; the program without it."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import numerics
from tests.train_helpers import ROOT, run_script

STATS = numerics.STATS


def reference(xs, dtype):
  """The statistics of the arrays ``xs`` (one module's: each FP8 figure scales each
  array by its own amax) against ``dtype``, by their definitions, in NumPy."""
  xs = [np.abs(np.asarray(x, np.float64)).ravel() for x in xs]
  f16, bf16 = np.finfo(np.float16), jnp.finfo(jnp.bfloat16)
  info = jnp.finfo(dtype)
  fp8 = {s: jnp.finfo(t) for s, t in (("e4m3", jnp.float8_e4m3fn), ("e5m2", jnp.float8_e5m2))}
  n = nonzero = nonfinite = 0
  under, over = {}, {}
  amax = 0.0
  for a in xs:
    finite = np.isfinite(a)
    nz = finite & (a > 0)
    top = a[finite].max(initial=0.0)
    amax = max(amax, top)
    n, nonzero, nonfinite = n + a.size, nonzero + nz.sum(), nonfinite + (~finite).sum()
    tiny = {"": info.tiny, "_float16": f16.tiny, "_bfloat16": bf16.tiny,
            **{"_" + s: top * float(f.tiny) / float(f.max) for s, f in fp8.items()},
            "_float16_ls": float(f16.tiny) / 2.0 ** 15}
    big = {"": info.max, "_float16": f16.max, "_bfloat16": bf16.max}
    for k, t in tiny.items():
      under[k] = under.get(k, 0) + np.sum(nz & (a < float(t)))
    for k, b in big.items():
      over[k] = over.get(k, 0) + np.sum(a >= float(b))
  out = {"amax": amax, "count": n, "nonfinite": nonfinite}
  out.update({f"underflow{k}": v / max(nonzero, 1) for k, v in under.items()})
  out.update({f"overflow{k}": v / n for k, v in over.items()})
  return out


def assert_stats(got, x, dtype, what):
  want = reference(x if isinstance(x, list) else [x], dtype)
  assert set(STATS) <= set(got)  # and the what-if columns, if recorded
  for k in STATS:
    # float32 sums in another order: amax within rounding; counts exact.
    np.testing.assert_allclose(float(got[k]), want[k], rtol=1e-5, err_msg=f"{what}: {k}")


def spread(seed, shape, lo=-10, hi=6):
  """float32 values whose magnitudes span 10**lo .. 10**hi (under float16's smallest
  normal, over its largest), signs mixed, some exact zeros (NumPy: no JAX op to compile)."""
  r = np.random.RandomState(seed)
  mag = 10.0 ** r.uniform(lo, hi, shape)
  sign = np.where(r.rand(*shape) < 0.5, 1.0, -1.0)
  return np.where(r.rand(*shape) < 0.1, 0.0, mag * sign).astype(np.float32)


X = spread(0, (8, 4), -4, 2)


def loss(model, x):
  return jnp.mean(model(x) ** 2)


def forward(pa, pb, x):
  """The model's two Dense layers and the ReLU between them, in NumPy (float32)."""
  h = x @ pa["kernel"] + pa["bias"]
  return h, np.maximum(h, 0) @ pb["kernel"] + pb["bias"]


def check_step(train, state, pa, pb, names, transposed=False):
  """One recording step's figures against the same model computed by hand, the what-if
  columns too where the step records them (``transposed``: the library keeps kernels
  as ``(out, in)``)."""
  state, metrics = train.step(state, X)
  assert bool(metrics["numerics_recorded"])
  got = metrics["numerics"]
  a, b = names
  h, y = forward(pa, pb, X)
  # The cotangents arriving at each output (loss: the mean of y**2), the gradients.
  dy = (2 * y / y.size).astype(np.float32)
  dh = (dy @ pb["kernel"].T) * (h > 0)
  ga = {"kernel": X.T @ dh, "bias": dh.sum(0)}
  gb = {"kernel": np.maximum(h, 0).T @ dy, "bias": dy.sum(0)}
  f32 = np.float32
  assert_stats(got[a]["activation"], h, f32, "a activation")
  assert_stats(got[b]["activation"], y, f32, "b activation")
  assert_stats(got[b]["cotangent"], dy, f32, "b cotangent")
  assert_stats(got[a]["cotangent"], dh, f32, "a cotangent")
  assert_stats(got[a]["grad"], [ga["bias"], ga["kernel"]], f32, "a grad")
  assert_stats(got[b]["grad"], [gb["bias"], gb["kernel"]], f32, "b grad")
  # The layers FP8 runs record the input their matmul quantizes; the model, none.
  assert_stats(got[a]["input"], X, f32, "a input")
  assert_stats(got[b]["input"], np.maximum(h, 0), f32, "b input")
  assert "input" not in got[""]
  names_ = train.options.debug.numerics.whatif
  t = (lambda k: k.T) if transposed else (lambda k: k)
  for path, kind, xs, role in (
      (a, "input", [X], "input"), (b, "input", [np.maximum(h, 0)], "input"),
      (a, "activation", [h], "input"), (b, "cotangent", [dy], "grad"),
      (a, "cotangent", [dh], "grad"), (b, "grad", [gb["bias"], t(gb["kernel"])], "grad")):
    for k, v in whatif_reference(xs, names_, role).items():
      np.testing.assert_allclose(float(got[path][kind][k]), v, rtol=1e-6, atol=1e-12,
                                 err_msg=f"{path} {kind}: {k}")
  return state, metrics


def params_for(seed):
  pa = {"kernel": spread(seed, (4, 16)), "bias": spread(seed + 1, (16,), -3, 1)}
  pb = {"kernel": spread(seed + 2, (16, 3), -3, 1), "bias": spread(seed + 3, (3,), -3, 1)}
  return pa, pb


def make(every=1, whatif=(), **kw):
  return jaxamp.make_train_step(loss, optax.sgd(0.0), policy="float32",
                                numerics=jaxamp.Numerics(every=every, whatif=whatif), **kw)


@pytest.mark.slow
def test_nnx_statistics_match_numpy():
  from flax import nnx

  class M(nnx.Module):
    def __init__(self):
      self.a = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
      self.b = nnx.Linear(16, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.b(jax.nn.relu(self.a(x)))

  pa, pb = params_for(10)
  m = M()
  for layer, p in ((m.a, pa), (m.b, pb)):
    layer.kernel[...], layer.bias[...] = p["kernel"], p["bias"]
  # Steps 0 and 2 record (SGD at rate 0: the same values).
  train = make(every=2, whatif=numerics.whatif_policies())
  state, metrics = check_step(train, train.init(m), pa, pb, ("a", "b"))
  assert set(metrics["numerics"]) == {"", "a", "b"}  # '' is the model's own call
  state, metrics = train.step(state, X)
  assert not bool(metrics["numerics_recorded"])
  assert np.isnan([float(v) for v in jax.tree.leaves(metrics["numerics"])]).all()
  check_step(train, state, pa, pb, ("a", "b"))


@pytest.mark.slow
def test_linen_statistics_match_numpy():
  import flax.linen as nn

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3, name="b")(jax.nn.relu(nn.Dense(16, name="a")(x)))

  pa, pb = params_for(20)
  train = make(whatif=numerics.whatif_policies())
  state = train.init(M(), {"params": {"a": pa, "b": pb}}, X)
  check_step(train, state, pa, pb, ("a", "b"))


@pytest.mark.slow
def test_equinox_statistics_match_numpy():
  eqx = pytest.importorskip("equinox")

  class M(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __call__(self, x):
      return jax.vmap(lambda r: self.b(jax.nn.relu(self.a(r))))(x)

  pa, pb = params_for(30)
  m = M(eqx.nn.Linear(4, 16, key=jax.random.key(0)), eqx.nn.Linear(16, 3, key=jax.random.key(1)))
  # Equinox keeps the weight as (out, in).
  m = eqx.tree_at(lambda m: (m.a.weight, m.a.bias, m.b.weight, m.b.bias), m,
                  (pa["kernel"].T, pa["bias"], pb["kernel"].T, pb["bias"]))
  train = make(whatif=numerics.whatif_policies())
  check_step(train, train.init(m), pa, pb, ("a", "b"), transposed=True)


@pytest.mark.slow
def test_compute_dtype_columns_follow_the_policy():
  """Under mixed_float16 the headline figures are float16's; the activation is the
  float16 output, which the eager float16 layer reproduces."""
  from flax import nnx

  layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  layer.kernel[...] = spread(4, (4, 3), -6, 3)
  train = jaxamp.make_train_step(loss, optax.sgd(0.0), policy="mixed_float16",
                                 numerics=jaxamp.Numerics(every=1))
  state = train.init(layer)
  _, metrics = train.step(state, X)
  got = metrics["numerics"][""]
  h = X.astype(jnp.float16) @ layer.kernel[...].astype(jnp.float16) + layer.bias[...].astype(
      jnp.float16)
  assert_stats(got["activation"], h, np.float16, "activation")
  for kind in ("activation", "cotangent", "grad"):
    assert float(got[kind]["underflow"]) == float(got[kind]["underflow_float16"])
    assert float(got[kind]["overflow"]) == float(got[kind]["overflow_float16"])


@pytest.mark.slow
def test_every_n_schedule_and_nan_between():
  from flax import nnx

  n = 2
  train = jaxamp.make_train_step(loss, optax.sgd(1e-3), policy="mixed_bfloat16",
                                 numerics=jaxamp.Numerics(every=n))
  state = train.init(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
  recorded = []
  for _ in range(2 * n + 1):
    state, metrics = train.step(state, X)
    recorded.append(bool(metrics["numerics_recorded"]))
    values = np.array([float(v) for v in jax.tree.leaves(metrics["numerics"])])
    assert np.isnan(values).all() != recorded[-1]
  assert recorded == [i % n == 0 for i in range(2 * n + 1)]


@pytest.mark.slow
def test_program_without_numerics_is_unchanged():
  from flax import nnx

  texts = []
  for kw in ({}, {"numerics": None}):
    train = jaxamp.make_train_step(loss, optax.sgd(1e-3), policy="mixed_bfloat16", **kw)
    state = train.init(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    texts.append(train.lower(state, X).as_text())
  assert texts[0] == texts[1]
  train = jaxamp.make_train_step(loss, optax.sgd(1e-3), policy="mixed_bfloat16",
                                 numerics=jaxamp.Numerics(every=2))
  state = train.init(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
  assert train.lower(state, X).as_text() != texts[0]


@pytest.mark.slow
def test_grad_accumulation_combines_micro_batches():
  from flax import nnx

  layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  one = make()
  two = make(grad_accum_steps=2)
  _, m1 = one.step(one.init(layer), X)
  _, m2 = two.step(two.init(layer), X)
  act1, act2 = m1["numerics"][""]["activation"], m2["numerics"][""]["activation"]
  for k in STATS:  # the activations are the same values, seen in two halves
    np.testing.assert_allclose(float(act2[k]), float(act1[k]), rtol=1e-6, err_msg=k)


E4M3, E5M2 = (jnp.finfo(t) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2))


def scaled_reference(rows, name, role):
  """``|rows|`` (2-D, the contraction last) scaled as ``name``'s recipe scales a matmul
  operand in ``role``, and its FP8 format, written from each rule in NumPy."""
  rows = np.abs(np.asarray(rows, np.float64))
  fmt = E5M2 if (name == "mixed_fp8_rowwise" and role == "grad") else E4M3
  top = float(fmt.max)
  if name == "mixed_mxfp8":  # 32-blocks, scale 2**ceil(log2(amax / 448)), OCP's E8M0 range
    k = rows.shape[1]
    b = np.pad(rows, [(0, 0), (0, -k % 32)]).reshape(rows.shape[0], -1, 32)
    mant, ex = np.frexp(b.max(-1) / 448.0)  # amax / 448 = mant * 2**ex, mant in [0.5, 1)
    e = np.clip(np.where(mant > 0.5, ex, ex - 1), -127, 127)
    e = np.where(b.max(-1) == 0, -127, e)
    return (b / 2.0 ** e[..., None]).reshape(rows.shape[0], -1)[:, :k], fmt
  width = rows.shape[1] if name == "mixed_fp8_rowwise" else 128  # 1x128 tiles
  out = np.empty_like(rows)
  for j in range(0, rows.shape[1], width):
    t = rows[:, j:j + width]
    amax = t.max(1, keepdims=True)
    out[:, j:j + width] = t * np.where(amax > 0, top / np.maximum(amax, 1e-12), 1.0)
  return out, fmt


def whatif_reference(xs, names, role):
  """``underflow_<name>`` / ``overflow_<name>`` of the arrays ``xs`` by the rules: a
  value counts if it is lost along its last axis (forward / input-gradient product) or
  along its rows (the weight-gradient product, the transposed layout)."""
  out = {}
  for name in names:
    under = over = nonzero = 0
    for x in xs:
      rows = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
      nz = rows != 0
      nonzero += nz.sum()
      lost, sat = np.zeros(rows.shape, bool), np.zeros(rows.shape, bool)
      for layout in (rows, rows.T):
        v, fmt = scaled_reference(layout, name, role)
        v = v.T if layout is not rows else v
        # Saturated: past the largest value by more than half its spacing (E4M3: 464).
        top = float(fmt.max) + 2.0 ** np.floor(np.log2(float(fmt.max))) * float(fmt.eps) / 2
        lost, sat = lost | (v < float(fmt.tiny)), sat | (v > top)
      under, over = under + np.sum(nz & lost), over + np.sum(nz & sat)
    out[f"underflow_{name}"] = under / max(nonzero, 1)
    out[f"overflow_{name}"] = over / max(nonzero, 1)
  return out


def test_whatif_figures_follow_each_recipe_rule():
  """Numerics(whatif=...): each block- or row-scaled recipe's underflow and saturation
  of a layer's input and of the cotangent at its output, in the layouts of the forward,
  input-gradient and weight-gradient products, equal the recipe's rule recomputed in
  NumPy; 160 input features: two 1x128 tiles, five MX blocks."""
  from flax import nnx

  names = numerics.whatif_policies()
  assert set(names) >= {"mixed_fp8_rowwise", "mixed_fp8_block", "mixed_mxfp8"}
  x = spread(5, (6, 160), -9, 3)
  layer = nnx.Linear(160, 3, rngs=nnx.Rngs(0))
  layer.kernel[...] = spread(6, (160, 3), -3, 0)
  train = jaxamp.make_train_step(loss, optax.sgd(0.0), policy="float32",
                                 numerics=jaxamp.Numerics(every=1, whatif=names))
  _, metrics = train.step(train.init(layer), x)
  got = metrics["numerics"][""]
  y = x @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])
  dy = (2 * y / y.size).astype(np.float32)
  for kind, xs, role in (("input", [x], "input"), ("activation", [y], "input"),
                         ("cotangent", [dy], "grad")):
    want = whatif_reference(xs, names, role)
    assert set(got[kind]) == set(numerics.STATS) | set(want)
    for k, v in want.items():
      np.testing.assert_allclose(float(got[kind][k]), v, rtol=1e-6, atol=1e-12,
                                 err_msg=f"{kind}: {k}")
  # The cases differ: an input spanning 12 decades underflows per tensor more than per
  # row, per tile, per 32-block.
  u = {n: float(got["input"][f"underflow_{n}"]) for n in names}
  assert float(got["input"]["underflow_e4m3"]) > u["mixed_fp8_rowwise"] > 0
  assert u["mixed_fp8_rowwise"] >= u["mixed_fp8_block"] >= u["mixed_mxfp8"]


def test_ocp_rule_saturates_in_the_whatif():
  """MXFP8's OCP scale rule, 2**(floor(log2 amax) - 8), leaves a block's amax at 256..512:
  above 448 it saturates, which the what-if counts (the round-up rule never does)."""
  fmt = jaxamp.scaled.format_of(jaxamp.MXFP8Scaling(scale_rule="ocp"))
  x = jnp.array([[500.0, 1.0] + [0.0] * 30 + [300.0, 2.0] + [0.0] * 30])
  v, dtype = fmt.whatif(x, "input", jaxamp.MXFP8Scaling(scale_rule="ocp"))
  assert dtype == jnp.float8_e4m3fn
  assert v[0, 0] == 500.0 and v[0, 32] == 300.0  # scale 1 in both blocks: 500 > 464
  v, _ = fmt.whatif(x, "input", jaxamp.MXFP8Scaling())
  assert float(jnp.max(v)) <= 448.0


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="Numerics.whatif takes .*'mixed_fp8_block'.*got 'mixed_fp8'"):
    jaxamp.Numerics(whatif=("mixed_fp8",))
  assert jaxamp.Numerics(whatif="mixed_mxfp8").whatif == ("mixed_mxfp8",)
  with pytest.raises(ValueError, match="Numerics.every must be a positive int"):
    jaxamp.Numerics(every=-1)
  with pytest.raises(ValueError, match="DebugConfig.numerics must be a jaxamp.Numerics"):
    jaxamp.DebugConfig(numerics=5)
  with pytest.raises(ValueError, match="numerics=.* and debug= setting numerics=.*give it once"):
    jaxamp.make_train_step(loss, optax.sgd(0.1), numerics=jaxamp.Numerics(),
                           debug=jaxamp.DebugConfig(numerics=jaxamp.Numerics()))


MESH_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax, jaxamp
    from flax import nnx
    assert jax.device_count() == 8
    x = jnp.asarray(np.random.RandomState(0).standard_normal((16, 4)) * 1e-3, jnp.float32)
    x = x.at[3, 1].set(200.0)  # one device's rows hold the amax
    loss = lambda m, b: jnp.mean(m(b) ** 2)
    out = {}
    for name, mesh in (("one", None), ("eight", jax.make_mesh((8,), ("data",)))):
      for sharding in ([None] if mesh is None else [jaxamp.fsdp("data"), None]):
        cfg = None if mesh is None else jaxamp.ShardingConfig(mesh=mesh, param_sharding=sharding)
        train = jaxamp.make_train_step(loss, optax.sgd(0.0), policy="mixed_float16",
                                       sharding=cfg, numerics=jaxamp.Numerics(every=1))
        state = train.init(nnx.Linear(4, 64, rngs=nnx.Rngs(0)))
        _, m = train.step(state, x)
        out[name, sharding is None] = jax.tree.map(float, m["numerics"])
    ref = out["one", True]
    for key, got in out.items():
      for kind in ("activation", "cotangent", "grad"):
        for stat, v in ref[""][kind].items():
          np.testing.assert_allclose(got[""][kind][stat], v, rtol=1e-5, err_msg=str((key, kind, stat)))
    assert ref[""]["activation"]["count"] == 16 * 64
    print("ok")
""")


@pytest.mark.slow
def test_mesh_gives_global_figures(tmp_path):
  out = run_script(MESH_SCRIPT, tmp_path, "mesh_numerics.py",
                   {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": ROOT})
  assert "ok" in out


@pytest.mark.slow
def test_step_picks_the_program_on_the_host_without_reading_the_device(monkeypatch):
  """train.step runs the plain or the recording program as the schedule says, reading
  the step counter from the device only for a state it did not return."""
  import importlib

  from flax import nnx

  watch = importlib.import_module("jaxamp.train.watch")
  reads = []
  read = watch.read_step
  monkeypatch.setattr(watch, "read_step", lambda s: reads.append(1) or read(s))
  n = 2
  train = make(every=n)
  state = train.init(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
  recorded = []
  for _ in range(2 * n + 1):
    state, metrics = train.step(state, X)
    recorded.append(bool(metrics["numerics_recorded"]))
    values = np.array([float(v) for v in jax.tree.leaves(metrics["numerics"])])
    assert np.isnan(values).all() != recorded[-1]
  assert recorded == [i % n == 0 for i in range(2 * n + 1)]
  assert len(reads) == 1  # init's state, once; none in the loop
  assert train.trace_count == 2  # the plain and the recording program, each once
  # A resumed state at an odd step (not the one returned): one read, then the schedule.
  state = state._replace(step=jnp.asarray(7, state.step.dtype))
  recorded = []
  for _ in range(3):
    state, metrics = train.step(state, X)
    recorded.append(bool(metrics["numerics_recorded"]))
  assert recorded == [False, True, False] and int(state.step) == 10
  assert len(reads) == 2


def test_plain_program_is_the_program_without_numerics():
  """The program train.step runs on the steps that do not record lowers to exactly
  numerics=None's text (its NaN records are constants added on the host); train.lower
  gives step_fn's one program, a lax.cond on the counter (more conds)."""
  from flax import nnx

  texts, cond = [], None
  for numerics_ in (None, jaxamp.Numerics(every=100)):
    train = jaxamp.make_train_step(loss, optax.sgd(1e-3), policy="mixed_bfloat16",
                                   numerics=numerics_)
    state = train.init(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    step = train._programs.step_jit
    texts.append((step.plain if numerics_ else step).lower(state, X).as_text())
    if numerics_:
      cond = train.lower(state, X).as_text()
  assert texts[0] == texts[1]
  assert cond.count("stablehlo.case") > texts[0].count("stablehlo.case")


def test_modules_inside_their_own_scan_are_named_in_a_warning(fresh_warnings):
  """Layers run inside nnx.scan cannot hand a record out once per step: the monitor says
  which it does not observe, and their gradients land under the enclosing module."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.lin(x))

  class M(nnx.Module):
    def __init__(self):
      @nnx.split_rngs(splits=3)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(rngs)

      self.blocks = make(nnx.Rngs(0))
      self.head = nnx.Linear(4, 1, rngs=nnx.Rngs(1))

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(h, block):
        return block(h)

      return self.head(body(x, self.blocks))

  train = make()
  with pytest.warns(RuntimeWarning, match=r"does not observe .*'a Linear \(no path"):
    _, metrics = train.step(train.init(M()), X)
  got = metrics["numerics"]
  assert set(got) == {"", "head"}
  assert float(got[""]["grad"]["count"]) == 3 * (4 * 4 + 4)  # the stacked blocks'


def test_the_plan_pass_of_a_half_model_is_not_taken_for_unobserved_modules(fresh_warnings):
  """Under mixed_bfloat16 the NNX wrapper traces an abstract plan pass on copies of the
  modules inside the step: it records nothing and warns of nothing."""
  import warnings

  from flax import nnx

  class M(nnx.Module):
    def __init__(self):
      self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
      self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.bn(self.lin(x))

  train = jaxamp.make_train_step(loss, optax.sgd(0.0), policy="mixed_bfloat16",
                                 numerics=jaxamp.Numerics(every=1))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, metrics = train.step(train.init(M()), X)
  assert not [w for w in caught if "does not observe" in str(w.message)]
  assert set(metrics["numerics"]) == {"", "lin", "bn"}
