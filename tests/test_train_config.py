"""make_train_step's grouped options: ShardingConfig, MemoryConfig, DebugConfig, and the
former keywords (deprecated) that spell the same Options."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp.train.config import DEPRECATED

loss_fn = lambda m, b: jnp.mean(m(b) ** 2)
TX = optax.sgd(0.1)
MESH = jax.make_mesh((1,), ("data",))
FSDP = jaxamp.fsdp("data", min_size=1)


@pytest.mark.parametrize("make, match", [
    (lambda: jaxamp.ShardingConfig(mesh=MESH, batch_axis="batch"),
     r"ShardingConfig.batch_axis 'batch' is not an axis of the mesh; its axes are \('data',\)"),
    (lambda: jaxamp.ShardingConfig(mesh="data"),
     r"ShardingConfig.mesh must be a jax.sharding.Mesh .* or None, got 'data'"),
    (lambda: jaxamp.ShardingConfig(param_sharding=FSDP),
     r"ShardingConfig.param_sharding needs a mesh: pass mesh=jax.make_mesh"),
    (lambda: jaxamp.ShardingConfig(grad_reduce_dtype=jnp.int32),
     r"ShardingConfig.grad_reduce_dtype must be a floating dtype \(float32, bfloat16, "
     r"float16\) or None"),
    (lambda: jaxamp.ShardingConfig(model_state_reduction={"count": "avg"}),
     r"to one of 'mean', 'sum', 'max', 'min', 'same'; got 'count': 'avg'"),
    (lambda: jaxamp.MemoryConfig(donate="no"),
     r"MemoryConfig.donate must be True or False, got 'no'"),
    (lambda: jaxamp.MemoryConfig(master_weights=1),
     r"MemoryConfig.master_weights must be True, False, None \(decided at init\), "
     r"'stochastic' or 'kahan', got 1"),
    (lambda: jaxamp.MemoryConfig(recompute_norms=None),
     r"MemoryConfig.recompute_norms must be True or False, got None"),
    (lambda: jaxamp.MemoryConfig(half_residuals="yes"),
     r"MemoryConfig.half_residuals must be True or False, got 'yes'"),
    (lambda: jaxamp.DebugConfig(nonfinite_grads=1),
     r"DebugConfig.nonfinite_grads must be True or False, got 1"),
    (lambda: jaxamp.DebugConfig(warn_skipped_steps=True),
     r"DebugConfig.warn_skipped_steps must be a positive int \(steps\) or None \(never "
     r"warn\), got True"),
    (lambda: jaxamp.make_train_step(loss_fn, TX, memory=jaxamp.DebugConfig()),
     r"memory must be a jaxamp.MemoryConfig \(or None: the defaults\), got DebugConfig"),
])
def test_each_config_refuses_a_bad_field_naming_what_is_valid(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_configs_are_frozen_and_normalise_their_fields():
  sharding = jaxamp.ShardingConfig(mesh=MESH, grad_reduce_dtype="bfloat16",
                                   batch_axis=("data",))
  assert sharding.grad_reduce_dtype == np.dtype(jnp.bfloat16)
  assert sharding.batch_axes == ("data",)
  assert sharding.reduce_dtype(jnp.float32) == jnp.bfloat16
  memory = jaxamp.MemoryConfig(master_weights=np.bool_(True), donate=np.bool_(False))
  assert memory.master_weights is True and memory.donate is False
  with pytest.raises(AttributeError):
    memory.donate = True  # frozen


# Each former keyword (param_sharding needs its mesh), the config it now belongs to, and
# the warning naming the new spelling.
OLD = [
    (dict(mesh=MESH), "sharding", jaxamp.ShardingConfig(mesh=MESH),
     "make_train_step(mesh=...) is deprecated; pass sharding=jaxamp.ShardingConfig(mesh=...)"),
    (dict(batch_axis=("data",)), "sharding", jaxamp.ShardingConfig(batch_axis=("data",)),
     "pass sharding=jaxamp.ShardingConfig(batch_axis=...)"),
    (dict(mesh=MESH, param_sharding=FSDP), "sharding",
     jaxamp.ShardingConfig(mesh=MESH, param_sharding=FSDP),
     "make_train_step(mesh=..., param_sharding=...) is deprecated; pass "
     "sharding=jaxamp.ShardingConfig(mesh=..., param_sharding=...)"),
    (dict(grad_reduce_dtype=jnp.bfloat16), "sharding",
     jaxamp.ShardingConfig(grad_reduce_dtype=jnp.bfloat16),
     "pass sharding=jaxamp.ShardingConfig(grad_reduce_dtype=...)"),
    (dict(model_state_reduction={"count": "sum"}), "sharding",
     jaxamp.ShardingConfig(model_state_reduction={"count": "sum"}),
     "pass sharding=jaxamp.ShardingConfig(model_state_reduction=...)"),
    (dict(donate=False), "memory", jaxamp.MemoryConfig(donate=False),
     "make_train_step(donate=...) is deprecated; pass memory=jaxamp.MemoryConfig(donate=...)"),
    (dict(recompute_norms=True), "memory", jaxamp.MemoryConfig(recompute_norms=True),
     "pass memory=jaxamp.MemoryConfig(recompute_norms=...)"),
    (dict(half_residuals=False), "memory", jaxamp.MemoryConfig(half_residuals=False),
     "pass memory=jaxamp.MemoryConfig(half_residuals=...)"),
    (dict(debug_nonfinite=True), "debug", jaxamp.DebugConfig(nonfinite_grads=True),
     "make_train_step(debug_nonfinite=...) is deprecated; pass "
     "debug=jaxamp.DebugConfig(nonfinite_grads=...)"),
    (dict(warn_skipped_steps=None), "debug", jaxamp.DebugConfig(warn_skipped_steps=None),
     "pass debug=jaxamp.DebugConfig(warn_skipped_steps=...)"),
]


def test_every_former_keyword_is_covered():
  assert {k for old, *_ in OLD for k in old} == set(DEPRECATED)


@pytest.mark.parametrize("old, key, config, message", OLD,
                         ids=["+".join(o) for o, *_ in OLD])
def test_a_former_keyword_warns_once_and_gives_the_options_of_the_new_spelling(
    old, key, config, message):
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    before = jaxamp.make_train_step(loss_fn, TX, policy="mixed_bfloat16", **old)
  (warning,) = [w for w in seen if issubclass(w.category, DeprecationWarning)]
  assert message in str(warning.message)
  assert warning.filename == __file__  # points at the caller
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the new spelling warns nothing
    after = jaxamp.make_train_step(loss_fn, TX, policy="mixed_bfloat16", **{key: config})
  assert before.options == after.options
  assert getattr(before.options, key) == config


def test_former_keywords_of_two_configs_warn_once_each():
  with pytest.warns(DeprecationWarning) as seen:
    train = jaxamp.make_train_step(loss_fn, TX, donate=False, debug_nonfinite=True,
                                   recompute_norms=True)
  assert sorted(str(w.message) for w in seen) == [
      "make_train_step(debug_nonfinite=...) is deprecated; pass "
      "debug=jaxamp.DebugConfig(nonfinite_grads=...).",
      "make_train_step(donate=..., recompute_norms=...) is deprecated; pass "
      "memory=jaxamp.MemoryConfig(donate=..., recompute_norms=...).",
  ]
  assert train.memory == jaxamp.MemoryConfig(donate=False, recompute_norms=True)
  assert train.debug.nonfinite_grads and train.sharding == jaxamp.ShardingConfig()


@pytest.mark.parametrize("old, key, config", [
    (dict(mesh=MESH), "sharding", jaxamp.ShardingConfig()),
    (dict(donate=False), "memory", jaxamp.MemoryConfig(recompute_norms=True)),
    (dict(debug_nonfinite=True), "debug", jaxamp.DebugConfig()),
])
def test_a_former_keyword_with_the_config_that_owns_it_is_refused(old, key, config):
  (name,) = old
  with pytest.raises(ValueError, match=rf"make_train_step got both {name}=\.\.\. and {key}=: "
                     rf"pass {key}=jaxamp\.\w+Config\("):
    jaxamp.make_train_step(loss_fn, TX, **old, **{key: config})


def test_an_unknown_keyword_is_a_type_error():
  with pytest.raises(TypeError, match="unexpected keyword argument 'mesh_axes'"):
    jaxamp.make_train_step(loss_fn, TX, mesh_axes=("data",))


def test_an_opt_levels_master_weights_fill_in_only_what_memory_leaves_open():
  level = jaxamp.make_train_step(loss_fn, TX, opt_level="O2")
  assert level.memory.master_weights is True
  kept = jaxamp.make_train_step(loss_fn, TX, opt_level="O2",
                                memory=jaxamp.MemoryConfig(master_weights=False, donate=False))
  assert kept.memory == jaxamp.MemoryConfig(master_weights=False, donate=False)


def test_a_step_made_with_the_former_keyword_runs_as_the_new_spelling():
  """debug_nonfinite=True and DebugConfig(nonfinite_grads=True) both name the parameters
  whose gradient overflowed, the same metrics bit for bit."""
  batch = jnp.ones((4, 3)).at[0, 0].set(jnp.inf)
  results = []
  with pytest.warns(DeprecationWarning):
    old = jaxamp.make_train_step(loss_fn, TX, debug_nonfinite=True, donate=False)
  new = jaxamp.make_train_step(loss_fn, TX, debug=jaxamp.DebugConfig(nonfinite_grads=True),
                               memory=jaxamp.MemoryConfig(donate=False))
  for train in (old, new):
    state = train.init(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    _, metrics = train.step(state, batch)
    results.append(jax.tree.map(np.asarray, metrics))
  assert {k: bool(v) for k, v in results[0]["nonfinite_grads"].items()} == {
      "bias": True, "kernel": True}
  jax.tree.map(np.testing.assert_array_equal, results[0], results[1])


@pytest.mark.parametrize("attr, config, field, value", [
    ("mesh", "sharding", "mesh", MESH), ("batch_axis", "sharding", "batch_axis", "data"),
    ("param_sharding", "sharding", "param_sharding", FSDP),
    ("grad_reduce_dtype", "sharding", "grad_reduce_dtype", np.dtype("bfloat16")),
    ("donate", "memory", "donate", False),
    ("debug_nonfinite", "debug", "nonfinite_grads", True)])
def test_a_former_attribute_reads_its_config_with_a_deprecation(attr, config, field, value):
  train = jaxamp.make_train_step(
      loss_fn, TX,
      sharding=jaxamp.ShardingConfig(mesh=MESH, param_sharding=FSDP,
                                     grad_reduce_dtype=jnp.bfloat16),
      memory=jaxamp.MemoryConfig(donate=False), debug=jaxamp.DebugConfig(nonfinite_grads=True))
  with pytest.warns(DeprecationWarning, match=rf"TrainStep.{attr} is deprecated; read "
                    rf"train.{config}.{field}") as caught:
    got = getattr(train, attr)
  assert got == value == getattr(getattr(train, config), field)
  assert caught[0].filename == __file__


def test_master_weights_and_opt_state_dtype_keywords_are_memory_shorthands():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    train = jaxamp.make_train_step(loss_fn, TX, policy="bfloat16",
                                   master_weights="stochastic", opt_state_dtype=jnp.bfloat16,
                                   memory=jaxamp.MemoryConfig(donate=False))
  assert train.memory == jaxamp.MemoryConfig(donate=False, master_weights="stochastic",
                                             opt_state_dtype=jnp.bfloat16)
  assert train.memory.rounding == "stochastic" and train.master_weights == "stochastic"
  assert jaxamp.make_train_step(loss_fn, TX, master_weights=True).memory.rounding is None
  with pytest.raises(ValueError, match=r"make_train_step got master_weights='kahan' and "
                     r"memory= setting master_weights=True: give it once"):
    jaxamp.make_train_step(loss_fn, TX, master_weights="kahan",
                           memory=jaxamp.MemoryConfig(master_weights=True))


@pytest.mark.parametrize("kwargs, match", [
    (dict(master_weights="float32"),
     r"master_weights must be True, False, None \(decided at init\), 'stochastic' or "
     r"'kahan', got 'float32'"),
    (dict(opt_state_dtype=jnp.int8),
     r"opt_state_dtype must be a floating dtype of at most 32 bits .* got <class"),
    (dict(master_weights="stochastic", opt_state_dtype=jnp.float16),
     r"master_weights='stochastic' rounds the optimizer state stochastically, to "
     r"bfloat16 only; got opt_state_dtype float16"),
])
def test_memory_modes_refuse_bad_values_naming_what_is_valid(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxamp.MemoryConfig(**kwargs)
