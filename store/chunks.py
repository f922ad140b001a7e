"""The chunk pipeline's pieces: what a chunk is while it is filled, and the byte-level work on it.

A dense chunk of an uncompressed array is a :class:`Stream` (each batch ``pwrite`` straight to its
byte range of a temporary file, sealed when every row has arrived); any other chunk is an
:class:`Assembly` (a block filled in memory, written whole). Either becomes a
:class:`ChunkRecord` that the committer fsyncs and records. CRC-32C, NaN/inf counts and the
seal run on the writer's I/O lanes, off the writer thread (a small stream's counts on the
writer thread: :mod:`store.writer.pipeline`).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from store.checksum import crc32c
from store.dtypes import count_nonfinite

if TYPE_CHECKING:
    from store.writer.handles import ArrayHandle

FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)

@dataclass
class ChunkRecord:
    handle: ArrayHandle
    chunk: int
    row_start: int
    row_stop: int
    n_rows: int
    nbytes: int
    # Resolves to (crc32c, n_nonfinite, n_clipped, offsets crc32c or None) once the files are in
    # place, computed off the writer thread.
    written: Future[tuple[int, int, int, int | None]]
    # fsynced at commit time, all at once: an fsync per chunk while other chunks are being
    # written stalls those writes several-fold on ext4, a batch of fsyncs does not.
    files: list[Path]
    dirs: list[Path]


@dataclass(frozen=True)
class WrittenChunk:
    """A chunk a worker wrote and made durable where the arrays live, for its client to commit:
    the ``chunks`` row it becomes, its checksums included (plain values, so it travels between processes)."""

    zarr_path: str
    chunk: int
    row_start: int
    row_stop: int
    n_rows: int
    nbytes: int
    crc32c: int
    n_nonfinite: int
    n_clipped: int
    offsets_crc32c: int | None


@dataclass
class Assembly:
    """A block of one array being filled by possibly many producer batches."""

    rows: range
    kind: str
    dense: np.ndarray | None
    ragged: list[np.ndarray | None] | None
    filled: np.ndarray

    def complete(self) -> bool:
        return bool(self.filled.all())


@dataclass
class Stream:
    """An uncompressed dense chunk written in place: each batch goes straight to its byte range
    of a temporary file, so no assembly copy is made and memory stays flat however many arrays
    a run has. Sealed (fsync, rename into place, fsync folder) when every row has arrived."""

    rows: range
    kind: str
    tmp: Path
    final: Path
    fd: int
    filled: np.ndarray
    crc: int = 0
    crc_rows: int = 0
    in_order: bool = True
    n_nonfinite: int = 0
    n_clipped: int = 0
    # Whether this stream's checksums and NaN/inf counts run on the writer thread: decided by its
    # first batch and kept, so they see its rows in order. Set by the pipeline.
    inline: bool | None = None


class Budget:
    """Bytes queued but not yet taken over by the writer thread."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.cv = threading.Condition()

    def take(self, n: int, abort: threading.Event) -> float:
        start = time.perf_counter()
        with self.cv:
            # A batch larger than the whole budget still goes through once the queue is empty.
            while self.used > 0 and self.used + n > self.limit and not abort.is_set():
                self.cv.wait(0.1)
            self.used += n
        return time.perf_counter() - start

    def give(self, n: int) -> None:
        with self.cv:
            self.used -= n
            self.cv.notify_all()

def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def crc_of_file(path: Path, nbytes: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        while nbytes > 0:
            block = f.read(min(nbytes, 16 << 20))
            if not block:
                break
            crc = crc32c(block, crc)
            nbytes -= len(block)
    return crc


def stream_stats(st: Stream, values: np.ndarray | None, stored: np.ndarray | None) -> None:
    if values is not None:
        st.n_nonfinite += count_nonfinite(values, st.kind)
    if stored is not None:
        st.crc = crc32c(stored, st.crc)


def seal(st: Stream, nbytes: int) -> tuple[int, int, int, int | None]:
    """Close the finished temporary file and rename it into place; returns its CRC-32C.

    Renaming before fsync is safe here: a chunk counts only once the commit has fsynced it, and
    a crash before that leaves an uncommitted file that the resumed run overwrites.
    """
    try:
        if not st.in_order:
            st.crc = crc_of_file(st.tmp, nbytes)
        if FADV_DONTNEED is not None:
            # Start writeback now (Linux: DONTNEED on dirty pages queues them and keeps them
            # cached), so the commit's fsync finds little left to do: the disk works while
            # the next chunks are being written instead of after.
            os.posix_fadvise(st.fd, 0, 0, FADV_DONTNEED)
    finally:
        os.close(st.fd)
    os.replace(st.tmp, st.final)
    return st.crc, st.n_nonfinite, st.n_clipped, None


def crc_block(values: np.ndarray, n_nonfinite: int, n_clipped: int,
         offsets: np.ndarray | None) -> tuple[int, int, int, int | None]:
    return crc32c(values), n_nonfinite, n_clipped, None if offsets is None else crc32c(offsets.astype(np.int64))


def bytes_view(values: np.ndarray) -> memoryview:
    return np.ascontiguousarray(values).reshape(-1).view(np.uint8).data

