"""A plain DuckDB client reads the manifest throughout a real extraction (issue 40, item 1): the
toy counting VLM over 121 Go boards through `python -m extract`, polled by a client that knows
nothing of agnosia (tests/store/test_plain_readers.py polls a writer loop; this one the CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from faultlib import REPO, env, go_set, write_manifest
from plain_reader import poll_during

from store import db


@pytest.mark.slow
def test_a_plain_client_gets_in_within_a_second_throughout_an_extraction(tmp_path):
    """Asserts: while `python -m extract` runs the toy VLM over 121 boards (chunks of 4, so a
    commit every few batches), a plain read-only client retrying for 1 s never gives up, every gap
    between its reads is under 1 s, and it sees the committed chunks grow."""
    stimuli = go_set(tmp_path / "go", counts="0-120")
    manifest = write_manifest(tmp_path / "m.yaml", stimuli)
    data = tmp_path / "ws"

    def extract() -> None:
        run = subprocess.run([sys.executable, "-m", "extract", str(manifest), "--data", str(data), "--no-progress"],
                             cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]

    got = poll_during(data / "manifest.duckdb", extract, db.PLAIN_READER_WAIT_S, tmp_path)
    assert not got.gave_up, f"{len(got.gave_up)} reads gave up: {got.stderr[-500:]}"
    assert got.chunks[-1] > 0 and len(set(got.chunks)) >= 3, got.chunks   # it read while chunks were committed
    assert got.gaps()[-1][0] < db.PLAIN_READER_WAIT_S, got.gaps()[-5:]
