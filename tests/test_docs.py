"""Every Python block of the docs runs as copied, and the recipes do what their pages say.

The docs' convention (stated on docs/index.md): each ```python block is complete on its own.
So each block runs here by itself, in a fresh namespace, with jaxamp's global policy and
rules put back afterwards, as a fresh interpreter would have them. Blocks that are not
meant to run are fenced ```bash or ```text.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def pages() -> list[pathlib.Path]:
  return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
  """(first line number, code) of each ```python block of a Markdown file."""
  text = path.read_text(encoding="utf-8")
  return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in _FENCE.finditer(text)]


def section_blocks(path: pathlib.Path, heading: str) -> list[str]:
  """The ```python blocks under ``heading`` (a full heading line), up to the next heading."""
  lines, in_fence, inside = [], False, False
  for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
    if line.startswith("```"):
      in_fence = not in_fence
    elif not in_fence and line.startswith("#"):  # a heading: not a comment inside a block
      if inside:
        break
      inside = line.rstrip("\n") == heading
      continue
    if inside:
      lines.append(line)
  assert lines, f"no section {heading!r} in {path}"
  return [m.group(1) for m in _FENCE.finditer("".join(lines))]


def run_block(code: str, where: str) -> dict:
  namespace = {"__name__": "__main__"}
  exec(compile(code, where, "exec"), namespace)  # pylint: disable=exec-used
  return namespace


# Each block may set the global policy or rules, as a fresh interpreter would have them.
# Heavier checks: the slow tier (pytest -m slow), which CI runs after the main suite.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_jaxamp_state")]


# What a block prints that its page states (a printed line, exactly), by (page, block index).
_STATED_OUTPUT = {
    ("getting_started.md", 0): ["8192.0 2", "float32"],
    ("getting_started.md", 1): ["{'bias': 'float32', 'kernel': 'float32'}"],
    ("guides/policies.md", 1): ["float32", "bfloat16", "float32"],
    ("guides/policies.md", 3): ["float16", "float32"],
    ("guides/policies.md", 4): ["True"],
    ("guides/policies.md", 5): ["bfloat16 float32"],
    ("guides/loss_scaling.md", 1): ["16384.0"],
    ("guides/loss_scaling.md", 2): ["32768.0"],
    ("guides/autocast.md", 0): ["float32", "1.0"],
    ("guides/autocast.md", 1): ["bfloat16 True", "bfloat16"],
    ("guides/train_step.md", 1): ["True False"],
    ("guides/train_step.md", 2): ["2"],
    ("guides/train_step.md", 3): ["True"],
    ("guides/memory.md", 0): ["bfloat16 bfloat16 int32"],
    ("guides/third_party.md", 0): ["1.0"],
    ("guides/checking_precision.md", 1): ["1.0"],
    ("guides/debugging.md", 0): ["['big', 'tiny']"],
    ("guides/debugging.md", 1): ["{'mix': 'mixed_bfloat16'}"],
    ("guides/migrating.md", 0): ["params=float32,compute=bfloat16,output=float32"],
}

_BLOCKS = [(page, i, line, code) for page in pages()
           for i, (line, code) in enumerate(python_blocks(page))]


@pytest.mark.parametrize("page,index,line,code", _BLOCKS,
                         ids=[f"{p.relative_to(DOCS)}:{line}" for p, _, line, _ in _BLOCKS])
def test_block_runs_as_copied(page, index, line, code, capsys):
  if "transformers" in code:
    pytest.importorskip("transformers")
  run_block(code, f"{page}:{line}")
  lines = capsys.readouterr().out.splitlines()
  stated = _STATED_OUTPUT.get((str(page.relative_to(DOCS)), index))
  if stated:
    it = iter(lines)  # in order, each a whole printed line
    assert all(any(got == want for got in it) for want in stated), (stated, lines)


def test_stated_outputs_name_existing_blocks():
  for (page, index) in _STATED_OUTPUT:
    assert index < len(python_blocks(DOCS / page)), (page, index)


def test_no_python_block_escapes_the_runner():
  """Python written under another fence would not be run: there is none."""
  for page in pages():
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"^```\s*(py|python3|ipython|pycon|\{code-cell\}|\{code-block\})\b",
                         text, flags=re.M), page


def test_loss_scale_table_block_prints_the_rule():
  (block,) = section_blocks(DOCS / "guides" / "loss_scaling.md", "## The elements")
  ns = run_block(block, "loss_scaling.md")
  assert float(jaxamp.get_loss_scale(ns["opt_state"])) == 4.0  # 4 -> 8 (growth) -> 4 (inf)


def test_hand_written_step_skips_overflow_exactly():
  (block,) = section_blocks(DOCS / "guides" / "loss_scaling.md", "## A hand-written step")
  ns = run_block(block, "loss_scaling.md")
  params, opt_state, x = ns["params"], ns["opt_state"], ns["x"]
  params, opt_state = ns["step"](params, opt_state, x)
  before = (params, opt_state)
  scale = float(jaxamp.get_loss_scale(opt_state))
  params, opt_state = ns["step"](params, opt_state, x * jnp.inf)  # overflows
  assert float(jaxamp.get_loss_scale(opt_state)) == scale / 2
  is_ls = lambda t: isinstance(t, jaxamp.LossScaleState)
  rest = lambda s: [t for t in jax.tree.leaves(s, is_leaf=is_ls) if not is_ls(t)]
  for a, b in zip(rest(before), rest((params, opt_state)), strict=True):
    assert (a == b).all()  # MultiSteps' accumulator and Adam untouched


def test_nnx_optimizer_recipe_skips_overflow_exactly():
  (block,) = section_blocks(DOCS / "guides" / "loss_scaling.md", "## With `nnx.Optimizer`")
  ns = run_block(block, "loss_scaling.md")
  model, optimizer = ns["model"], ns["optimizer"]
  x, y = jnp.ones((8, 4)), jnp.zeros((8, 2))
  kernel = model.kernel[...]
  ns["train_step"](model, optimizer, x * jnp.inf, y)
  assert (model.kernel[...] == kernel).all()
  assert int(optax.tree_utils.tree_get(optimizer.opt_state, "count")) == 1
  assert float(jaxamp.get_loss_scale(optimizer.opt_state)) == 2.0**14


def test_fp8_example_prints_what_the_page_says(capsys):
  import warnings

  (block,) = section_blocks(DOCS / "guides" / "fp8.md", "# FP8")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # FP8 on CPU runs upcast
    run_block(block, "fp8.md")
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "['layers/0']" and lines[-1] == "True"


def test_api_reference_lists_every_public_name():
  api = (DOCS / "api" / "index.md").read_text(encoding="utf-8")
  listed = set(re.findall(r"^   (\w+)$", api, flags=re.M))
  submodules = {"fp8", "linen", "nnx", "scaled"}
  assert listed == set(jaxamp.__all__) - submodules
  for name in submodules:
    assert f".. automodule:: jaxamp.{name}" in (DOCS / "api" / f"{name}.md").read_text()


def test_install_lines_name_our_distribution():
  """Every pip line installs from the clone; none names the registry's unrelated 'jaxamp'."""
  name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
  assert name != "jaxamp"
  for path in [ROOT / "README.md", ROOT / ".ci" / "run", *pages()]:
    commands = re.findall(r"pip install[^`\n#&]*", path.read_text(encoding="utf-8"))
    assert commands or path.name not in ("README.md", "getting_started.md"), path
    for command in (c for c in commands if "--upgrade pip" not in c):
      assert not re.search(r"\bjaxamp\b", command), (path, command)
      assert re.search(r"-e \S", command), (path, command)  # from the clone
