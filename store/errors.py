"""The errors the store raises. Every message says what was expected, what was found, and the fix."""

from __future__ import annotations


class StoreError(Exception):
    """Base class: anything the store refuses or cannot do."""


class WorkspaceError(StoreError):
    """The workspace folder, its manifest or its Zarr group is missing, unreadable or inconsistent."""


class SchemaVersionError(WorkspaceError):
    """The manifest was written by a newer agnosia, or needs a migration a read-only open cannot do."""


class ManifestBusyError(StoreError):
    """Another process held the DuckDB file longer than the retry budget."""


class WriterLockError(StoreError):
    """Another live process is writing to this workspace."""


class WriterError(StoreError):
    """The background writer failed; the original exception is chained as ``__cause__``."""


class DtypeOverflowError(StoreError):
    """Values that are finite in the source dtype would become inf in the stored dtype."""


class NotCommittedError(StoreError):
    """A read asked for rows whose chunks are not committed yet."""


class SpecMismatchError(StoreError):
    """A run, array or stimulus is already registered with different content."""
