"""Fixtures of the security tests: a small real workspace, copied fresh for each test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from securitytest_lib import build


@pytest.fixture(scope="session")
def built_workspace(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("security") / "data")


@pytest.fixture
def workspace(built_workspace, tmp_path) -> Path:
    """A fresh copy per test, so a test may tamper with it."""
    return Path(shutil.copytree(built_workspace, tmp_path / "data"))
