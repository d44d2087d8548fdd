"""jaxamp._stack: each thread's scopes are its own; a block pops its scope even on error."""

import threading

import pytest

from jaxamp._stack import Stack


def test_each_thread_sees_only_its_own_scopes():
  scopes = Stack()
  seen = {}
  inside, release = threading.Event(), threading.Event()

  def other():
    with scopes.pushed("other"):
      inside.set()
      release.wait(5)
      seen["other"] = scopes.top()

  t = threading.Thread(target=other)
  with scopes.pushed("main"):
    t.start()
    inside.wait(5)
    seen["main"] = scopes.top()
    release.set()
    t.join(5)
  assert seen == {"main": "main", "other": "other"}
  assert scopes.top() is None


def test_a_failing_block_pops_its_scope():
  scopes = Stack()
  with pytest.raises(ValueError):
    with scopes.pushed("a"):
      raise ValueError("boom")
  assert scopes.top() is None
