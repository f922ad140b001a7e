"""Fixtures shared by the store tests."""

from __future__ import annotations

import duckdb
import pytest


@pytest.fixture
def connects(monkeypatch):
    """Every duckdb.connect of this process, by path (the real connect still runs)."""
    calls: list[str] = []
    real = duckdb.connect

    def counting(database=":memory:", *args, **kwargs):
        calls.append(str(database))
        return real(database, *args, **kwargs)

    monkeypatch.setattr(duckdb, "connect", counting)
    return calls
