"""Delayed FP8 scaling for stacked NNX layers run by ``nnx.scan`` (:mod:`jaxamp.fp8_stacked`).

The reference is the same model written unrolled: L separate ``nnx.Linear`` layers
holding the stack's kernels, each with its own (unstacked) state. Each slice of the
stacked state must follow the matching layer's state, and the parameters the unrolled
model's.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import nnx_models
from jaxamp import fp8_stacked, scaled
from train_helpers import orbax_round_trip

L = 2


@pytest.fixture(autouse=True)
def _quiet():
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*XLA on CPU.*")
    yield


def _stack(remat=False, axes=0):
  return nnx_models.scan_stack(L, remat=remat, axes=axes)


class _Unrolled(nnx.Module):
  """The stack's layers as separate Linear layers with the same weights."""

  def __init__(self, stack):
    kernel, bias = stack.blocks.kernel.get_value(), stack.blocks.bias.get_value()
    self.layers = nnx.List([nnx.Linear(8, 8, rngs=nnx.Rngs(0)) for _ in range(L)])
    for i, layer in enumerate(self.layers):
      layer.kernel.set_value(kernel[i])
      layer.bias.set_value(bias[i])
    self.head = nnx.Linear(8, 2, rngs=nnx.Rngs(1))
    self.head.kernel.set_value(stack.head.kernel.get_value())
    self.head.bias.set_value(stack.head.bias.get_value())

  def __call__(self, x):
    for layer in self.layers:
      x = nnx.relu(layer(x))
    return self.head(x)


def _train(**kwargs):
  return jaxamp.make_train_step(lambda m, b: jnp.mean((m(b) - 1.0) ** 2), optax.sgd(0.1),
                                policy=jaxamp.Policy("float32", "bfloat16", "bfloat16",
                                                     fp8=jaxamp.DelayedScaling(
                                                         amax_history_len=4)), **kwargs)


def _batches(n):
  rs = np.random.RandomState(0)
  return [jnp.asarray(rs.randn(4, 8) * (1 + i), jnp.float32) for i in range(n)]


def test_stacked_recipe_state_and_per_layer_update():
  """The stacked format broadcasts the state and updates each layer by the per-tensor
  rule (a NumPy reference: the history rolled, the newest amaxes in front, the scale
  ``FP8_MAX / max(history)``), and a skip keeps the old state."""
  recipe = fp8_stacked.Stacked(jaxamp.DelayedScaling(amax_history_len=4), (3,))
  fmt = scaled.format_of(recipe)
  meta = fmt.init_state(recipe)
  assert meta.amax_history.shape == (3, 3, 4) and meta.scale.shape == (3, 3)
  assert scaled.describe(recipe) == "fp8 e4m3fn/e5m2 per-tensor delayed"
  old = np.zeros((3, 3, 4), np.float32)
  old[:, :, 0] = np.arange(9.0).reshape(3, 3) + 20.0  # a previous step's amaxes
  newest = np.arange(1.0, 10.0, dtype=np.float32).reshape(3, 3)
  newest[1, 2] = 100.0
  cot = np.zeros_like(old)
  cot[:, :, 0] = newest
  state = meta._replace(amax_history=jnp.asarray(old))
  new, kept = jax.jit(lambda s, c: (fmt.update(s, c, recipe), fmt.kept_on_skip(
      s, fmt.update(s, c, recipe), recipe)))(state, state._replace(amax_history=cot))
  want = np.roll(old, 1, axis=2)
  want[:, :, 0] = newest
  np.testing.assert_array_equal(new.amax_history, want)
  maxes = np.array([448.0, 448.0, 57344.0], np.float32)
  np.testing.assert_array_equal(new.scale, (maxes / want.max(axis=2)).astype(np.float32))
  jax.tree.map(np.testing.assert_array_equal, kept, state)


def test_one_step_records_each_layer_of_the_stack_without_a_warning(fresh_warnings):
  """The stacked layer's state is stacked as its kernel; one step records every layer's
  amaxes (the first layer's input amax is the batch's) and warns of no missing state."""
  train = _train()
  state = train.init(_stack())
  assert set(state.fp8) == {"blocks", "head"}
  assert state.fp8["blocks"].amax_history.shape == (L, 3, 4)
  assert state.fp8["blocks"].scale.shape == (L, 3)
  x = _batches(1)[0]
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, _ = train.step(state, x)
  assert not [w for w in seen if "state" in str(w.message)], [str(w.message) for w in seen]
  history = np.asarray(state.fp8["blocks"].amax_history)
  assert history[:, :, 0].all() and not history[:, :, 1:].any()
  # The input's amax as the bfloat16 matmul reads it.
  assert history[0, 0, 0] == float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))))
  assert history[1, 0, 0] != history[0, 0, 0]  # each layer its own


@pytest.mark.slow
def test_stacked_layers_keep_per_layer_state_equal_to_the_unrolled_model(fresh_warnings):
  """Two steps: each slice of the stacked history and scales equals the unrolled model's
  layer's, and the parameters the unrolled model's; no current-scaling warning."""
  stack = _stack()
  unrolled = _Unrolled(stack)
  train, ref = _train(), _train()
  state, ref_state = train.init(stack), ref.init(unrolled)
  assert state.fp8["blocks"].amax_history.shape == (L, 3, 4)
  assert state.fp8["blocks"].scale.shape == (L, 3)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for x in _batches(2):
      state, _ = train.step(state, x)
      ref_state, _ = ref.step(ref_state, x)
  assert not [w for w in seen if "state" in str(w.message)], [str(w.message) for w in seen]
  stacked = state.fp8["blocks"]
  assert np.asarray(stacked.amax_history)[:, :, :2].all()  # both steps, every layer
  for i in range(L):
    layer = ref_state.fp8[f"layers/{i}"]
    np.testing.assert_array_equal(stacked.amax_history[i], layer.amax_history)
    np.testing.assert_array_equal(stacked.scale[i], layer.scale)
    np.testing.assert_array_equal(state.params["blocks"]["kernel"][i],
                                  ref_state.params["layers"][i]["kernel"])
  np.testing.assert_array_equal(state.fp8["head"].amax_history,
                                ref_state.fp8["head"].amax_history)


@pytest.mark.slow
def test_a_non_finite_batch_keeps_the_stacked_state_and_params():
  train = _train()
  state, _ = train.step(train.init(_stack()), _batches(1)[0])
  bad = _batches(1)[0].at[0, 0].set(jnp.nan)
  kept = jax.tree.map(np.asarray, (state.fp8, state.params))  # the step donates its state
  after, metrics = train.step(state, bad)
  assert not bool(metrics["grads_finite"])
  jax.tree.map(np.testing.assert_array_equal, (after.fp8, after.params), kept)


@pytest.mark.slow
def test_stacked_state_round_trips_orbax(tmp_path):
  train = _train()
  state, _ = train.step(train.init(_stack()), _batches(1)[0])
  restored = orbax_round_trip(state, tmp_path / "s")
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.fp8),
               jax.tree.map(np.asarray, state.fp8))


@pytest.mark.slow
def test_remat_in_the_body_and_the_cuda_program_runs_fp8_dots(fresh_warnings):
  """``nnx.remat`` inside the scan body keeps the per-layer state; the lowered CUDA
  program's dots take E4M3 operands (forward) and E5M2 (output gradient)."""
  train = _train()
  state = train.init(_stack(remat=True))
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, _ = train.step(state, _batches(1)[0])
  assert not [w for w in seen if "state" in str(w.message)], [str(w.message) for w in seen]
  assert np.asarray(state.fp8["blocks"].amax_history)[:, :, 0].all()
  text = train.lower(state, _batches(1)[0], platforms=("cuda",)).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert sum("f8E4M3FN>" in line for line in dots) >= 2, dots  # the body's and the head's
  assert any("f8E5M2" in line for line in dots), dots


@pytest.mark.slow
def test_a_scan_broadcasting_the_state_falls_back_to_current_scaling(fresh_warnings):
  """``nnx.StateAxes`` slicing only the params broadcasts the stacked state: the layer
  warns, runs current scaling, and its state stays as it was."""
  train = _train()
  state = train.init(_stack(axes=nnx.StateAxes({nnx.Param: 0, ...: None})))
  before = jax.tree.map(np.asarray, state.fp8["blocks"])
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, metrics = train.step(state, _batches(1)[0])
  msgs = [str(w.message) for w in seen if "current scaling" in str(w.message)]
  assert len(msgs) == 1 and "FP8 Linear blocks has no delayed-scaling state" in msgs[0], msgs
  assert np.isfinite(float(metrics["loss"]))
  jax.tree.map(np.testing.assert_array_equal, state.fp8["blocks"], before)
  assert np.asarray(state.fp8["head"].amax_history)[:, 0].all()


@pytest.mark.slow
def test_grad_accumulation_records_each_micro_batch_per_layer_and_eval_reads_the_state():
  train = _train(grad_accum_steps=2)
  x = _batches(1)[0]
  state, _ = train.step(train.init(_stack()), x)
  history = np.asarray(state.fp8["blocks"].amax_history)
  halves = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)).reshape(2, 2, 8)
  # The first layer's input: the second micro-batch's amax newest, the first's before it.
  np.testing.assert_array_equal(history[0, 0, :2], [np.abs(halves[1]).max(),
                                                    np.abs(halves[0]).max()])
  assert history[:, :, :2].all() and not history[:, :, 2:].any()
  assert np.isfinite(float(train.eval_step(state, x)))


class _EinsumBlock(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Einsum("bi,io->bo", (8, 8), rngs=rngs)
    self.b = nnx.LinearGeneral(8, (2, 4), rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.b(self.a(x)).reshape(x.shape))


class _ConvBlock(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(2, 2, (3,), rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.conv(x))


def _scanned(block, n=3):
  class Stack(nnx.Module):
    def __init__(self):
      @nnx.split_rngs(splits=n)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return block(rngs)

      self.blocks = make(nnx.Rngs(0))

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, b):
        return b(x)

      return body(x, self.blocks)

  return Stack()


@pytest.mark.slow
def test_einsum_and_linear_general_in_a_scanned_block_keep_per_layer_state(fresh_warnings):
  train = _train()
  state = train.init(_scanned(_EinsumBlock))
  assert set(state.fp8) == {"blocks/a", "blocks/b"}
  assert all(m.amax_history.shape == (3, 3, 4) for m in state.fp8.values())
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, _ = train.step(state, jnp.ones((4, 8)))
  assert not [w for w in seen if "state" in str(w.message)], [str(w.message) for w in seen]
  first = np.asarray(state.fp8["blocks/a"].amax_history)
  assert first[0, 0, 0] == 1.0 and first[:, :, 0].all()  # the first layer reads the ones
  assert np.asarray(state.fp8["blocks/b"].amax_history)[:, :, 0].all()


class _ConvTBlock(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.ConvTranspose(2, 2, (3,), rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.conv(x))


class _UnrolledConvs(nnx.Module):
  """A conv stack's layers as separate blocks (of class ``block``) with the same weights."""

  def __init__(self, stack, n, block):
    self.layers = nnx.List([block(nnx.Rngs(0)) for _ in range(n)])
    for i, layer in enumerate(self.layers):
      layer.conv.kernel.set_value(stack.blocks.conv.kernel.get_value()[i])
      layer.conv.bias.set_value(stack.blocks.conv.bias.get_value()[i])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("block", [_ConvBlock, _ConvTBlock], ids=["conv", "conv_transpose"])
def test_stacked_convolutions_keep_per_layer_state_equal_to_the_unrolled_model(
    block, fresh_warnings):
  """Two steps of a stack of ``nnx.Conv`` (``nnx.ConvTranspose``) blocks: each slice of
  the stacked history and scales equals the unrolled model's layer's, the kernels the
  unrolled kernels, no warning."""
  stack = _scanned(block, n=2)
  unrolled = _UnrolledConvs(stack, 2, block)
  train, ref = _train(), _train()
  state, ref_state = train.init(stack), ref.init(unrolled)
  assert state.fp8["blocks/conv"].amax_history.shape == (2, 3, 4)
  rs = np.random.RandomState(0)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for i in range(2):
      x = jnp.asarray(rs.randn(2, 6, 2) * (1 + i), jnp.float32)
      state, _ = train.step(state, x)
      ref_state, _ = ref.step(ref_state, x)
  assert not [w for w in seen if "state" in str(w.message)], [str(w.message) for w in seen]
  stacked = state.fp8["blocks/conv"]
  assert np.asarray(stacked.amax_history)[:, :, :2].all()  # both steps, every layer
  for i in range(2):
    layer = ref_state.fp8[f"layers/{i}/conv"]
    np.testing.assert_array_equal(stacked.amax_history[i], layer.amax_history)
    np.testing.assert_array_equal(stacked.scale[i], layer.scale)
    np.testing.assert_array_equal(state.params["blocks"]["conv"]["kernel"][i],
                                  ref_state.params["layers"][i]["conv"]["kernel"])


_MESH_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import warnings
warnings.filterwarnings("ignore")
import jax, numpy as np
import jaxamp
import test_fp8_stacked as t

assert jax.device_count() == 2
x = t._batches(1)[0]
one = t._train()
single, _ = one.step(one.init(t._stack()), x)
mesh = jax.make_mesh((2,), ("data",))
for name, param_sharding in [("replicated", None), ("fsdp", jaxamp.fsdp("data", min_size=1))]:
  train = t._train(sharding=jaxamp.ShardingConfig(mesh=mesh, param_sharding=param_sharding))
  state, _ = train.step(train.init(t._stack()), x)
  for path in ("blocks", "head"):
    for got, want in zip(state.fp8[path], single.fp8[path]):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
  print(name, "ok")
print("STACKED-MESH-OK")
"""


@pytest.mark.slow
def test_stacked_state_with_a_mesh_equals_one_devices(tmp_path):
  """Data parallel and FSDP on 2 CPU devices: each layer's amaxes are maxed over the
  devices, so the stacked state equals the one-device step's bit for bit."""
  import os  # pylint: disable=g-import-not-at-top

  from train_helpers import run_script  # pylint: disable=g-import-not-at-top

  tests = os.path.dirname(os.path.abspath(__file__))
  out = run_script(_MESH_SCRIPT.format(root=os.path.dirname(tests), tests=tests), tmp_path,
                   "stacked_mesh.py",
                   env={"JAX_PLATFORMS": "cpu",
                        "XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                                     "--xla_backend_optimization_level=0"})
  assert "STACKED-MESH-OK" in out, out


@pytest.mark.slow
def test_a_state_without_the_stacked_entries_gets_fresh_ones_with_a_warning(fresh_warnings):
  """A checkpoint saved before stacked layers kept state (``fp8`` without ``'blocks'``):
  the step gives the stack a fresh state, keeps the head's, and says so."""
  train = _train()
  x = _batches(1)[0]
  state, _ = train.step(train.init(_stack()), x)
  head = jax.tree.map(np.asarray, state.fp8["head"])
  old = state._replace(fp8={"head": state.fp8["head"]})
  with pytest.warns(RuntimeWarning, match="fresh state for blocks"):
    state, _ = train.step(old, x)
  history = np.asarray(state.fp8["blocks"].amax_history)
  assert history[:, :, 0].all() and not history[:, :, 1:].any()  # one step recorded
  np.testing.assert_array_equal(state.fp8["head"].amax_history[:, 1], head.amax_history[:, 0])


# --- Linen: layers inside nn.scan / nn.remat read their state from 'jaxamp_fp8' -------------


def _linen_layer(conv, name):
  """``conv``: False (a Dense), True (a Conv) or ``'transpose'`` (a ConvTranspose)."""
  if conv == "transpose":
    return nn.ConvTranspose(8, (3,), name=name)
  return nn.Conv(8, (3,), name=name) if conv else nn.Dense(8, name=name)


def _linen_block(conv):
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.relu(_linen_layer(conv, "inner")(x)), None

  return Block


def _linen_stack(conv=False, axes=("params", fp8_stacked.COLLECTION)):
  """L blocks under ``nn.scan`` slicing the collections ``axes``, then a head."""
  block = _linen_block(conv)

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(block, variable_axes={a: 0 for a in axes},
                     split_rngs={"params": True}, length=L)
      return nn.Dense(2, name="head")(scan(name="blocks")(x, None)[0])

  return Stack()


def _linen_unrolled(conv=False):
  """The stack's layers as separate modules (``l0``, ``l1``, the head)."""

  class Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(L):
        x = nn.relu(_linen_layer(conv, f"l{i}")(x))
      return nn.Dense(2, name="head")(x)

  return Unrolled()


def _linen_batches(conv, n):
  rs = np.random.RandomState(0)
  shape = (2, 5, 8) if conv else (4, 8)
  return [jnp.asarray(rs.randn(*shape) * (1 + i), jnp.float32) for i in range(n)]


def test_linen_scan_layers_keep_a_stacked_state_read_through_the_collection(fresh_warnings):
  """An ``nn.Dense`` inside ``nn.scan`` (``variable_axes`` listing ``'jaxamp_fp8'``) gets a
  state stacked as its kernel; one step records every layer's amaxes without a warning;
  the eval step reads it."""
  x = _linen_batches(False, 1)[0]
  model, train = _linen_stack(), _train(eval_fn=lambda m, b: jnp.mean(m(b)))
  state = train.init(model, model.init(jax.random.key(0), x), x)
  assert set(state.fp8) == {"blocks/inner", "head"}
  assert state.fp8["blocks/inner"].amax_history.shape == (L, 3, 4)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, _ = train.step(state, x)
  assert not [w for w in seen if "state" in str(w.message)], [str(w.message) for w in seen]
  history = np.asarray(state.fp8["blocks/inner"].amax_history)
  assert history[:, :, 0].all() and not history[:, :, 1:].any()
  assert history[0, 0, 0] == float(jnp.max(jnp.abs(x.astype(jnp.bfloat16))))
  assert history[1, 0, 0] != history[0, 0, 0]  # each layer its own
  assert np.isfinite(float(train.eval_step(state, x)))


@pytest.mark.slow
@pytest.mark.parametrize("conv", [False, True, "transpose"])
def test_linen_scan_layers_equal_the_unrolled_model_and_skip_exactly(conv, fresh_warnings):
  """Two steps: each slice of the stacked history and scales, and each kernel, equals the
  unrolled model's layer's bit for bit (Dense, Conv and ConvTranspose bodies); then a
  non-finite batch changes neither the state nor the params."""
  xs = _linen_batches(conv, 2)
  model, unrolled = _linen_stack(conv), _linen_unrolled(conv)
  variables = model.init(jax.random.key(0), xs[0])
  stacked = variables["params"]["blocks"]["inner"]
  ref_vars = {"params": {**{f"l{i}": jax.tree.map(lambda a, i=i: a[i], stacked)
                            for i in range(L)}, "head": variables["params"]["head"]}}
  train, ref = _train(), _train()
  state = train.init(model, variables, xs[0])
  ref_state = ref.init(unrolled, ref_vars, xs[0])
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for x in xs:
      state, _ = train.step(state, x)
      ref_state, _ = ref.step(ref_state, x)
  assert not [w for w in seen if "state" in str(w.message)], [str(w.message) for w in seen]
  got = state.fp8["blocks/inner"]
  assert np.asarray(got.amax_history)[:, :, :2].all()
  for i in range(L):
    np.testing.assert_array_equal(got.amax_history[i], ref_state.fp8[f"l{i}"].amax_history)
    np.testing.assert_array_equal(got.scale[i], ref_state.fp8[f"l{i}"].scale)
    np.testing.assert_array_equal(state.params["blocks"]["inner"]["kernel"][i],
                                  ref_state.params[f"l{i}"]["kernel"])
  kept = jax.tree.map(np.asarray, (state.fp8, state.params))  # the step donates its state
  after, metrics = train.step(state, xs[0].at[0, 0].set(jnp.nan))
  assert not bool(metrics["grads_finite"])
  jax.tree.map(np.testing.assert_array_equal, (after.fp8, after.params), kept)


@pytest.mark.slow
def test_linen_scan_not_slicing_the_collection_falls_back_with_the_warning(fresh_warnings):
  """``variable_axes={'params': 0}`` alone: the scan body does not see the collection; the
  layer warns (saying what to add), runs current scaling, and its state stays as it was."""
  x = _linen_batches(False, 1)[0]
  model, train = _linen_stack(axes=("params",)), _train()
  state = train.init(model, model.init(jax.random.key(0), x), x)
  before = jax.tree.map(np.asarray, state.fp8["blocks/inner"])
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, metrics = train.step(state, x)
  msgs = [str(w.message) for w in seen if "current scaling" in str(w.message)]
  assert len(msgs) == 1 and "FP8 Dense blocks/inner has no delayed-scaling state" in msgs[0]
  assert "'jaxamp_fp8': 0 to variable_axes" in msgs[0], msgs
  assert np.isfinite(float(metrics["loss"]))
  jax.tree.map(np.testing.assert_array_equal, state.fp8["blocks/inner"], before)


@pytest.mark.slow
def test_linen_remat_layers_keep_their_delayed_state(fresh_warnings):
  """``nn.remat(nn.Dense)`` (it lifts every collection): the same history and params as
  the plain ``nn.Dense`` after a step, bit for bit; a second step records again, no
  warning. (After two steps the two differ in the last bits under ``mixed_bfloat16``
  too: the recomputed forward pass rounds otherwise.)"""
  def make(remat):
    class Stack(nn.Module):
      @nn.compact
      def __call__(self, x):
        dense = nn.remat(nn.Dense) if remat else nn.Dense
        return nn.Dense(2, name="head")(nn.relu(dense(8, name="inner")(x)))
    return Stack()

  xs = _linen_batches(False, 2)
  variables = make(False).init(jax.random.key(0), xs[0])
  out = []
  for remat in (False, True):
    train = _train()
    state = train.init(make(remat), variables, xs[0])
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      state, _ = train.step(state, xs[0])
      out.append(jax.tree.map(np.asarray, (state.fp8, state.params)))
      state, _ = train.step(state, xs[1])
    assert not [w for w in seen if "state" in str(w.message)], [str(w.message) for w in seen]
    assert np.asarray(state.fp8["inner"].amax_history)[:, :2].all()
  jax.tree.map(np.testing.assert_array_equal, out[1], out[0])


@pytest.mark.slow
def test_a_linen_vmap_broadcasting_its_kernel_gets_no_state(fresh_warnings):
  """``nn.vmap`` of a Dense whose kernel (and the collection) it broadcasts: a state read
  once per example would get its amaxes summed over them, so the layer gets none; it
  warns and runs current scaling."""

  class Mapped(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.vmap(nn.Dense, variable_axes={"params": None, fp8_stacked.COLLECTION: None},
                      split_rngs={"params": False})
      return dense(4, name="d")(x)

  x = jnp.asarray(np.random.RandomState(0).randn(3, 2, 8), jnp.float32)
  model, train = Mapped(), _train()
  state = train.init(model, model.init(jax.random.key(0), x), x)
  assert state.fp8 is None
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    state, metrics = train.step(state, x)
  msgs = [str(w.message) for w in seen if "current scaling" in str(w.message)]
  assert len(msgs) == 1 and "Dense d has no delayed-scaling state" in msgs[0], msgs
  assert np.isfinite(float(metrics["loss"]))
