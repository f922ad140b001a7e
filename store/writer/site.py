"""Where a run's arrays live, as a worker of a cluster run needs to know it (extract/cluster/)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from store.workspace import Workspace


@dataclass(frozen=True)
class ArraySite:
    """Where a run's arrays live, as a worker needs to know it: the workspace folder (on a shared
    file system, the same path on every machine), or an object store's URL with the run's node
    metadata (``zarr.json`` files by path under the arrays root), which a worker stages locally."""

    workspace: str
    url: str | None = None
    metadata: Mapping[str, bytes] | None = None

    @classmethod
    def of(cls, ws: Workspace, zarr_paths: Iterable[str]) -> ArraySite:
        """The site of the declared arrays at ``zarr_paths`` in ``ws``: for an object store, the
        ``zarr.json`` of each array's node and of every group above it (not of the blocks a ragged
        array has written so far: a worker makes its own)."""
        if not ws.root.remote:
            return cls(str(ws.path))
        nodes = {""}
        for path in zarr_paths:
            parts = path.split("/")
            nodes.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
        base = ws.zarr_path
        files = [base / node / "zarr.json" for node in sorted(nodes)]
        return cls(str(ws.path), ws.root.url, {str(f.relative_to(base)): f.read_bytes() for f in files})
