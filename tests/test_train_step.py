"""Tests for make_train_step and TrainStep: end to end, compiling once, donation, step_fn, eval, compiler options."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp

from train_helpers import LinenNet, POLICIES, init, leaves, loss_fn, make_batches, xent


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("policy", POLICIES)
def test_end_to_end_trains_with_batchnorm_and_dropout(api, policy):
  seen = []

  def spy_loss(model, batch):
    out = model(batch["x"])
    seen.append(out.dtype)
    return xent(out, batch["y"])

  train = jaxamp.make_train_step(spy_loss, optax.adam(1e-2), policy=policy)
  state = init(train, api, dropout=0.1)
  stats0 = leaves(state.model_state)
  batch = make_batches(1)[0]
  losses = []
  for _ in range(6):
    state, metrics = train.step(state, batch)
    losses.append(float(metrics["loss"]))
  assert seen == [jnp.float32]  # traced once; outputs handed over in float32
  assert losses[-1] < losses[0]
  assert metrics["loss"].dtype == jnp.float32
  assert int(metrics["skipped_steps"]) == 0 and bool(metrics["grads_finite"])
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  expected_scale = 2.0**15 if policy == "mixed_float16" else 1.0
  assert float(jaxamp.get_loss_scale(state.opt_state)) == expected_scale
  assert float(metrics["loss_scale"]) == expected_scale
  stats = [x for x in jax.tree.leaves(state.model_state)
           if jnp.issubdtype(x.dtype, jnp.floating)]
  assert stats and all(x.dtype == jnp.float32 for x in stats)  # BatchNorm stats stay f32
  changed = [not np.array_equal(a, b) for a, b in zip(leaves(state.model_state), stats0)
             if a.dtype == np.float32]
  assert any(changed)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_mixed_matches_float32_within_tolerance(api):
  batches = make_batches(4)
  final = {}
  for policy in ("float32", "mixed_bfloat16"):
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.05), policy=policy)
    state = init(train, api, batchnorm=False)
    for b in batches:
      state, _ = train.step(state, b)
    final[policy] = leaves(state.params)
  # bfloat16 has an 8-bit mantissa: after 4 small SGD steps params agree to ~1e-2.
  for a, b in zip(final["float32"], final["mixed_bfloat16"]):
    np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)


def test_compiles_once_and_donates_buffers(caplog):
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy="mixed_bfloat16")
  state = init(train, "nnx")
  old = state
  # XLA compiles the step once: init's state is committed, as the state a step returns
  # (an uncommitted first state compiled a second program on the second step).
  with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
    for b in make_batches(4):
      state, _ = train.step(state, b)
  compiles = [r for r in caplog.records
              if "Finished XLA compilation of jit(_step_impl)" in r.getMessage()]
  assert len(compiles) == 1, [r.getMessage() for r in compiles]
  assert train.trace_count == 1
  assert all(x.is_deleted() for x in jax.tree.leaves(old.params))
  assert int(state.step) == 4


@pytest.mark.slow
def test_aux_metrics_and_eval_step():
  def loss_with_aux(model, batch):
    logits = model(batch["x"])
    acc = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return xent(logits, batch["y"]), {"accuracy": acc}

  def eval_fn(model, batch):
    return model(batch["x"])

  train = jaxamp.make_train_step(loss_with_aux, optax.sgd(0.1), policy="mixed_bfloat16",
                                 has_aux=True, eval_fn=eval_fn,
                                 memory=jaxamp.MemoryConfig(donate=False))
  state = init(train, "nnx", dropout=0.5)
  batch = make_batches(1)[0]
  state, metrics = train.step(state, batch)
  assert 0.0 <= float(metrics["accuracy"]) <= 1.0
  out = train.eval_step(state, batch)
  assert out.dtype == jnp.float32
  # eval mode: deterministic dropout and running BatchNorm statistics
  np.testing.assert_array_equal(np.asarray(out), np.asarray(train.eval_step(state, batch)))
  ref = train.model(state)
  ref.eval()
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref(batch["x"])), atol=5e-2)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="grad_accum_steps must be >= 1"):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), grad_accum_steps=0)
  mesh = jax.make_mesh((1,), ("batch",))
  with pytest.raises(ValueError, match="batch_axis 'data' is not an axis of the mesh"):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), sharding=jaxamp.ShardingConfig(mesh=mesh))
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1))
  with pytest.raises(RuntimeError, match="init"):
    train.step(None, None)
  with pytest.raises(ValueError, match="init\\(module, variables\\)"):
    train.init(LinenNet())


def test_float16_on_cpu_warns_once(monkeypatch, fresh_warnings):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with pytest.warns(RuntimeWarning, match="no fast float16 path"):
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_float16")
  with pytest.warns(RuntimeWarning, match="no fast float16 path"):
    fresh_warnings.reset()
    jaxamp.make_train_step(loss_fn, optax.sgd(0.1), opt_level="O1")


def test_grad_reduce_dtype_must_be_floating():
  for bad in (jnp.int32, "nope"):
    with pytest.raises(ValueError, match="grad_reduce_dtype must be a floating dtype"):
      jaxamp.make_train_step(loss_fn, optax.sgd(0.1),
                             sharding=jaxamp.ShardingConfig(grad_reduce_dtype=bad))
  # None, the default: float32, or float64 for float64 gradients.
  sharding = jaxamp.make_train_step(loss_fn, optax.sgd(0.1)).options.sharding
  assert sharding.grad_reduce_dtype is None
  assert sharding.reduce_dtype(jnp.bfloat16) == jnp.float32
  assert sharding.reduce_dtype(jnp.float64) == jnp.float64


@pytest.mark.slow
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_step_fn_under_the_users_jit_and_scan_steps_as_train_step(api):
  """train.step_fn, the pure step, run inside the user's own jax.jit (and lax.scan over
  batches, an overflowing one included) gives the state and metrics train.step gives,
  bit for bit: the same skip, the same loss scale, the same BatchNorm statistics."""
  batches = make_batches(3)
  batches[1] = {"x": batches[1]["x"] * np.inf, "y": batches[1]["y"]}  # overflows
  eval_fn = (loss_fn if api == "nnx"
             else lambda model, batch: xent(model(batch["x"], train=False), batch["y"]))
  train = jaxamp.make_train_step(loss_fn, optax.adam(1e-2), policy="mixed_float16",
                                 memory=jaxamp.MemoryConfig(donate=False), eval_fn=eval_fn)
  with pytest.raises(RuntimeError, match="init"):
    train.step_fn  # pylint: disable=pointless-statement
  state = init(train, api, dropout=0.1)
  expected, metrics = state, []
  for b in batches:
    expected, m = train.step(expected, b)
    metrics.append(m)
  assert [int(m["skipped_steps"]) for m in metrics] == [0, 1, 1]

  got = state
  jitted = jax.jit(train.step_fn)
  for b in batches:
    got, m = jitted(got, b)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
  # As docs/guides/train_step.md ("Your own jit or scan") runs it: donating the state.
  scanned, scan_metrics = jax.jit(lambda s, bs: jax.lax.scan(train.step_fn, s, bs),
                                  donate_argnums=0)(state, stacked)
  data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  for other in (got, scanned):
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(other)):
      np.testing.assert_array_equal(np.asarray(data(a)), np.asarray(data(b)))
  np.testing.assert_array_equal(scan_metrics["loss_scale"],
                                [float(m["loss_scale"]) for m in metrics])
  assert float(jax.jit(train.eval_step_fn)(expected, batches[0])) == float(
      train.eval_step(expected, batches[0]))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_model_kept_from_train_model_survives_the_donating_steps_after_it(api):
  """train.model(state) copies the arrays when the step donates: "the best so far" kept
  from it still runs after later steps consumed that state, and holds its values."""
  batches = make_batches(3)
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16")
  state = init(train, api, batchnorm=False)
  state, _ = train.step(state, batches[0])
  kept = train.model(state)
  shared = train.model(state, copy=False)
  kernel = np.asarray(jax.tree.leaves(state.params)[0])
  for b in batches[1:]:
    state, _ = train.step(state, b)
  if api == "nnx":
    kept(batches[0]["x"])  # runs: its arrays were not donated
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(nnx.state(kept, nnx.Param))[0]),
                                  kernel)
    assert any(x.is_deleted() for x in jax.tree.leaves(nnx.state(shared, nnx.Param)))
  else:
    module, variables = kept
    module.apply(variables, batches[0]["x"])
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(variables["params"])[0]), kernel)
    assert any(x.is_deleted() for x in jax.tree.leaves(shared[1]["params"]))


def _dots(text):
  """The element types of the StableHLO dot_generals' results in ``text``: 'f32'/'bf16'."""
  import re
  return re.findall(r"stablehlo\.dot_general.*->\s*tensor<[0-9x]*x?(f32|bf16|f16)>", text)


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_the_step_runs_under_the_rules_in_force_at_init_wherever_it_is_called(api):
  """policy_rules around make_train_step and init, the loop after the block (or in
  another thread, or eval after it): init stored the head float32, and the step must
  compute it in float32 too (it compiled with 0 float32 dots)."""
  import threading

  head = "l2" if api == "nnx" else "Dense_1"
  batch = make_batches(1)[0]
  with jaxamp.policy_rules({head: "float32"}):
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy="mixed_bfloat16",
                                   memory=jaxamp.MemoryConfig(donate=False))
    state = init(train, api, batchnorm=False)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
  texts = {"step": train.lower(state, batch).as_text(),
           "eval": jax.jit(train.eval_step_fn).lower(state, batch).as_text()}
  thread = threading.Thread(target=lambda: texts.update(
      thread=jax.jit(train.step_fn).lower(state, batch).as_text()))
  thread.start()
  thread.join()
  for where, text in texts.items():
    dots = _dots(text)
    assert "f32" in dots and "bf16" in dots, (where, dots)


def test_compiler_options_reach_the_steps_program():
  """make_train_step(..., compiler_options=) is jax.jit's: XLA reads them (an option it
  does not know is refused when the step compiles), for the step and the eval step."""
  batch = make_batches(1)[0]
  train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), memory=jaxamp.MemoryConfig(donate=False),
                                 compiler_options={"xla_backend_optimization_level": 1})
  state = init(train, "nnx", batchnorm=False)
  state, metrics = train.step(state, batch)
  assert bool(metrics["grads_finite"])
  bad = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), memory=jaxamp.MemoryConfig(donate=False),
                               compiler_options={"xla_no_such_option": True})
  state = init(bad, "nnx", batchnorm=False)
  for run in (bad.step, bad.eval_step):
    with pytest.raises(Exception, match="xla_no_such_option"):
      run(state, batch)


# --- a float64 policy trains in float64 throughout -------------------------------------------


def _f64_batches():
  rng = np.random.RandomState(0)
  return [{"x": rng.randn(8, 8), "y": rng.randn(8, 4)} for _ in range(3)]


def _f64_model(api):
  """``(model for train.init, its args, loss_fn, (params, value_and_grad of the loss))``:
  Linear -> LayerNorm -> ReLU -> Linear in float64, and the plain float64 gradient of
  its mean squared error."""
  mse = lambda out, y: jnp.mean((out - y) ** 2)
  f64 = dict(param_dtype=jnp.float64)
  if api == "nnx":
    class Net(nnx.Module):
      def __init__(self, rngs):
        self.l1, self.ln = nnx.Linear(8, 16, rngs=rngs, **f64), nnx.LayerNorm(16, rngs=rngs, **f64)
        self.l2 = nnx.Linear(16, 4, rngs=rngs, **f64)

      def __call__(self, x):
        return self.l2(jax.nn.relu(self.ln(self.l1(x))))

    graphdef, params = nnx.split(Net(nnx.Rngs(0)))
    return ((Net(nnx.Rngs(0)),), lambda m, b: mse(m(b["x"]), b["y"]),
            (params, jax.value_and_grad(
                lambda p, b: mse(nnx.merge(graphdef, p)(b["x"]), b["y"]))))
  if api == "linen":
    class Net(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.LayerNorm(**f64)(nn.Dense(16, **f64)(x))
        return nn.Dense(4, **f64)(jax.nn.relu(h))

    x = jnp.zeros((2, 8), jnp.float64)
    variables = Net().init(jax.random.key(0), x)
    return ((Net(), variables, x), lambda m, b: mse(m(b["x"]), b["y"]),
            (variables["params"], jax.value_and_grad(
                lambda p, b: mse(Net().apply({"params": p}, b["x"]), b["y"]))))
  eqx = pytest.importorskip("equinox")
  k1, k2 = jax.random.split(jax.random.key(0))
  model = eqx.nn.Sequential([eqx.nn.Linear(8, 16, key=k1, dtype=jnp.float64),
                             eqx.nn.LayerNorm(16, dtype=jnp.float64),
                             eqx.nn.Lambda(jax.nn.relu),
                             eqx.nn.Linear(16, 4, key=k2, dtype=jnp.float64)])
  params, static = eqx.partition(model, eqx.is_inexact_array)
  loss = lambda m, b: mse(jax.vmap(m)(b["x"]), b["y"])
  return ((model,), loss, (params, jax.value_and_grad(
      lambda p, b: loss(eqx.combine(p, static), b))))


@pytest.mark.slow
@pytest.mark.parametrize("api,accum", [("nnx", 1), ("nnx", 2), ("linen", 1), ("equinox", 1)])
def test_a_float64_policy_trains_as_plain_float64_adam(api, accum):
  """Every "in float32" default means at least float32: the LayerNorm, the outputs
  handed to the loss, the loss, the accumulation and the global norm stay float64, so
  three Adam steps are plain float64 Adam's, bit for bit (accumulated over two
  micro-batches: to float64 rounding, rtol 1e-12; float32 anywhere gave ~1e-6)."""
  with jax.enable_x64(True):
    args, loss, (params, value_and_grad) = _f64_model(api)
    tx = optax.adam(1e-2)

    @jax.jit
    def plain_step(params, opt_state, batch):
      loss, grads = value_and_grad(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    for batch in _f64_batches():
      params, opt_state, ref_loss = plain_step(params, opt_state, batch)

    train = jaxamp.make_train_step(loss, optax.adam(1e-2), policy="float64",
                                   grad_accum_steps=accum)
    state = train.init(*args)
    for batch in _f64_batches():
      state, metrics = train.step(state, batch)
    assert metrics["loss"].dtype == metrics["grad_norm"].dtype == jnp.float64
    got, want = leaves(state.params), leaves(params)
    assert [x.dtype for x in got] == [np.dtype(np.float64)] * len(want)
    if accum == 1:
      for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
      assert float(metrics["loss"]) == float(ref_loss)
    else:
      for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
