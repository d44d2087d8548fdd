"""Tests for jaxamp.convert_for_inference: half-precision storage, float32 norms, parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp
import linen_models
import nnx_models


def _dtypes(tree):
  return {x.dtype for x in jax.tree.leaves(tree)}


@pytest.mark.slow
def test_nnx_conversion_halves_storage_and_keeps_outputs():
  model = nnx_models.TransformerLM(vocab=16, d=8, heads=2, hidden=16, layers=2, max_len=8,
                                   rngs=nnx.Rngs(0))
  ids, _ = nnx_models.lm_batch(batch=2, length=8, vocab=16)
  served = jaxamp.convert_for_inference(model, policy="mixed_bfloat16")
  assert served is not model
  assert _dtypes(nnx.state(model, nnx.Param)) == {jnp.dtype(jnp.float32)}  # untouched
  assert served.embed.embedding.get_value().dtype == jnp.bfloat16
  assert served.blocks[0].attn.query.kernel.get_value().dtype == jnp.bfloat16
  assert served.pos.get_value().dtype == jnp.bfloat16
  assert served.blocks[0].ln1.scale.get_value().dtype == jnp.float32
  assert served.blocks[0].ln2.scale.get_value().dtype == jnp.float32
  before = jaxamp.summary(model, policy="mixed_bfloat16")
  after = jaxamp.summary(served, policy="mixed_bfloat16")
  assert after.total_stored_bytes == before.total_compute_bytes
  assert after.total_stored_bytes < 0.55 * before.total_stored_bytes

  mixed = jaxamp.nnx.with_policy(model, "mixed_bfloat16")(ids)
  converted = jaxamp.nnx.with_policy(served, "mixed_bfloat16")(ids)
  # Rounding the weights once when stored or on every read gives the same bits.
  np.testing.assert_array_equal(np.asarray(converted, np.float32), np.asarray(mixed, np.float32))
  reference = model(ids)
  # bfloat16 keeps 8 mantissa bits; logits of this tiny model are O(1).
  np.testing.assert_allclose(np.asarray(converted, np.float32), np.asarray(reference),
                             atol=6e-2, rtol=6e-2)


@pytest.mark.slow
def test_linen_conversion_keeps_norms_and_batch_stats_float32():
  module = linen_models.CNN()
  x = linen_models.image_batch()
  variables = module.init(jax.random.key(0), x)
  served = jaxamp.convert_for_inference(variables, x, module=module, policy="mixed_bfloat16")
  assert served["params"]["conv_0"]["kernel"].dtype == jnp.bfloat16
  assert served["params"]["head"]["kernel"].dtype == jnp.bfloat16
  assert served["params"]["bn_0"]["scale"].dtype == jnp.float32
  assert _dtypes(served["batch_stats"]) == {jnp.dtype(jnp.float32)}
  assert _dtypes(variables["params"]) == {jnp.dtype(jnp.float32)}  # untouched
  amp = jaxamp.linen.with_policy(module, "mixed_bfloat16")
  np.testing.assert_array_equal(np.asarray(amp.apply(served, x), np.float32),
                                np.asarray(amp.apply(variables, x), np.float32))
  np.testing.assert_allclose(np.asarray(amp.apply(served, x), np.float32),
                             np.asarray(module.apply(variables, x)), atol=6e-2, rtol=6e-2)


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match="module=<the Linen module>"):
    jaxamp.convert_for_inference({"params": {}})
  module = linen_models.CNN()
  with pytest.raises(ValueError, match="'params' collection"):
    jaxamp.convert_for_inference({"batch_stats": {}}, module=module)
  with pytest.raises(ValueError, match="example inputs"):
    jaxamp.convert_for_inference({"params": {}}, module=module)


@pytest.mark.slow
def test_a_parameter_out_of_float16_range_is_refused_not_stored_as_inf():
  model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
  model.layers[1].kernel[...] = model.layers[1].kernel[...].at[0, 0].set(1e5)
  with pytest.raises(ValueError, match=r"inf: layers/1/kernel \(\|max\| 1e\+05, float16\)"):
    jaxamp.convert_for_inference(model, policy="mixed_float16")
  served = jaxamp.convert_for_inference(model, policy="mixed_bfloat16")  # float32's range
  assert np.isfinite(np.asarray(served.layers[1].kernel[...], np.float32)).all()
  with jaxamp.policy_rules({"layers/1": "float32"}):
    served = jaxamp.convert_for_inference(model, policy="mixed_float16")
  assert served.layers[1].kernel[...].dtype == jnp.float32

  module = nn.Dense(2)
  x = jnp.ones((1, 4))
  variables = module.init(jax.random.key(0), x)
  variables["params"]["kernel"] = variables["params"]["kernel"].at[0, 0].set(-1e5)
  with pytest.raises(ValueError, match="inf: kernel"):
    jaxamp.convert_for_inference(variables, x, module=module, policy="mixed_float16")


@pytest.mark.slow
def test_equinox_conversion_stores_each_module_in_its_compute_dtype():
  eqx = pytest.importorskip("equinox")
  import jaxamp.equinox as amp_eqx  # pylint: disable=g-import-not-at-top

  k1, k2 = jax.random.split(jax.random.key(0))
  model = eqx.nn.Sequential([eqx.nn.Linear(4, 8, key=k1), eqx.nn.LayerNorm(8),
                             eqx.nn.Lambda(jax.nn.relu), eqx.nn.Linear(8, 2, key=k2)])
  x = jnp.linspace(-1.0, 1.0, 4)
  served = jaxamp.convert_for_inference(model, policy="mixed_float16")
  assert type(served) is type(model)
  assert _dtypes(eqx.filter(served.layers[0], eqx.is_inexact_array)) == {jnp.dtype(jnp.float16)}
  assert _dtypes(eqx.filter(served.layers[1], eqx.is_inexact_array)) == {jnp.dtype(jnp.float32)}
  assert _dtypes(eqx.filter(served.layers[3], eqx.is_inexact_array)) == {jnp.dtype(jnp.float16)}
  assert _dtypes(eqx.filter(model, eqx.is_inexact_array)) == {jnp.dtype(jnp.float32)}  # untouched
  np.testing.assert_array_equal(amp_eqx.with_policy(served, "mixed_float16")(x),
                                amp_eqx.with_policy(model, "mixed_float16")(x))
  # A view converts under its own policy, and comes back a plain model.
  view = amp_eqx.with_policy(model, "mixed_bfloat16")
  from_view = jaxamp.convert_for_inference(view)
  assert not amp_eqx.is_policy_view(from_view)
  assert from_view.layers[0].weight.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="module= is for Linen variables"):
    jaxamp.convert_for_inference(model, module=nn.Dense(2))
  big = eqx.tree_at(lambda m: m.layers[3].weight, model, model.layers[3].weight * 1e6)
  with pytest.raises(ValueError, match=r"inf: layers/3/weight \(\|max\| .*, float16\)"):
    jaxamp.convert_for_inference(big, policy="mixed_float16")
