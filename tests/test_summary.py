"""Tests for jaxamp.summary: one row per module with policy dtypes and parameter bytes."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp
import linen_models
import nnx_models


def _nnx_lm():
  return nnx_models.TransformerLM(vocab=16, d=8, heads=2, hidden=16, layers=2, max_len=8,
                                  rngs=nnx.Rngs(0))


def _param_sizes(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_nnx_rows_policies_and_bytes():
  model = _nnx_lm()
  s = jaxamp.summary(model, policy="mixed_bfloat16")
  rows = {r.path: r for r in s.rows}
  assert s.policy == "mixed_bfloat16"
  assert rows[""].cls == "TransformerLM" and rows[""].param_count == 8 * 8  # raw `pos` param
  assert rows["embed"].compute_dtype == "bfloat16" and rows["embed"].param_count == 16 * 8
  assert rows["blocks/0/attn/query"].cls == "LinearGeneral"
  assert rows["blocks/0/attn/query"].compute_dtype == "bfloat16"
  ln = rows["blocks/1/ln1"]
  assert (ln.param_dtype, ln.compute_dtype, ln.output_dtype) == ("float32", "float32",
                                                                 "bfloat16")
  total = _param_sizes(nnx.state(model, nnx.Param))
  assert s.total_params == total
  assert s.total_stored_bytes == 4 * total
  norm_params = sum(r.param_count for r in s.rows if r.compute_dtype == "float32")
  assert norm_params > 0
  assert s.total_compute_bytes == 2 * (total - norm_params) + 4 * norm_params
  # parents come before their children, blocks in numeric order
  paths = [r.path for r in s.rows]
  assert paths[0] == "" and paths.index("blocks/0") < paths.index("blocks/0/attn")
  assert paths.index("blocks/0/mlp/up") < paths.index("blocks/1")


def test_bfloat16_stored_params_count_at_the_compute_dtype():
  # numpy does not call bfloat16 floating; the summary must.
  model = nnx.Linear(4, 8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  (row,) = jaxamp.summary(model, policy="float32").rows
  assert (row.param_count, row.stored_bytes, row.compute_bytes) == (40, 80, 160)


def test_rules_show_up_in_the_summary():
  with jaxamp.policy_rules({"blocks/1": "float32"}):
    s = jaxamp.summary(_nnx_lm(), policy="mixed_float16")
  rows = {r.path: r for r in s.rows}
  assert rows["blocks/0/mlp/up"].compute_dtype == "float16"
  assert rows["blocks/1/mlp/up"].compute_dtype == "float32"
  assert rows["blocks/1/mlp/up"].compute_bytes == rows["blocks/1/mlp/up"].stored_bytes


def test_wrapper_policy_is_used():
  wrapped = jaxamp.nnx.with_policy(_nnx_lm(), "mixed_float16")
  assert jaxamp.summary(wrapped).policy == "mixed_float16"


@pytest.mark.slow
def test_linen_rows_from_module_and_example_inputs():
  module = linen_models.TransformerLM()
  ids = linen_models.token_batch()
  s = jaxamp.summary(module, ids, policy="mixed_bfloat16")
  rows = {r.path: r for r in s.rows}
  assert rows["embed"].cls == "Embed" and rows["embed"].compute_dtype == "bfloat16"
  assert rows["ln_final"].compute_dtype == "float32"
  assert rows["head"].param_count == 16 * 32 + 32
  variables = module.init(jax.random.key(0), ids)
  assert s.total_params == _param_sizes(variables["params"])
  same = jaxamp.summary((module, variables), ids, policy="mixed_bfloat16")
  assert same.rows == s.rows


def test_table_and_data():
  s = jaxamp.summary(_nnx_lm(), policy="mixed_bfloat16")
  text = str(s)
  assert text.splitlines()[0] == "policy: mixed_bfloat16"
  header = text.splitlines()[1]
  for col in ("path", "class", "params", "compute", "output", "#params", "stored", "at compute"):
    assert col in header
  assert "(model)" in text and "LinearGeneral" in text and text.splitlines()[-1].startswith("total")
  data = s.to_dict()
  assert data["total_params"] == s.total_params and len(data["rows"]) == len(s.rows)
  assert data["rows"][0]["path"] == ""


def test_bad_inputs_are_named():
  with pytest.raises(ValueError, match="NNX module, a Linen module"):
    jaxamp.summary(42)
  with pytest.raises(ValueError, match="needs example inputs"):
    jaxamp.summary(linen_models.TransformerLM())


class _WeightNormed(nn.Module):
  """Runs its submodule through the submodule's own ``apply`` (weight norm, tied heads)."""

  def setup(self):
    self.inner = nn.Dense(8, use_bias=False)

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (8, 8))
    return self.inner.apply({"params": {"kernel": scale * 2}}, x)


class _Collecting(nn.Module):
  """Nested applies, each followed by a collection that frees the clone it ran."""

  @nn.compact
  def __call__(self, x):
    for k in range(30):
      x = _WeightNormed(name=f"w{k}")(x)
      gc.collect(1)  # the clone, freed mid-trace, leaves its id to the next module
      x = nn.Dense(8, name=f"d{k}")(x)
    return x


@pytest.mark.slow
def test_the_summary_attributes_matmuls_whatever_the_garbage_collector_frees():
  """A nested apply's clone was known by its id: a module allocated where a collected
  clone had been took the clone's path, and its matmuls went to the nested root (the
  reported Hugging Face Wav2Vec2 q_proj after the weight-normed positional conv). Four
  summaries, 30 nested applies each: before, most summaries gave some module's matmuls
  to another."""
  x = jnp.zeros((2, 8))
  variables = jax.eval_shape(lambda: _Collecting().init(jax.random.key(0), x))
  tables = set()
  for _ in range(4):
    s = jaxamp.summary((_Collecting(), variables), x, policy="mixed_bfloat16")
    tables.add(str(s))
    dense = [r for r in s.rows if r.cls == "Dense"]
    assert len(dense) == 60
    assert [r.path for r in dense if (r.matmul_dtypes, r.matmul_flops) != ("bfloat16", 256)
            ] == []
  assert len(tables) == 1
