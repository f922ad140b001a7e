"""The state of each part of the writer, one dataclass per part.

Each part of :class:`store.writer.Writer` keeps its own state and no other part reads or sets it:
the others ask the owner through its methods. What two parts do share is passed to both when
the writer is made: :class:`Handover` (the producer's queue to the writer thread and the byte
budget that bounds it) and :class:`store.writer.context.Failure` (the first error, and the
event that stops a producer waiting on the budget).
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from store.chunks import Assembly, Budget, ChunkRecord, Stream
from store.writer.handles import ArrayHandle


@dataclass
class ManifestState:
    """The run manifest part's (:mod:`store.writer.run_manifest`): what it knows of the run's rows."""

    # Whether this writer inserted the run's row: a new run, so no other row of it can exist yet.
    created: bool
    # Whether this writer has marked the run ``running``, i.e. changed it; until then a close
    # leaves the run's row as it found it (a resume refused by its checks).
    marked: bool
    stimuli: list[str] | None  # the run's row map once known (row i of every array = stimuli[i])
    root: Any  # the local zarr.Group of the arrays (metadata, and staging for a remote root)
    handles: dict[str, ArrayHandle] = field(default_factory=dict)  # by zarr_path
    chunk_sizes: set[int] | None = None  # the chunk sizes of the run's arrays in the manifest, once asked


@dataclass
class Handover:
    """Between the producer and the writer thread: batches queued, bounded in bytes."""

    queue: queue.Queue[Any]
    budget: Budget


@dataclass
class PipelineState:
    """The writer thread's (:mod:`store.writer.pipeline`): the chunks being filled."""

    assembling: dict[tuple[int, int], Assembly] = field(default_factory=dict)  # (id(handle), chunk)
    streams: dict[tuple[int, int], Stream] = field(default_factory=dict)
    item_jobs: list[Future[Any]] = field(default_factory=list)  # the current item's jobs on the I/O lanes
    handling: tuple[Any, ...] = ("none",)  # the item being handled: what a failure names
    retry_at: float = 0.0  # a commit that failed is not tried again before this (time.monotonic)


@dataclass
class CommitState:
    """The committer's (:mod:`store.writer.committer`): what awaits the next transaction."""

    # The stimuli whose generations this writer committed, when its run was new (so no other row
    # can exist); None for a run that was there already (a resume: any row may exist).
    generated: set[str] | None
    chunks: list[ChunkRecord] = field(default_factory=list)
    tokens: list[dict[str, Any]] = field(default_factory=list)
    generations: list[dict[str, Any]] = field(default_factory=list)
    commit_failed: bool = False  # a commit failed: its COMMIT may have landed, so its rows may exist
    last_commit: float = field(default_factory=time.monotonic)


@dataclass
class Lifecycle:
    """The writer's own (:mod:`store.writer.writer`): whether it is closed and whether it finished."""

    closed: bool = False
    finished: bool = False
