"""Shared pytest fixtures, and the XLA:CPU compiler settings the suite runs under."""

import fcntl
import importlib.util
import os

# Most tests compile a small program and run it a few steps, so XLA:CPU's LLVM backend
# optimizations cost more than they save: at level 0 the suite takes about a fifth less
# CPU time. The level changes how XLA:CPU generates machine code, not the HLO that jaxamp
# builds (dtypes, casts, skips, collectives); emulated half-precision loops may round
# differently, well within every tolerance here, and both sides of every comparison run
# under the same flags. Set before JAX starts a backend, and inherited by the tests'
# subprocesses. A level already in XLA_FLAGS wins (XLA_FLAGS=--xla_backend_optimization_level=3
# runs the suite at XLA's default); nothing is set where a GPU plugin is installed.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if ("xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
    and not any(importlib.util.find_spec(name) for name in (
        "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin"))):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxamp import _warn_once  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture
def fresh_warnings():
  """jaxamp's warn-once registry emptied before and after the test: each warning fires
  again, and the test's warnings are forgotten by the next one."""
  _warn_once.reset()
  yield _warn_once
  _warn_once.reset()


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
  """``once_per_run(name, make)``: ``make(folder)`` run once per pytest run, however many
  xdist workers ask; returns the folder it wrote into.

  For a subprocess whose results several tests read: a module-scoped fixture alone would
  run it again on each worker that gets one of those tests. The workers share the parent
  of their temporary folders, and a file lock there makes the others wait for the first.
  """
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent

  def run(name, make):
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
      if not (folder / ".done").exists():
        folder.mkdir(exist_ok=True)
        make(folder)
        (folder / ".done").touch()
    return folder

  return run


@pytest.fixture
def fresh_jaxamp_state():
  """Puts back what a test may change process-wide: the global policy and the rules."""
  import jaxamp  # pylint: disable=g-import-not-at-top

  policy = jaxamp.global_policy()
  yield
  jaxamp.set_global_policy(policy)
  jaxamp.clear_policies()
