import threading
import warnings

import pytest

from jaxamp import _warn_once


def _caught(fn):
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    result = fn()
  return result, [(w.category, str(w.message)) for w in seen]


def test_warns_once_per_key(fresh_warnings):
  result, seen = _caught(lambda: [_warn_once.warn_once(("test", "a"), "first a"),
                                  _warn_once.warn_once(("test", "a"), "second a"),
                                  _warn_once.warn_once(("test", "b"), "b", UserWarning)])
  assert result == [True, False, True]
  assert seen == [(RuntimeWarning, "first a"), (UserWarning, "b")]
  assert _warn_once.has_warned(("test", "a")) and not _warn_once.has_warned(("test", "c"))


def test_reset_warns_again(fresh_warnings):
  assert _caught(lambda: _warn_once.warn_once(("test", "r"), "r"))[0]
  assert not _caught(lambda: _warn_once.warn_once(("test", "r"), "r"))[0]
  _warn_once.reset()
  assert not _warn_once.has_warned(("test", "r"))
  assert _caught(lambda: _warn_once.warn_once(("test", "r"), "r"))[1] == [(RuntimeWarning, "r")]


def test_stacklevel_names_the_callers_line(fresh_warnings):
  def library_function():
    _warn_once.warn_once(("test", "stack"), "here", stacklevel=2)

  with pytest.warns(RuntimeWarning, match="here") as record:
    library_function()  # the line the warning should name
  assert record[0].filename == __file__
  assert record[0].lineno == test_stacklevel_names_the_callers_line.__code__.co_firstlineno + 5


def test_one_warning_from_many_threads(fresh_warnings):
  start = threading.Barrier(8)
  results = []

  def worker():
    start.wait()
    results.append(_warn_once.warn_once(("test", "threads"), "threads"))

  def run():
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()

  _, seen = _caught(run)
  assert sorted(results) == [False] * 7 + [True]
  assert seen == [(RuntimeWarning, "threads")]
