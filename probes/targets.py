"""Target extractors: what a probe should read out, computed from the stimuli's exact truth.

A target turns the selected rows of ``v_samples`` (truth and params JSON, the patch grid of
the image tokens) into labels of one of four shapes:

==========  ================================  =========================================
shape       values                            used by
==========  ================================  =========================================
``token``   ``[n, T]`` class codes, -1 none   linear, hidden_number
``sample``  ``[n]`` class codes (or numbers)  pooled
``grid``    ``[n, H, W]`` class codes         conv_spatial
``boxes``   ``n`` arrays ``[k, 4]`` (xyxy,    detect
            image-normalised)
==========  ================================  =========================================

Register a new one with :func:`register_target`; ``truth:<path>`` and ``params:<path>`` read
any scalar from the JSON (dotted path, list indices allowed: ``truth:subject.colour``).

The built-in targets read a row's truth through its family's truth schema (the stimulus
family's ``Truth`` dataclass, see docs/stimuli/new-family.md), never with ``.get``: a row of that
family whose truth lacks a declared key (renamed, say) stops the target with a message naming
the key, rather than reading as "no label". Rows of other families get no label. The schema is
imported on first use, from the one module of that family, so importing ``probes`` loads no
extraction code, and computing a target never loads model code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from probes.errors import ProbeError, did_you_mean

Shape = Literal["token", "sample", "grid", "boxes"]
SHAPES: tuple[Shape, ...] = ("token", "sample", "grid", "boxes")


@dataclass(frozen=True)
class SampleInfo:
    """The parts of one ``v_samples`` row a target may read."""

    stimulus: str
    family: str | None
    split: str | None
    truth: dict[str, Any]
    params: dict[str, Any]
    grid_h: int | None = None
    grid_w: int | None = None


@dataclass(frozen=True)
class TargetValues:
    """Labels for a group's rows (row i = selection row i). ``classes`` names codes 0..K-1;
    it is None for a numeric target without classes (regression only)."""

    name: str
    shape: Shape
    values: np.ndarray
    classes: tuple[Any, ...] | None
    numeric: np.ndarray | None = None  # sample targets whose raw values are numbers

    def __len__(self) -> int:
        return len(self.values)

    def labelled(self) -> np.ndarray:
        """Per sample: has at least one label."""
        v = self.values
        if self.shape == "boxes":
            return np.array([x is not None for x in v], dtype=bool)
        if self.shape == "sample":
            return np.asarray(~np.isnan(v) if v.dtype.kind == "f" else v >= 0)
        return np.asarray((v.reshape(len(v), -1) >= 0).any(1))

    def permuted(self, perm: np.ndarray) -> TargetValues:
        """The same labels given to other samples (the shuffled-label control)."""
        return replace(self, values=self.values[perm], numeric=None if self.numeric is None else self.numeric[perm])

    def as_numeric(self) -> np.ndarray:
        if self.numeric is None:
            raise ProbeError(f"target {self.name} is categorical ({self.classes[:5] if self.classes else ()} ...): it has no"
                             " numeric values to regress on")
        return self.numeric


TargetFn = Callable[[Sequence[SampleInfo], int | None], TargetValues]


@dataclass(frozen=True)
class TargetSpec:
    name: str
    shape: Shape
    fn: TargetFn
    doc: str = ""

    def __call__(self, rows: Sequence[SampleInfo], n_tokens: int | None = None) -> TargetValues:
        out = self.fn(rows, n_tokens)
        if out.shape != self.shape or len(out) != len(rows):
            raise ProbeError(f"target {self.name} returned shape {out.shape!r} for {len(out)} rows; expected {self.shape!r}"
                             f" for {len(rows)}")
        if not out.labelled().any():
            fams = sorted({str(r.family) for r in rows})
            hint = _key_hint(self.name, rows)
            raise ProbeError(
                f"target {self.name}: none of the {len(rows)} selected rows has it (families {fams}){hint}:"
                " narrow the rows with where: (e.g. family = 'go') or pick another target"
            )
        return out


def _key_hint(name: str, rows: Sequence[SampleInfo]) -> str:
    """For ``truth:<path>`` / ``params:<path>`` naming no key of the rows: the closest key they have."""
    prefix, _, path = name.partition(":")
    if prefix not in ("truth", "params") or not path:
        return ""
    keys = {k for r in rows for k in getattr(r, prefix)}
    first = path.split(".")[0]
    return "" if first in keys else did_you_mean(first, keys)


TARGETS: dict[str, TargetSpec] = {}


def register_target(name: str, shape: Shape, doc: str = "") -> Callable[[TargetFn], TargetFn]:
    """Decorator: ``fn(rows, n_tokens) -> TargetValues`` becomes target ``name``.

    Parameters
    ----------
    name
        The target's name in plans.
    shape
        What one value labels: ``sample``, ``token``, ``grid`` or ``boxes``.
    doc
        One line for listings; default: the first line of ``fn``'s docstring.

    Returns
    -------
    Callable
        The decorator; it returns ``fn`` unchanged.

    Raises
    ------
    ProbeError
        ``shape`` is not one of the shapes.
    """
    if shape not in SHAPES:
        raise ProbeError(f"target shape must be one of {SHAPES}, got {shape!r}")

    def deco(fn: TargetFn) -> TargetFn:
        TARGETS[name] = TargetSpec(name, shape, fn, doc or (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return deco


def get_target(name: str) -> TargetSpec:
    """The target called ``name``: a registered one, or ``truth:<path>`` / ``params:<path>`` for
    the scalar at that JSON path of each sample's truth or parameters.

    Parameters
    ----------
    name
        A registered target (``python -m probes --list-targets``) or a ``truth:`` / ``params:`` path.

    Returns
    -------
    TargetSpec
        Its name, shape (sample, token, grid, boxes) and the function that makes its values.

    Raises
    ------
    ProbeError
        An unknown name or an empty path, with the names that exist.
    """
    if name in TARGETS:
        return TARGETS[name]
    for prefix in ("truth", "params"):
        if name.startswith(prefix + ":"):
            path = name[len(prefix) + 1 :]
            if not path:
                raise ProbeError(f"target {name!r}: give a JSON path after '{prefix}:', e.g. {prefix}:count")
            return TargetSpec(name, "sample", _json_scalar(prefix, path), f"the scalar at {prefix}.{path}")
    raise ProbeError(f"unknown target {name!r}{did_you_mean(name, [*TARGETS, 'truth:<path>', 'params:<path>'])}")


# ----------------------------------------------------------------------------- helpers


def encode(name: str, raw: Sequence[Any]) -> TargetValues:
    """Sample-level raw values (None = missing) -> class codes, plus numbers when all are numeric."""
    present = [v for v in raw if v is not None]
    for v in present:
        if isinstance(v, (dict, list)):
            raise ProbeError(f"target {name}: expected a scalar per sample, got {type(v).__name__} {str(v)[:60]};"
                             " point the path at a scalar")
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present)
    classes = tuple(sorted(set(present), key=lambda v: (v if numeric else str(v))))
    index = {c: i for i, c in enumerate(classes)}
    codes = compact(np.array([-1 if v is None else index[v] for v in raw], dtype=np.int64))
    nums = np.array([np.nan if v is None else float(v) for v in raw], dtype=np.float64) if numeric else None
    return TargetValues(name, "sample", codes, classes, nums)


def compact(codes: np.ndarray) -> np.ndarray:
    """Class codes in the smallest signed dtype: labels travel with every Dask task."""
    top = int(codes.max(initial=0))
    for dt in (np.int8, np.int16, np.int32):
        if top <= np.iinfo(dt).max:
            return codes.astype(dt)
    return codes


def lookup(obj: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(obj, dict):
            obj = obj.get(part)
        elif isinstance(obj, list) and part.lstrip("-").isdigit() and -len(obj) <= int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return None
        if obj is None:
            return None
    return obj


def _json_scalar(prefix: str, path: str) -> TargetFn:
    def fn(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
        return encode(f"{prefix}:{path}", [lookup(getattr(r, prefix), path) for r in rows])

    return fn


def token_grid(row: SampleInfo, n_tokens: int) -> tuple[int, int]:
    """The (h, w) raster the array's ``n_tokens`` tokens form over the image.

    The manifest's grid is that of the LLM's image tokens; a vision-encoder array may hold
    ``s^2`` times as many (before a 2x2 merger), still covering the image in raster order.
    """
    h, w = row.grid_h, row.grid_w
    if h and w:
        if h * w == n_tokens:
            return h, w
        s = math.isqrt(n_tokens // (h * w)) if n_tokens % (h * w) == 0 else 0
        if s and s * s * h * w == n_tokens:
            return h * s, w * s
    r = math.isqrt(n_tokens)
    if r * r == n_tokens:
        return r, r
    raise ProbeError(
        f"cannot place {n_tokens} tokens on the image of {row.stimulus}: the manifest's patch grid is {h}x{w}"
        " and the count is not a square. Per-token targets need tokens=image arrays in raster order"
    )


def cells_under_tokens(h: int, w: int, rows: int, cols: int) -> np.ndarray:
    """Row-major index of the rows x cols cell under each token's patch centre ([h*w])."""
    cy = np.minimum(((np.arange(h) + 0.5) / h * rows).astype(np.int64), rows - 1)
    cx = np.minimum(((np.arange(w) + 0.5) / w * cols).astype(np.int64), cols - 1)
    return (cy[:, None] * cols + cx[None, :]).reshape(-1)


def _per_token(name: str, rows: Sequence[SampleInfo], n_tokens: int | None, grid_of: Callable[[SampleInfo], np.ndarray | None],
               classes: tuple[Any, ...]) -> TargetValues:
    if not n_tokens:
        raise ProbeError(f"target {name} labels each token: read a dense token array (tokens: image)")
    out = np.full((len(rows), n_tokens), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        grid = grid_of(row)
        if grid is None:
            continue
        h, w = token_grid(row, n_tokens)
        out[i] = grid.reshape(-1)[cells_under_tokens(h, w, grid.shape[0], grid.shape[1])]
    return TargetValues(name, "token", compact(out), classes)


def _uniform_grid(name: str, rows: Sequence[SampleInfo], grid_of: Callable[[SampleInfo], np.ndarray | None],
                  classes: tuple[Any, ...]) -> TargetValues:
    grids = [grid_of(r) for r in rows]
    shapes = sorted({g.shape for g in grids if g is not None})
    if len(shapes) > 1:
        raise ProbeError(
            f"target {name}: the selected rows mix grid sizes {[f'{a}x{b}' for a, b in shapes]}; a spatial probe maps"
            " to one size. Add where: (params->>'grid_size')::INT = N (one plan entry per N)"
        )
    if not shapes:
        return TargetValues(name, "grid", np.full((len(rows), 1, 1), -1, dtype=np.int64), classes)
    out = np.full((len(rows), *shapes[0]), -1, dtype=np.int64)
    for i, g in enumerate(grids):
        if g is not None:
            out[i] = g
    return TargetValues(name, "grid", compact(out), classes)


# ----------------------------------------------------------------------------- built-in targets

GO_CLASSES = ("black", "white", "empty")  # stimuli/goboard.py: BLACK, WHITE, EMPTY = 0, 1, 2


def typed_truth(row: SampleInfo, family: str) -> Any | None:
    """``row.truth`` through ``family``'s truth schema, or None for a row of another family."""
    if row.family != family:
        return None
    # Imported here, not at the top: importing probes must not load the extraction package.
    from stimuli import StimulusError, get_family

    try:
        return get_family(family).read_truth(row.truth, row.stimulus)
    except StimulusError as err:
        raise ProbeError(f"{err}. The built-in {family}.* targets read these keys") from None


def _go_board(row: SampleInfo) -> np.ndarray | None:
    truth = typed_truth(row, "go")
    if truth is None or not truth.labels:
        return None
    labels = truth.labels
    b = int(row.params.get("board_size") or math.isqrt(len(labels)))
    if b * b != len(labels):
        raise ProbeError(f"{row.stimulus}: truth.labels has {len(labels)} entries, not board_size^2 = {b * b}")
    return np.asarray(labels, dtype=np.int64).reshape(b, b)


def _g2m_matrix(row: SampleInfo) -> np.ndarray | None:
    truth = typed_truth(row, "g2m")
    return None if truth is None else np.asarray(truth.matrix, dtype=np.int64)


def _g2m_classes(rows: Sequence[SampleInfo]) -> tuple[int, ...]:
    c = max((int(r.params.get("num_colors") or 0) for r in rows), default=0)
    seen = max((int(g.max()) + 1 for g in map(_g2m_matrix, rows) if g is not None), default=0)
    return tuple(range(max(c, seen)))


def _field(rows: Sequence[SampleInfo], family: str, name: str) -> list[Any]:
    return [None if t is None else getattr(t, name) for t in (typed_truth(r, family) for r in rows)]


@register_target("go.intersection", "token")
def go_intersection(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
    """Per token: black / white / empty at the Go intersection under the token (truth.labels)."""
    return _per_token("go.intersection", rows, n_tokens, _go_board, GO_CLASSES)


@register_target("go.board", "grid")
def go_board(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
    """The whole board as a B x B map of black / white / empty (for spatial probes)."""
    return _uniform_grid("go.board", rows, _go_board, GO_CLASSES)


@register_target("go.count", "sample")
def go_count(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
    """Number of black stones (truth.count)."""
    return encode("go.count", _field(rows, "go", "count"))


@register_target("g2m.cell_color", "token")
def g2m_cell_color(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
    """Per token: colour index of the G2M cell under the token's patch centre (truth.matrix)."""
    return _per_token("g2m.cell_color", rows, n_tokens, _g2m_matrix, _g2m_classes(rows))


@register_target("g2m.matrix", "grid")
def g2m_matrix(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
    """The N x N colour matrix (truth.matrix), one N per probe."""
    return _uniform_grid("g2m.matrix", rows, _g2m_matrix, _g2m_classes(rows))


@register_target("counting.count", "sample")
def counting_count(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
    """Number of objects drawn (CountingTricks truth.count)."""
    return encode("counting.count", _field(rows, "counting", "count"))


@register_target("counting.boxes", "boxes")
def counting_boxes(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
    """Object boxes (truth.objects[*].bbox) as image-normalised x1, y1, x2, y2."""
    out = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        truth = typed_truth(r, "counting")
        if truth is None:
            out[i] = None
            continue
        boxes = np.array([o["bbox"] for o in truth.objects], dtype=np.float32).reshape(-1, 4) / float(truth.image_size)
        out[i] = np.clip(boxes, 0.0, 1.0)
    return TargetValues("counting.boxes", "boxes", out, ("object",))


@register_target("spatial.relation", "sample")
def spatial_relation(rows: Sequence[SampleInfo], n_tokens: int | None) -> TargetValues:
    """The spatial relation of subject to reference (truth.relation: left, right, above, ...)."""
    return encode("spatial.relation", _field(rows, "spatial", "relation"))
