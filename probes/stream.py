"""Statistics probes streamed over the store's chunks: one read of a layer's bytes trains every
closed-form probe of it (all targets, their shuffled-label controls, every ridge strength).

A layer's selected rows are cut into partitions of whole chunks; each partition is one Dask
task that reads its rows block by block (``block_rows`` samples at a time, never the whole
layer) and accumulates, per training design (:class:`Solve`), the sufficient statistics of
ridge regression: the row count, the feature means, the upper triangle of the centred Gram
matrix XᵀX, XᵀY and the target sums. Partitions merge pairwise (a tree; Chan's parallel
update keeps the centred sums exact), one task solves every column and alpha with one
Cholesky factor per alpha, and a second map over the *test* rows scores them (train and test
samples are disjoint, so each selected byte is read once per design). With fewer training
units than features (``StreamSpec.dual``: pooled probes over wide models) the maps keep the
rows themselves, test rows included, and the solve works on the training rows' n×n Gram matrix
(probes/ridge_dual.py) and scores the test rows it holds: one pass, no second map. Workers import numpy,
scipy and the store reader only (never torch), so their resident memory stays small and plannable.

Everything here is plain numpy/scipy on one BLAS thread; the client builds the :class:`StreamSpec`
(labels, masks, classes: small) and turns the solved weights into probe records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any, Literal

import numpy as np

from probes.class_solve import solve_classes
from probes.moments import Moments
from probes.ridge_dual import Rows, merge_rows, solve_rows
from probes.ridge_solve import Stats, solve_stats
from probes.rss import peak_rss, rss_now
from store.location import ArrayRoot
from store.records import ArrayInfo


@dataclass
class Variant:
    """One probe's label columns inside a Solve: Y[..., start:stop]."""

    job: int
    control: bool
    start: int
    stop: int
    classes: np.ndarray | None   # class codes of the columns (classification), None: regression


@dataclass
class Solve:
    """Label columns that share their training and test units (a fold, a labelled mask)."""

    train: np.ndarray            # bool [n, R]: units fitted (R = tokens per sample, or 1 when pooled)
    test: np.ndarray             # bool [n, R]
    Y: np.ndarray                # float64 [n, R, c]: ±1 one-hot columns or numbers
    codes: np.ndarray            # int64 [n, R, V]: each variant's true class code (-1: regression)
    variants: list[Variant] = field(default_factory=list)


@dataclass
class StreamSpec:
    """What every map task of one group needs (paths, rows, masks, labels; never features)."""

    root: ArrayRoot
    rows: np.ndarray             # array rows of the selection, ascending
    level: Literal["token", "sample"]
    pool: str
    alphas: tuple[float, ...]
    standardize: bool
    precision: Literal["float64", "float32"]
    block_rows: int
    solves: list[Solve]
    dense_tokens: int | None = None
    method: Literal["ridge", "lda", "centroid"] = "ridge"   # the kind's solve (probes/kinds/*.py stream_solver)
    #: Solves that differ only in their split (seeds) share one pass: statistics of the union of
    #: their training units, plus of each Solve's units left out of it; a Solve's own statistics
    #: are the union's minus its left-out part (:func:`own_stats`). Cheaper when the left-out
    #: parts (about a test fraction each) are smaller than the training sets.
    shared: bool = False
    #: Count per sample the test units predicted as this class (hidden_number_ridge's N_H: tokens
    #: predicted black per board); None: no per-sample counts.
    count_class: int | None = None
    #: lda's ``shrinkage: auto``: each variant's per-class moments up to the fourth (probes/moments.py)
    #: instead of the pooled XᵀX; never shared between Solves.
    ledoit_wolf: bool = False
    #: ridge in its dual form (probes/ridge_dual.py): the maps keep the union of the Solves'
    #: training and test rows (n×d) instead of accumulating XᵀX (d×d), and the solve scores the
    #: test rows; chosen when n < d and cheaper (probes/trainers/stream_specs.py _spec). Never shared: the
    #: rows of the union serve every Solve.
    dual: bool = False


@dataclass
class Part:
    """A map task's output: Stats per Solve, plus what it cost."""

    stats: list[Stats | None]
    rows: Rows | None = None     # dual specs: the training rows themselves (stats stay None)
    flops: float = 0.0
    read_bytes: int = 0
    seconds: float = 0.0
    rss_peak: int = 0


def partitions(rows: np.ndarray, chunk_samples: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) positions into ``rows`` cut at chunk boundaries into about ``parts`` pieces."""
    if len(rows) == 0:
        return []
    ks = rows // chunk_samples
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ks)) + 1])
    per = max(1, -(-len(starts) // max(parts, 1)))
    cuts = list(starts[::per]) + [len(rows)]
    return [(int(a), int(b)) for a, b in pairwise(cuts)]


def _positions(spec: StreamSpec, lo: int, hi: int, side: Literal["train", "test", "any"]) -> np.ndarray:
    """Positions in [lo, hi) holding a unit on ``side`` ("train", "test" or either) of any Solve."""
    keep = np.zeros(hi - lo, bool)
    for s in spec.solves:
        keep |= _kept(s, side)[lo:hi].any(1)
    return lo + np.flatnonzero(keep)


def _kept(s: Solve, side: Literal["train", "test", "any"]) -> np.ndarray:
    return s.train | s.test if side == "any" else getattr(s, side)


def gathered(solves: list[Solve]) -> np.ndarray:
    """bool [n, R]: the units a dual spec's maps keep (every Solve's training and test units)."""
    return np.logical_or.reduce([_kept(s, "any") for s in solves])


def read_block(spec: StreamSpec, info: ArrayInfo, rows: np.ndarray) -> tuple[np.ndarray, int]:
    """(units of ``rows`` as float32 [m, R, d], stored bytes read): every token (token level) or
    one pooled vector per sample."""
    from probes.features import read_features
    from probes.pooling import pool

    # Pooled: float16 stays as stored until pool(), which averages its bits without a float32 copy.
    X = read_features(spec.root, info, rows, spec.dense_tokens, stored=spec.level != "token")
    values = X.values if hasattr(X, "offsets") else X
    nbytes = int(np.asarray(values).size * np.dtype(info.stored_dtype).itemsize)
    if spec.level == "token":
        X = np.asarray(X)
        return (X if X.ndim == 3 else X[:, None, :]), nbytes
    return pool(X, spec.pool)[:, None, :], nbytes


_CONTROLLER: Any = None


def one_blas_thread() -> Any:
    """``threadpool_limits(1)`` from one cached controller: a fresh ``threadpool_limits`` scans
    the loaded libraries each time (~3 ms, as long as a small layer's whole solve)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        import scipy.linalg  # noqa: F401  (its BLAS loaded first, so the controller sees it)
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1)


def _blas(precision: str) -> Any:
    from scipy.linalg import blas

    return (blas.dsyrk, blas.dsyr) if precision == "float64" else (blas.ssyrk, blas.ssyr)


def accumulate(spec: StreamSpec, info: ArrayInfo, lo: int, hi: int) -> Part:
    """Map task: the statistics of selection positions [lo, hi), read ``block_rows`` at a time."""
    import time

    t0 = time.perf_counter()
    dtype = np.dtype(spec.precision)
    syrk, syr = _blas(spec.precision)
    designs = _designs(spec)
    raw: list[dict[str, Any] | None] = [None] * len(designs)
    part = Part([None] * len(designs))
    if spec.dual:   # the test rows too: the solve scores them, so no second pass reads them
        part.rows = _gather(spec, info, _positions(spec, lo, hi, "any"), part)
        part.seconds = time.perf_counter() - t0
        part.rss_peak = peak_rss()
        return part
    pos = _positions(spec, lo, hi, "train")   # test-only samples are read by the score pass, not here
    with one_blas_thread():
        for idx, U in _units(spec, info, pos, part):
            for s, (units, labels, gram) in enumerate(designs):
                mask = units[idx]
                if mask.any():
                    X = U[mask]
                    Y = labels(idx)[mask] if labels is not None else np.zeros((len(X), 0))
                    acc = raw[s]
                    if acc is None:  # shift by the first block's mean: the sums stay well conditioned
                        acc = raw[s] = _empty(X, Y.shape[1], dtype if gram else None)
                    part.flops += _update(acc, X, Y, dtype, syrk if gram else None)
                    if spec.ledoit_wolf:
                        part.flops += _add_moments(acc, spec.solves[s], X, spec.solves[s].codes[idx][mask])
        for s, acc in enumerate(raw):
            if acc is not None:
                part.stats[s] = _centre(acc, syr)
    part.seconds = time.perf_counter() - t0
    part.rss_peak = peak_rss()
    return part


def _gather(spec: StreamSpec, info: ArrayInfo, pos: np.ndarray, part: Part) -> Rows | None:
    """Dual map: the training and test units of any Solve among positions ``pos``, copied into one
    array sized up front (the plan counts n×d once, not a list of blocks beside their concatenation)."""
    union = gathered(spec.solves)
    R = union.shape[1]
    m = int(union[pos].sum())
    if m == 0:
        return None
    rows = Rows(np.empty(m, np.int64), np.empty((m, info.item_shape[-1]), spec.precision))
    at = 0
    for idx, U in _units(spec, info, pos, part):
        mask = union[idx]
        k = int(mask.sum())
        rows.X[at : at + k] = U[mask]
        rows.units[at : at + k] = (idx[:, None] * R + np.arange(R))[mask]
        at += k
    return rows


#: Pooled rows gathered per XᵀX update (see _units).
POOLED_ROWS = 256


def _units(spec: StreamSpec, info: ArrayInfo, pos: np.ndarray, part: Part) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(positions, units) to accumulate: each block as read (token level), or pooled rows of
    several blocks together (sample level). A block of pooled samples is a few rows, and a
    rank-few XᵀX update streams the whole d×d matrix through memory for them (at d = 3,584,
    three rows per block cost ~8 ms of syrk); from ~256 rows on, the update is compute-bound.
    The rows gathered stay within what the plan counts for one block's float32 tokens
    (probes/trainers/stream_specs.py plan_stream), which pooled reads no longer hold."""
    tokens = max(1, info.values_per_row // max(info.item_shape[-1], 1))
    batch = spec.block_rows
    if spec.level == "sample":
        batch = max(batch, min(batch * tokens, POOLED_ROWS))
    got: list[tuple[np.ndarray, np.ndarray]] = []
    held = 0
    for a in range(0, len(pos), spec.block_rows):
        idx = pos[a : a + spec.block_rows]
        U, nbytes = read_block(spec, info, spec.rows[idx])
        part.read_bytes += nbytes
        got.append((idx, U))
        held += len(idx)
        if held >= batch or a + spec.block_rows >= len(pos):
            yield got[0] if len(got) == 1 else (np.concatenate([g[0] for g in got]),
                                                np.concatenate([g[1] for g in got]))
            got, held = [], 0


Design = tuple[np.ndarray, Callable[[np.ndarray], np.ndarray] | None, bool]


def _designs(spec: StreamSpec) -> list[Design]:
    """What a map accumulates: (units [n, R], rows -> Y or None, whether XᵀX). Own: each Solve's
    training units, with its Y. Shared: XᵀX of the union of the training units and of each
    Solve's left-out units, then each Solve's XᵀY on its training units (XᵀY costs the same
    either way; only XᵀX, d² per row, is worth sharing)."""
    def own(s: Solve) -> Callable[[np.ndarray], np.ndarray]:
        return lambda idx: s.Y[idx]

    gram = spec.method != "centroid" and not spec.ledoit_wolf   # class means (and LW's moments) need no XᵀX
    if not spec.shared:
        return [(s.train, own(s), gram) for s in spec.solves]
    union = np.logical_or.reduce([s.train for s in spec.solves])
    return ([(union, None, True)] + [(union & ~s.train, None, True) for s in spec.solves]
            + [(s.train, own(s), False) for s in spec.solves])


def _empty(X: np.ndarray, c: int, gram: np.dtype[Any] | None) -> dict[str, Any]:
    d = X.shape[1]
    xx = np.zeros((d, d) if gram is not None else (0, 0), gram or np.float64, order="F")
    return {"n": 0.0, "k": X.mean(0, dtype=np.float64), "sx": np.zeros(d), "sy": np.zeros(c), "xx": xx,
            "xy": np.zeros((d, c)), "yy": np.zeros(c)}


def _update(acc: dict[str, Any], X: np.ndarray, Y: np.ndarray, dtype: np.dtype[Any], syrk: Callable[..., Any] | None) -> float:
    """Add rows X (labels Y) to an accumulator; the flops spent."""
    Xk = X.astype(dtype, copy=False)
    Xk -= acc["k"].astype(dtype)
    if syrk is not None:
        syrk(1.0, Xk.T, beta=1.0, c=acc["xx"], trans=0, lower=0, overwrite_c=1)
    acc["n"] += len(Xk)
    acc["sx"] += Xk.sum(0, dtype=np.float64)
    acc["sy"] += Y.sum(0)
    acc["xy"] += Xk.T @ Y.astype(dtype)
    acc["yy"] += (Y * Y).sum(0)
    d = Xk.shape[1]
    return float(len(Xk)) * d * (d + 1) * (syrk is not None) + 2.0 * len(Xk) * d * Y.shape[1]


def _add_moments(acc: dict[str, Any], solve_: Solve, X: np.ndarray, codes: np.ndarray) -> float:
    """Add rows X to each variant's per-class moments (``codes`` [m, V]: each variant's class)."""
    lw = acc.setdefault("lw", [[None] * len(v.classes if v.classes is not None else []) for v in solve_.variants])
    flops = 0.0
    for v, var in enumerate(solve_.variants):
        for k, cls in enumerate(var.classes if var.classes is not None else []):
            rows = X[codes[:, v] == cls]
            if len(rows):
                if lw[v][k] is None:
                    lw[v][k] = Moments.empty(rows.mean(0, dtype=np.float64))
                flops += lw[v][k].add(rows)
    return flops


def own_stats(spec: StreamSpec, stats: list[Stats | None]) -> Iterator[Stats | None]:
    """Each Solve's statistics, one at a time (one copy of XᵀX in flight): as accumulated, or
    (shared) its XᵀY with the XᵀX of the union minus its left-out units'."""
    if not spec.shared:
        yield from stats
        return
    S = len(spec.solves)
    for s in range(S):
        xy = stats[1 + S + s]
        gram = None if stats[0] is None or xy is None else _downdate(stats[0], stats[1 + s])
        if gram is None or xy is None:
            yield None
            continue
        yield Stats(xy.n, xy.mx, xy.my, gram.xx, xy.xy, xy.yy)   # the same units: the same means


def _downdate(T: Stats, E: Stats | None) -> Stats | None:
    """T without the units of E (XᵀX and means): Chan's update run backwards, from
    T = E + R + (n_E n_R / n_T) δδᵀ with δ the difference of their means."""
    xx = np.array(T.xx, order="F")            # the solve overwrites its copy; T serves every Solve
    if E is None:
        return Stats(T.n, T.mx, T.my, xx, T.xy, T.yy)
    n = T.n - E.n
    if n < 1:
        return None
    mx = (T.n * T.mx - E.n * E.mx) / n
    dx = E.mx - mx
    xx -= E.xx
    _blas(xx.dtype.name)[1](-E.n * n / T.n, dx.astype(xx.dtype), a=xx, lower=0, overwrite_a=1)
    return Stats(n, mx, T.my, xx, T.xy, T.yy)


def _centre(acc: dict[str, Any], syr: Callable[..., Any]) -> Stats:
    n = acc["n"]
    mean_k = acc["sx"] / n
    xx = acc["xx"]
    if xx.size:
        syr(-n, mean_k.astype(xx.dtype), a=xx, lower=0, overwrite_a=1)   # Σ(x-k)(x-k)ᵀ - n m mᵀ
    my = acc["sy"] / n
    xy = acc["xy"] - n * np.outer(mean_k, my)
    yy = acc["yy"] - n * my * my
    return Stats(n, acc["k"] + mean_k, my, xx, xy, yy, acc.get("lw"))


def merge(a: Part, b: Part) -> Part:
    """Reduce task: b folded into a (in place; Chan et al.'s update of centred sums)."""
    a.rows = merge_rows(a.rows, b.rows)
    for s, (x, y) in enumerate(zip(a.stats, b.stats, strict=False)):
        if y is None:
            continue
        if x is None:
            a.stats[s] = y
            continue
        n = x.n + y.n
        dx, dy = y.mx - x.mx, y.my - x.my
        f = x.n * y.n / n
        if x.moments is not None and y.moments is not None:
            x.moments = [[q if p is None else p if q is None else p.merge(q) for p, q in zip(a_, b_, strict=True)]
                         for a_, b_ in zip(x.moments, y.moments, strict=True)]
        x.xx += y.xx
        if x.xx.size:
            _blas(x.xx.dtype.name)[1](f, dx.astype(x.xx.dtype), a=x.xx, lower=0, overwrite_a=1)
        x.xy += y.xy + f * np.outer(dx, dy)
        x.yy += y.yy + f * dy * dy
        x.mx += dx * (y.n / n)
        x.my += dy * (y.n / n)
        x.n = n
    a.flops += b.flops
    a.read_bytes += b.read_bytes
    a.seconds += b.seconds
    a.rss_peak = max(a.rss_peak, b.rss_peak, peak_rss())
    return a


def tree_reduce(items: list[Any], combine: Callable[[Any, Any], Any]) -> Any:
    """Pairwise reduction (depth log2 n); ``combine`` may be a Dask submit."""
    while len(items) > 1:
        nxt = [combine(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
        if len(items) % 2:
            nxt.append(items[-1])
        items = nxt
    return items[0]


@dataclass
class Solution:
    """Weights in original feature units per Solve: W [d, c, A], b [c, A]; the GCV per alpha."""

    W: list[np.ndarray | None]
    b: list[np.ndarray | None]
    gcv: list[np.ndarray | None]          # [c, A]
    n_train: list[float]
    flops: float = 0.0
    rss_peak: int = 0
    read_bytes: int = 0
    scores: Scores | None = None          # dual specs: the test rows' scores, from the rows the solve holds


def solve(spec: StreamSpec, part: Part) -> Solution:
    """One Cholesky factor per alpha per Solve solves every column (dual specs: one eigh of the
    n×n Gram matrix per Solve, then the test rows held are scored); GCV picks alphas later."""
    out = Solution([], [], [], [], part.flops, read_bytes=part.read_bytes)
    with one_blas_thread():
        if spec.dual:
            _solve_dual(spec, part.rows, out)
            out.scores = _score_rows(spec, part.rows, out)
        for s, st in enumerate([] if spec.dual else own_stats(spec, part.stats)):
            if st is None or st.n < 2:
                out.W.append(None)
                out.b.append(None)
                out.gcv.append(None)
                out.n_train.append(0 if st is None else st.n)
                continue
            if spec.method == "ridge":
                W, b, gcv, flops = solve_stats(st, spec.alphas, spec.standardize)
            else:
                W, b, gcv, flops = solve_classes(st, spec.solves[s], spec.method, spec.alphas[0])
            out.W.append(W)
            out.b.append(b)
            out.gcv.append(gcv)
            out.n_train.append(st.n)
            out.flops += flops
    out.rss_peak = max(part.rss_peak, peak_rss())
    return out


def _solve_dual(spec: StreamSpec, rows: Rows | None, out: Solution) -> None:
    """Each Solve's weights from its own training rows among the gathered ones."""
    for solve_ in spec.solves:
        mask = solve_.train.reshape(-1)[rows.units] if rows is not None else np.zeros(0, bool)
        n = int(mask.sum())
        out.n_train.append(n)
        if rows is None or n < 2:
            out.W.append(None)
            out.b.append(None)
            out.gcv.append(None)
            continue
        Y = solve_.Y.reshape(-1, solve_.Y.shape[-1])[rows.units[mask]]
        W, b, gcv, flops = solve_rows(rows.X[mask], Y, spec.alphas, spec.standardize)
        out.W.append(W)
        out.b.append(b)
        out.gcv.append(gcv)
        out.flops += flops


@dataclass
class Scores:
    """Test-pass sums per Solve and Variant, per alpha: hits / count (classify), SSE and y sums
    (regress), and each variant's per-sample column (:func:`_per_sample`)."""

    hits: list[np.ndarray]       # [V, A]
    count: list[np.ndarray]      # [V]
    sse: list[np.ndarray]        # [V, A]
    sy: list[np.ndarray]         # [V]
    syy: list[np.ndarray]        # [V]
    #: [n, V, A] per Solve: each variant's number per sample of the selection, on the test units of
    #: its job's *real* target (a control's too: the per-sample control is scored against the real
    #: labels): the predicted value (sample regression), class code (sample classification), units
    #: predicted right (token classification) or predicted ``count_class`` (counting kinds).
    per_sample: list[np.ndarray] = field(default_factory=list)
    #: [V, A] per Solve (count_class): samples whose count of units predicted ``count_class`` on the
    #: variant's *own* test units equals that of its own labels (the control's score, on its labels).
    exact: list[np.ndarray] = field(default_factory=list)
    flops: float = 0.0
    read_bytes: int = 0
    rss_peak: int = 0


def empty_scores(spec: StreamSpec) -> Scores:
    A, n = len(spec.alphas), len(spec.rows)
    V = [len(s.variants) for s in spec.solves]
    return Scores([np.zeros((v, A)) for v in V], [np.zeros(v) for v in V], [np.zeros((v, A)) for v in V],
                  [np.zeros(v) for v in V], [np.zeros(v) for v in V], [np.zeros((n, v, A)) for v in V],
                  [np.zeros((v, A)) for v in V])


Partner = tuple[int, int, int]   # (real variant in this Solve, control's Solve, control's variant)


def partners(spec: StreamSpec) -> list[list[Partner]]:
    """Per Solve, its probes that have a control: the control may sit in another Solve (its
    permuted labels mark other units labelled or, for hidden_number_ridge, other training tokens)."""
    real: dict[int, tuple[int, int]] = {}
    control: dict[int, tuple[int, int]] = {}
    for s, solve_ in enumerate(spec.solves):
        for v, var in enumerate(solve_.variants):
            (control if var.control else real)[var.job] = (s, v)
    out: list[list[Partner]] = [[] for _ in spec.solves]
    for job, (s, v) in real.items():
        if job in control:
            out[s].append((v, *control[job]))
    return out


def score(spec: StreamSpec, info: ArrayInfo, lo: int, hi: int, sol: Solution) -> Scores:
    """Map task over test rows: predictions for every column and alpha, summed into Scores."""
    out = empty_scores(spec)
    pos = _positions(spec, lo, hi, "test")
    paired = partners(spec)
    with one_blas_thread():
        for a in range(0, len(pos), spec.block_rows):
            idx = pos[a : a + spec.block_rows]
            U, nbytes = read_block(spec, info, spec.rows[idx])
            out.read_bytes += nbytes
            for s, solve_ in enumerate(spec.solves):
                mask = solve_.test[idx]
                if sol.W[s] is not None and mask.any():   # a block holds whole samples (see _exact_counts)
                    _score_units(out, spec, s, sol, U[mask], solve_.Y[idx][mask], solve_.codes[idx][mask],
                                 idx[np.nonzero(mask)[0]], paired[s])
    out.rss_peak = peak_rss()
    return out


def _score_rows(spec: StreamSpec, rows: Rows | None, sol: Solution) -> Scores:
    """A dual solve's test pass over the rows it gathered: what :func:`score` sums over the store."""
    out = empty_scores(spec)
    if rows is None:
        return out
    paired = partners(spec)
    for s, solve_ in enumerate(spec.solves):
        R = solve_.test.shape[1]
        mask = solve_.test.reshape(-1)[rows.units]
        if sol.W[s] is None or not mask.any():
            continue
        units = rows.units[mask]
        _score_units(out, spec, s, sol, rows.X[mask], solve_.Y.reshape(-1, solve_.Y.shape[-1])[units],
                     solve_.codes.reshape(-1, solve_.codes.shape[-1])[units], units // R, paired[s])
    return out


def _score_units(out: Scores, spec: StreamSpec, s: int, sol: Solution, X: np.ndarray, Y: np.ndarray,
                 codes: np.ndarray, samples: np.ndarray, paired: list[Partner]) -> None:
    """Add Solve ``s``'s predictions of test units X [m, d] (labels Y, class codes, each unit's
    position in the selection) to ``out``, for every column and alpha; and, on the same units,
    the per-sample columns of its probes and of their controls."""
    A = len(spec.alphas)
    X = X.astype(np.float64)
    P = _predict(sol, s, X, slice(None))
    out.flops += 2.0 * X.shape[0] * X.shape[1] * P.shape[1] * A
    solve_ = spec.solves[s]
    pred = [_predicted(P, var) for var in solve_.variants]
    _tally(out, s, solve_, P, pred, Y, codes)
    local, at = np.unique(samples, return_inverse=True)
    units = _Units(samples, local, at)
    for v, var in enumerate(solve_.variants):
        if not var.control:
            _per_sample(out.per_sample[s][:, v], spec, P[:, var.start], pred[v], codes[:, v], units)
    for v, cs, cv in paired:
        cvar = spec.solves[cs].variants[cv]
        if sol.W[cs] is None:
            continue
        if cs == s:
            value, cpred = P[:, cvar.start], pred[cv]
        else:   # the control's weights on its probe's test units
            Pc = _predict(sol, cs, X, slice(cvar.start, cvar.stop))
            out.flops += 2.0 * X.shape[0] * X.shape[1] * Pc.shape[1] * A
            value, cpred = Pc[:, 0], _predicted(Pc, replace(cvar, start=0, stop=Pc.shape[1]))
        _per_sample(out.per_sample[cs][:, cv], spec, value, cpred, codes[:, v], units)
    if spec.count_class is not None:
        _exact_counts(out.exact[s], pred, codes, units, spec.count_class)


def _predict(sol: Solution, s: int, X: np.ndarray, cols: slice) -> np.ndarray:
    """[m, c, A]: Solve ``s``'s columns ``cols`` on units X [m, d] float64, every alpha."""
    W, b = sol.W[s], sol.b[s]
    assert W is not None and b is not None, "a scored probe was solved"
    W, b = W[:, cols], b[cols]
    return (X @ W.reshape(W.shape[0], -1)).reshape(len(X), W.shape[1], W.shape[2]) + b[None]


def _predicted(P: np.ndarray, var: Variant) -> np.ndarray | None:
    """[m, A]: a classifying variant's predicted class codes (None: a regression); once per
    variant, for the sums and the per-sample columns alike."""
    if var.classes is None:
        return None
    known = var.classes if len(var.classes) else np.zeros(1, np.int64)   # trained on no class: code 0
    return known[P[:, var.start : var.stop].argmax(1)]


def _tally(out: Scores, s: int, solve_: Solve, P: np.ndarray, pred: list[np.ndarray | None], Y: np.ndarray,
           codes: np.ndarray) -> None:
    for v, var in enumerate(solve_.variants):
        p, y, got = P[:, var.start : var.stop], Y[:, var.start : var.stop], pred[v]
        if got is not None:
            out.hits[s][v] += (got == codes[:, v, None]).sum(0)
            out.count[s][v] += len(y)
        else:
            out.sse[s][v] += ((p[:, 0] - y[:, 0:1]) ** 2).sum(0)
            out.sy[s][v] += y[:, 0].sum()
            out.syy[s][v] += (y[:, 0] ** 2).sum()
            out.count[s][v] += len(y)


@dataclass
class _Units:
    """Scored units' samples: each unit's position in the selection, the distinct ones (``local``)
    and each unit's index among them (``at``): per-sample sums are bincounts of the units, not
    np.add.at (several times slower)."""

    samples: np.ndarray
    local: np.ndarray
    at: np.ndarray

    def sums(self, values: np.ndarray) -> np.ndarray:
        """[len(local), A]: ``values`` [m, A] summed over each sample's units."""
        return np.stack([np.bincount(self.at, weights=values[:, a], minlength=len(self.local))
                         for a in range(values.shape[1])], 1)


def _per_sample(into: np.ndarray, spec: StreamSpec, value: np.ndarray, pred: np.ndarray | None, truth: np.ndarray,
                units: _Units) -> None:
    """Add one variant's output on some units (``value`` [m, A]: a regression's predictions;
    ``pred`` [m, A]: a classifier's codes; ``truth``: the real codes) to its per-sample column
    ``into`` [n, A]; see :class:`Scores`. A token regression has no per-sample number: nothing
    is added. O(units) per block, never O(samples)."""
    if pred is None:
        if spec.level == "sample":   # one unit per sample: its predicted value
            into[units.samples] = value
        return
    if spec.count_class is None and spec.level == "sample":
        into[units.samples] = pred
        return
    hit = pred == (spec.count_class if spec.count_class is not None else truth[:, None])
    into[units.local] += units.sums(hit.astype(np.float64))


def _exact_counts(into: np.ndarray, pred: list[np.ndarray | None], codes: np.ndarray, units: _Units, cls: int) -> None:
    """Add, per variant and alpha, the samples among the units' whose units predicted ``cls``
    number as many as their labels ``cls``. The units given hold every test unit of their
    samples (a scored block reads whole samples; a dual solve scores all its rows at once)."""
    for v, got in enumerate(pred):
        if got is not None:
            n_h = units.sums((got == cls).astype(np.float64))
            n_g = units.sums((codes[:, v : v + 1] == cls).astype(np.float64))
            into[v] += (n_h == n_g).sum(0)


def solved_scores(sol: Solution) -> Scores:
    """A dual layer's test pass: the scores its solve took from the rows it held."""
    assert sol.scores is not None, "a dual spec's solve scores its test rows"
    return sol.scores


def add_scores(a: Scores, b: Scores) -> Scores:
    for f in ("hits", "count", "sse", "sy", "syy", "per_sample", "exact"):
        for x, y in zip(getattr(a, f), getattr(b, f), strict=False):
            x += y
    a.flops += b.flops
    a.read_bytes += b.read_bytes
    a.rss_peak = max(a.rss_peak, b.rss_peak)
    return a


def pack(solutions: list[Solution], scores: list[Scores]) -> tuple[list[Solution], list[Scores]]:
    """The last task of a group: gathers its layers' results for the client in one transfer."""
    return solutions, scores


def warm() -> int:
    """Worker warm-up of streamed-only plans: numpy, scipy and the store reader, never torch.
    Returns the worker's RSS after it (probes/trainers/base.py check_base)."""
    import scipy.linalg  # noqa: F401
    import zarr  # noqa: F401

    import store.reader  # noqa: F401
    from store.heap import tune_malloc

    tune_malloc()
    return rss_now()
