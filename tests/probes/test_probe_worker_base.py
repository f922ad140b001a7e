"""The workers' measured RSS at rest against the base a plan assumed (probes/trainers/base.py check_base).

Dask starts each worker by re-running the imports of the client's main script. A script that
imports torch and the farm at its top level thus puts them into every worker: ~180 MiB more
than a streamed plan's idle worker. The farm measures that once its workers are up and refuses,
before any training, a plan it no longer fits, naming the fix.
"""

from __future__ import annotations

import textwrap

import pytest
from probetest_lib import build_spatial_layers, python

from probes.errors import ProbeError
from probes.trainers.base import FIT_FRACTION, WORKER_BASE, MemoryPlan, Planned, check_base
from probes.trainers.streamed import TRAINER as STREAMED

MiB = 1 << 20
# 380 MiB: room for the plan's planned 160 MiB worker, but not for the ~320 MiB one with torch
# (which Dask's 95 % restart line, 361 MiB, still lets start, so the farm gets to measure it).
PLAN = ('{"name": "base", "derive": "never", "probes": [{"runs": ["spatial"], "layers": [1],'
        ' "targets": ["truth:flag_0"], "kinds": {"ridge": {"pool": "mean"}}}]}')
RUN = """
    rep = run_plan(parse_plan(json.loads(PLAN)), sys.argv[1], workers=1, memory_limit="380MiB", progress=False,
                   log=lambda line: print(line, flush=True))
    print("TRAINED", rep.trained, rep.worker_base >> 20)
"""


def _script(top_level: bool) -> str:
    imports = "import torch  # noqa: F401\nfrom probes import parse_plan, run_plan\n"
    body = textwrap.indent(("" if top_level else imports) + textwrap.dedent(RUN), "    ")
    return (f"import json, sys\n{imports if top_level else ''}PLAN = {PLAN!r}\n\n"
            f"def main():\n{body}\n\nif __name__ == '__main__':\n    main()\n")


@pytest.mark.slow
def test_a_script_that_imports_torch_at_its_top_is_refused_before_training(tmp_path):
    ws = build_spatial_layers(tmp_path / "ws", layers=2)
    for top_level in (True, False):
        script = tmp_path / f"farm_{top_level}.py"
        script.write_text(_script(top_level))
        out = python(str(script), str(ws.path), timeout=180)
        if top_level:   # torch in every worker: refused once the workers are up, nothing trained
            assert out.returncode != 0 and "TRAINED" not in out.stdout
            err = next((line for line in out.stderr.splitlines() if line.startswith("probes.errors.ProbeError")), "")
            assert err.startswith("probes.errors.ProbeError: the workers hold"), out.stderr[-3000:]
            assert "if __name__ ==" in err and "raise --memory-limit to at least" in err, err
            assert ws.rows("SELECT count(*) FROM probes") == [(0,)]
        else:           # the same plan with the imports inside main(): light workers, it fits
            assert out.returncode == 0, out.stderr[-2000:]
            trained, base = out.stdout.split("TRAINED ")[1].split()
            assert trained == "1" and int(base) * MiB < WORKER_BASE, out.stdout
            assert ws.rows("SELECT count(*) FROM probes") == [(1,)]

def test_check_base_lowers_the_streamed_limit_by_what_the_workers_hold_over_the_planned_base():
    plan = MemoryPlan(read_bytes=0, peak_bytes=WORKER_BASE + 40 * MiB, what="map")
    work = [Planned(_Job("g0"), STREAMED, [], plan)]  # type: ignore[arg-type]
    limit = 400 * MiB
    assert check_base(work, WORKER_BASE - 20 * MiB, limit) == limit            # lighter than planned: as planned
    assert check_base(work, WORKER_BASE + 50 * MiB, limit) == limit - 50 * MiB
    assert check_base(work, WORKER_BASE + 500 * MiB, None) is None             # no limit: nothing to check
    over = int(FIT_FRACTION * limit) - plan.peak_bytes + MiB
    with pytest.raises(ProbeError, match=r"group g0's plan assumed \(160 MiB\)"):
        check_base(work, WORKER_BASE + over, limit)


class _Job:
    def __init__(self, group: str) -> None:
        self.group = group
