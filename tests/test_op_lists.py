"""Tests for jaxamp.op_lists: coverage of every primitive, editing, validation."""

import jax
import jax.extend as jex
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from jax import lax

import jaxamp
from jaxamp.op_lists import (BFLOAT16_LISTS, CATEGORIES, DEFAULT_LISTS, HIGHER_ORDER,
                              AutocastLists, ReductionSize)


def _primitives_in(module):
  return {v.name for v in vars(module).values() if isinstance(v, jex.core.Primitive)}


def _traced_primitives():
  """Primitives met when tracing common jax.numpy, jax.nn, optax, Flax and control-flow code."""
  names = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      names.add(eqn.primitive.name)
      for sub in jex.core.jaxprs_in_params(eqn.params):
        walk(sub)

  x, key = jnp.ones((2, 8)), jax.random.key(0)
  mesh = jax.make_mesh((1,), ("d",))
  P = jax.sharding.PartitionSpec
  fns = [
      jax.nn.relu, jax.nn.gelu, jax.nn.silu, jax.nn.softplus, jax.nn.softmax,
      jax.nn.log_softmax, jax.nn.sigmoid, jax.nn.standardize, jax.nn.elu, jax.nn.selu,
      jax.nn.glu, jax.nn.mish, jax.nn.logsumexp, jnp.linalg.norm, jnp.var, jnp.cumsum,
      jnp.cumprod, jnp.sort, jnp.argsort, jnp.median, jnp.clip, jnp.round, jnp.nan_to_num,
      lambda a: a ** 2.5, lambda a: a[:, ::2], lambda a: a[jnp.array([0, 1])],
      lambda a: a.at[0].set(1.0), lambda a: a.at[jnp.array([0, 1])].add(1.0),
      lambda a: jnp.concatenate([a, a]), lambda a: jnp.stack([a, a]), lambda a: jnp.pad(a, 1),
      lambda a: jnp.einsum("ij,kj->ik", a, a), lambda a: jnp.arctan2(a, a),
      lambda a: jnp.logaddexp(a, a), lambda a: lax.top_k(a, 2)[0],
      lambda a: optax.softmax_cross_entropy(a, a), lambda a: optax.sigmoid_binary_cross_entropy(a, a),
      lambda a: jax.nn.dot_product_attention(a[None, :, None], a[None, :, None], a[None, :, None]),
      lambda a: jax.random.normal(key, a.shape) * a, lambda a: jax.random.bernoulli(key, 0.5, a.shape),
      lambda a: jax.random.categorical(key, a), lambda a: jax.random.split(key),
      lambda a: jnp.fft.rfft(a), lambda a: jnp.linalg.inv(a[:, :2]),
      lambda a: jnp.linalg.svd(a, compute_uv=False), lambda a: jnp.linalg.eigh(a[:, :2] @ a[:, :2].T),
      lambda a: jnp.linalg.qr(a), lambda a: jnp.linalg.cholesky(a[:, :2] @ a[:, :2].T),
      lambda a: jax.scipy.special.erf(a), jax.scipy.special.gammaln, jax.scipy.special.digamma,
      lambda a: jax.image.resize(a, (4, 16), "linear"),
      lambda a: nn.max_pool(a[None, :, :, None], (2, 2)), lambda a: nn.avg_pool(a[None, :, :, None], (2, 2)),
      lambda a: lax.conv_general_dilated(a[None, None], a[None, None, :, :2], (1, 1), "SAME"),
      lambda a: lax.reduce_precision(a, 5, 10), lambda a: a.astype(jnp.bfloat16).view(jnp.int16),
      lambda a: jax.checkpoint(jnp.sin)(a), lambda a: jax.jit(jnp.cos)(a),
      lambda a: lax.scan(lambda c, r: (c + r, c * r), a[0], a)[1],
      lambda a: lax.cond(a.sum() > 0, jnp.sin, jnp.cos, a),
      lambda a: lax.while_loop(lambda c: c.sum() < 10, lambda c: c + 1, a),
      lambda a: lax.fori_loop(0, 3, lambda i, c: c * 2, a),
      lambda a: jax.shard_map(lambda b: lax.psum(b, "d"), mesh=mesh, in_specs=P(),
                              out_specs=P())(a),
      lambda a: jax.grad(lambda b: jnp.sum(jax.nn.gelu(b) ** 2))(a),
      lambda a: jax.grad(lambda b: jnp.sum(nn.max_pool(b[None, :, :, None], (2, 2))))(a),
      lambda a: jax.grad(lambda b: jnp.sum(jnp.take_along_axis(b, jnp.zeros((2, 1), int), 1)))(a),
  ]
  for fn in fns:
    walk(jax.make_jaxpr(fn)(x).jaxpr)
  return names


def test_every_primitive_is_in_exactly_one_list():
  """MXNet's coverage test: a new JAX primitive fails here until it is classified."""
  names = _primitives_in(lax) | _primitives_in(jex.core.primitives) | _traced_primitives()
  lists = {what: getattr(DEFAULT_LISTS, what) for what in CATEGORIES}
  lists["conditional"] = set(DEFAULT_LISTS.conditional)
  lists["higher_order"] = HIGHER_ORDER
  membership = {name: [what for what, members in lists.items() if name in members]
                for name in names}
  missing = sorted(n for n, m in membership.items() if not m)
  several = {n: m for n, m in membership.items() if len(m) > 1}
  assert not missing, f"unclassified primitives: {missing}"
  assert not several, f"primitives in several lists: {several}"
  assert len(names) > 170


def test_defaults_follow_the_peers():
  assert DEFAULT_LISTS.category("dot_general") == "low_precision"
  assert DEFAULT_LISTS.category("conv_general_dilated") == "low_precision"
  for name in ("exp", "log", "log1p", "pow", "rsqrt", "erf_inv", "reduce_prod", "cumprod"):
    assert DEFAULT_LISTS.category(name) == "float32", name
  for name in ("add", "sub", "mul"):
    assert DEFAULT_LISTS.category(name) == "follow_compute", name
  for name in ("add_any", "div", "select_n", "concatenate", "atan2"):
    assert DEFAULT_LISTS.category(name) == "widest", name
  for name in ("tanh", "reshape", "reduce_max", "convert_element_type", "gather"):
    assert DEFAULT_LISTS.category(name) == "passthrough", name
  assert DEFAULT_LISTS.category("scatter-add") == "as_traced"
  assert DEFAULT_LISTS.category("reduce_sum") == "conditional"
  assert DEFAULT_LISTS.category("not_a_primitive") is None
  assert AutocastLists() == DEFAULT_LISTS and hash(AutocastLists()) == hash(DEFAULT_LISTS)
  assert jaxamp.AutocastLists is AutocastLists
  # bfloat16 has float32's range: powers need no float32 there; the rest is the same.
  assert {n for n in BFLOAT16_LISTS.names if BFLOAT16_LISTS.category(n)
          != DEFAULT_LISTS.category(n)} == {"square", "integer_pow"}
  assert BFLOAT16_LISTS.category("square") == "passthrough"


def _eqn(fn, *args):
  return jax.make_jaxpr(fn)(*args).eqns[-1]


def test_resolve():
  x = jnp.ones((3, 5))
  assert DEFAULT_LISTS.resolve(_eqn(jnp.exp, x)) == "float32"
  assert DEFAULT_LISTS.resolve(_eqn(lambda a: a.sum(1), x)) == "float32"
  assert DEFAULT_LISTS.resolve(_eqn(lambda a: a.sum(1), jnp.ones((3, 1)))) == "passthrough"
  assert DEFAULT_LISTS.resolve(_eqn(lambda a: jax.debug.print("{}", a), x)) == "as_traced"
  assert DEFAULT_LISTS.remove("exp").resolve(_eqn(jnp.exp, x)) == "as_traced"  # in no list
  bad = DEFAULT_LISTS.add("exp", to=lambda eqn: "float64")
  with pytest.raises(ValueError, match="returned 'float64'"):
    bad.resolve(_eqn(jnp.exp, x))


@pytest.mark.parametrize("shape,axes,more_than,expected", [
    ((4, 8), (1,), 7, "float32"), ((4, 8), (1,), 8, "passthrough"),
    ((4, 8), (0, 1), 31, "float32"), ((4, 8), (0,), 4, "passthrough"),
])
def test_reduction_size(shape, axes, more_than, expected):
  eqn = _eqn(lambda a: lax.reduce_sum_p.bind(a, axes=axes, out_sharding=None), jnp.ones(shape))
  assert ReductionSize(more_than)(eqn) == expected


def test_reduction_size_cumulative_and_lists():
  eqn = _eqn(lambda a: lax.cumsum(a, axis=0), jnp.ones((6, 2)))
  assert ReductionSize(5)(eqn) == "float32" and ReductionSize(6)(eqn) == "passthrough"
  assert ReductionSize(0, large="widest", small="as_traced")(eqn) == "widest"
  with pytest.raises(ValueError, match="ReductionSize.large"):
    ReductionSize(1, large="fp32")


def test_add_and_remove_return_edited_copies():
  edited = DEFAULT_LISTS.add("tanh", "logistic", to="float32")
  assert edited.category("tanh") == edited.category("logistic") == "float32"
  assert DEFAULT_LISTS.category("tanh") == "passthrough"  # unchanged
  assert "tanh" not in edited.passthrough
  assert edited.remove("tanh").category("tanh") is None
  assert edited.add("tanh", to="passthrough") == DEFAULT_LISTS.add("logistic", to="float32")
  rule = ReductionSize(1024)
  conditional = DEFAULT_LISTS.add("exp", to=rule)
  assert conditional.category("exp") == "conditional" and conditional.conditional["exp"] is rule
  assert conditional.add("exp", to="float32") == DEFAULT_LISTS
  assert DEFAULT_LISTS.remove("reduce_sum").category("reduce_sum") is None
  assert DEFAULT_LISTS.names - DEFAULT_LISTS.remove("exp").names == {"exp"}


def test_validation():
  with pytest.raises(ValueError, match="one list only.*'exp' \\(float32 and passthrough\\)"):
    AutocastLists(passthrough=DEFAULT_LISTS.passthrough | {"exp"})
  with pytest.raises(ValueError, match="'exp' \\(float32 and conditional\\)"):
    AutocastLists(conditional={"exp": ReductionSize(1)})
  with pytest.raises(ValueError, match="higher-order"):
    DEFAULT_LISTS.add("scan", to="float32")
  with pytest.raises(ValueError, match="Unknown list 'fp32'"):
    DEFAULT_LISTS.add("tanh", to="fp32")
  with pytest.raises(TypeError, match="collection of primitive names"):
    AutocastLists(low_precision="dot_general")
  with pytest.raises(TypeError, match="must be callable"):
    AutocastLists(conditional={"reduce_sum": "float32"})
  with pytest.raises(dataclasses_frozen_error()):
    DEFAULT_LISTS.float32 = frozenset()  # type: ignore[misc]
  with pytest.raises(TypeError):
    DEFAULT_LISTS.conditional["exp"] = ReductionSize(1)  # type: ignore[index]


def dataclasses_frozen_error():
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.FrozenInstanceError
