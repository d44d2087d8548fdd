"""Tests for jaxamp.policy: parsing, the Policy value, the global policy and scopes."""

import threading
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxamp
from jaxamp import policy as policy_lib

F16, BF16, F32, F64 = (np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32,
                                              jnp.float64))
HALF = F16 if jax.default_backend() != "tpu" else BF16  # jmp's 'half'


@pytest.mark.parametrize("spec,expected", [
    # Keras names
    ("float32", (F32, F32, F32)),
    ("float16", (F16, F16, F16)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("float64", (F64, F64, F64)),
    ("mixed_float16", (F32, F16, F16)),
    ("mixed_bfloat16", (F32, BF16, BF16)),
    # jmp strings, long and short keys, every token
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("p=full,c=f16,o=full", (F32, F16, F32)),
    ("params=f64,compute=float64", (F64, F64, F64)),
    ("c=half", (F32, HALF, HALF)),
    # jmp defaults: params f32, compute follows params, output follows compute
    ("c=bf16", (F32, BF16, BF16)),
    ("p=bf16", (BF16, BF16, BF16)),
    ("p=f32,o=f16", (F32, F32, F16)),
    (" p = f32 , c = bf16 ", (F32, BF16, BF16)),
    # bare jmp tokens
    ("bf16", (BF16, BF16, BF16)),
    ("half", (HALF, HALF, HALF)),
    ("full", (F32, F32, F32)),
    # dtypes
    (jnp.bfloat16, (BF16, BF16, BF16)),
    (np.float16, (F16, F16, F16)),
    (np.dtype("float32"), (F32, F32, F32)),
])
def test_parsing_table(spec, expected):
  with jax.enable_x64(F64 in expected):
    p = jaxamp.get_policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected
    assert jaxamp.get_policy(p.name) == p  # the name round-trips


def test_parsing_matches_jmp_on_its_own_strings():
  for s in ("c=bf16", "p=f32,c=f16", "p=f16,c=f16", "p=f16,c=bf16", "p=f32,c=bf16,o=f32",
            "half", "f32"):
    ours, theirs = jaxamp.get_policy(s), jmp.get_policy(s)
    assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == (
        np.dtype(theirs.param_dtype), np.dtype(theirs.compute_dtype),
        np.dtype(theirs.output_dtype))


def test_policy_and_jmp_objects_convert_both_ways():
  p = jaxamp.get_policy("p=f32,c=bf16,o=f32")
  assert jaxamp.get_policy(p) is p
  j = p.to_jmp()
  assert isinstance(j, jmp.Policy) and str(j) == "p=full,c=bf16,o=full"
  assert jaxamp.get_policy(j) == p
  assert jaxamp.get_policy(jmp.get_policy("c=f16")).name == "mixed_float16"


@pytest.mark.parametrize("bad", ["mixed_int8", "float8", "p=f32,x=bf16", "p=int32",
                                 "params:float32", "", 3, None, jnp.int32, "mixed_float32"])
def test_bad_specs_list_what_is_valid(bad):
  with pytest.raises(ValueError) as err:
    jaxamp.get_policy(bad)
  msg = str(err.value)
  if not (isinstance(bad, str) and "=" in bad and ":" not in bad and "x=" not in bad):
    for name in jaxamp.POLICY_NAMES + jaxamp.scaled.policy_names():
      assert repr(name) in msg
    assert "'p=f32,c=bf16'" in msg
  else:  # a bad dtype inside a jmp string lists the dtype tokens
    assert "bf16" in msg and "half" in msg
  # Short enough to read: the registered formats' names are what lengthens it.
  registered = sum(len(repr(n)) + 2 for n in jaxamp.scaled.policy_names())
  assert len(msg) <= 320 + registered, msg


def test_registered_policy_names_are_suggested_and_listed():
  with pytest.raises(ValueError, match="Did you mean 'mixed_fp8_rowwise'\\?") as err:
    jaxamp.get_policy("mixed_fp8_rowwis")
  assert "'mixed_fp8_rowwise'" in str(err.value).split("Valid:")[1]
  with pytest.raises(ValueError, match="fp8= takes 'delayed', 'current', .*'rowwise'"):
    jaxamp.get_policy("p=f32,c=bf16,fp8=roww")


@pytest.mark.parametrize("bad,suggestion", [
    ("mixed-bfloat16", "mixed_bfloat16"), ("fp16", "float16"), ("mixed_fp16", "mixed_float16"),
    ("Mixed_BFloat16", "mixed_bfloat16"), ("flaot32", "float32"), ("mixed_bf16", "mixed_bfloat16"),
    ("p=f32,c=fp16", "float16"),
])
def test_near_misses_say_did_you_mean(bad, suggestion):
  with pytest.raises(ValueError, match=f"Did you mean '{suggestion}'\\?"):
    jaxamp.get_policy(bad)


@pytest.mark.parametrize("bad,match", [
    ("p=f32,p=f16", "sets params twice"),
    ("params=f32,c=bf16,p=bf16", "sets params twice"),
    ("c=bf16,compute=f16", "sets compute twice"),
    (jnp.ones(3), "from an array"),
    (np.float32(1.0), "from an array"),
    (float, "Python's float"),
    (1.0, "from 1.0"),
    (jnp.float8_e4m3fn, "cannot be float8_e4m3fn.*FP8 mode.*'mixed_fp8'"),
    ("p=f32,c=f32,o=f32", None),
])
def test_ambiguous_or_unsupported_specs_are_refused(bad, match):
  if match is None:  # a control: the same grammar with each key once is fine
    assert jaxamp.get_policy(bad).name == "float32"
    return
  with pytest.raises(ValueError, match=match):
    jaxamp.get_policy(bad)


def test_float8_and_arrays_are_refused_as_policy_dtypes():
  with pytest.raises(ValueError, match="cannot be float8_e5m2"):
    jaxamp.Policy(jnp.float32, jnp.float8_e5m2)
  with pytest.raises(ValueError, match="got an array"):
    jaxamp.Policy(jnp.zeros((), jnp.float32))
  with pytest.raises(ValueError, match="Python's float"):
    jaxamp.Policy(float)


def test_float64_needs_x64():
  assert not jax.config.jax_enable_x64
  for spec in ("float64", "p=f64,c=f32", np.float64):
    with pytest.raises(ValueError, match="jax_enable_x64"):
      jaxamp.get_policy(spec)
  with jax.enable_x64(True):
    assert jaxamp.get_policy("float64").compute_dtype == F64


def test_value_semantics():
  a = jaxamp.Policy(jnp.float32, jnp.bfloat16)
  b = jaxamp.get_policy("mixed_bfloat16")
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  assert a != jaxamp.get_policy("mixed_float16")
  with pytest.raises(AttributeError):
    a.compute_dtype = F16  # frozen
  assert repr(a) == ("Policy(param_dtype='float32', compute_dtype='bfloat16', "
                     "output_dtype='bfloat16')")
  assert str(a) == "mixed_bfloat16" and a.is_mixed
  assert not jaxamp.get_policy("float32").is_mixed
  assert a.with_output_dtype("float32").name == "params=float32,compute=bfloat16,output=float32"
  assert a.with_compute_dtype(jnp.float16).name == (
      "params=float32,compute=float16,output=bfloat16")
  assert a.with_param_dtype(jnp.bfloat16).name == "bfloat16"
  with pytest.raises(ValueError, match="compute_dtype must be a floating dtype"):
    jaxamp.Policy(jnp.float32, jnp.int8)
  with pytest.raises(ValueError, match="param_dtype must be a floating dtype, got None"):
    jaxamp.Policy(None)


def test_policy_is_a_static_jit_argument():
  traces = []

  def cast(x, p):
    traces.append(p)
    return p.cast_to_compute(x)

  f = jax.jit(cast, static_argnums=1)
  x = jnp.ones(3)
  assert f(x, jaxamp.get_policy("mixed_bfloat16")).dtype == jnp.bfloat16
  assert f(x, jaxamp.Policy(jnp.float32, jnp.bfloat16)).dtype == jnp.bfloat16
  assert f(x, jaxamp.get_policy("mixed_float16")).dtype == jnp.float16
  assert len(traces) == 2  # equal policies share one trace


def test_cast_methods_touch_only_floating_leaves():
  from flax import nnx
  from flax.core import FrozenDict

  p = jaxamp.get_policy("p=f32,c=bf16,o=f16")
  tree = {"x": jnp.ones(2), "np": np.ones(2, np.float32), "ids": jnp.arange(3),
          "mask": jnp.array([True, False]), "key": jax.random.key(0),
          "raw_key": jax.random.PRNGKey(0), "none": None, "scalar": 1.5, "name": "w",
          "frozen": FrozenDict({"w": jnp.ones(2, jnp.float16)})}
  out = p.cast_to_compute(tree)
  assert out["x"].dtype == BF16 and out["np"].dtype == BF16 and out["frozen"]["w"].dtype == BF16
  assert out["ids"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_
  assert out["key"] is tree["key"] and out["raw_key"] is tree["raw_key"]
  assert out["none"] is None and out["scalar"] == 1.5 and out["name"] == "w"
  assert isinstance(out["frozen"], FrozenDict)
  assert p.cast_to_output(tree)["x"].dtype == F16
  assert p.cast_to_param(out)["x"].dtype == F32
  state = nnx.state(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  cast = p.cast_to_compute(state)
  assert isinstance(cast, nnx.State)
  assert {x.dtype for x in jax.tree.leaves(cast)} == {BF16}


def test_global_policy_default_set_and_scopes():
  assert jaxamp.global_policy().name == "float32"
  try:
    jaxamp.set_global_policy("mixed_bfloat16")
    assert jaxamp.global_policy().name == "mixed_bfloat16"
    with jaxamp.policy_scope("float32") as p:
      assert p.name == "float32" and jaxamp.global_policy() is p
      with jaxamp.policy_scope("p=f32,c=bf16,o=f32"):
        assert jaxamp.global_policy().output_dtype == F32
      assert jaxamp.global_policy().name == "float32"
    assert jaxamp.global_policy().name == "mixed_bfloat16"
  finally:
    jaxamp.set_global_policy("float32")


def test_scope_restores_after_exception():
  with pytest.raises(RuntimeError):
    with jaxamp.policy_scope("mixed_bfloat16"):
      with jaxamp.policy_scope("bfloat16"):
        raise RuntimeError("boom")
  assert jaxamp.global_policy().name == "float32"


def test_scopes_are_thread_local():
  inside, other = threading.Event(), threading.Event()
  seen = {}

  def worker():
    inside.wait()
    seen["worker"] = jaxamp.global_policy().name  # main thread is inside its scope now
    with jaxamp.policy_scope("mixed_float16"):
      seen["worker_scoped"] = jaxamp.global_policy().name
      other.set()

  t = threading.Thread(target=worker)
  t.start()
  with jaxamp.policy_scope("mixed_bfloat16"):
    inside.set()
    other.wait()
    seen["main"] = jaxamp.global_policy().name
  t.join()
  assert seen == {"worker": "float32", "worker_scoped": "mixed_float16",
                  "main": "mixed_bfloat16"}


def test_slow_path_warning_is_given_once(monkeypatch, fresh_warnings):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with jaxamp.policy_scope("mixed_float16"):
      pass
    with jaxamp.policy_scope("mixed_float16"):
      pass
    with jaxamp.policy_scope("mixed_bfloat16"):  # bfloat16 has no such warning on CPU
      pass
  messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert len(messages) == 1 and "float16" in messages[0] and "CPU" in messages[0]


@pytest.mark.parametrize("cc,dtype,warns", [("7.5", "mixed_bfloat16", True),
                                            ("8.0", "mixed_bfloat16", False),
                                            ("6.1", "mixed_float16", True),
                                            ("7.0", "mixed_float16", False),
                                            ("8.6", "mixed_fp8", True),  # Ampere: no FP8
                                            ("8.9", "mixed_fp8", False),
                                            ("9.0", "mixed_fp8_current", False)])
def test_gpu_compute_capability_rules(monkeypatch, cc, dtype, warns):
  class FakeGPU:
    compute_capability = cc

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda: [FakeGPU()])
  reason = policy_lib._fast_path_missing(jaxamp.get_policy(dtype))
  assert (reason is not None) == warns
  if warns:
    assert cc in reason


def _plain_flax_script(wrap):
  """An ordinary NNX + optax training step (nnx.Optimizer, nnx.jit), run once; ``wrap``
  optionally runs the model under jaxamp first."""
  import optax
  from flax import nnx

  model = wrap(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def plain_train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss

  plain_train_step(model, optimizer, jnp.ones((3, 4)))


@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16"])
def test_a_global_policy_no_jaxamp_api_reads_warns_when_the_users_program_is_traced(
    fresh_warnings, name):
  import warnings

  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)  # float16 on CPU
      jaxamp.set_global_policy(name)
    with pytest.warns(UserWarning, match="plain_train_step.*with_policy.*make_train_step") as w:
      _plain_flax_script(lambda m: m)
    assert [r.filename for r in w if "global policy" in str(r.message)] == [__file__]
    with warnings.catch_warnings():  # once
      warnings.simplefilter("error", UserWarning)
      _plain_flax_script(lambda m: m)
  finally:
    jaxamp.set_global_policy("float32")


@pytest.mark.parametrize("case", ["with_policy", "float32"])
def test_a_global_policy_that_is_read_or_float32_gives_no_warning(fresh_warnings, case):
  import warnings

  try:
    jaxamp.set_global_policy("float32" if case == "float32" else "mixed_bfloat16")
    wrap = jaxamp.nnx.with_policy if case == "with_policy" else (lambda m: m)
    with warnings.catch_warnings():
      warnings.simplefilter("error", UserWarning)
      _plain_flax_script(wrap)
  finally:
    jaxamp.set_global_policy("float32")
