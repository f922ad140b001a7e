"""The background writer of a run: the producer hands over batches, a thread makes them durable chunks.

:class:`Writer` (:mod:`store.writer.writer`) is made of parts that each own their state; see
that module for the run's life and the guarantees, and docs/design.md for how the parts meet.
"""

from store.writer.handles import ArrayHandle, WriterStats
from store.writer.run_manifest import library_versions
from store.writer.writer import Writer

__all__ = ["ArrayHandle", "Writer", "WriterStats", "library_versions"]
