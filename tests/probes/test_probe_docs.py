"""docs/new-probe.md's example is real: its code, as written, registers a kind and runs it."""

from __future__ import annotations

import re

import pytest
from probetest_lib import REPO, go_family, go_features, python, write_run

from probes.farm import open_workspace
from store import Workspace


@pytest.mark.slow
def test_new_probe_example_runs_as_written(tmp_path):
    text = (REPO / "docs" / "new-probe.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) <= 30, f"the example should stay under 30 lines of code, it has {len(lines)}"
    script = tmp_path / "my_probes.py"
    script.write_text(code)
    # The demo's run name and tap, over synthetic boards whose vision tokens hold their stones
    rows, labels = go_family(96)
    write_run(Workspace.open(tmp_path / "data"), "toy-counter-go", rows,
              [go_features(labels, layer) for layer in (0, 1)], (10, 10))
    got = python(str(script), str(tmp_path / "data"), timeout=180)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "trained 2 centroid probes" in got.stdout
    rows = open_workspace(tmp_path / "data").rows(
        "SELECT layer, score, control_score, artifact FROM probes WHERE kind = 'centroid' ORDER BY layer")
    assert [r[0] for r in rows] == [0, 1]
    # the regime is in the pooled tokens at both layers, and not in shuffled labels
    assert all(r[1] > r[2] + 0.2 and r[3].endswith(".safetensors") for r in rows), rows
