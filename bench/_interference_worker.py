"""What the writer thread's storing of a batch costs the main thread beside it, alone in a fresh process.

    python -m bench._interference_worker '{"model": {"path": "/tmp/m"}, "set": "/tmp/g2m", "batch": 1, "samples": 96,
                                           "taps": [...]}'

Every batch's captures are computed first (``extract.run.run_batch``, prompt-only). Then, for
each batch, the step that follows a hand-over in a run (``prepare_group`` of the next batch; and,
in a second pass with a writer of its own, the bare forward) is timed twice: once with the writer
idle, once right after ``write`` handed it that batch's captures (cast, write and checksum of each
array, and a commit when a chunk completes), the order of the two alternating from batch to batch.
A batch's figure is the difference; the first 4 batches (fewer in a short run) warm up.

A commit (when a chunk completes) lands in a few pairs only, so the medians leave it out: the
writer's commits are counted apart, with their wall and CPU seconds on the writer thread.

Prints one JSON line: per step, the median time with the writer idle, the median paired
difference, and the writer's commits (count, wall and CPU seconds in all), in seconds.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import torch


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(int(spec.get("threads", 2)))
    import extract.run as run
    from bench._paired import bare_forward
    from extract.generation import eos_ids
    from extract.manifest import parse_manifest
    from extract.models import load_model
    from store import Workspace

    bs = int(spec["batch"])
    manifest = parse_manifest({"run": "interference", "model": spec["model"],
                               "stimuli": [{"set": spec["set"], "limit": int(spec["samples"])}], "taps": spec["taps"],
                               "generation": {"max_new_tokens": 1}, "batch_size": bs, "chunk_samples": 64,
                               "logit_lens": False})
    sets, samples = run.collect_samples(manifest)
    lm = load_model(manifest.model.path, dtype=manifest.model.dtype, device=manifest.model.device)
    points = run.resolve_points(lm, run.tap_request(lm, manifest), ())
    stop = eos_ids(lm.model)
    groups = [samples[i : i + bs] for i in range(0, len(samples), bs)]
    done = [run.run_batch(lm, g, points, manifest, stop, "forward", start=i * bs) for i, g in enumerate(groups)]
    specs = run.specs_of(done[0].res, points, True, str(lm.dtype).removeprefix("torch."), "none")
    assert specs is not None
    batches = [run.prepare_group(lm, g) for g in groups]

    def forward(j: int) -> None:
        bare_forward(lm, batches[j].inputs)

    def prepare(j: int) -> None:
        run.prepare_group(lm, groups[j])

    def measure(step: Callable[[int], None]) -> dict[str, float]:
        folder = tempfile.mkdtemp(prefix="agnosia-interference-")
        try:
            return measure_in(step, Workspace.open(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def measure_in(step: Callable[[int], None], ws: Workspace) -> dict[str, float]:
        idle, extra = [], []
        with ws.writer(run.run_info(lm, manifest, None, ("forward", "bench"))) as w:
            for path, dataset in sets:
                w.register_stimulus_set(path, dataset=dataset)
            w.set_samples([s.key for s in samples])
            handles = dict(zip(specs, w.arrays(list(specs.values())), strict=True))
            before = (w.stats.commits, w.stats.commit_s, w.stats.commit_cpu_s)

            def quiet(j: int) -> float:
                while w.pending():  # the writer's last hand-over taken up, then a moment for its tail
                    time.sleep(0.001)
                time.sleep(0.003)
                started = time.perf_counter()
                step(j)
                return time.perf_counter() - started

            def busy(j: int) -> float:
                done[j].write(w, handles, specs)
                started = time.perf_counter()
                step(j)
                return time.perf_counter() - started

            warm = min(4, len(groups) // 2)
            for j in range(len(groups)):
                took: dict[str, float] = {}
                for name, fn in (("quiet", quiet), ("busy", busy)) if j % 2 == 0 else (("busy", busy), ("quiet", quiet)):
                    took[name] = fn(j)
                if j >= warm:
                    idle.append(took["quiet"])
                    extra.append(took["busy"] - took["quiet"])
            w.finish()
            commits, wall, cpu = (now - then for now, then in zip(
                (w.stats.commits, w.stats.commit_s, w.stats.commit_cpu_s), before, strict=True))
        return {"idle_s": median(idle), "extra_s": median(extra), "pairs": len(extra), "batches": len(groups),
                "commits": commits, "commit_wall_s": wall, "commit_cpu_s": cpu}

    out: dict[str, Any] = {"prepare": measure(prepare), "forward": measure(forward)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
