"""Warnings given once per process: one registry for every module of jaxamp.

A module names its warnings by a key of its own (``('fp8.stateless', what)``), so keys
of different modules never collide; :func:`reset` forgets them all (tests use it through
the ``fresh_warnings`` fixture).

Example:
  >>> import warnings
  >>> from jaxamp import _warn_once
  >>> with warnings.catch_warnings(record=True) as seen:
  ...   warnings.simplefilter("always")
  ...   [_warn_once.warn_once(("doc.example", 1), "jaxamp: once") for _ in range(3)]
  [True, False, False]
  >>> len(seen)
  1
  >>> _warn_once.reset()
  >>> with warnings.catch_warnings(record=True):
  ...   _warn_once.warn_once(("doc.example", 1), "jaxamp: once")
  True
  >>> _warn_once.reset()
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Hashable

_warned: set[Hashable] = set()
_lock = threading.Lock()


def warn_once(key: Hashable, message: str, category: type[Warning] = RuntimeWarning,
              stacklevel: int = 2) -> bool:
  """Warns ``message`` unless a warning with ``key`` was given before in this process.

  Args:
    key: what the warning is about, namespaced by the caller (``('rules.unmatched', ...)``).
    message: the warning's text.
    category: the warning's class.
    stacklevel: as for ``warnings.warn`` called where ``warn_once`` is called (1 names
      that line, 2 its caller, ...).

  Returns:
    Whether it warned: False if ``key`` had warned already (in any thread).
  """
  with _lock:  # check and mark in one step: two threads must not both warn
    if key in _warned:
      return False
    _warned.add(key)
  warnings.warn(message, category, stacklevel=stacklevel + 1)
  return True


def has_warned(key: Hashable) -> bool:
  """Whether a warning with ``key`` was given (a cheap check before building a message)."""
  return key in _warned


def reset() -> None:
  """Forgets every warning given, so each warns again (for tests)."""
  with _lock:
    _warned.clear()
