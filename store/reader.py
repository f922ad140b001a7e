"""Reading rows of one array: eager numpy, lazy dask, ragged; only the chunks the rows live in.

Uncompressed dense chunks are plain C-order little-endian bytes (one file per sample chunk), so
the selected samples are read straight into the result, one read() per run of consecutive rows
(memory-mapped only when part of each row is asked for); in an object store, only the selected
rows' byte ranges are fetched.
Compressed chunks go through zarr-python, one orthogonal selection, which decodes only the
chunks that hold selected rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import zarr

from store import arrays as layout
from store.dtypes import decode_stored, numpy_dtype
from store.errors import StoreError, WorkspaceError
from store.location import ArrayRoot
from store.records import ArrayInfo, Ragged

Index = tuple[Any, ...]


def group_by_chunk(rows: np.ndarray, chunk_samples: int) -> Iterator[tuple[int, np.ndarray, int, int]]:
    """(chunk, local rows, out start, out stop) for ascending ``rows``."""
    if len(rows) == 0:
        return
    ks = rows // chunk_samples
    cuts = np.flatnonzero(np.diff(ks)) + 1
    bounds = np.concatenate([[0], cuts, [len(rows)]])
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        k = int(ks[a])
        yield k, rows[a:b] - k * chunk_samples, int(a), int(b)


def _item_shape_after(info: ArrayInfo, index: Index | None) -> tuple[int, ...]:
    if index is None:
        return info.item_shape
    probe = np.lib.stride_tricks.as_strided(
        np.zeros(1, dtype=np.uint8), shape=(1, *info.item_shape), strides=(0,) * (1 + len(info.item_shape))
    )
    return probe[(slice(None), *index)].shape[1:]


def _require_array(root: ArrayRoot, info: ArrayInfo) -> None:
    zarr_path = layout.check_zarr_path(info.zarr_path)
    if not root.has(zarr_path):
        raise WorkspaceError(
            f"array {info.key()} is listed in the manifest but missing on disk (expected {root.where(zarr_path, 'zarr.json')})."
            f" Run `python -m store verify --data {root.local.parent}`; re-extract the run (drop-run {info.run})"
            " to restore it"
        )


def _open_array(root: ArrayRoot, info: ArrayInfo) -> zarr.Array:
    _require_array(root, info)
    return root.open(info.zarr_path)


def read_dense(root: ArrayRoot, info: ArrayInfo, rows: np.ndarray, index: Index | None, bf16_as: str) -> np.ndarray:
    stored = numpy_dtype(info.stored_dtype)
    if info.codec != "none":
        z = _open_array(root, info)
        # np.asarray: zarr types its reads as a scalar-or-array union; these are always arrays
        values = np.asarray(z.get_orthogonal_selection((rows, *[slice(None)] * len(info.item_shape))))
        if index is not None:
            values = values[(slice(None), *index)]
        return decode_stored(np.ascontiguousarray(values), info.stored_dtype, bf16_as)
    if root.remote:  # every selected row's bytes in one batch of concurrent ranged GETs
        values = _fetch_rows(root, info, rows, np.dtype(stored).newbyteorder("<"))
        if index is not None:
            values = np.ascontiguousarray(values[(slice(None), *index)])
        return decode_stored(values, info.stored_dtype, bf16_as)
    out = np.empty((len(rows), *_item_shape_after(info, index)), dtype=stored)
    for k, local, a, b in group_by_chunk(rows, info.chunk_samples):
        read_chunk_rows(root, info, k, local, index, raw=True, out=out[a:b])
    return decode_stored(out, info.stored_dtype, bf16_as)


def read_chunk_rows(
    root: ArrayRoot,
    info: ArrayInfo,
    k: int,
    local: np.ndarray,
    index: Index | None,
    *,
    raw: bool = False,
    bf16_as: str = "float32",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Rows ``local`` (0-based inside chunk ``k``) of a dense array; also the dask task."""
    if info.codec != "none":
        z = _open_array(root, info)
        values = np.asarray(z.get_orthogonal_selection((local + k * info.chunk_samples, *[slice(None)] * len(info.item_shape))))
        if index is not None:
            values = values[(slice(None), *index)]
        if out is not None:
            out[...] = values
            return out
        return values if raw else decode_stored(values, info.stored_dtype, bf16_as)
    stored = np.dtype(numpy_dtype(info.stored_dtype)).newbyteorder("<")
    shape = (info.chunk_samples, *info.item_shape)
    if root.remote:
        values = _fetch_rows(root, info, local + k * info.chunk_samples, stored)
        if index is not None:
            values = values[(slice(None), *index)]
        if out is not None:
            out[...] = values
            values = out
        return values if raw else decode_stored(values, info.stored_dtype, bf16_as)
    path = layout.dense_chunk_file(root.local.parent, info.zarr_path, len(info.shape), k)
    expected = int(np.prod(shape)) * stored.itemsize
    _check_chunk_size(root, info, k, root.size(info.zarr_path, path.name), expected)
    if index is None:
        target = out if out is not None else np.empty((len(local), *info.item_shape), dtype=stored)
        _read_runs(path, local, target, expected // info.chunk_samples, info, k)
        return target if raw else decode_stored(target, info.stored_dtype, bf16_as)
    mm = np.memmap(path, dtype=stored, mode="r", shape=shape)
    values = mm[(local, *index)] if _index_is_basic(index) else mm[local][(slice(None), *index)]
    if out is not None:
        out[...] = values
        values = out
    else:
        values = np.array(values)
    del mm
    return values if raw else decode_stored(values, info.stored_dtype, bf16_as)


def _read_runs(path: Any, local: np.ndarray, target: np.ndarray, row_bytes: int, info: ArrayInfo, k: int) -> None:
    """Rows ``local`` of one chunk file straight into ``target``: one read per run of consecutive
    rows, no memory map. A mapped page costs a fault on first touch and then the copy out of it; a
    read() copies from the page cache into the buffer in one pass (``numpy.fromfile`` speed)."""
    if not target.flags.c_contiguous:
        whole = np.empty(target.shape, target.dtype)
        _read_runs(path, local, whole, row_bytes, info, k)
        target[...] = whole
        return
    buf = target.reshape(-1).view(np.uint8).data
    cuts = np.flatnonzero(np.diff(local) != 1) + 1
    with open(path, "rb", buffering=0) as f:
        for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(local)]]), strict=True):
            dst = buf[int(a) * row_bytes:int(b) * row_bytes]
            f.seek(int(local[a]) * row_bytes)
            while len(dst):
                got = f.readinto(dst)
                if not got:
                    raise WorkspaceError(f"chunk file {path} of {info.key()} ended early while its rows were read"
                                         f" (chunk {k}): it changed or is damaged; run `python -m store verify`")
                dst = dst[got:]


def _check_chunk_size(root: ArrayRoot, info: ArrayInfo, k: int, size: int | None, expected: int) -> None:
    name = layout.chunk_file_key(len(info.shape), k)
    data = root.local.parent
    if size is None:
        _require_array(root, info)
        raise WorkspaceError(
            f"chunk {k} of {info.key()} is committed in the manifest but its file {root.where(info.zarr_path, name)}"
            f" is missing: run `python -m store verify --data {data}` and re-extract the run"
        )
    if size != expected:
        raise WorkspaceError(
            f"chunk file {root.where(info.zarr_path, name)} of {info.key()} has {size} bytes, expected {expected}"
            f" ({info.chunk_samples} samples x {info.item_shape} {info.stored_dtype}): it is damaged;"
            f" run `python -m store verify --data {data}`"
        )


def _fetch_rows(root: ArrayRoot, info: ArrayInfo, rows: np.ndarray, stored: np.dtype) -> np.ndarray:
    """Rows (ascending) of an uncompressed remote array: one ranged GET per run of consecutive rows
    inside a chunk, all issued at once."""
    row_bytes = int(np.prod(info.item_shape)) * stored.itemsize
    out = np.empty((len(rows), *info.item_shape), dtype=stored)
    if not len(rows):
        return out
    ks = rows // info.chunk_samples
    cuts = np.flatnonzero((np.diff(rows) != 1) | (np.diff(ks) != 0)) + 1
    starts, stops = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(rows)]])
    ndim = len(info.shape)
    ranges = [(layout.chunk_file_key(ndim, int(ks[a])), int(rows[a] - ks[a] * info.chunk_samples) * row_bytes,
               int(rows[b - 1] - ks[a] * info.chunk_samples + 1) * row_bytes) for a, b in zip(starts, stops, strict=False)]
    expected = info.chunk_samples * row_bytes
    try:
        pieces = root.read_ranges(info.zarr_path, ranges)
    except FileNotFoundError:
        for k in sorted(set(ks.tolist())):  # name the missing chunk
            _check_chunk_size(root, info, k, root.size(info.zarr_path, layout.chunk_file_key(ndim, k)), expected)
        raise
    for a, b, (name, lo, hi), piece in zip(starts, stops, ranges, pieces, strict=False):
        if len(piece) != hi - lo:
            k = int(ks[a])
            _check_chunk_size(root, info, k, root.size(info.zarr_path, name), expected)
            raise WorkspaceError(f"chunk {k} of {info.key()}: a ranged read returned {len(piece)} of {hi - lo} bytes")
        out[a:b] = np.frombuffer(piece, dtype=stored).reshape((b - a, *info.item_shape))
    return out


def _index_is_basic(index: Index) -> bool:
    # Mixing one fancy index (the rows) with slices/ints keeps numpy's result layout predictable.
    return all(isinstance(i, (slice, int, np.integer)) for i in index)


def read_lazy(root: ArrayRoot, info: ArrayInfo, rows: np.ndarray, index: Index | None, bf16_as: str) -> Any:
    import dask
    import dask.array as da

    _require_array(root, info)
    item = _item_shape_after(info, index)
    out_dtype = np.float32 if info.stored_dtype == "bfloat16" and bf16_as != "bits" else numpy_dtype(info.stored_dtype)
    blocks = []
    for k, local, _, _ in group_by_chunk(rows, info.chunk_samples):
        task = dask.delayed(read_chunk_rows, pure=True)(root, info, k, local, index, bf16_as=bf16_as)
        blocks.append(da.from_delayed(task, shape=(len(local), *item), dtype=out_dtype))
    if not blocks:
        return da.zeros((0, *item), dtype=out_dtype)
    return da.concatenate(blocks, axis=0)


def read_ragged(root: ArrayRoot, info: ArrayInfo, rows: np.ndarray, bf16_as: str) -> Ragged:
    _require_array(root, info)
    pieces: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for k, local, _, _ in group_by_chunk(rows, info.chunk_samples):
        block = f"{info.zarr_path}/{layout.block_name(k)}"
        try:
            offsets = root.open(f"{block}/offsets")[...]
            rows_z = root.open(f"{block}/rows")
        except (FileNotFoundError, KeyError, ValueError) as err:
            raise WorkspaceError(
                f"block {k} of ragged array {info.key()} is committed but unreadable at {root.where(block)} ({err}):"
                f" run `python -m store verify --data {root.local.parent}`"
            ) from err
        lo, hi = int(offsets[local[0]]), int(offsets[local[-1] + 1])
        span = rows_z[lo:hi] if hi > lo else np.empty((0, *info.item_shape), dtype=rows_z.dtype)
        for r in local:
            a, b = int(offsets[r]) - lo, int(offsets[r + 1]) - lo
            pieces.append(span[a:b])
        lengths.append(np.diff(offsets)[local])
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    values = (
        np.concatenate(pieces, axis=0)
        if pieces
        else np.empty((0, *info.item_shape), dtype=numpy_dtype(info.stored_dtype))
    )
    offsets_out = np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64)
    return Ragged(decode_stored(values, info.stored_dtype, bf16_as), offsets_out)


def as_rows(rows: Any, n_samples: int) -> np.ndarray:
    """Normalise a row selection to sorted unique int64 within [0, n_samples)."""
    if isinstance(rows, slice):
        rows = range(*rows.indices(n_samples))
    arr = np.asarray(getattr(rows, "rows", rows), dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= n_samples):
        raise StoreError(f"rows must lie in [0, {n_samples}), got min {arr.min()} max {arr.max()}")
    uniq = np.unique(arr)
    if len(uniq) != len(arr) or (len(arr) > 1 and np.any(np.diff(arr) < 0)):
        raise StoreError("rows must be ascending and unique (as ws.select returns them); sort them first")
    return arr
