"""One measured side of ``python -m bench extract``, alone in a fresh process.

    python -m bench._extract_worker '{"side": "agnosia", "manifest": {...}, "workspace": "/tmp/ws"}'

``side``: ``agnosia`` (``run_extraction`` of the manifest into ``workspace``), ``generate`` (a bare
batched greedy ``generate`` of the manifest's model over the same samples, batches and new tokens:
no hooks, no store) or ``forward`` (a bare batched forward whose one new token is the argmax of
the last logits, as ``generate`` with one new token picks it). Both bare sides load the model and
build batches with agnosia's own loader and ``prepare_batch``, so the sides differ only in the
capture and the store. Imports happen before the clock starts; loading the weights is timed.

Prints one JSON line: seconds, CPU seconds of every thread of the process, samples, peak RSS
(MiB), minor page faults while the clock ran, ``duckdb.connect`` calls made while it ran
(every call: the store's, DuckDB's own, anyone's; each builds a DuckDB instance) and the store's
manifest attaches (its read-write connections, store/db.py). With ``"steps": true`` also seconds and calls
per step of the run (a timer around each; ``python -m bench extract --part steps`` prints them).
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import threading
import time
from functools import wraps
from typing import Any

import duckdb

_CONNECTS = [0]


def counting(real: Any, box: list[int]) -> Any:
    """``real``, adding one to ``box[0]`` at each call (put in place of ``duckdb.connect``, which the
    store looks up at each call)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        box[0] += 1
        return real(*args, **kwargs)

    return call


def _bare(spec: dict[str, Any], side: str) -> int:
    from extract.manifest import parse_manifest
    from extract.models import load_model

    manifest = parse_manifest(spec["manifest"])
    m = manifest.model
    return bare_batches(load_model(m.path, dtype=m.dtype, device=m.device), manifest, side)


def bare_batches(lm: Any, manifest: Any, side: str) -> int:
    """The bare side of a comparison: the manifest's samples in its batches through ``lm``, with no
    hooks and no store; ``side`` ``generate`` (its new tokens) or ``forward`` (one new token)."""
    import torch

    from bench._paired import bare_forward
    from extract.models import prepare_batch
    from extract.run import collect_samples

    _, samples = collect_samples(manifest)
    bs = manifest.batch_size
    new = int(manifest.generation.max_new_tokens)  # the bench's manifests give a number
    for i in range(0, len(samples), bs):
        chunk = samples[i : i + bs]
        batch = prepare_batch(lm, [s.image for s in chunk], [s.prompt for s in chunk],
                              strings=[s.strings for s in chunk], padding_side="left")
        if side == "generate":
            with torch.inference_mode():
                lm.model.generate(**batch.inputs, do_sample=False, max_new_tokens=new).cpu()
        else:
            bare_forward(lm, batch.inputs)
    return len(samples)


def _agnosia(spec: dict[str, Any]) -> int:
    from extract.manifest import parse_manifest
    from extract.run import run_extraction

    summary = run_extraction(parse_manifest(spec["manifest"]), workspace=spec["workspace"], progress=False)
    return summary.samples


# What ``"steps": true`` times: the run's steps (extract/run.py), the writer's, and the model's forward.
_RUN_STEPS = ("collect_samples", "load_model", "image_sizes", "check_image_sizes", "array_specs", "write_lens",
              "prepare_batch", "capture_first_token", "capture_generate", "score_answer", "token_spans")
_WRITER_STEPS = ("__init__", "register_stimulus_set", "set_samples", "arrays", "write_batch", "finish", "__exit__")


def time_calls(owner: Any, name: str, label: str, steps: dict[str, list[float]]) -> None:
    """Put a timer around ``owner.name``: each call adds its seconds and one call to ``steps[label]``."""
    fn = getattr(owner, name)

    @wraps(fn)  # the signature stays fn's: generate checks its inputs against the forward's
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            got = steps.setdefault(label, [0.0, 0])
            got[0] += time.perf_counter() - started
            got[1] += 1

    setattr(owner, name, timed)


def _time_steps(steps: dict[str, list[float]]) -> None:
    """Wrap every step of a run (either side) in a timer: seconds and calls per step."""
    import extract.models as models
    import extract.run as run
    from store import Workspace, Writer

    for name in _RUN_STEPS:
        for owner in (run, models):
            if hasattr(owner, name):
                time_calls(owner, name, name, steps)
    for name in _WRITER_STEPS:
        time_calls(Writer, name, f"Writer.{name}", steps)
    time_calls(Workspace, "open", "Workspace.open", steps)
    loaded = models.load_model

    def load(*args: Any, **kwargs: Any) -> Any:
        lm = loaded(*args, **kwargs)
        time_calls(lm.model, "forward", "model forward (hooks included)", steps)
        return lm

    run.load_model = models.load_model = load


class _ThreadCPU:
    """CPU seconds per thread while the clock runs (Linux /proc; polled, so a thread's last
    0.05 s may be missed): the main thread, torch's workers (unnamed native threads), the writer."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self._seen: dict[str, tuple[str, float]] = {}
        self._base = {t: c for t, (_, c) in self._poll().items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-watch", daemon=True)
        self._thread.start()

    def _poll(self) -> dict[str, tuple[str, float]]:
        names = {str(t.native_id): t.name for t in threading.enumerate()}
        names[str(os.getpid())] = "main"
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = re.sub(r"^(agnosia-[a-z]+)\d*-.*$|_\d+$", r"\1", names.get(tid, "torch/native"))
            out[tid] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return out

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            self._seen.update(self._poll())

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._seen.update(self._poll())
        for tid, (name, cpu) in self._seen.items():
            if name != "bench-watch":
                self.cpu[name] = self.cpu.get(name, 0.0) + cpu - self._base.get(tid, 0.0)
        return self.cpu


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch
    import transformers  # noqa: F401 - imported before the clock, like everything below

    torch.set_num_threads(int(spec.get("threads", 2)))
    import extract.run  # noqa: F401
    from extract.models.adapters import registry

    registry()
    import store.db

    duckdb.connect = counting(duckdb.connect, _CONNECTS)
    attached = store.db.OPENS.attaches
    steps: dict[str, list[float]] = {}
    if spec.get("steps"):
        _time_steps(steps)
    threads = _ThreadCPU() if spec.get("steps") else None
    started, cpu = time.perf_counter(), time.process_time()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    side = spec["side"]
    samples = _agnosia(spec) if side == "agnosia" else _bare(spec, side)
    seconds = time.perf_counter() - started
    if threads is not None:
        steps.update({f"CPU of thread {name}": [seconds_, 1] for name, seconds_ in threads.stop().items()})
    print(json.dumps({"seconds": seconds, "cpu_seconds": time.process_time() - cpu, "samples": samples,
                      "connects": _CONNECTS[0], "attaches": store.db.OPENS.attaches - attached, "steps": steps,
                      "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
