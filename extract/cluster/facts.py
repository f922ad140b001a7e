"""What a worker computes on, and the check that every worker of a run computes alike.

A chunk may be computed twice (its first worker died after writing it), and a resumed run mixes
chunks of two sessions: both are sound only if every worker gives the same bytes for the same
batch. The store's rule for resumes (same batch size, same dtype, same device kind) therefore
holds across the workers of a run too: the client refuses, before any work, workers that differ
in device kind, GPU model or torch build, or that cannot run the manifest's device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extract.manifest import Manifest, ManifestError


@dataclass(frozen=True)
class WorkerFacts:
    """The hardware and software a worker computes with."""

    device: str  # the device kind the manifest's ``model.device`` resolves to on this worker: cpu, cuda, mps
    gpu: str | None  # the CUDA device's name, None on the CPU
    torch: str
    bf16: bool  # whether the device computes in bfloat16 (CPUs do; CUDA from compute capability 8.0)
    # Whether this worker sees a CUDA device at all: for the manifest's device, not what the worker
    # computes on (a CPU run is the same on machines with and without a GPU).
    cuda: bool = field(compare=False)

    def describe(self) -> str:
        return f"{self.device}{f' ({self.gpu})' if self.gpu else ''}, torch {self.torch}"


def worker_facts(device: str) -> WorkerFacts:
    """This process's facts for a manifest whose ``model.device`` is ``device``."""
    import torch

    cuda = torch.cuda.is_available()
    kind = device.split(":", 1)[0]
    if kind == "auto":
        kind = "cuda" if cuda else "cpu"
    gpu = torch.cuda.get_device_name(torch.device(device if device.startswith("cuda") else "cuda")) \
        if kind == "cuda" and cuda else None
    bf16 = kind != "cuda" or (cuda and torch.cuda.is_bf16_supported())
    return WorkerFacts(kind, gpu, torch.__version__, bf16, cuda)


def check_workers(facts: dict[str, WorkerFacts], manifest: Manifest, path: str) -> WorkerFacts:
    """The one set of facts every worker shares; a clear refusal naming the workers that differ
    from each other or cannot run ``manifest`` (read from ``path``)."""
    if not facts:
        raise ManifestError("the cluster has no worker with a GPU resource: start workers with"
                            " `dask worker ADDRESS --resources GPU=1 --nthreads 1` (one per GPU)")
    m = manifest.model
    wanted = m.device.split(":", 1)[0]
    if wanted == "cuda":
        blind = sorted(w for w, f in facts.items() if not f.cuda)
        if blind:
            raise ManifestError(f"{path}: model.device is {m.device!r} but worker(s) {', '.join(blind)} see no CUDA device:"
                                " start them on GPU machines (CUDA_VISIBLE_DEVICES set), or set model.device: cpu")
    if m.dtype == "bfloat16":
        slow = sorted(f"{w} ({f.gpu})" for w, f in facts.items() if not f.bf16)
        if slow:
            raise ManifestError(f"{path}: model.dtype is bfloat16 but worker(s) {', '.join(slow)} do not compute in"
                                " bfloat16: use GPUs of compute capability 8.0 or later, or set model.dtype: float16")
    kinds: dict[WorkerFacts, list[str]] = {}
    for worker, f in sorted(facts.items()):
        kinds.setdefault(f, []).append(worker)
    if len(kinds) > 1:
        listed = "; ".join(f"{f.describe()}: {', '.join(ws)}" for f, ws in kinds.items())
        raise ManifestError(f"{path}: the workers compute on different hardware or software ({listed}). A chunk may be"
                            " computed on any worker, so its values would depend on which one ran it: give the run"
                            " workers of one kind (start the others without --resources GPU=1, or on another scheduler)")
    return next(iter(kinds))
