"""The capture's own cost per batch, paired with the bare forward, alone in a fresh process.

    python -m bench._capture_worker '{"model": {"path": "/tmp/m"}, "set": "/tmp/g2m", "batch": 1, "samples": 48, "rounds": 12}'

Batches are prepared before the clock. For each batch of each round, a bare forward (the one new
token the argmax of the last logits, as ``python -m bench extract`` part 1's bare side picks it)
and ``capture_first_token`` of the bench's taps run back to back, their order alternating; a
batch's figure is the capture's time minus the forward's. Whole runs on this machine differ by
5-10 % from one run to the next, which hides a change of a few tenths of a millisecond per batch;
a difference paired batch by batch does not. No store: this is the capture, hooks included.

Prints one JSON line: the median paired difference and the median bare forward, in seconds.
"""

from __future__ import annotations

import importlib
import json
import sys
from functools import partial
from statistics import median

import torch


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(int(spec.get("threads", 2)))
    from bench._paired import bare_forward, in_turn
    from extract.manifest import parse_manifest
    from extract.models import load_model
    from extract.run import collect_samples, prepare_group, tap_request

    capture = importlib.import_module("extract.models.capture")  # the package re-exports a function of that name
    bs, n = int(spec["batch"]), int(spec["samples"])
    manifest = parse_manifest({"run": "capture", "model": spec["model"],
                               "stimuli": [{"set": spec["set"], "limit": n}], "taps": spec["taps"],
                               "generation": {"max_new_tokens": 1}, "batch_size": bs})
    _, samples = collect_samples(manifest)
    lm = load_model(manifest.model.path, dtype=manifest.model.dtype, device=manifest.model.device)
    points = capture.resolve_points(lm, tap_request(lm, manifest), ())
    batches = [prepare_group(lm, samples[i : i + bs]) for i in range(0, len(samples), bs)]

    extra, forward = [], []
    for r in range(int(spec["rounds"])):
        for j, batch in enumerate(batches):
            took = in_turn({"bare": partial(bare_forward, lm, batch.inputs),
                            "capture": partial(capture.capture_first_token, lm, batch, points,
                                               tokens=("image", "last", "answer"))}, flip=(r + j) % 2 == 1)
            if r >= 2:  # the first rounds warm the caches and torch's thread pool
                extra.append(took["capture"] - took["bare"])
                forward.append(took["bare"])
    print(json.dumps({"extra_s": median(extra), "forward_s": median(forward), "pairs": len(extra)}))


if __name__ == "__main__":
    main()
