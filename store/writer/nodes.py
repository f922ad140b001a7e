"""The Zarr nodes of a run's arrays: made, made durable (and uploaded), or reopened.

A new array's node and its group's ``sample`` coordinate are durable before the manifest row
that points at them commits (:meth:`store.writer.run_manifest.RunManifest.arrays`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import zarr

from store import arrays as layout
from store.errors import StoreError
from store.records import ArrayInfo, RunInfo
from store.writer.context import RunContext, disk_full_names


def reopen_node(ctx: RunContext, root: Any, info: ArrayInfo, committed: set[int]) -> Any:
    """The Zarr node of an array the manifest knows; None (to be made again) if it is missing
    on disk and none of its chunks is committed."""
    try:
        node = root[info.zarr_path]
        # As when it was made: zarr would skip (and delete) an all-zero chunk, which then has no file.
        return node.with_config(layout.WRITE_EMPTY) if isinstance(node, zarr.Array) else node
    except KeyError:
        if committed:
            raise StoreError(
                f"array {info.zarr_path} has {len(committed)} committed chunks in the manifest but is missing"
                f" on disk: the workspace lost data; run `python -m store verify --data {ctx.ws.path}` and"
                f" re-extract (drop-run {ctx.run})"
            ) from None
        return None


def create_nodes(ctx: RunContext, root: Any, todo: list[tuple[ArrayInfo, layout.Codec]],
                 stimuli: list[str]) -> tuple[dict[str, Any], dict[str, list[Path]]]:
    """The new arrays' Zarr nodes, in one call, and the ``sample`` coordinate (``stimuli``) of each
    dense array's group that has none yet (node path: its files); not yet durable: see :func:`sync_new_nodes`."""
    metas = {info.zarr_path: node_metadata(ctx.info, info, codec) for info, codec in todo}
    groups = dict.fromkeys(info.zarr_path.rsplit("/", 1)[0] for info, _ in todo if info.layout == "dense")
    with disk_full_names(ctx.ws.zarr_path / todo[0][0].zarr_path):
        nodes = layout.create_nodes(root, metas, layout.WRITE_EMPTY)
        coords = {f"{group}/{layout.COORD}": layout.ensure_sample_coord(root, group, stimuli)
                  for group in groups}
    return nodes, {path: files for path, files in coords.items() if files}


def sync_new_nodes(ctx: RunContext, zarr_paths: list[str], coords: dict[str, list[Path]]) -> None:
    """Sync new nodes and the coordinates made with them, all at once on the fsync pool (each
    shared parent once), and, for a remote root, upload them."""
    ws = ctx.ws
    with disk_full_names(ws.zarr_path / zarr_paths[0]):
        layout.fsync_node_chains(ws.path, [*zarr_paths, *coords], ctx.syncers,
                                 [f for files in coords.values() for f in files])
    for path in zarr_paths:
        ctx.upload(partial(ws.root.upload_meta, path))
    if ws.root.remote:
        for files in coords.values():
            ctx.upload(partial(ws.root.upload, files))
            files[-1].unlink()  # its ids, staged like a chunk: once uploaded, only metadata stays local


def node_metadata(run: RunInfo, info: ArrayInfo, codec: layout.Codec) -> layout.NodeMetadata:
    """The ``zarr.json`` document of a new array of ``run``: a dense array, or a ragged array's group."""
    attrs: dict[str, Any] = {
        "run": info.run, "tap": info.tap, "layer": info.layer, "site": info.site, "tokens": info.tokens,
        "module": info.module, "layout": info.layout, "source_dtype": info.dtype,
        "stored_dtype": info.stored_dtype, "bf16_policy": run.bf16, "overflow_policy": run.overflow,
        "codec": info.codec, "lossy": not codec.lossless, "chunk_samples": info.chunk_samples,
        "agnosia_layout": layout.LAYOUT_VERSION,
    }
    if info.stored_dtype == "bfloat16":
        attrs["note"] = "raw bfloat16 bits stored as uint16: float32 = (bits.astype(uint32) << 16).view(float32)"
    if not codec.lossless:
        attrs["keepbits"] = codec.keepbits
    if info.layout == "dense":
        return layout.dense_metadata(info.n_samples, info.item_shape, info.chunk_samples, info.stored_dtype,
                                     codec, info.dims[1:], attrs)
    attrs["row_shape"] = list(info.item_shape)
    attrs["blocks"] = "b<k>/rows [n_rows, ...] and b<k>/offsets [n+1] per chunk of chunk_samples samples"
    return layout.ragged_metadata(attrs)
