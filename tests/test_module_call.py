"""Tests for jaxamp.module_call: the module-call core the NNX, Linen and Equinox
wrappers share."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp import module_call
from jaxamp.census import ModuleMatmul, module_matmuls
from jaxamp.policy import get_policy
from jaxamp.residuals import recompute_all

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)


class Box:
  """A stand-in for a library's node (a module, a Variable): casts pass it untouched."""

  def __init__(self, value):
    self.value = value


_keep_boxes = lambda x: isinstance(x, Box)


def test_cast_values_casts_floating_arrays_only_and_keeps_nodes():
  box = Box(jnp.ones(2))
  tree = {"x": jnp.ones(3), "ids": jnp.arange(3), "mask": jnp.ones(2, bool), "node": box,
          "n": 3.0}
  out = module_call.cast_values(tree, BF16, _keep_boxes)
  assert out["x"].dtype == BF16
  assert out["ids"].dtype == jnp.arange(3).dtype and out["mask"].dtype == np.bool_
  assert out["node"] is box and out["node"].value.dtype == F32
  assert out["n"] == 3.0  # a Python float is no array
  x = jnp.ones(3, BF16)
  assert module_call.cast_values(x, BF16, _keep_boxes) is x  # no cast traced
  pair = module_call.cast_values((jnp.ones(2), jnp.ones(2, BF16)), F32, _keep_boxes)
  assert type(pair) is tuple and [p.dtype for p in pair] == [F32, F32]


def test_widens_looks_past_kept_nodes():
  assert module_call.widens((jnp.ones(2, BF16),), F32)
  assert not module_call.widens((jnp.ones(2),), F32)
  assert not module_call.widens((jnp.arange(2),), F32)  # integers never widen
  assert not module_call.widens((Box(jnp.ones(2, BF16)),), F32, _keep_boxes)


@pytest.mark.parametrize("norm, recompute, inputs, owns, expected", [
    (True, True, jnp.ones(2, BF16), False, "recompute"),
    (True, True, jnp.ones(2, BF16), True, "recompute"),  # the norm rule comes first
    (True, False, jnp.ones(2, BF16), False, None),  # recompute_norms off
    (True, True, jnp.ones(2), False, None),  # the norm does not widen its input
    (False, True, jnp.ones(2, BF16), False, None),  # no norm
    (False, False, jnp.ones(2), True, "regather"),
])
def test_remat_for_chooses_recompute_regather_or_plain(norm, recompute, inputs, owns, expected):
  remat = module_call.remat_for(norm=norm, recompute_norms=recompute, owns_slices=owns,
                                inputs=((inputs,), {}), compute=F32)
  if expected is None:
    assert remat is None
  elif expected == "recompute":
    assert remat == module_call.Remat(recompute_all, False)
  else:
    assert remat.regather and remat.policy is not recompute_all


def test_call_under_casts_inputs_widens_outputs_and_takes_the_remat_path():
  policy = get_policy("mixed_bfloat16")
  library = module_call.Library(keep=_keep_boxes)
  seen = []

  def call(args, kwargs):
    seen.append((args[0].dtype, kwargs["y"].dtype, args[1]))
    return {"out": args[0] + kwargs["y"], "ids": jnp.arange(2)}

  box = Box(jnp.ones(2))
  out = module_call.call_under(library, policy, (jnp.ones(2), box), {"y": jnp.ones(2)},
                               call=call, recomputed=None)
  assert seen == [(BF16, BF16, box)]
  assert out["out"].dtype == BF16 and out["ids"].dtype == jnp.arange(2).dtype
  # The output dtype the caller names; widen=False hands outputs back as they came.
  out = module_call.call_under(library, policy, (jnp.ones(2), box), {"y": jnp.ones(2)},
                               call=call, recomputed=None, output_dtype=F32)
  assert out["out"].dtype == F32
  out = module_call.call_under(library, policy, (jnp.ones(2), box), {"y": jnp.ones(2)},
                               call=call, recomputed=None, widen=False)
  assert out["out"].dtype == BF16
  # With a remat, ``recomputed`` runs instead, on the arguments as passed.
  remat = module_call.Remat(recompute_all, False)
  out = module_call.call_under(library, policy, (jnp.ones(2),), {}, call=None,
                               recomputed=lambda r: (r, jnp.ones(2)), remat=remat)
  assert out[0] == remat and out[1].dtype == BF16


def test_call_under_runs_a_census_call_under_its_scope():
  policy = get_policy("mixed_bfloat16")
  library = module_call.Library(keep=_keep_boxes)
  w = jnp.ones((2, 2))

  def fn(x):
    return module_call.call_under(library, policy, (x,), {}, recomputed=None, scope=7,
                                  call=lambda a, k: a[0] @ w.astype(a[0].dtype))

  ops = module_matmuls(jax.make_jaxpr(fn)(jnp.ones((2, 2))))
  assert [op.module for op in ops] == [7]
  assert isinstance(ops[0], ModuleMatmul)


def test_arrays_of_puts_other_arrays_back_in_place():
  tree = ((jnp.ones(2), Box(1), 3), {"k": jnp.zeros(1)})
  arrays, put_back = module_call.arrays_of(tree, lambda x: isinstance(x, jax.Array),
                                           _keep_boxes)
  assert len(arrays) == 2
  new = put_back([jnp.full(2, 5.0), jnp.full(1, 6.0)])
  assert new[0][1] is tree[0][1] and new[0][2] == 3
  np.testing.assert_array_equal(new[0][0], [5.0, 5.0])
  np.testing.assert_array_equal(new[1]["k"], [6.0])


def test_policy_classes_cache_one_subclass_per_class_and_key():
  methods = {Base: ("__call__",)}
  runs = []

  def run(module, fn, name, found, args, kwargs):
    runs.append((name, found))
    return fn(module, *args, **kwargs) * 10

  classes = module_call.PolicyClasses(methods, lambda m: getattr(m, "policy", None), run,
                                      lambda base, ns: type(base.__name__, (base,), ns))
  sub = classes.subclass(Child, {"marker": 1}, key="a")
  assert issubclass(sub, Child) and sub.__qualname__ == Child.__qualname__ and sub.marker == 1
  assert classes.subclass(Child, {"marker": 2}, key="a") is sub  # cached per key
  assert classes.subclass(Child, {"marker": 2}, key="b") is not sub
  assert classes.subclass(Child, {}, key="a", cache=False) is not sub
  assert classes.methods_for(Child) == ("__call__",)
  module = sub()
  assert module(2) == 2  # no policy found: the user's method as it is
  module.policy = "p"
  assert module(2) == 20 and runs == [("__call__", "p")]
  # An edit of the methods table is seen by the next class made.
  methods[Child] = ("encode",)
  assert classes.methods_for(Child) == ("encode", "__call__")  # by the MRO
  assert classes.subclass(Child, {}, key="a") is not sub


class Base:

  def __call__(self, x):
    return x


class Child(Base):

  def encode(self, x):
    return x + 1


def test_first_time_remembers_keys_and_stays_bounded():
  checked = set()
  assert module_call.first_time(checked, "a")
  assert not module_call.first_time(checked, "a")
  for i in range(300):
    module_call.first_time(checked, i)
  assert len(checked) <= 256
  sig = module_call.input_signature([jnp.ones((2, 3), BF16), 3])
  assert sig == (((2, 3), "bfloat16"), (None, "<class 'int'>"))


def test_warn_float32_traces_only_where_something_computes_in_half(fresh_warnings):
  called = []
  census = lambda: called.append(1) or ([], [])
  assert module_call.warn_float32("M", "float32", {"": F32}, census, stacklevel=2) is None
  assert not called
  op = ModuleMatmul(module=0, kind="dot_general", lhs_dtype="float32", rhs_dtype="float32",
                    flops=10)
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    found = module_call.warn_float32("ModelForWarnTest", "mixed_bfloat16", {"": BF16},
                                     lambda: ([op], [""]), stacklevel=2)
  assert found == ([op], [""])
  assert [str(r.message).count("ModelForWarnTest") for r in w] == [1]
  assert w[0].filename == __file__


def test_traced_takes_shape_structs_and_runs_nothing():
  ran = []

  def fn(x, tree):
    ran.append(type(x))
    return {"y": x @ tree["w"], "n": 3}

  x = jax.ShapeDtypeStruct((2, 3), BF16)
  jaxpr = module_call.traced(fn, x, {"w": jnp.ones((3, 4), BF16)})
  assert [v.aval.shape for v in jaxpr.jaxpr.outvars] == [(2, 4)]  # arrays only
  assert [op.lhs_dtype for op in module_matmuls(jaxpr)] == ["bfloat16"]
  assert all(issubclass(t, jax.core.Tracer) for t in ran)
