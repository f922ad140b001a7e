"""A new manifest built ahead of time, on a thread, while the caller does other work.

Creating a manifest costs ~0.1 s of DuckDB schema steps. An extraction into a new workspace may
not create anything there before its manifest is validated against the loaded model (a bad
manifest leaves no workspace behind), but it may build the file elsewhere meanwhile: it builds
one while the model loads, and ``Workspace.open(path, ahead=...)`` copies it into place when the
workspace is new (and leaves it unused otherwise).

    with ManifestAhead() as ahead:
        model = load_model(...)            # the schema steps run beside this
        ws = Workspace.open(path, ahead=ahead)
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from types import TracebackType

from store.workspace import build_manifest


class ManifestAhead:
    """A fresh manifest (the latest schema) built in a private temporary folder."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="agnosia-manifest-"))
        self._path = self._dir / "manifest.duckdb"
        self._failed = False
        self._thread = threading.Thread(target=self._build, name="agnosia-manifest-ahead", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            build_manifest(self._path)
        except Exception:  # e.g. a full temporary disk: Workspace.open builds its own, and meets the error there
            self._failed = True

    def take(self) -> Path | None:
        """The built file once it is ready; None if building it failed."""
        self._thread.join()
        return None if self._failed or not self._path.is_file() else self._path

    def close(self) -> None:
        self._thread.join()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ManifestAhead:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
