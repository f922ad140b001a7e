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

Prints one JSON line: per label, each round's (agnosia, bare) seconds.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(int(spec.get("threads", 2)))
    import extract.models
    import extract.run
    from bench._extract_worker import bare_batches
    from extract.manifest import parse_manifest
    from extract.models import load_model

    manifests = {label: parse_manifest(m) for label, m in spec["manifests"].items()}
    model = next(iter(manifests.values())).model
    lm = load_model(model.path, dtype=model.dtype, device=model.device)
    extract.run.load_model = extract.models.load_model = lambda *args, **kwargs: lm
    root = Path(spec["root"])

    def agnosia(label: str) -> float:
        ws = Path(tempfile.mkdtemp(dir=root, prefix="ws-"))
        try:
            started = time.perf_counter()
            extract.run.run_extraction(manifests[label], workspace=ws, progress=False)
            return time.perf_counter() - started
        finally:
            shutil.rmtree(ws, ignore_errors=True)

    def bare(label: str) -> float:
        started = time.perf_counter()
        bare_batches(lm, manifests[label], spec["bare"][label])
        return time.perf_counter() - started

    sides = {"agnosia": agnosia, "bare": bare}
    for label in manifests:  # warm-up: the first kernels, the allocator's pools, the page cache
        agnosia(label), bare(label)
    rounds: dict[str, list[tuple[float, float]]] = {label: [] for label in manifests}
    for r in range(int(spec["rounds"])):
        for label in manifests:
            order = ("bare", "agnosia") if r % 2 == 0 else ("agnosia", "bare")
            took: dict[str, Any] = {side: sides[side](label) for side in order}
            rounds[label].append((took["agnosia"], took["bare"]))
    print(json.dumps({"rounds": rounds}))


if __name__ == "__main__":
    main()
