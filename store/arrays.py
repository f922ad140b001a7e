"""Array layout on disk: Zarr paths, chunking, codecs, and durable creation.

Layout (all plain Zarr v3, readable by zarr-python and xarray without agnosia)::

    <workspace>/arrays/                         Zarr group
        <run>/<tap>/<layer>/<site>/<tokens>     one array per (run, tap, layer, site, token kind)

* dense: shape ``[samples, *per_sample]`` (``[samples, tokens, dim]``; attention rows
  ``[samples, heads, query_rows, keys]``), chunks ``(chunk_samples, *per_sample)`` so a chunk is a
  block of whole samples; each token kind is its own array, so a probe reading one kind of one
  layer reads only that kind's bytes.
* ragged: a group holding one block per sample chunk, ``b<k>/rows [n_rows, *row_shape]`` and
  ``b<k>/offsets [n_samples_in_block + 1]`` (flat rows + offsets, CSR). A block is written whole,
  so resume stays chunk-aligned even though row counts vary.

Chunk keys use the ``.`` separator (``c.<k>.0.0``), so one sample chunk is one file in the
array's folder: one file to fsync, and, for uncompressed arrays, a file the reader can memory-map.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import cache
from itertools import count
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import zarr
from zarr.codecs import BloscCodec
from zarr.core.array import default_serializer_v3
from zarr.core.array_spec import ArrayConfigLike
from zarr.core.buffer import default_buffer_prototype
from zarr.core.chunk_grids import RegularChunkGrid
from zarr.core.group import GroupMetadata
from zarr.core.metadata import ArrayV3Metadata
from zarr.dtype import parse_dtype

from store.dtypes import numpy_dtype
from store.errors import StoreError, WorkspaceError

ZARR_DIR = "arrays"
LAYOUT_VERSION = 1
_KEY_ENCODING: dict[str, Any] = {"name": "default", "separator": "."}
_MANTISSA = {"float16": 10, "float32": 23, "bfloat16": 7}
_UINT: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32}
_EXPONENT = {"float16": 0x7C00, "float32": 0x7F800000, "bfloat16": 0x7F80}


def array_path(run: str, tap: str, layer: int, site: str, tokens: str) -> str:
    return f"{run}/{tap}/{layer}/{site}/{tokens}"


# One segment of a node path: the name rule of store/records.py, plus a leading '_' (``_tensors``).
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def check_zarr_path(zarr_path: object) -> str:
    """A node path read from the manifest, refused unless it stays inside the Zarr group.

    Paths come from the manifest's ``zarr_path`` columns, and a manifest can be edited (or shared
    from elsewhere): a relative path of name-rule segments is accepted; an absolute path, an empty
    or ``.``/``..`` segment or a backslash would make the store read (or verify, or write) outside
    the workspace, so it is an error instead.
    """
    segments = zarr_path.split("/") if isinstance(zarr_path, str) else []
    if not segments or not all(_SEGMENT.match(seg) for seg in segments):
        raise WorkspaceError(
            f"the manifest names the Zarr node {zarr_path!r}, which is not a path inside the workspace's"
            f" {ZARR_DIR}/ group (expected run/tap/layer/site/tokens, names of letters, digits, '_', '.', '-'):"
            " refusing to read or write outside the workspace. The manifest was edited or corrupted: restore it"
            " or drop the run"
        )
    return str(zarr_path)  # a str: the check above refused everything else


def node_dir(workspace: Path, zarr_path: str) -> Path:
    """The folder of the node ``zarr_path`` (checked by :func:`check_zarr_path`)."""
    return workspace / ZARR_DIR / check_zarr_path(zarr_path)


@dataclass(frozen=True)
class Codec:
    """A storage codec: ``none``, ``zstd`` (lossless) or ``bitround<k>`` (lossy, then zstd).

    BitRound is applied by agnosia before the values reach Zarr (the array then holds already
    rounded values behind a plain Blosc/zstd codec), so every Zarr v3 reader can decode it.
    """

    name: str
    keepbits: int | None = None

    @property
    def lossless(self) -> bool:
        return self.keepbits is None

    def compressors(self) -> list[Any] | None:
        if self.name == "none":
            return None
        # Byte shuffle + zstd level 1: same ratio as level 3 on fp16 activations, 1.5-2x faster.
        return [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle")]

    def prepare(self, values: np.ndarray, stored: str) -> np.ndarray:
        if self.keepbits is None:
            return values
        return bitround(values, stored, self.keepbits)


def parse_codec(name: str, stored: str) -> Codec:
    if name in ("none", "zstd"):
        return Codec(name)
    m = re.fullmatch(r"bitround(\d+)", name)
    if m:
        keep = int(m.group(1))
        most = _MANTISSA[stored]
        if not 1 <= keep < most:
            raise StoreError(
                f"codec {name}: {stored} has {most} mantissa bits, so keepbits must be 1..{most - 1}, got {keep}"
                " (bitround7 keeps relative error <= 2^-8; use 'zstd' or 'none' for lossless)"
            )
        return Codec(name, keep)
    raise StoreError(f"codec must be 'none', 'zstd' or 'bitround<k>' (e.g. bitround7), got {name!r}")


def bitround(values: np.ndarray, stored: str, keepbits: int) -> np.ndarray:
    """Round to ``keepbits`` mantissa bits, nearest-even (the numcodecs BitRound algorithm).

    NaN/inf are left alone, and a value that would round up to inf is truncated instead, so
    rounding never creates a nonfinite value.
    """
    drop = _MANTISSA[stored] - keepbits
    utype = _UINT[values.dtype.itemsize]
    bits = values.view(utype)
    one = utype(1)
    half_minus_one = utype((1 << (drop - 1)) - 1)
    mask = utype(~((1 << drop) - 1) & np.iinfo(utype).max)
    out = ((bits + ((bits >> utype(drop)) & one) + half_minus_one) & mask).astype(utype)
    exp = utype(_EXPONENT[stored])
    broke = ((out & exp) == exp) | ((bits & exp) == exp)
    if broke.any():
        out[broke] = np.where((bits[broke] & exp) == exp, bits[broke], bits[broke] & mask)
    return out.view(values.dtype)


def open_root(workspace: Path, *, read_only: bool) -> zarr.Group:
    return zarr.open_group(str(workspace / ZARR_DIR), mode="r" if read_only else "a", zarr_format=3)


def create_root(workspace: Path, attributes: Mapping[str, Any]) -> None:
    """A new workspace's root group with ``attributes``, written whole and only where there is
    none: two processes creating one workspace at once (shards started together) leave one root,
    the first's, and neither fails. (zarr's ``open_group(mode="a")`` raises ContainsGroupError for
    the second, and its attributes are a second write of the file a peer may be reading.) Not
    yet durable: :func:`fsync_node_chain` makes it so."""
    folder = workspace / ZARR_DIR
    folder.mkdir(parents=True, exist_ok=True)
    _put(folder / "zarr.json", _metadata_bytes(GroupMetadata(attributes=dict(attributes))), exclusive=True)


# Write every chunk, even all-zero ones: a committed chunk always has a file, and zarr skips the
# scan it would otherwise make of every chunk for emptiness. A runtime setting, not in zarr.json.
WRITE_EMPTY: ArrayConfigLike = {"write_empty_chunks": True}

NodeMetadata = ArrayV3Metadata | GroupMetadata


def array_metadata(
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    dtype: Any,
    compressors: Sequence[Any] | None,
    dims: Sequence[str],
    attributes: dict[str, Any] | None = None,
    fill_value: Any = 0,
) -> ArrayV3Metadata:
    """The metadata ``Group.create_array`` writes for these arguments (with ``filters=None``, the
    default serializer and the ``.`` key encoding), built without touching the store: zarr's own
    classes make the document, so its bytes are zarr's. ``fill_value=None``: the dtype's default."""
    zdtype = parse_dtype(dtype, zarr_format=3)
    return ArrayV3Metadata(
        shape=shape,
        data_type=zdtype,
        chunk_grid=RegularChunkGrid(chunk_shape=chunks),
        chunk_key_encoding=_KEY_ENCODING,
        fill_value=zdtype.default_scalar() if fill_value is None else fill_value,
        codecs=(default_serializer_v3(zdtype), *(compressors or ())),
        attributes=attributes or {},
        dimension_names=tuple(dims) or None,
    )


def dense_metadata(
    n_samples: int,
    item_shape: tuple[int, ...],
    chunk_samples: int,
    stored: str,
    codec: Codec,
    dims: tuple[str, ...],
    attributes: dict[str, Any],
) -> ArrayV3Metadata:
    """A dense array's metadata: chunks of whole samples, per-sample dims after ``sample``."""
    return array_metadata(
        (n_samples, *item_shape), (min(chunk_samples, max(n_samples, 1)), *item_shape), numpy_dtype(stored),
        codec.compressors(), ("sample", *dims), attributes,
    )


def create_array(root: zarr.Group, path: str, meta: ArrayV3Metadata) -> zarr.Array:
    """One array at ``path`` (replacing any node there) that writes every chunk (``WRITE_EMPTY``)."""
    arr = create_nodes(root, {path: meta}, WRITE_EMPTY)[path]
    assert isinstance(arr, zarr.Array)
    return arr


def create_nodes(
    root: zarr.Group, nodes: Mapping[str, NodeMetadata], config: ArrayConfigLike | None = None
) -> dict[str, zarr.Array | zarr.Group]:
    """Create the nodes ``{path under root: metadata}``, in order, as ``root.create_array(path, ...,
    overwrite=True)`` / ``create_group`` would: whatever is at a path is replaced, missing parent
    groups are made empty, and each ``zarr.json`` is written whole (a temporary file, then a rename);
    a group of the batch comes before its children. Arrays get the runtime ``config``.

    Written here, not through zarr's store: zarr-python 3.1 sends each file operation through its
    event-loop thread to a worker thread and, for every node, re-reads and re-writes every parent
    group's metadata (~15 ms an array on two cores; a run has hundreds). The nodes are not yet
    durable: :func:`fsync_node_chains` makes them so."""
    base = local_dir(root)
    groups: set[Path] = set()  # folders whose group zarr.json this call has seen or written
    made: dict[str, zarr.Array | zarr.Group] = {}
    for path, meta in nodes.items():
        folder = base / path
        _ensure_groups(base, folder.parent, groups)
        _replace_folder(folder)
        _put(folder / "zarr.json", _metadata_bytes(meta))
        where = root.store_path / path
        if isinstance(meta, GroupMetadata):
            groups.add(folder)
            made[path] = zarr.Group(zarr.AsyncGroup(meta, where))
        else:
            made[path] = zarr.Array(zarr.AsyncArray(meta, where, config))
    return made


def _ensure_groups(base: Path, folder: Path, known: set[Path]) -> None:
    """Make ``folder`` and every folder from ``base`` down to it a group, where it is not one yet
    (zarr's implicit parents: an empty group, never replacing an existing ``zarr.json``)."""
    for d in [*reversed(folder.relative_to(base).parents), folder.relative_to(base)]:
        group = base / d
        if group in known:
            continue
        try:
            group.mkdir()
        except FileExistsError:
            if not (group / "zarr.json").exists():
                _put(group / "zarr.json", _empty_group(), exclusive=True)
        else:
            # A folder made just now holds no group whose attributes a rename could lose: at most
            # the same empty group from a peer shard. A rename is one file operation fewer than
            # the exclusive link and its clean-up, for each new tap, layer and site folder.
            _put(group / "zarr.json", _empty_group())
        known.add(group)


def _replace_folder(folder: Path) -> None:
    """An empty ``folder`` (overwrite: a node found there is removed first)."""
    try:
        folder.mkdir()
    except FileExistsError:
        shutil.rmtree(folder)
        folder.mkdir()


@cache
def _empty_group() -> bytes:
    return _metadata_bytes(GroupMetadata())


def _metadata_bytes(meta: NodeMetadata) -> bytes:
    return meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


_TEMP = count()  # unique temporary names within the process (threads of one pid)


def _put(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``path`` whole or not at all, as zarr's LocalStore does: a temporary file, then a
    rename (``exclusive``: a link, which leaves an existing file as it is). The temporary name
    ends ``.<pid>.partial``, so a writer removes one a killed process left (store/writer/opening.py)."""
    tmp = path.with_name(f"{path.name}.{next(_TEMP)}.{os.getpid()}.partial")
    try:
        tmp.write_bytes(data)
        if exclusive:
            with contextlib.suppress(FileExistsError):  # another writer made it first: the same document
                os.link(tmp, path)
            tmp.unlink()
        else:
            os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror, str(path)) from err  # named by the file, not its temporary name


# Per-sample dims whose length depends on the token kind: named per kind, so the arrays of one
# site group (image, last, answer) open together in xarray without "conflicting sizes".
_KIND_DIMS = ("token", "query", "key")
COORD = "sample"  # the per-group coordinate array: row i's stimulus id


def kind_dims(dims: tuple[str, ...], tokens: str) -> tuple[str, ...]:
    """``("token", "dim")`` of the ``image`` array -> ``("image_token", "dim")``."""
    return tuple(f"{tokens}_{d}" if d in _KIND_DIMS else d for d in dims)


def ensure_sample_coord(root: zarr.Group, group_path: str, stimuli: list[str]) -> list[Path]:
    """Write the stimulus ids of the run's rows as the ``sample`` coordinate of ``group_path`` (once;
    xarray then indexes every array of the group by stimulus). Returns the files written, to fsync.

    The group exists (an array of it was just made); ``stimuli`` is the run's non-empty row map."""
    folder = local_dir(root) / group_path / COORD
    meta = folder / "zarr.json"
    if meta.exists():
        return []
    n = len(stimuli)
    doc = array_metadata(
        (n,), (max(n, 1),), str, None, [COORD],
        {"long_name": "stimulus id (the manifest's stimuli.stimulus) of each array row"}, fill_value=None,
    )
    folder.mkdir(exist_ok=True)
    chunk = folder / chunk_file_key(1, 0)
    # The one chunk as zarr's vlen-utf8 codec encodes it (numcodecs' VLenUTF8), written before
    # the metadata: a kill between the two leaves no coordinate that looks whole.
    _put(chunk, bytes(numcodecs.VLenUTF8().encode(np.asarray(stimuli, dtype=object))))
    _put(meta, _metadata_bytes(doc))
    return [meta, chunk]


def ragged_metadata(attributes: dict[str, Any]) -> GroupMetadata:
    """A ragged array's group: its blocks (:func:`write_ragged_block`) are added as chunks arrive."""
    return GroupMetadata(attributes=attributes)


def block_name(chunk: int) -> str:
    return f"b{chunk}"


def write_ragged_block(
    group: zarr.Group,
    chunk: int,
    rows: np.ndarray,
    offsets: np.ndarray,
    codec: Codec,
    dims: tuple[str, ...],
) -> list[Path]:
    """Write block ``chunk`` whole (replacing any earlier attempt); returns the files to fsync."""
    name = block_name(chunk)
    n_rows = rows.shape[0]
    nodes = create_nodes(group, {
        name: GroupMetadata(),
        f"{name}/rows": array_metadata(rows.shape, (max(n_rows, 1), *rows.shape[1:]), rows.dtype,
                                       codec.compressors(), dims),
        # all-zero offsets (a block of empty rows) still need their file: WRITE_EMPTY
        f"{name}/offsets": array_metadata(offsets.shape, offsets.shape, np.int64, None, ["sample_plus_one"]),
    }, WRITE_EMPTY)
    r, o = nodes[f"{name}/rows"], nodes[f"{name}/offsets"]
    assert isinstance(r, zarr.Array) and isinstance(o, zarr.Array)
    if n_rows:
        r[...] = rows
    o[...] = offsets
    base = local_dir(group) / name
    files = [base / "zarr.json", base / "rows" / "zarr.json", base / "offsets" / "zarr.json", base / "offsets" / "c.0"]
    if n_rows:
        files.append(base / "rows" / chunk_file_key(rows.ndim, 0))
    return files


def chunk_file_key(ndim: int, chunk: int) -> str:
    return "c." + ".".join([str(chunk)] + ["0"] * (ndim - 1))


def local_dir(node: zarr.Array | zarr.Group) -> Path:
    store = node.store
    root = getattr(store, "root", None)
    if root is None:
        raise StoreError(f"expected a local Zarr store, got {type(store).__name__}")
    return Path(root) / node.path


def dense_chunk_file(workspace: Path, zarr_path: str, ndim: int, chunk: int) -> Path:
    return node_dir(workspace, zarr_path) / chunk_file_key(ndim, chunk)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_node_chain(workspace: Path, zarr_path: str) -> None:
    """Make a newly created node durable: its metadata and every directory entry up to the root."""
    fsync_node_chains(workspace, [zarr_path])


def fsync_node_chains(workspace: Path, zarr_paths: Sequence[str], pool: Executor | None = None,
                      files: Sequence[Path] = ()) -> None:
    """:func:`fsync_node_chain` of several new nodes, each file and directory synced once: the
    nodes of one run share their parents (a run's arrays were ~60 fsyncs when synced one by one).
    ``files``: data files written with them (a coordinate's ids), synced in the same pass. With a
    ``pool``, the fsyncs run concurrently, so the file system can group them into fewer journal
    commits (the committer syncs chunk files the same way)."""
    root = workspace / ZARR_DIR
    metas: dict[Path, None] = dict.fromkeys(files)
    dirs: dict[Path, None] = {}
    for zarr_path in zarr_paths:
        node = root / zarr_path
        chain = [node, *[p for p in node.parents if root in (p, *p.parents)]]
        metas.update(dict.fromkeys(p / "zarr.json" for p in chain))
        dirs.update(dict.fromkeys(chain))
    dirs[workspace] = None
    todo = [p for p in metas if p.exists()] + [d for d in dirs if d.is_dir()]
    if pool is None or len(todo) < 2:
        for path in todo:
            fsync_path(path)
    else:
        list(pool.map(fsync_path, todo))
