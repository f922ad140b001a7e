"""probes/ imports store only: never transformers, never the extraction stage."""

from __future__ import annotations

import pytest
from probetest_lib import python

CHECK = """
import sys
import probes, probes.farm, probes.cli, probes.plan, probes.logreg, probes.targets
from probes.kinds import conv_spatial, detect, hidden_number, linear, pooled
from probes.trainers import in_memory, iterative, streamed
bad = sorted(m for m in sys.modules if m == 'transformers' or m.startswith(('transformers.', 'extract', 'lab.', 'queries')))
assert not bad, bad
assert 'store' in sys.modules
print('ok')
"""


@pytest.mark.slow
def test_importing_probes_loads_no_model_code():
    got = python("-c", CHECK)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr
