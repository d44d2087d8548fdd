"""The limits the code holds itself to: the import layers, no import cycle, and sizes.

The layers are the import-linter contracts in ``pyproject.toml`` (the picture in
``docs/architecture.md``); ``.ci/run`` runs ``lint-imports`` too. The sizes are the
team's limits for ``jaxamp/``: no file over 800 lines, no class over 300, no function
over 150.
"""

import ast
import pathlib
import subprocess
import sys

import grimp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxamp"
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 800, 300, 150


def test_import_contracts_are_kept():
  lint = pathlib.Path(sys.executable).parent / "lint-imports"
  result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "0 broken" in result.stdout


def _runtime_imports() -> dict[str, set[str]]:
  """Each module's imports as Python runs them: importing ``a.b.c`` also runs the
  ``__init__`` of ``a`` and ``a.b`` (grimp's graph has only the named module)."""
  graph = grimp.build_graph("jaxamp")
  edges = {}
  for module in graph.modules:
    targets = set()
    for imported in graph.find_modules_directly_imported_by(module):
      parts = imported.split(".")
      targets.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    # A package's own __init__ runs before its submodules: not an import of the package.
    edges[module] = {t for t in targets if not module.startswith(t + ".") and t != module}
  return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in edges.get(node, ()):
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(edges):
    if node not in index:
      visit(node)
  return found


def test_no_import_cycle_through_package_inits():
  # The root package imports everything to re-export it; leave it out.
  edges = {m: {t for t in ts if t != "jaxamp"} for m, ts in _runtime_imports().items()
           if m != "jaxamp"}
  assert _cycles(edges) == []


def test_cycle_finder_sees_a_cycle_through_an_init():
  # The shape of the cycle the wrappers had: nnx._call -> train (its __init__) -> ... -> nnx.
  edges = {"a.nnx": {"a.train"}, "a.train": {"a.train.step"}, "a.train.step": {"a.nnx"},
           "a.casting": set()}
  assert _cycles(edges) == [["a.nnx", "a.train", "a.train.step"]]


def _oversized() -> list[str]:
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    source = path.read_text()
    name = path.relative_to(ROOT)
    lines = source.count("\n")
    if lines > MAX_FILE:
      found.append(f"{name}: {lines} lines (file limit {MAX_FILE})")
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
        size = node.end_lineno - node.lineno + 1
        if size > limit:
          found.append(f"{name}: {node.name} is {size} lines (limit {limit})")
  return found


def test_size_limits():
  assert _oversized() == []


@pytest.mark.parametrize("kind", ["file", "class"])
def test_size_check_sees_an_oversized_piece(kind, tmp_path, monkeypatch):
  body = ("x = 1\n" * (MAX_FILE + 1) if kind == "file" else
          "class Big:\n" + "  x = 1\n" * MAX_CLASS)
  (tmp_path / "jaxamp").mkdir()
  (tmp_path / "jaxamp" / "big.py").write_text(body)
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "jaxamp")
  assert len(_oversized()) == 1
