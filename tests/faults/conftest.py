"""Fixtures shared by the fault tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from faultlib import Zygote


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """A warm process (torch, transformers and the toy already imported) that forks one child per
    extraction; one per test module, closed when the module is done."""
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    try:
        yield z
    finally:
        z.close()
