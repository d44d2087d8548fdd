"""One test per Flax internal jaxamp relies on (jaxamp/_flax_compat.py): each checks that
the internal still behaves as jaxamp assumes, on a tiny model."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxamp import _flax_compat as compat


def _graph_nodes(model):
  return [node for _, node in nnx.iter_graph(model) if compat.is_graph_node(node)]


def _model():
  return nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu,
                        nnx.LayerNorm(3, rngs=nnx.Rngs(1)))


def test_a_missing_internal_names_itself_and_the_flax_version():
  with pytest.raises(ImportError, match=rf"flax's nnx.Gone \(found flax {flax.__version__}\)"):
    compat._require(object(), "gone", "nnx.Gone")


def test_is_graph_node():
  model = _model()
  assert compat.is_graph_node(model) and compat.is_graph_node(model.layers)
  assert not compat.is_graph_node(model.layers[0].kernel)  # a Variable
  assert not compat.is_graph_node(jnp.ones(2)) and not compat.is_graph_node(3)


def test_node_items_match_nnx_graph_node_dict():
  model = nnx.Sequential(_model(), nnx.Dict(a=nnx.Linear(1, 1, rngs=nnx.Rngs(0))))
  nodes = _graph_nodes(model)
  assert any(isinstance(n, nnx.List) for n in nodes)  # int keys: the node_dict path
  for node in nodes:
    want = compat._get_node_impl(node).node_dict(node)
    assert list(compat.node_items(node)) == list(want.items()), type(node)
  assert [k for k, _ in compat.node_items(model.layers) if isinstance(k, int)] == [0, 1]


def test_nnx_bookkeeping_attributes_carry_the_prefix():
  class Net(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(2))
      self.scale = 2.0

  extra = set(vars(Net())) - {"w", "scale"}
  assert extra and all(name.startswith(compat.NNX_BOOKKEEPING_PREFIX) for name in extra)


def test_graph_subclass_is_a_graph_node_type_like_its_base():
  calls = []

  def call(self, x):
    calls.append(x.shape)
    return nnx.Linear.__call__(self, x)

  linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  sub = compat.graph_subclass(nnx.Linear, {"__call__": call, "__qualname__": "Linear"})
  assert sub._pytree__is_pytree == nnx.Linear._pytree__is_pytree
  want = linear(jnp.ones((1, 2)))
  object.__setattr__(linear, "__class__", sub)
  np.testing.assert_array_equal(linear(jnp.ones((1, 2))), want)
  assert calls == [(1, 2)] and compat.is_graph_node(linear)
  graphdef, state = nnx.split(linear)
  np.testing.assert_array_equal(nnx.merge(graphdef, state)(jnp.ones((1, 2))), want)


def test_variable_metadata_holds_the_get_value_hooks():
  param = nnx.Param(jnp.ones(2, jnp.float32))
  meta = compat.variable_metadata(param)
  assert isinstance(meta, dict) and compat.GET_VALUE_HOOKS not in meta
  meta[compat.GET_VALUE_HOOKS] = (lambda variable, value: value.astype(jnp.bfloat16),)
  assert param[...].dtype == jnp.bfloat16 and param.get_value().dtype == jnp.bfloat16
  assert param.get_raw_value().dtype == jnp.float32  # the stored value is untouched
  meta.pop(compat.GET_VALUE_HOOKS)
  assert param[...].dtype == jnp.float32


def test_set_raw_value_unchecked_writes_the_stored_value():
  param = nnx.Param(jnp.ones(2, jnp.float32))
  new = jnp.zeros(2, jnp.bfloat16)
  compat.set_raw_value_unchecked(param, new)
  assert param.get_raw_value() is new


def test_set_attr_unchecked_sets_nnx_attributes_and_frozen_linen_fields():
  linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  compat.set_attr_unchecked(linear, "dtype", jnp.bfloat16)
  assert linear.dtype == jnp.bfloat16 and vars(linear)["dtype"] == jnp.bfloat16
  assert linear(jnp.ones((1, 2))).dtype == jnp.bfloat16
  seen = []

  class Probe(nn.Module):  # a bound Linen module is frozen: only the bypass sets a field
    features: int = 2

    @nn.compact
    def __call__(self, x):
      with pytest.raises(Exception, match="frozen|Can't set"):
        self.features = 3
      compat.set_attr_unchecked(self, "features", 3)
      seen.append((self.features, vars(self)["features"]))
      return x

  Probe().init(jax.random.key(0), jnp.ones(1))
  assert seen == [(3, 3)]


def test_tonnx_keeps_its_linen_module_and_calls_its_apply():
  dense = nn.Dense(2)
  model = nnx.bridge.ToNNX(dense, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 3))
  nnx.bridge.lazy_init(model, x)
  assert compat.tonnx_module(model) is dense
  seen = []

  class Recorder:
    def apply(self, *args, **kwargs):
      seen.append("apply")
      return dense.apply(*args, **kwargs)

    def init_with_output(self, *args, **kwargs):
      return dense.init_with_output(*args, **kwargs)

  want = model(x)
  compat.set_attr_unchecked(model, compat.TONNX_MODULE, Recorder())
  np.testing.assert_array_equal(model(x), want)
  assert seen == ["apply"]
  compat.set_attr_unchecked(model, compat.TONNX_MODULE, dense)


def test_union_filters():
  assert compat.union_filters(False, "cache") == {"cache"}
  assert compat.union_filters(["batch_stats"], "cache") == {"batch_stats", "cache"}
  assert compat.union_filters(True, "cache") is True


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.Dense(3, name="inner")(x), None


class _Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                length=2)(name="blocks")(x, None)[0]
    return nn.Dense(2, name="head")(x)


def _intercepted(model, x, look):
  seen = {}

  def intercept(next_fun, args, kwargs, context):
    if context.method_name == "__call__":
      seen.setdefault("/".join(map(str, context.module.path)), look(context, args))
    return next_fun(*args, **kwargs)

  variables = model.init(jax.random.key(0), x)
  with nn.intercept_methods(intercept):
    model.apply(variables, x)
  return seen


def test_linen_is_bound():
  assert not compat.linen_is_bound(nn.Dense(2))
  seen = _intercepted(_Stack(), jnp.ones((1, 3)),
                      lambda context, _: compat.linen_is_bound(context.module))
  assert seen and all(seen.values())


def test_linen_is_lifted_body():
  seen = _intercepted(_Stack(), jnp.ones((1, 3)),
                      lambda context, _: compat.linen_is_lifted_body(context.module))
  assert seen == {"": False, "blocks": True, "blocks/inner": False, "head": False}


def test_linen_unbound_method_is_the_function_behind_the_intercepted_method():
  names = []

  def intercept(next_fun, args, kwargs, context):
    del next_fun  # run the method through the unbound function instead
    fn = compat.linen_unbound_method(context)
    names.append(fn.__name__)
    return fn(context.module, *args, **kwargs)

  model, x = _Stack(), jnp.ones((1, 3))
  variables = model.init(jax.random.key(0), x)
  with nn.intercept_methods(intercept):
    out = model.apply(variables, x)
  np.testing.assert_array_equal(out, model.apply(variables, x))
  assert names.count("__call__") >= 3  # the stack, the scanned body, the head


def test_unbox_strips_linen_partitioning_boxes():
  boxed = {"kernel": nn.Partitioned(jnp.ones((2, 2)), names=("a", "b")),
           "bias": jnp.zeros(2)}
  out = compat.unbox(boxed)
  assert isinstance(out["kernel"], jax.Array) and out["kernel"].shape == (2, 2)
  assert out["bias"] is boxed["bias"]


@pytest.mark.parametrize("dims", [(((1,), (0,)), ((), ())), (((2,), (1,)), ((0,), (0,)))])
def test_dot_general_transposes_are_the_gradients_of_dot_general(dims):
  rng = np.random.RandomState(0)
  if dims[1][0]:
    lhs, rhs = rng.randn(2, 3, 4), rng.randn(2, 4, 5)
  else:
    lhs, rhs = rng.randn(3, 4), rng.randn(4, 5)
  lhs, rhs = jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32)
  out, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), lhs, rhs)
  g = jnp.asarray(rng.randn(*out.shape), jnp.float32)
  want_lhs, want_rhs = vjp(g)
  kwargs = dict(dimension_numbers=dims, precision=None, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(compat.dot_general_transpose_lhs(g, lhs, rhs, **kwargs),
                             want_lhs, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(compat.dot_general_transpose_rhs(g, lhs, rhs, **kwargs),
                             want_rhs, rtol=1e-5, atol=1e-5)


def test_a_variable_flattens_its_value_under_the_value_key():
  state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Param)
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert paths and all(path[-1] == jax.tree_util.GetAttrKey(compat.VARIABLE_VALUE_KEY)
                       for path in paths)
