"""The errors the store raises. Every message says what was expected, what was found, and the fix."""

from __future__ import annotations

import errno


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


class DiskFullError(StoreError):
    """A write failed because the disk (or a quota, or the process's file-size limit) is full.

    Nothing committed is lost: chunks are recorded only once durable, so freeing space and
    re-running the same command resumes the run.
    """


# ENOSPC (no space left), EFBIG (file too large: RLIMIT_FSIZE or the file system's limit),
# EDQUOT (quota). DuckDB reports the same conditions as text inside its IOException.
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_DISK_FULL_TEXTS = ("No space left on device", "File too large", "Disk quota exceeded")


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (an OSError, or a DuckDB error carrying the OS message) means a full disk."""
    if isinstance(err, DiskFullError):
        return True
    if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
        return True
    text = str(err)
    return any(t in text for t in _DISK_FULL_TEXTS)


def disk_full_error(where: object, err: BaseException) -> DiskFullError:
    """The error a user reads when a write hit a full disk: the file, the cause, the fix."""
    if isinstance(err, DiskFullError):
        return err
    detail = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return DiskFullError(
        f"disk full / file too large while writing {where} ({detail}): free space on that file system (or raise"
        " the file-size limit, `ulimit -f`), then re-run the same command to resume. Chunks committed so far are"
        " durable and kept; `python -m store verify` checks them"
    )
