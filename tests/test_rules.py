"""Tests for jaxamp.rules: class and path rules, precedence, defaults, scoped rules."""

import dataclasses
import re
import threading

import pytest
from flax import linen as nn
from flax import nnx

import jaxamp
from jaxamp.rules import _glob_to_regex

F32 = jaxamp.get_policy("float32")
BF16 = jaxamp.get_policy("mixed_bfloat16")


class MyLinear(nnx.Linear):
  pass


class MyLinearChild(MyLinear):
  pass


@pytest.mark.parametrize("pattern,path,matches", [
    ("blocks/*/attn", "blocks/0/attn", True),
    ("blocks/*/attn", "blocks/0/mlp/attn", False),
    ("blocks/*", "blocks", False),
    ("blocks/**", "blocks", True),
    ("blocks/**", "blocks/3/mlp/up", True),
    ("**/attn", "attn", True),
    ("**/attn", "encoder/blocks/2/attn", True),
    ("**/attn", "encoder/blocks/2/attn_out", False),
    ("a/**/b", "a/b", True),
    ("a/**/b", "a/x/y/b", True),
    ("block_*", "block_12", True),
    ("block_?", "block_12", False),
    ("head", "head", True),
    ("head", "lm_head", False),
    ("a.b", "axb", False),
])
def test_glob_semantics(pattern, path, matches):
  assert bool(_glob_to_regex(pattern).fullmatch(path)) == matches


def test_class_rules_cover_subclasses_and_the_most_specific_wins():
  with jaxamp.policy_rules({nnx.Linear: "mixed_float16", MyLinear: "bfloat16"}):
    assert jaxamp.resolve_policy(nnx.Linear, "x", F32).name == "mixed_float16"
    assert jaxamp.resolve_policy(MyLinear, "x", F32).name == "bfloat16"
    assert jaxamp.resolve_policy(MyLinearChild, "x", F32).name == "bfloat16"
    assert jaxamp.resolve_policy(nnx.Conv, "x", F32) == F32  # no rule: enclosing


def test_path_rules_beat_class_rules_beat_enclosing():
  with jaxamp.policy_rules({nnx.Linear: "mixed_float16", "blocks/*/head": "float32",
                            re.compile(r"enc/\d+"): "bfloat16"}):
    assert jaxamp.resolve_policy(nnx.Linear, "blocks/1/head", BF16) == F32
    assert jaxamp.resolve_policy(nnx.Linear, ("blocks", 1, "up"), BF16).name == "mixed_float16"
    assert jaxamp.resolve_policy(nnx.Conv, "enc/12", F32).name == "bfloat16"
    assert jaxamp.resolve_policy(nnx.Conv, "enc/x", F32) == F32


def test_latest_path_rule_wins_and_resetting_moves_it_last():
  with jaxamp.policy_rules():
    jaxamp.set_policy("**/head", "float32")
    jaxamp.set_policy("blocks/**", "mixed_float16")
    assert jaxamp.resolve_policy(nnx.Linear, "blocks/head", BF16).name == "mixed_float16"
    jaxamp.set_policy("**/head", "float32")
    assert jaxamp.resolve_policy(nnx.Linear, "blocks/head", BF16) == F32


@pytest.mark.parametrize("norm", jaxamp.NORM_CLASSES)
def test_norm_defaults_compute_float32_and_return_the_enclosing_compute_dtype(norm):
  p = jaxamp.resolve_policy(norm, "ln", BF16)
  assert p.name == "params=float32,compute=float32,output=bfloat16"
  assert jaxamp.resolve_policy(norm, "ln", F32) == F32


def test_defaults_can_be_overridden_and_are_restored():
  with jaxamp.policy_rules({nnx.LayerNorm: None, nn.BatchNorm: "mixed_float16"}):
    assert jaxamp.resolve_policy(nnx.LayerNorm, "ln", BF16) == BF16
    assert jaxamp.resolve_policy(nn.BatchNorm, "bn", F32).name == "mixed_float16"
  assert jaxamp.resolve_policy(nnx.LayerNorm, "ln", BF16).compute_dtype.name == "float32"


def test_callable_rules_see_the_enclosing_policy():
  with jaxamp.policy_rules({"head": lambda enclosing: enclosing.with_output_dtype("float32")}):
    assert jaxamp.resolve_policy(nnx.Linear, "head", BF16).name == (
        "params=float32,compute=bfloat16,output=float32")


def test_clear_policies_keeps_defaults_and_scopes_undo_everything():
  with jaxamp.policy_rules({"a": "float32"}):
    jaxamp.set_policy(nnx.Linear, "bfloat16")
    jaxamp.clear_policies()
    assert jaxamp.resolve_policy(nnx.Linear, "a", BF16) == BF16
    assert jaxamp.resolve_policy(nnx.RMSNorm, "n", BF16).compute_dtype.name == "float32"
    jaxamp.set_policy("b", "float16")
  assert jaxamp.resolve_policy(nnx.Linear, "b", F32) == F32
  with pytest.raises(RuntimeError):
    with jaxamp.policy_rules({"x": "float16"}):
      raise RuntimeError
  assert jaxamp.resolve_policy(nnx.Linear, "x", F32) == F32


def test_bad_rules_are_named():
  with pytest.raises(ValueError, match="module class, a glob path pattern"):
    jaxamp.set_policy(42, "float32")
  with pytest.raises(ValueError, match="must not be empty"):
    jaxamp.set_policy("/", "float32")
  with pytest.raises(ValueError, match="mixed_bfloat16"):
    jaxamp.set_policy("head", "mixed_int4")


def test_norm_defaults_replace_only_the_default_rules():
  from jaxamp.rules import norm_defaults

  half = jaxamp.get_policy("float16")
  keep = lambda p: jaxamp.Policy("float32", "float32", p.compute_dtype)
  with jaxamp.policy_rules({nn.LayerNorm: "bfloat16"}):
    with norm_defaults(keep):
      assert jaxamp.resolve_policy(nnx.BatchNorm, "bn", half) == jaxamp.Policy(
          "float32", "float32", "float16")
      assert jaxamp.resolve_policy(nn.LayerNorm, "ln", half).name == "bfloat16"  # user's
      assert jaxamp.resolve_policy(nnx.Linear, "l", half) == half
    with norm_defaults(None):
      assert jaxamp.resolve_policy(nnx.BatchNorm, "bn", half) == half
    # Restored after the block.
    assert jaxamp.resolve_policy(nnx.BatchNorm, "bn", half) == jaxamp.float32_compute(half)


def test_policy_rules_are_thread_local_and_never_leak():
  # Two threads' blocks interleave: A enters, B enters, A exits, B exits. With one
  # process-wide rule table, B's exit restored A's rule (a leak) and A saw B's rules.
  f32 = jaxamp.get_policy("float32")
  seen = {}
  a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

  def resolve(path):
    return jaxamp.resolve_policy(nnx.Linear, path, f32).name

  def thread_a():
    with jaxamp.policy_rules({"a": "mixed_bfloat16"}):
      a_in.set()
      b_in.wait(5)
      seen["a sees b"] = resolve("b")
      seen["a sees a"] = resolve("a")
    a_out.set()

  def thread_b():
    a_in.wait(5)
    with jaxamp.policy_rules({"b": "mixed_float16"}):
      seen["b sees a"] = resolve("a")
      b_in.set()
      a_out.wait(5)
      jaxamp.set_policy("c", "bfloat16")  # inside a block: the block's own rule
      seen["b sees c"] = resolve("c")
    seen["b after exit"] = (resolve("a"), resolve("b"), resolve("c"))

  threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert seen == {"a sees a": "mixed_bfloat16", "a sees b": "float32",
                  "b sees a": "float32", "b sees c": "bfloat16",
                  "b after exit": ("float32", "float32", "float32")}
  assert resolve("a") == resolve("b") == resolve("c") == "float32"  # nothing leaked


def test_set_policy_outside_a_block_is_process_wide():
  f32 = jaxamp.get_policy("float32")
  out = []
  try:
    jaxamp.set_policy("head", "mixed_bfloat16")
    t = threading.Thread(target=lambda: out.append(
        jaxamp.resolve_policy(nnx.Linear, "head", f32).name))
    t.start()
    t.join()
    assert out == ["mixed_bfloat16"]
    with jaxamp.policy_rules():
      jaxamp.clear_policies()  # clears the block's rules only
      assert jaxamp.resolve_policy(nnx.Linear, "head", f32).name == "float32"
    assert jaxamp.resolve_policy(nnx.Linear, "head", f32).name == "mixed_bfloat16"
  finally:
    jaxamp.set_policy("head", None)


def test_resolved_trees_are_reused_until_a_rule_changes_and_user_functions_run_each_time():
  from jaxamp import rules

  tree = [((), nnx.Sequential), (("layers", 0), nnx.Linear), (("layers", 1), nnx.LayerNorm)]
  first = rules.resolve_tree(tree, BF16)
  assert rules.resolve_tree(tree, BF16) == first
  assert len(rules._trees) >= 1 and any(k[0] == tuple(tree) for k in rules._trees)
  first[("layers", 0)] = F32  # a caller's edit does not reach the cache
  assert rules.resolve_tree(tree, BF16)[("layers", 0)] == BF16
  assert rules.resolve_tree(tree, F32)[("layers", 0)] == F32  # the model policy is in the key
  with jaxamp.policy_rules({"layers/0": "float16"}):
    assert rules.resolve_tree(tree, BF16)[("layers", 0)].name == "float16"
    jaxamp.set_policy(nnx.LayerNorm, "mixed_bfloat16")  # an edit inside the block
    assert rules.resolve_tree(tree, BF16)[("layers", 1)] == BF16
    jaxamp.clear_policies()
    assert rules.resolve_tree(tree, BF16)[("layers", 0)] == BF16
  assert rules.resolve_tree(tree, BF16)[("layers", 1)].compute_dtype.name == "float32"
  seen = []

  def spy(enclosing):
    seen.append(enclosing)
    return enclosing.with_output_dtype("float32")

  with jaxamp.policy_rules({nnx.Linear: spy}):
    for _ in range(3):
      assert rules.resolve_tree(tree, BF16)[("layers", 0)].output_dtype.name == "float32"
  assert len(seen) == 3  # a user's policy function is never cached

  @dataclasses.dataclass
  class Output:  # eq=True without frozen: a callable that cannot be hashed
    dtype: str
    calls: list = dataclasses.field(default_factory=list)

    def __call__(self, enclosing):
      self.calls.append(enclosing)
      return enclosing.with_output_dtype(self.dtype)

  spec = Output("float32")
  with jaxamp.policy_rules({nnx.Linear: spec}):
    for _ in range(2):
      assert rules.resolve_tree(tree, BF16)[("layers", 0)].output_dtype.name == "float32"
  assert len(spec.calls) == 2


def test_a_path_rule_that_matches_no_module_warns_once_at_init_and_summary(fresh_warnings):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top

  class Net(nnx.Module):
    def __init__(self):
      self.body = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
      self.head = nnx.Linear(4, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.head(self.body(x))

  def seen(rules):
    with jaxamp.policy_rules(rules), warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b)), optax.sgd(0.1),
                                     policy="mixed_bfloat16")
      train.init(Net())
      jaxamp.summary(Net(), policy="mixed_bfloat16")
    return [str(w.message) for w in record if "path rule" in str(w.message)]

  # A typo and a parameter's path match no module: one warning, naming them.
  msgs = seen({"haed": "float32", "head/kernel": "float32", "b*": "float32"})
  assert len(msgs) == 1 and "'haed', 'head/kernel' match no module of Net" in msgs[0]
  assert "'body'" in msgs[0]  # the paths there are
  assert seen({"head": "float32", re.compile("bo.y"): "float32"}) == []  # both match
