"""What lands on disk is the Zarr v3 that zarr-python itself writes.

agnosia makes its nodes without zarr's store calls (store/arrays.py ``create_nodes``: zarr's own
metadata classes, files written directly), so a run is written through the writer and compared,
file by file, with a reference tree made by zarr-python's ``create_array`` / ``create_group``
calls with the same arguments (the calls the store made before): each ``zarr.json`` parsed, each
chunk byte for byte, the same set of files. Then zarr and xarray read the values back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from storetest_lib import DIM, TOKENS, dense_values, ragged_values, stimulus_rows

from store import ArraySpec, RunInfo, Workspace
from store import arrays as layout
from store.dtypes import numpy_dtype

_KEYS = {"name": "default", "separator": "."}
N, CHUNK = 10, 4  # three chunks, the last one partial


def _tree(folder: Path) -> dict[str, Any]:
    """Every file under ``folder``: a ``zarr.json`` parsed, anything else as bytes."""
    return {
        p.relative_to(folder).as_posix(): json.loads(p.read_bytes()) if p.name == "zarr.json" else p.read_bytes()
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _write(ws: Workspace) -> list[str]:
    """A run with a dense array of each codec and stored dtype, a ragged array and a run tensor."""
    with ws.writer(RunInfo(run="r", model="tiny-test", dtype="float32", chunk_samples=CHUNK)) as w:
        keys = w.register_stimuli(stimulus_rows(N), dataset="set")
        w.set_samples(keys)
        specs = [
            ArraySpec(tap="llm", layer=0, tokens="image", shape=(TOKENS, DIM), codec="none", stored_dtype="float32"),
            ArraySpec(tap="llm", layer=0, tokens="last", shape=(1, DIM), codec="zstd", stored_dtype="float16"),
            ArraySpec(tap="llm", layer=1, tokens="image", shape=(TOKENS, DIM), dtype="bfloat16", codec="bitround4",
                      stored_dtype="bfloat16"),
            ArraySpec(tap="llm", layer=0, tokens="answer", shape=(DIM,), ragged=True, codec="zstd"),
        ]
        img, last, img1, ans = w.arrays(specs)
        vals = dense_values(range(N))
        bits = (vals.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 handed over as its raw bits
        w.write_batch(0, {img: vals, last: vals[:, :1], img1: bits, ans: [ragged_values(i) for i in range(N)]})
        w.write_tensor("lm_head", np.linspace(-1, 1, 1000 * 64, dtype=np.float32).reshape(1000, 64))
        w.finish()
    return keys


def _reference(ws: Workspace, ref: Path, keys: list[str]) -> None:
    """The same run's tree as zarr-python's own calls make it, from the values the store holds.
    Attributes are taken from the store's nodes: the writer builds them, however the node is made."""
    ours = zarr.open_group(str(ws.zarr_path), mode="r", zarr_format=3)
    root = zarr.open_group(str(ref), mode="a", zarr_format=3)
    root.attrs.update(dict(ours.attrs))
    for path, layout_, shape, chunk, stored, codec, dims in ws.rows(
        "SELECT zarr_path, layout, shape, chunk_samples, stored_dtype, codec, dims FROM activations ORDER BY zarr_path"
    ):
        node: Any = ours[path]
        attrs = dict(node.attrs)
        compressors = layout.parse_codec(codec, stored).compressors()
        if layout_ == "dense":
            arr = root.create_array(
                path, shape=tuple(shape), chunks=(min(chunk, max(shape[0], 1)), *shape[1:]),
                dtype=numpy_dtype(stored), compressors=compressors, filters=None, fill_value=0,
                chunk_key_encoding=_KEYS, dimension_names=list(dims), attributes=attrs,
                config={"write_empty_chunks": True}, overwrite=True,
            )
            arr[...] = node[...]
            group = root[path.rsplit("/", 1)[0]]
            if layout.COORD not in group:
                coord = group.create_array(
                    layout.COORD, shape=(len(keys),), chunks=(len(keys),), dtype=str, compressors=None,
                    filters=None, chunk_key_encoding=_KEYS, dimension_names=[layout.COORD],
                    attributes=dict(ours[f"{group.path}/{layout.COORD}"].attrs),
                )
                coord[...] = np.asarray(keys, dtype=object)
            continue
        ragged = root.create_group(path, attributes=attrs)
        for name in sorted(node.group_keys()):
            block = ragged.create_group(name)
            rows, offsets = node[f"{name}/rows"][...], node[f"{name}/offsets"][...]
            r = block.create_array(
                "rows", shape=rows.shape, chunks=(max(rows.shape[0], 1), *rows.shape[1:]), dtype=rows.dtype,
                compressors=compressors, filters=None, fill_value=0, chunk_key_encoding=_KEYS,
                dimension_names=list(dims[1:]), config={"write_empty_chunks": True},
            )
            o = block.create_array(
                "offsets", shape=offsets.shape, chunks=offsets.shape, dtype=np.int64, compressors=None,
                filters=None, fill_value=0, chunk_key_encoding=_KEYS, dimension_names=["sample_plus_one"],
                config={"write_empty_chunks": True},
            )
            if rows.shape[0]:
                r[...] = rows
            o[...] = offsets
    for path, stored in ws.rows("SELECT zarr_path, stored_dtype FROM tensors"):
        node = ours[path]
        vals = node[...]
        per_row = max(1, vals[:1].nbytes)
        t = root.create_array(
            path, shape=vals.shape, chunks=(max(1, min(vals.shape[0], (16 << 20) // per_row)), *vals.shape[1:]),
            dtype=numpy_dtype(stored), compressors=None, filters=None, fill_value=0, chunk_key_encoding=_KEYS,
            overwrite=True, attributes=dict(node.attrs), config={"write_empty_chunks": True},
        )
        t[...] = vals


def test_a_run_on_disk_is_what_zarr_python_writes(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    keys = _write(ws)
    ref = tmp_path / "ref"
    _reference(ws, ref, keys)
    ours, theirs = _tree(ws.zarr_path), _tree(ref)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name
    # The documents hold what a reader relies on (not only "the same as zarr, whatever that is").
    doc = ours["r/llm/0/resid_post/last/zarr.json"]
    assert doc["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "."}}
    assert doc["chunk_grid"]["configuration"]["chunk_shape"] == [CHUNK, 1, DIM]
    assert doc["dimension_names"] == ["sample", "last_token", "dim"] and doc["fill_value"] == 0.0
    assert [c["name"] for c in doc["codecs"]] == ["bytes", "blosc"]
    assert ours["r/llm/0/resid_post/zarr.json"] == {"attributes": {}, "zarr_format": 3, "node_type": "group"}
    assert "r/llm/0/resid_post/image/c.2.0.0" in ours and not any(n.endswith(".partial") for n in ours)


def test_plain_zarr_and_xarray_read_the_values(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    keys = _write(ws)
    site = ws.zarr_path / "r" / "llm" / "0" / "resid_post"
    vals = dense_values(range(N))
    np.testing.assert_array_equal(zarr.open_array(str(site / "image"), mode="r")[...], vals)
    np.testing.assert_array_equal(zarr.open_array(str(site / "last"), mode="r")[...], vals[:, :1].astype(np.float16))
    assert zarr.open_array(str(site / layout.COORD), mode="r")[...].tolist() == keys
    block = zarr.open_group(str(site / "answer" / "b0"), mode="r")
    np.testing.assert_array_equal(block["rows"][...], np.concatenate([ragged_values(i) for i in range(CHUNK)]))
    np.testing.assert_array_equal(block["offsets"][...], np.cumsum([0] + [i % 4 for i in range(CHUNK)]))
    np.testing.assert_array_equal(zarr.open_array(str(ws.zarr_path / "r" / "_tensors" / "lm_head"), mode="r")[...],
                                  ws.read_tensor("r", "lm_head"))
    xr = pytest.importorskip("xarray", reason="xarray is in the dev extras: make setup")
    ds = xr.open_zarr(site, consolidated=False)
    assert ds["sample"].values.tolist() == keys
    np.testing.assert_array_equal(ds["image"].values, vals)


def test_creating_a_node_again_replaces_it_and_keeps_its_parents(tmp_path):
    """A resume re-makes a node none of whose chunks is committed: the old node's files go, the
    groups above it (and their attributes) stay, and the new node writes its chunks unprompted by
    emptiness (write_empty_chunks, a runtime setting zarr keeps out of zarr.json)."""
    root = zarr.open_group(str(tmp_path / "arrays"), mode="a", zarr_format=3)
    root.attrs["kept"] = 1
    path = "r/llm/0/resid_post/image"
    meta = layout.dense_metadata(8, (3,), 4, "float32", layout.Codec("none"), ("dim",), {"a": 1})
    first = layout.create_array(root, path, meta)
    first[...] = np.ones((8, 3), np.float32)
    assert (tmp_path / "arrays" / "r/llm/0/resid_post/image/c.1.0").is_file()
    again = layout.create_array(root, path, meta)
    assert sorted(p.name for p in (tmp_path / "arrays" / "r/llm/0/resid_post/image").iterdir()) == ["zarr.json"]
    assert again.config.write_empty_chunks and zarr.open_group(str(tmp_path / "arrays"), mode="r").attrs["kept"] == 1
    again[:4] = 0
    assert (tmp_path / "arrays" / "r/llm/0/resid_post/image/c.0.0").is_file()


def test_a_resumed_array_writes_an_all_zero_chunk(tmp_path):
    """A resume reopens its arrays from disk: a compressed dense array (written through zarr, not
    streamed) must still write an all-zero chunk's file, as when it was made (before: zarr's
    default write_empty_chunks=False skipped it and the writer failed on the missing file)."""
    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r", model="tiny-test", dtype="float32", chunk_samples=CHUNK)
    spec = ArraySpec(tap="llm", layer=0, tokens="last", shape=(DIM,), codec="zstd", stored_dtype="float32")
    with ws.writer(info) as w:
        keys = w.register_stimuli(stimulus_rows(2 * CHUNK), dataset="set")
        w.set_samples(keys)
        w.write_batch(0, {w.array(spec): np.ones((CHUNK, DIM), np.float32)})
        w.finish(partial_ok=True)
    with ws.writer(info) as w:
        w.set_samples(keys)
        w.write_batch(CHUNK, {w.array(spec): np.zeros((CHUNK, DIM), np.float32)})
        w.finish()
    assert (ws.zarr_path / "r/llm/0/resid_post/last/c.1.0").is_file()
    np.testing.assert_array_equal(ws.read("r", "llm", 0, tokens="last"),
                                  np.concatenate([np.ones((CHUNK, DIM)), np.zeros((CHUNK, DIM))]))


def test_the_root_group_is_written_once_and_the_first_one_stays(tmp_path):
    """Two processes creating one workspace at once (shard processes started together) each write
    the root group: the second finds the first's and keeps it, where zarr's open_group raised
    ContainsGroupError (seen: a shard process of tests/extract/test_shards.py exited 1)."""
    layout.create_root(tmp_path, {"agnosia_layout": layout.LAYOUT_VERSION, "who": "first"})
    layout.create_root(tmp_path, {"agnosia_layout": layout.LAYOUT_VERSION, "who": "second"})
    assert dict(zarr.open_group(str(tmp_path / "arrays"), mode="r").attrs) == {
        "agnosia_layout": layout.LAYOUT_VERSION, "who": "first"}
    assert sorted(p.name for p in (tmp_path / "arrays").iterdir()) == ["zarr.json"]  # no temporary left


def test_a_workspace_whose_root_a_peer_made_meanwhile_opens(tmp_path, monkeypatch):
    """Injects: a peer process's root group written between this process's check for one and its
    own creation. Asserts: the open succeeds, and the root is the peer's."""
    real = layout.create_root

    def peer_first(workspace, attributes):
        real(workspace, {**attributes, "peer": True})
        real(workspace, attributes)

    monkeypatch.setattr(layout, "create_root", peer_first)
    ws = Workspace.open(tmp_path / "ws")
    assert zarr.open_group(str(ws.zarr_path), mode="r").attrs["peer"] is True
