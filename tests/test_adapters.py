"""Tests for jaxamp.adapters: the registry, and every public entry point on a small NNX,
Linen and Equinox model through it."""

import ast
import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp
from jaxamp import adapters

eqx = pytest.importorskip("equinox")

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


class _Case:
  """One library's model: Linear/Dense(4, 8) -> LayerNorm -> Linear/Dense(8, 2)."""

  linears: tuple[str, str]  # the two dense layers' paths
  norm: str

  def make(self):
    """``(model, variables, example_args)`` as ``TrainStep.init`` takes them."""
    raise NotImplementedError

  def loss(self, model, batch):
    return jnp.mean(self.call(model, batch) ** 2)

  def call(self, model, batch):
    return model(batch)


class _NNXCase(_Case):
  linears, norm = ("layers/0", "layers/2"), "layers/1"

  def make(self):
    rngs = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs),
                          nnx.Linear(8, 2, rngs=rngs)), None, ()


class _LinenCase(_Case):
  linears, norm = ("layers_0", "layers_2"), "layers_1"
  module = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])

  def make(self):
    return self.module, self.module.init(jax.random.key(0), X), (X,)


class _EquinoxCase(_Case):
  linears, norm = ("layers/0", "layers/2"), "layers/1"

  def make(self):
    k1, k2 = jax.random.split(jax.random.key(0))
    return eqx.nn.Sequential([eqx.nn.Linear(4, 8, key=k1), eqx.nn.LayerNorm(8),
                              eqx.nn.Linear(8, 2, key=k2)]), None, ()

  def call(self, model, batch):
    return jax.vmap(model)(batch)


CASES = {"nnx": _NNXCase(), "linen": _LinenCase(), "equinox": _EquinoxCase()}


def test_registry_holds_the_three_libraries():
  libs = adapters.libraries()
  assert [lib.name for lib in libs] == ["nnx", "linen", "equinox"]
  assert all(isinstance(lib, adapters.Library) for lib in libs)
  for name, case in CASES.items():
    model, variables, _ = case.make()
    assert adapters.library_of(model).name == name
    assert [lib.name for lib in libs if lib.accepts(model)] == [name]
  assert adapters.library_of((CASES["linen"].module, {})).name == "linen"
  assert adapters.library_of({"w": jnp.ones(2)}) is None
  assert adapters.library_of({"w": jnp.ones(2)}, pytrees=True).name == "equinox"
  assert adapters.library_of({"n": jnp.ones(2, jnp.int32)}, pytrees=True) is None
  with pytest.raises(ValueError, match="already registered"):
    adapters.register(adapters.NNX)


def test_asking_the_registry_does_not_import_equinox():
  code = ("import sys, jaxamp, jax.numpy as jnp\n"
          "from jaxamp import adapters\n"
          "assert adapters.library_of(object()) is None\n"
          "assert adapters.library_of({'w': jnp.ones(2)}, pytrees=True).name == 'equinox'\n"
          "assert not jaxamp.fp8.runs_fp8(object, jaxamp.get_policy('mixed_fp8'))\n"
          "print('equinox' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=pathlib.Path(jaxamp.__file__).parent.parent)
  assert out.stdout.strip() == "False"


@pytest.fixture(params=list(CASES), name="case")
def _case(request):
  return request.param, CASES[request.param]


def _sums(tree):
  return [float(jnp.sum(x)) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_train_step_entry_points(case):
  name, case = case
  model, variables, args = case.make()
  train = jaxamp.make_train_step(case.loss, optax.sgd(0.1), policy="mixed_bfloat16")
  state = train.init(model, variables, *args)
  plan = train.plan
  assert isinstance(plan.adapter, adapters.Adapter)
  assert dataclasses.is_dataclass(plan.adapter)
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.adapter.recompute_norms = True  # the plan's adapter is immutable
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  before = _sums(state.params)
  new, metrics = train.step(state, X)
  assert int(metrics["skipped_steps"]) == 0 and np.isfinite(float(metrics["loss"]))
  assert _sums(new.params) != before
  assert {x.dtype for x in jax.tree.leaves(new.params)} == {jnp.dtype(jnp.float32)}
  assert np.isfinite(float(train.eval_step(new, X)))
  trained = train.model(new)
  assert adapters.library_of(trained).name == name
  # The trained model called under the policy gives the step's eval loss.
  lib = adapters.library_of(trained)
  if name == "linen":
    module, variables = trained
    out = lib.with_policy(module, "mixed_bfloat16").apply(variables, X)
  else:
    out = case.call(lib.with_policy(trained, "mixed_bfloat16"), X)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(float(jnp.mean(out.astype(jnp.float32) ** 2)),
                             float(train.eval_step(new, X)), rtol=2e-2)


def _summary(name, case, policy):
  model, variables, _ = case.make()
  if name == "equinox":
    return jaxamp.summary(model, X[0], policy=policy)
  if name == "linen":
    return jaxamp.summary((model, variables), X, policy=policy)
  return jaxamp.summary(model, X, policy=policy)


def test_summary(case):
  name, case = case
  s = _summary(name, case, "mixed_bfloat16")
  rows = {r.path: r for r in s.rows}
  for path in case.linears:
    assert rows[path].compute_dtype == "bfloat16" and rows[path].matmul_dtypes == "bfloat16"
    assert rows[path].param_dtype == "float32" and not rows[path].fp8
  assert rows[case.norm].compute_dtype == "float32"
  assert s.total_params == 4 * 8 + 8 + 2 * 8 + 8 * 2 + 2
  assert s.total_stored_bytes == 4 * s.total_params
  fp8 = _summary(name, case, "mixed_fp8")
  assert fp8.fp8_modules == case.linears


def test_precision_report(case):
  name, case = case
  model, variables, _ = case.make()
  lib = adapters.library_of(model)
  if name == "linen":
    wrapped = lib.with_policy(model, "mixed_bfloat16")
    r = jaxamp.precision_report(lambda v, x: wrapped.apply(v, x).sum(), variables, X,
                                backward=True)
  elif name == "equinox":  # the view itself an argument: its functions closed over
    view = lib.with_policy(model, "mixed_bfloat16")
    r = jaxamp.precision_report(lambda m, x: case.call(m, x).astype(jnp.float32).sum(),
                                view, X, backward=True)
  else:
    view = lib.with_policy(model, "mixed_bfloat16")
    r = jaxamp.precision_report(lambda x: view(x).astype(jnp.float32).sum(), X)
  assert r.ops and r.half_share == 1.0
  assert {(op.lhs_dtype, op.rhs_dtype) for op in r.ops} == {("bfloat16", "bfloat16")}


def test_convert_for_inference(case):
  name, case = case
  model, variables, args = case.make()
  lib = adapters.library_of(model)
  if name == "linen":
    served = jaxamp.convert_for_inference(variables, *args, module=model,
                                          policy="mixed_bfloat16")
    params = served["params"]
    dtypes = {k: {x.dtype.name for x in jax.tree.leaves(v)} for k, v in params.items()}
    out = lib.with_policy(model, "mixed_bfloat16").apply(served, X)
    ref = lib.with_policy(model, "mixed_bfloat16").apply(variables, X)
  else:
    served = jaxamp.convert_for_inference(model, policy="mixed_bfloat16")
    assert lib.accepts(served)
    if name == "nnx":
      params = nnx.to_pure_dict(nnx.state(served, nnx.Param))["layers"]
      dtypes = {f"layers/{k}": {x.dtype.name for x in jax.tree.leaves(v)}
                for k, v in params.items()}
    else:
      dtypes = {f"layers/{i}": {x.dtype.name for x in jax.tree.leaves(
          eqx.filter(layer, eqx.is_inexact_array))} for i, layer in enumerate(served.layers)}
    out = case.call(lib.with_policy(served, "mixed_bfloat16"), X)
    ref = case.call(lib.with_policy(model, "mixed_bfloat16"), X)
  assert dtypes == {case.linears[0]: {"bfloat16"}, case.norm: {"float32"},
                    case.linears[1]: {"bfloat16"}}
  # The original is untouched, and the served model computes what the original does.
  assert {x.dtype.name for x in jax.tree.leaves(
      variables if name == "linen" else eqx.filter(model, eqx.is_inexact_array)
      if name == "equinox" else nnx.state(model, nnx.Param))} == {"float32"}
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


@pytest.mark.filterwarnings("error::RuntimeWarning",  # no layer falls back, none unreached
                            "ignore:.*runs FP8 matmuls upcast:RuntimeWarning")  # XLA on CPU
def test_fp8_training_moves_the_state(case):
  name, case = case
  model, variables, args = case.make()
  train = jaxamp.make_train_step(case.loss, optax.sgd(0.1), policy="mixed_fp8")
  state = train.init(model, variables, *args)
  assert set(state.fp8) == set(case.linears)
  fresh = jax.tree.map(np.asarray, state.fp8)
  for _ in range(2):
    state, metrics = train.step(state, X)
    assert int(metrics["skipped_steps"]) == 0
  for path in case.linears:
    history = np.asarray(state.fp8[path].amax_history)
    assert np.all(history[:, 0] > 0) and np.all(history[:, 1] > 0)  # both steps recorded
    assert not np.array_equal(history, fresh[path].amax_history)
    assert not np.array_equal(np.asarray(state.fp8[path].scale), fresh[path].scale)
  # The first layer's input is the batch: its newest input amax is max|x|, for Equinox
  # too (called once per example under jax.vmap, its FP8 Linear folds the batch into
  # one matmul: one scale and one amax for the batch, not a sum of the examples').
  first = np.asarray(state.fp8[case.linears[0]].amax_history)[0, 0]
  # (The layer's input is cast to its compute dtype, bfloat16, before the amax.)
  per_example = np.max(np.abs(np.asarray(X.astype(jnp.bfloat16), np.float32)), axis=1)
  expected = per_example.max()
  np.testing.assert_allclose(first, expected, rtol=1e-6)
  text = train.lower(state, X).as_text()
  assert "f8E4M3FN" in text and "f8E5M2" in text


# --- no library dispatch outside the adapters ----------------------------------------------

JAXAMP = pathlib.Path(jaxamp.__file__).parent
# The adapters, and the library wrappers themselves (each knows its own library's types);
# fp8.py holds the Flax layers' FP8 field hooks those wrappers call.
_LIBRARY_CODE = ("adapters/", "nnx/", "linen.py", "equinox.py", "_flax_compat.py", "fp8.py")
_LIBRARY_NAMES = {"nnx", "nn", "linen", "flax", "eqx", "equinox"}


def _library_types(node: ast.AST) -> list[str]:
  """The ``<library>.<Name>`` attributes a class argument of isinstance mentions."""
  return [ast.unparse(n) for n in ast.walk(node)
          if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
          and n.value.id in _LIBRARY_NAMES and n.attr[:1].isupper()]


def _dispatch(path: pathlib.Path) -> list[str]:
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
      types = [t for t in _library_types(node.args[1]) if t.endswith("Module")]
      found += [f"{node.lineno}: {node.func.id}(..., {t})" for t in types]
    if (isinstance(node, ast.Attribute) and node.attr == "modules"
        and isinstance(node.value, ast.Name) and node.value.id == "sys"):
      found.append(f"{node.lineno}: sys.modules")
  return found


def test_no_library_dispatch_outside_the_adapters():
  found = {}
  for path in sorted(JAXAMP.rglob("*.py")):
    rel = path.relative_to(JAXAMP).as_posix()
    if rel.startswith(_LIBRARY_CODE):
      continue
    hits = _dispatch(path)
    if hits:
      found[rel] = hits
  assert not found, found


def test_the_dispatch_check_finds_dispatch(tmp_path):
  probe = tmp_path / "probe.py"
  probe.write_text("import sys\nfrom flax import nnx\n"
                   "def f(m):\n  return isinstance(m, nnx.Module) or 'equinox' in sys.modules\n")
  assert _dispatch(probe) == ["4: isinstance(..., nnx.Module)", "4: sys.modules"]
  # The entry points that dispatch do not even name a library's module types.
  for rel in ("train/init.py", "summary.py", "report.py", "inference.py"):
    source = (JAXAMP / rel).read_text()
    assert not _library_types(ast.parse(source)), rel


def test_jaxamp_with_policy_dispatches_through_the_registry(case):
  name, case = case
  model, variables, _ = case.make()
  lib = adapters.library_of(model)
  mine = jaxamp.with_policy(model, "mixed_bfloat16")
  assert type(mine) is type(lib.with_policy(model, "mixed_bfloat16"))
  out = mine.apply(variables, X) if name == "linen" else case.call(mine, X)
  assert out.dtype == jnp.bfloat16


def test_jaxamp_with_policy_names_the_libraries_for_another_object():
  with pytest.raises(TypeError, match=r"registered library \(nnx, linen, equinox\); got dict"):
    jaxamp.with_policy({"w": jnp.ones(2)}, "mixed_bfloat16")


def test_the_train_step_and_inspection_import_no_model_library():
  # They reach Flax and Equinox only through the registry (the state nodes a step walks
  # included: adapters.is_node / value_of), so no type of a library can creep back in.
  found = {}
  for path in [*sorted((JAXAMP / "train").glob("*.py")),
               *(JAXAMP / rel for rel in ("summary.py", "report.py", "inference.py"))]:
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      for name in names:
        if name.split(".")[0] in ("flax", "equinox"):
          found.setdefault(path.relative_to(JAXAMP).as_posix(), []).append(name)
  assert not found, found
