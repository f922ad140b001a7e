"""Where a workspace's arrays live: its own ``arrays/`` folder, or an object store behind an
fsspec URL (``s3://bucket/prefix``; any fsspec protocol with an async filesystem works).

With a remote root the local ``arrays/`` folder stays: it holds every node's ``zarr.json`` (a
copy; the remote has them too) and is the writer's staging area. A chunk is written and
checksummed locally as always, then uploaded, and only then committed in the manifest; once
committed its local file is removed. An object store shows an object only once its upload is
complete, so a kill mid-upload leaves either nothing or a whole uncommitted object, which the
resumed run overwrites: the same guarantee as the local rename.

The URL is recorded in the root group's attributes (``arrays/zarr.json``: ``agnosia_arrays_url``
and a workspace id, also written to the remote root), so every later open, reader or writer,
finds it. Credentials and endpoint never enter the workspace: they come from the usual
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, …) and from
``$AGNOSIA_STORAGE_OPTIONS``, a JSON object of fsspec storage options.

:class:`ArrayRoot` is small and picklable, so Dask tasks carry it to workers; each process builds
its filesystem client once, on first use.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from store.errors import StoreError, WorkspaceError

URL_ATTR = "agnosia_arrays_url"
ID_ATTR = "agnosia_workspace"
OPTIONS_ENV = "AGNOSIA_STORAGE_OPTIONS"
MERGE_GAP = 1 << 20  # bytes between two wanted ranges of one object below which one GET fetches both
_URL = re.compile(r"^(?P<protocol>[a-z][a-z0-9+.-]*)://(?P<path>[^?#]+)$")
# Protocols that are not object stores: a local path should be the workspace folder itself.
_LOCAL = {"file", "local"}
_FILESYSTEMS: dict[tuple[str, str], Any] = {}


def check_url(url: str) -> str:
    """``url`` without a trailing '/', or a clear error naming what is wrong with it."""
    m = _URL.match(url.strip()) if isinstance(url, str) else None
    if not m:
        raise WorkspaceError(
            f"arrays URL {url!r} is not a URL: expected protocol://bucket/prefix, e.g. s3://my-bucket/agnosia/ws1"
        )
    if m["protocol"] in _LOCAL:
        raise WorkspaceError(
            f"arrays URL {url!r} names a local path: local arrays live in the workspace folder itself;"
            " leave --arrays out, or point --data at that folder"
        )
    path = m["path"].rstrip("/")
    if not path or any(seg in ("", ".", "..") for seg in path.split("/")):
        raise WorkspaceError(f"arrays URL {url!r}: the bucket/prefix part must be non-empty, without '.', '..' or '//'")
    check_options(m["protocol"], storage_options())  # before a new workspace's manifest is written
    return f"{m['protocol']}://{path}"


# fsspec's own keyword arguments, which every filesystem takes besides its own.
_FSSPEC_OPTIONS = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "asynchronous",
                   "loop", "batch_size"}


def _known_options(protocol: str) -> set[str] | None:
    """The storage options ``protocol``'s filesystem takes, or None when we cannot tell (not installed,
    or a filesystem we do not know): then its own error stands."""
    if protocol not in ("s3", "s3a"):
        return None
    try:
        import inspect

        from aiobotocore.session import AioSession
        from s3fs import S3FileSystem
    except ImportError:
        return None
    # s3fs hands every key it does not name to aiobotocore's session, which raises a TypeError at
    # the first request: long after a new workspace's manifest was written.
    named = {*inspect.signature(S3FileSystem.__init__).parameters, *inspect.signature(AioSession.__init__).parameters}
    return (named - {"self", "kwargs"}) | _FSSPEC_OPTIONS


def check_options(protocol: str, options: dict[str, Any]) -> None:
    """Refuse, naming it, a key of ``$AGNOSIA_STORAGE_OPTIONS`` that ``protocol``'s filesystem does not take."""
    known = _known_options(protocol)
    unknown = sorted(set(options) - known) if known is not None else []
    if unknown:
        close = {k: difflib.get_close_matches(k, sorted(known or ()), n=1) for k in unknown}
        hints = ", ".join(f"{k!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for k, c in close.items())
        raise WorkspaceError(
            f"${OPTIONS_ENV} has key(s) the {protocol}:// filesystem does not take: {hints}. Remove or rename them;"
            f" it takes {', '.join(sorted(known or ()))}"
        )


def storage_options() -> dict[str, Any]:
    raw = os.environ.get(OPTIONS_ENV)
    if not raw:
        return {}
    try:
        opts = json.loads(raw)
    except json.JSONDecodeError as err:
        raise WorkspaceError(f"${OPTIONS_ENV} must be a JSON object of fsspec storage options: {err}") from None
    if not isinstance(opts, dict):
        raise WorkspaceError(f"${OPTIONS_ENV} must be a JSON object, got {type(opts).__name__}")
    return opts


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The object-store clients' own failures that are not OSErrors: botocore's (a garbled or cut
    reply, an endpoint that speaks no S3) and aiohttp's (a dropped connection)."""
    found: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError

        found.append(BotoCoreError)
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError

        found.append(ClientError)
    return tuple(found)


@contextlib.contextmanager
def _reaching(url: str | None) -> Iterator[None]:
    """Calls to the object store: its clients' non-OSError failures re-raised as ConnectionError
    (an OSError), so every caller's ``except OSError`` turns them into one line."""
    try:
        yield
    except _transport_errors() as err:
        raise ConnectionError(f"{type(err).__name__}: {err} (from {url})") from err


@dataclass(frozen=True)
class ArrayRoot:
    """The root of a workspace's Zarr group: ``local`` always, ``url`` when it lives remotely."""

    local: Path
    url: str | None = None

    @property
    def remote(self) -> bool:
        return self.url is not None

    def where(self, zarr_path: str = "", name: str = "") -> str:
        """The node (or one of its files) as a user would name it: a URL or a local path."""
        parts = [p for p in (zarr_path, name) if p]
        if self.url is None:
            return str(self.local.joinpath(*parts))
        return "/".join([self.url, *parts])

    # ------------------------------------------------------------------ the remote client

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of ``url`` (one per process and URL)."""
        assert self.url is not None, "a local ArrayRoot has no remote filesystem"
        options = storage_options()
        key = (self.url, json.dumps(options, sort_keys=True))
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = _FILESYSTEMS[key] = _filesystem(self.url, options)
        return fs

    def _key(self, *parts: str) -> str:
        assert self.url is not None
        return "/".join([self.url.split("://", 1)[1], *[p for p in parts if p]])

    # ------------------------------------------------------------------ reading

    def open(self, zarr_path: str = "", *, mode: Literal["r", "r+", "a", "w", "w-"] = "r") -> Any:
        """The Zarr node (array or group) at ``zarr_path``, read-only by default."""
        import zarr

        if self.url is None:
            return zarr.open(str(self.local / zarr_path) if zarr_path else str(self.local), mode=mode, zarr_format=3)
        from zarr.storage import FsspecStore

        # zarr drives its own event loop: it builds its own (asynchronous) client from the URL.
        store = FsspecStore.from_url(self.where(zarr_path), storage_options=_options(self.url, storage_options()),
                                     read_only=mode == "r")
        return zarr.open(store=store, mode=mode, zarr_format=3)

    def has(self, zarr_path: str, name: str = "zarr.json") -> bool:
        """Whether the node's file ``name`` exists where the arrays live."""
        if self.url is None:
            return (self.local / zarr_path / name).is_file()
        with _reaching(self.url):
            return bool(self.fs.exists(self._key(zarr_path, name)))

    def size(self, zarr_path: str, name: str) -> int | None:
        """Bytes of one of the node's files, None if it is missing."""
        if self.url is None:
            try:
                return (self.local / zarr_path / name).stat().st_size
            except FileNotFoundError:
                return None
        try:
            with _reaching(self.url):
                return int(self.fs.size(self._key(zarr_path, name)))
        except FileNotFoundError:
            return None

    def read_ranges(self, zarr_path: str, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Byte ranges ``(file name, start, stop)`` (ascending per file) of a node's remote files,
        fetched concurrently. Ranges of one file less than ``MERGE_GAP`` apart share one GET: a
        request costs more than that much transfer."""
        merged: list[list[Any]] = []  # [name, start, stop, [indices of the ranges it serves]]
        for i, (name, lo, hi) in enumerate(ranges):
            if merged and merged[-1][0] == name and 0 <= lo - merged[-1][2] < MERGE_GAP:
                merged[-1][2] = max(merged[-1][2], hi)
                merged[-1][3].append(i)
            else:
                merged.append([name, lo, hi, [i]])
        keys = [self._key(zarr_path, m[0]) for m in merged]
        with _reaching(self.url):
            got = self.fs.cat_ranges(keys, [m[1] for m in merged], [m[2] for m in merged], on_error="raise")
        out: list[bytes] = [b""] * len(ranges)
        for (_, start, _, served), piece in zip(merged, got, strict=False):
            for i in served:
                out[i] = piece[ranges[i][1] - start : ranges[i][2] - start]
        return out

    def children(self) -> list[str]:
        """Names of the root's child nodes where the arrays live (the runs)."""
        if self.url is None:
            return sorted(p.name for p in self.local.iterdir() if p.is_dir())
        self.fs.invalidate_cache()
        base = self._key()
        with _reaching(self.url):
            return sorted(p.rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False) if p.rstrip("/") != base
                          and self.fs.isdir(p))

    # ------------------------------------------------------------------ writing (remote roots)

    def upload(self, files: Iterable[Path]) -> None:
        """Copy staged local files (under ``local``) to the same keys remotely, all at once."""
        files = list(dict.fromkeys(files))
        if self.url is None or not files:
            return
        remote = [self._key(*Path(f).relative_to(self.local).parts) for f in files]
        with _reaching(self.url):
            self.fs.put([str(f) for f in files], remote)

    def upload_meta(self, zarr_path: str) -> None:
        """Upload the ``zarr.json`` of the node and of every group above it."""
        if self.url is None:
            return
        parts = zarr_path.split("/") if zarr_path else []
        metas = [self.local.joinpath(*parts[:i], "zarr.json") for i in range(len(parts), -1, -1)]
        self.upload([m for m in metas if m.is_file()])

    def remove(self, zarr_path: str) -> None:
        """Delete a node and everything under it remotely (missing is fine)."""
        if self.url is None:
            return
        key = self._key(zarr_path)
        try:
            with _reaching(self.url):
                self.fs.rm(key, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()

    def local_meta(self) -> dict[str, Any]:
        """The local root group's attributes (where the URL and the workspace id are kept)."""
        meta = self.local / "zarr.json"
        try:
            return dict(json.loads(meta.read_text()).get("attributes") or {})
        except (OSError, json.JSONDecodeError, AttributeError) as err:
            raise WorkspaceError(
                f"{meta} is unreadable ({err}): the workspace's root group metadata is damaged; restore it from a backup"
            ) from None

    def foreign(self) -> str | None:
        """None when the remote root group is this workspace's (same id as the local one); else
        what the prefix holds instead. Raises OSError when the store cannot be reached."""
        found = self.remote_meta()
        if found is None:
            return "no Zarr group"
        if found.get(ID_ATTR) != self.local_meta().get(ID_ATTR):
            return f"the arrays of workspace {found.get(ID_ATTR)}"
        return None

    def remote_meta(self) -> dict[str, Any] | None:
        """The remote root group's attributes, None if the prefix holds no Zarr group."""
        try:
            with _reaching(self.url):
                raw = self.fs.cat_file(self._key("zarr.json"))
        except FileNotFoundError:
            return None
        try:
            return dict(json.loads(raw).get("attributes") or {})
        except (json.JSONDecodeError, AttributeError):
            raise WorkspaceError(f"{self.where('', 'zarr.json')} is not Zarr v3 group metadata") from None


def _options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    check_options(url.split("://", 1)[0], options)
    if url.split("://", 1)[0] in ("s3", "s3a"):
        # Never answer "missing" from a listing made before a peer uploaded the object.
        return {"use_listings_cache": False, **options}
    return options


def _filesystem(url: str, options: dict[str, Any]) -> Any:
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        return fsspec.filesystem(protocol, **_options(url, options))
    except ImportError as err:
        package = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
        raise WorkspaceError(
            f"arrays URL {url}: the {protocol}:// filesystem needs a package that is not installed"
            f" ({err}); install it: pip install {package.get(protocol, '<the fsspec implementation>')}"
            " (for S3: pip install 'agnosia[s3]')"
        ) from None
    except ValueError as err:
        raise WorkspaceError(f"arrays URL {url}: fsspec knows no protocol {protocol!r} ({err})") from None


def describe_remote_error(url: str, err: BaseException) -> StoreError:
    """A connection or permission failure, named with the URL and what to check."""
    return WorkspaceError(
        f"cannot reach the arrays at {url}: {type(err).__name__}: {err}. Check the bucket exists and the"
        " credentials and endpoint in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL,"
        f" ${OPTIONS_ENV})"
    )
