"""What travels between the client and the workers of a cluster run (plain, picklable values)."""

from __future__ import annotations

from dataclasses import dataclass

from extract.cluster.facts import WorkerFacts
from extract.manifest import Manifest
from extract.models import CaptureKey
from extract.run import LensTensors
from extract.samples import Sample
from store import ArraySpec, RunInfo
from store.records import ArrayInfo
from store.writer.outbox import Written
from store.writer.site import ArraySite


@dataclass(frozen=True)
class RunRequest:
    """Asks a worker what a run stores: its model loaded, the taps resolved, the shapes read off one forward."""

    manifest: Manifest
    samples: list[Sample]
    codec: str
    cwd: str  # the client's working directory: the manifest's relative paths are relative to it


@dataclass(frozen=True)
class RunPlan:
    """A worker's answer to :class:`RunRequest`."""

    request: dict[str, list[str]]  # hook point -> token kinds
    specs: dict[CaptureKey, ArraySpec]
    chosen: tuple[str, str]  # the capture path and why
    routed: RunInfo  # the run's provenance, recording the capture path
    unrouted: RunInfo  # ... without it (a run stored before capture paths were recorded)
    dtype: str
    lens: LensTensors | None
    worker: str


@dataclass(frozen=True)
class GroupTask:
    """One chunk's rows of one run for a worker to compute and write."""

    manifest: Manifest
    samples: list[Sample]  # the rows' samples, in row order
    start: int  # the first row
    request: dict[str, list[str]]
    specs: dict[CaptureKey, ArraySpec]  # with their stored dtypes
    arrays: dict[CaptureKey, ArrayInfo]  # as the client declared them
    info: RunInfo
    site: ArraySite
    capture_via: str  # "forward" or "generate"
    facts: WorkerFacts  # what the worker must compute on (every worker of the run alike)
    cwd: str  # the client's working directory: the manifest's relative paths are relative to it

    @property
    def rows(self) -> range:
        return range(self.start, self.start + len(self.samples))

    @property
    def stimuli(self) -> dict[int, str]:
        """Array row -> stimulus key of the task's rows."""
        return {self.start + i: s.key for i, s in enumerate(self.samples)}


@dataclass(frozen=True)
class GroupDone:
    """A worker's answer to :class:`GroupTask`: what to commit, and who computed it how fast."""

    run: str
    rows: range
    written: Written
    worker: str
    seconds: float
    scored: int
    correct: int
