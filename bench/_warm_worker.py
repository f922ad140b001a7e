"""Part 1's comparisons with the weights loaded once, for one model, alone in a fresh process.

    python -m bench._warm_worker '{"manifests": {"LABEL": {...}}, "bare": {"LABEL": "forward"}, "rounds": 3,
                                   "root": "/tmp/x"}'

Part 1 starts a fresh process for every run and times the weights load; on a GPU machine a process
start (the CUDA context, the first kernels) takes tens of seconds, so its rounds do not fit a short
lease. Here the model is loaded once, each configuration runs once on each side to warm up, then in
every round each configuration's two sides run back to back, their order alternating between rounds.
``run_extraction`` is handed the loaded model (``extract.run.load_model`` returns it), so both sides
time the same thing: collecting the samples, the batches, and on agnosia's side the capture and the
store. The manifests share one model.

On the CPU each side's run is split in two: the model's forward calls (hooks included; ``generate``
calls it once per step) and the rest. The forward's share shows what the capture and the writer
thread beside it cost the model; the rest, what the run adds around it (set-up, store calls,
scoring). On another device a forward call returns before its kernels finish, so no split.

Prints one JSON line: per label, each round's (agnosia, bare) seconds, and on the CPU each round's
(agnosia, bare) seconds in the model's forward.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(int(spec.get("threads", 2)))
    import extract.models
    import extract.run
    from bench._extract_worker import bare_batches, time_calls
    from bench._paired import in_turn
    from extract.manifest import parse_manifest
    from extract.models import load_model

    manifests = {label: parse_manifest(m) for label, m in spec["manifests"].items()}
    model = next(iter(manifests.values())).model
    lm = load_model(model.path, dtype=model.dtype, device=model.device)
    extract.run.load_model = extract.models.load_model = lambda *args, **kwargs: lm
    root = Path(spec["root"])
    steps: dict[str, list[float]] = {}
    if model.device == "cpu":
        time_calls(lm.model, "forward", "forward", steps)

    def in_forward() -> float:
        return steps.get("forward", [0.0])[0]

    def sides(label: str, ws: Path) -> dict[str, Callable[[], object]]:
        """The two sides of ``label``, bare first; agnosia's runs into ``ws`` (made and removed untimed)."""
        return {"bare": partial(bare_batches, lm, manifests[label], spec["bare"][label]),
                "agnosia": partial(extract.run.run_extraction, manifests[label], workspace=ws, progress=False)}

    def counted(fn: Callable[[], object], into: dict[str, float], side: str) -> Callable[[], object]:
        def run() -> object:
            before = in_forward()
            try:
                return fn()
            finally:
                into[side] = in_forward() - before
        return run

    rounds: dict[str, list[tuple[float, float]]] = {label: [] for label in manifests}
    forward: dict[str, list[tuple[float, float]]] = {label: [] for label in manifests}
    for r in range(-1, int(spec["rounds"])):  # round -1 warms up: the first kernels, the allocator's pools, the page cache
        for label in manifests:
            ws = Path(tempfile.mkdtemp(dir=root, prefix="ws-"))
            fwd: dict[str, float] = {}
            took = in_turn({side: counted(fn, fwd, side) for side, fn in sides(label, ws).items()}, flip=r % 2 == 1)
            shutil.rmtree(ws, ignore_errors=True)
            if r >= 0:
                rounds[label].append((took["agnosia"], took["bare"]))
                forward[label].append((fwd["agnosia"], fwd["bare"]))
    print(json.dumps({"rounds": rounds, "forward": forward if model.device == "cpu" else None}))


if __name__ == "__main__":
    main()
