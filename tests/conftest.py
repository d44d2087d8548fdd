"""Shared pytest fixtures."""

import pytest

from jaxamp import _warn_once


@pytest.fixture
def fresh_warnings():
  """jaxamp's warn-once registry emptied before and after the test: each warning fires
  again, and the test's warnings are forgotten by the next one."""
  _warn_once.reset()
  yield _warn_once
  _warn_once.reset()
