"""One measured side of ``python -m bench extract``, alone in a fresh process.

    python -m bench._extract_worker '{"side": "agnosia", "manifest": {...}, "workspace": "/tmp/ws"}'

``side``: ``agnosia`` (``run_extraction`` of the manifest into ``workspace``), ``generate`` (a bare
batched greedy ``generate`` of the manifest's model over the same samples, batches and new tokens:
no hooks, no store) or ``forward`` (a bare batched forward whose one new token is the argmax of
the last logits, as ``generate`` with one new token picks it). Both bare sides load the model and
build batches with agnosia's own loader and ``prepare_batch``, so the sides differ only in the
capture and the store. Imports happen before the clock starts; loading the weights is timed.

Prints one JSON line: seconds, CPU seconds of every thread of the process, samples, peak RSS
(MiB), and ``duckdb.connect`` calls made while the clock ran (every call: the store's, DuckDB's
own, anyone's).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

import duckdb

_CONNECTS = [0]
_real_connect = duckdb.connect


def _counting_connect(*args: Any, **kwargs: Any) -> Any:
    _CONNECTS[0] += 1
    return _real_connect(*args, **kwargs)


def _bare(spec: dict[str, Any], side: str) -> int:
    import torch

    from extract.manifest import parse_manifest
    from extract.models import load_model, prepare_batch
    from extract.run import collect_samples

    manifest = parse_manifest(spec["manifest"])
    _, samples = collect_samples(manifest)
    m = manifest.model
    lm = load_model(m.path, dtype=m.dtype, device=m.device)
    bs = manifest.batch_size
    new = int(manifest.generation.max_new_tokens)  # the bench's manifests give a number
    with torch.inference_mode():
        for i in range(0, len(samples), bs):
            chunk = samples[i : i + bs]
            batch = prepare_batch(lm, [s.image for s in chunk], [s.prompt for s in chunk],
                                  strings=[s.strings for s in chunk], padding_side="left")
            if side == "generate":
                lm.model.generate(**batch.inputs, do_sample=False, max_new_tokens=new).cpu()
            else:
                out = lm.model(**batch.inputs, use_cache=False, logits_to_keep=1)
                out.logits[:, -1].float().argmax(-1).tolist()
    return len(samples)


def _agnosia(spec: dict[str, Any]) -> int:
    from extract.manifest import parse_manifest
    from extract.run import run_extraction

    summary = run_extraction(parse_manifest(spec["manifest"]), workspace=spec["workspace"], progress=False)
    return summary.samples


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch
    import transformers  # noqa: F401 - imported before the clock, like everything below

    torch.set_num_threads(int(spec.get("threads", 2)))
    import extract.run  # noqa: F401
    from extract.models.adapters import registry

    registry()
    duckdb.connect = _counting_connect  # the store looks it up at each call
    started, cpu = time.perf_counter(), time.process_time()
    side = spec["side"]
    samples = _agnosia(spec) if side == "agnosia" else _bare(spec, side)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "cpu_seconds": time.process_time() - cpu, "samples": samples,
                      "connects": _CONNECTS[0],
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
