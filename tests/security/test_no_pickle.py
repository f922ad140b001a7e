"""Rule 3: nothing from a store is unpickled.

Stores are shared (a cluster's workers, colleagues, downloads), and unpickling a file runs any
code it names. The store reads raw chunk bytes and Zarr v3 metadata (JSON), probe weights are
safetensors with a JSON header, the manifest is DuckDB. A static scan keeps pickle out of the
code that reads stores; planted pickle payloads (as a probe artifact, as a Zarr array) are
refused without running.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from probes import load_probe
from probes.artifacts import artifact_path
from probes.kinds import get_kind
from probes.kinds.base import Probe
from store import StoreError, Workspace

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("store", "probes", "queries", "extract")  # everything that reads (or resumes) a store
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


def _kw(node: ast.Call, key: str) -> object:
    for k in node.keywords:
        if k.arg == key:
            return k.value.value if isinstance(k.value, ast.Constant) else "<expr>"
    return None


def findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            out.append(f"from {node.module} import ...")
    for node, owner, name in _calls(tree):
        where = f"line {node.lineno}"
        if owner in PICKLE_MODULES and name in ("load", "loads", "Unpickler", "open"):
            out.append(f"{owner}.{name} at {where}")
        elif owner == "torch" and name == "load" and _kw(node, "weights_only") is not True:
            out.append(f"torch.load without weights_only=True at {where}")
        elif owner in ("np", "numpy") and name == "load" and _kw(node, "allow_pickle") not in (None, False):
            out.append(f"np.load(allow_pickle=...) at {where}")
        elif name in ("read_pickle", "unsafe_load", "full_load") or (owner == "yaml" and name == "load"):
            out.append(f"{owner}.{name} at {where}")
        elif isinstance(node.func, ast.Name) and name in ("eval", "exec"):
            out.append(f"{name}() at {where}")
    return out


@pytest.mark.slow
def test_code_that_reads_stores_never_unpickles():
    found = {str(p.relative_to(ROOT)): f for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))
             if (f := findings(p))}
    assert found == {}


def test_the_scan_catches_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch, numpy as np, yaml\npickle.loads(b'')\ntorch.load('w.pt')\n"
                   "np.load('x.npy', allow_pickle=True)\nyaml.load(open('m'))\neval('1')\n"
                   "torch.load('w.pt', weights_only=True)\nnp.load('x.npy')\n")
    assert len(findings(bad)) == 6


@pytest.mark.slow
def test_probe_artifacts_are_safetensors(workspace):
    probe = get_kind("linear")(random_state=0)
    probe.state_ = {"weight": np.arange(6, dtype=np.float32).reshape(2, 3)}
    path = probe.save(artifact_path(workspace, "00ff00ff00ff00ff"))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])  # safetensors: header length, JSON header, raw tensor bytes
    header = json.loads(raw[8:8 + n])
    assert header["weight"]["dtype"] == "F32" and "agnosia_probe" in header["__metadata__"]
    again = load_probe(workspace, "00ff00ff00ff00ff")
    assert isinstance(again, Probe) and np.array_equal(again.state_["weight"], probe.state_["weight"])


class _Payload:
    """Unpickling this runs os.system: what a planted pickle would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_planted_as_a_probe_artifact_is_refused_unrun(workspace, tmp_path):
    marker = tmp_path / "ran"
    path = artifact_path(workspace, "deadbeefdeadbeef")
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(Exception) as err:
        load_probe(workspace, "deadbeefdeadbeef")
    assert "safetensor" in str(err.value).lower() or "header" in str(err.value).lower()
    assert not marker.exists()


@pytest.mark.parametrize("metadata", ["v2", "v3"])
def test_a_pickle_codec_planted_in_the_zarr_store_is_refused_unrun(workspace, tmp_path, metadata):
    """Zarr v2 metadata can name numcodecs' Pickle codec; the store opens v3 metadata only, and no
    v3 codec unpickles."""
    marker = tmp_path / "ran"
    folder = workspace / "arrays" / "r1" / "_tensors" / "lm_head.weight"
    shutil.rmtree(folder)
    folder.mkdir()
    if metadata == "v2":
        (folder / ".zarray").write_text(json.dumps({
            "zarr_format": 2, "shape": [1], "chunks": [1], "dtype": "|O", "compressor": {"id": "pickle"},
            "fill_value": None, "filters": None, "order": "C", "dimension_separator": "."}))
        (folder / "0").write_bytes(pickle.dumps(_Payload(marker)))
    else:
        (folder / "zarr.json").write_text(json.dumps({
            "zarr_format": 3, "node_type": "array", "shape": [1], "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "codecs": [{"name": "numcodecs.pickle", "configuration": {}}], "fill_value": 0.0}))
        (folder / "c.0").write_bytes(pickle.dumps(_Payload(marker)))
    ws = Workspace.open(workspace, readonly=True)
    with pytest.raises((StoreError, ValueError, KeyError, TypeError)):
        ws.read_tensor("r1", "lm_head.weight")
    assert not ws.verify().ok
    assert not marker.exists()
