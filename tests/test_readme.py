"""The README runs as written, does what it says, and stays a short user's guide.

Each ```python block runs by itself in a fresh namespace (as copied into a fresh
interpreter); the recipes' behaviour is checked beyond "it ran". The docs pages' blocks
are run by tests/test_docs.py.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)


def _blocks(language: str) -> list[str]:
  return [code for lang, code in _FENCE.findall(README.read_text(encoding="utf-8"))
          if lang == language]


def _run(code: str) -> dict:
  namespace = {"__name__": "__main__"}
  exec(compile(code, str(README), "exec"), namespace)  # pylint: disable=exec-used
  return namespace


# Each block may set the global policy or rules, as a fresh interpreter would have them.
pytestmark = pytest.mark.usefixtures("fresh_jaxamp_state")


def test_readme_is_a_short_guide():
  text = README.read_text(encoding="utf-8")
  assert len(text.splitlines()) <= 300
  assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "run dates belong in benchmarks/"
  assert not re.search(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text), \
      "commit hashes belong in git history"
  for example in ("examples/digits.py", "examples/char_lm.py", "examples/resnet.py"):
    assert example in text
  assert len(_blocks("python")) == 3, "each Python block of the README has a test below"


def test_example_trains_without_skips(capsys):
  example = _blocks("python")[0]
  ns = _run(example)
  assert int(ns["metrics"]["skipped_steps"]) == 0
  assert int(ns["state"].step) == 3
  assert "norm     LayerNorm  float32  float32" in capsys.readouterr().out


def test_global_policy_block_computes_in_bfloat16(capsys):
  ns = _run(_blocks("python")[1])
  assert capsys.readouterr().out.splitlines()[-1] == "bfloat16 float32"
  assert jaxamp.global_policy().name == "float32"  # the block puts the default back
  assert ns["y"].dtype == jnp.bfloat16


def test_hand_written_optax_step_skips_overflow_exactly(capsys):
  ns = _run(_blocks("python")[2])
  assert capsys.readouterr().out.splitlines()[-1] == "32768.0"  # the finite step applied
  params, opt_state = ns["params"], ns["opt_state"]
  x = jnp.full((5, 3), 0.1, jnp.float16)
  before = (params, opt_state)
  params, opt_state = ns["step"](params, opt_state, x * jnp.inf)  # overflows
  assert float(jaxamp.get_loss_scale(opt_state)) == 2.0**14
  is_ls = lambda t: isinstance(t, jaxamp.LossScaleState)
  rest = lambda s: [t for t in jax.tree.leaves(s, is_leaf=is_ls) if not is_ls(t)]
  for a, b in zip(rest(before), rest((params, opt_state)), strict=True):
    assert (a == b).all()  # params and Adam's moments and count untouched


def test_quick_start_is_what_ci_runs():
  """The README's second Quick-start command installs and tests the way .ci/run does."""
  quick_start = README.read_text(encoding="utf-8").split("## Quick start", 1)[1]
  commands = _FENCE.findall(quick_start)[0][1].splitlines()
  assert len(commands) == 2
  ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
  test_command = commands[1]
  install = re.search(r'pip install -e "(\.\[[\w,]+\])"', test_command).group(1)
  pytest_args = re.search(r"python -m pytest (.*)$", test_command).group(1)
  assert f'-e "{install}' in ci
  assert f"-m pytest {pytest_args}" in ci
