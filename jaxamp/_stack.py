"""A per-thread stack of scopes: what a traced pass opens and the code it calls reads.

The train step opens a scope around a pass it traces (the scaled formats' state,
:mod:`jaxamp.scaled`; the numerics monitor's records, :mod:`jaxamp.numerics`); module
calls deep inside read the innermost one. One stack per thread, so that two threads
tracing at once never see each other's.

Example:
  >>> from jaxamp._stack import Stack
  >>> scopes = Stack()
  >>> scopes.top() is None
  True
  >>> with scopes.pushed('outer'):
  ...   with scopes.pushed('inner'):
  ...     scopes.top()
  'inner'
  >>> scopes.top() is None
  True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Stack"]


class Stack(threading.local):
  """A stack of this thread's scopes (each thread starts with an empty one)."""

  def __init__(self):
    super().__init__()
    self.items: list[Any] = []

  def top(self) -> Any:
    """The innermost scope, or None."""
    return self.items[-1] if self.items else None

  @contextlib.contextmanager
  def pushed(self, item: Any) -> Iterator[Any]:
    """``item`` the innermost scope in this block."""
    self.items.append(item)
    try:
      yield item
    finally:
      self.items.pop()
