"""The second half of the documented commands (docs/ from ``PART_B`` on), in this module's own copy
of the reduced demo checkout (tests/docs_commands_lib.py), so it runs beside the first half."""

from __future__ import annotations

import pytest
from docs_commands_lib import (
    SECOND_HALF,
    Command,
    built_checkout,  # noqa: F401 - a fixture `checkout` uses
    checkout,  # noqa: F401 - the fixture the test takes
    run_documented,
)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", SECOND_HALF, ids=[c.id for c in SECOND_HALF])
def test_documented_command_runs(cmd: Command, checkout: tuple) -> None:  # noqa: F811
    run_documented(cmd, checkout)
