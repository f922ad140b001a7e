"""Probe weights on disk: safetensors with a JSON header, never pickle.

``<workspace>/probes/<key>.safetensors`` holds a probe's tensors (numpy arrays) and, in the
safetensors metadata under ``agnosia_probe``, its kind, parameters and whatever the kind needs
to rebuild itself (classes, grid, ...). Writes go to a temporary file that is renamed into
place, so a process killed mid-write leaves no half file under the final name. Workers never
write them: a worker serialises the probe (:func:`dumps`) and its bytes travel back with the
result, so only the farm's client touches the workspace folder (workers need only the arrays).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as save_bytes

from store.lock import pid_alive

META_KEY = "agnosia_probe"
FOLDER = "probes"


_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def artifact_path(workspace: str | os.PathLike[str], key: str) -> Path:
    """``<workspace>/probes/<key>.safetensors``; a key that would leave that folder is refused."""
    return Path(workspace) / artifact_name(key)


def artifact_name(key: str) -> str:
    """``probes/<key>.safetensors``, the probes table's ``artifact`` (relative to the workspace);
    a key that would leave that folder is refused."""
    if not isinstance(key, str) or not _KEY.match(key):
        from probes.errors import ProbeError

        raise ProbeError(
            f"probe key {key!r} is not a probe key (letters, digits, '_', '.', '-'; the farm writes 16 hex digits,"
            " see params->>'key' of the probes table): refusing a path outside the workspace's probes/ folder"
        )
    return f"{FOLDER}/{key}.safetensors"


PENDING = ".pending"


def pending_path(workspace: str | os.PathLike[str], key: str) -> Path:
    """Where the farm's client puts a probe's weights until its row is committed:
    ``probes/.<key>.<pid>.pending`` (hidden, and named by the client that wrote it)."""
    final = artifact_path(workspace, key)
    return final.with_name(f".{key}.{os.getpid()}{PENDING}")


def write_pending(workspace: str | os.PathLike[str], blobs: dict[str, bytes]) -> dict[str, str]:
    """Each probe's weights (key -> safetensors bytes) put whole at its :func:`pending_path`;
    returns key -> that path. The same files as :func:`write` per key, in plain ``os`` calls and
    one folder check: the farm's client writes a file per probe, so pathlib's per-call parsing
    would be a visible share of its time."""
    folder = os.path.join(os.fspath(workspace), FOLDER)
    os.makedirs(folder, exist_ok=True)
    pid = os.getpid()
    out = {}
    for key, blob in blobs.items():
        artifact_name(key)   # refuses a key that would leave the folder
        pending = os.path.join(folder, f".{key}.{pid}{PENDING}")
        tmp = f"{pending}.{pid}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, pending)
        out[key] = pending
    return out


def publish(pending: str | os.PathLike[str]) -> str:
    """Rename a pending weight file to its final name (after its row is committed)."""
    folder, name = os.path.split(os.fspath(pending))
    final = os.path.join(folder, f"{name[1:].split('.')[0]}.safetensors")
    os.replace(pending, final)
    return final


def recover(workspace: str | os.PathLike[str], recorded: set[str]) -> tuple[int, int]:
    """Finish what a dead farm client left: its pending files whose row was committed are
    published, the others (no row: the client died before its next flush) deleted. Files of a
    live client (its pid still runs on this host) are left alone. Returns (published, deleted)."""
    folder = Path(workspace) / FOLDER
    published = deleted = 0
    if not folder.is_dir():
        return 0, 0
    for path in folder.glob(f".*{PENDING}"):
        parts = path.name[1:].split(".")
        if len(parts) != 3 or not parts[1].isdigit() or _alive(int(parts[1])):
            continue
        if parts[0] in recorded:
            publish(path)
            published += 1
        else:
            path.unlink(missing_ok=True)
            deleted += 1
    return published, deleted


def _alive(pid: int) -> bool:
    return pid == os.getpid() or pid_alive(pid)


def dumps(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> bytes:
    """The safetensors file of a probe, as bytes."""
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if not arrays:
        arrays = {"_empty": np.zeros(0, dtype=np.float32)}  # safetensors needs one tensor
    return save_bytes(arrays, metadata={META_KEY: json.dumps(meta, sort_keys=True, default=_plain)})


def write(path: str | os.PathLike[str], blob: bytes) -> Path:
    """Put a serialised probe at ``path`` whole (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return path


def save(path: str | os.PathLike[str], tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    return write(path, dumps(tensors, meta))


def load(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no probe artifact at {path}: the probes table's artifact column is relative to the workspace")
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "_empty"}
    return tensors, meta


def _plain(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in probe metadata")
