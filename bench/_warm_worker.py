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
from collections.abc import Callable
from functools import partial
from pathlib import Path


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    torch.set_num_threads(int(spec.get("threads", 2)))
    import extract.models
    import extract.run
    from bench._extract_worker import bare_batches
    from bench._paired import in_turn
    from extract.manifest import parse_manifest
    from extract.models import load_model

    manifests = {label: parse_manifest(m) for label, m in spec["manifests"].items()}
    model = next(iter(manifests.values())).model
    lm = load_model(model.path, dtype=model.dtype, device=model.device)
    extract.run.load_model = extract.models.load_model = lambda *args, **kwargs: lm
    root = Path(spec["root"])

    def sides(label: str, ws: Path) -> dict[str, Callable[[], object]]:
        """The two sides of ``label``, bare first; agnosia's runs into ``ws`` (made and removed untimed)."""
        return {"bare": partial(bare_batches, lm, manifests[label], spec["bare"][label]),
                "agnosia": partial(extract.run.run_extraction, manifests[label], workspace=ws, progress=False)}

    rounds: dict[str, list[tuple[float, float]]] = {label: [] for label in manifests}
    for r in range(-1, int(spec["rounds"])):  # round -1 warms up: the first kernels, the allocator's pools, the page cache
        for label in manifests:
            ws = Path(tempfile.mkdtemp(dir=root, prefix="ws-"))
            took = in_turn(sides(label, ws), flip=r % 2 == 1)
            shutil.rmtree(ws, ignore_errors=True)
            if r >= 0:
                rounds[label].append((took["agnosia"], took["bare"]))
    print(json.dumps({"rounds": rounds}))


if __name__ == "__main__":
    main()
