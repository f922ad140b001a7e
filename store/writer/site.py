"""Where a run's arrays live, as a worker of a cluster run needs to know it (extract/cluster/)."""

from __future__ import annotations

from collections.abc import Mapping
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
    def of(cls, ws: Workspace, run: str) -> ArraySite:
        """The site of run ``run``'s arrays in ``ws`` (declare them first: their metadata is read here)."""
        if not ws.root.remote:
            return cls(str(ws.path))
        base = ws.zarr_path
        files = [base / "zarr.json", *sorted((base / run).rglob("zarr.json"))]
        return cls(str(ws.path), ws.root.url, {str(f.relative_to(base)): f.read_bytes() for f in files})
