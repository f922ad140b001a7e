"""What a writer hands its caller: array handles and the run's statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from store import arrays as layout
from store.records import ArrayInfo


@dataclass(eq=False)
class ArrayHandle:
    """A declared array of the writer's run; pass it to :meth:`Writer.write`."""

    info: ArrayInfo
    codec: layout.Codec
    node: Any  # zarr.Array (dense) or zarr.Group (ragged)
    committed: set[int] = field(default_factory=set)
    writer_id: int = 0  # which writer's run manifest declared it: a handle is refused by any other

    @property
    def ragged(self) -> bool:
        return self.info.layout == "ragged"


@dataclass
class WriterStats:
    """Counters of one writer; each part of the writer adds to its own fields."""

    chunks_written: int = 0
    chunks_skipped: int = 0
    bytes_written: int = 0
    commits: int = 0
    commit_s: float = 0.0
    commit_cpu_s: float = 0.0              # CPU of the committing thread in those commits
    producer_wait_s: float = 0.0
    partial_chunks_dropped: int = 0
    upload_s: float = 0.0                  # time spent uploading to a remote array root
