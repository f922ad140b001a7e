"""Iterative kinds out of core (``linear``, ``pooled`` classification): the batched logistic
L-BFGS trained on a recorded, deterministic subsample of the training rows, whitened with
statistics streamed over *all* of them, and scored on every test row chunk by chunk. The small
neural kinds (``conv_spatial``, ``detect``) the same way with whole samples as the unit
(:func:`fit_samples`): a subsample of training samples, standardised with moments streamed over
every token of every training sample, predicted block by block over the whole test split.

One task per layer reads its selected rows ``block_rows`` samples at a time, twice:

1. the training samples: per Solve (a split and parameter set) it accumulates the feature
   means and the centred XᵀX over every training unit (every token of every training sample,
   as the in-memory path standardises with), and copies the units the client picked
   (:attr:`IterSolve.pick`, at most ``max_train_rows``) into one float32 buffer;
2. after the fit, the test samples: predictions of every column, summed per sample.

The subsample is chosen on the client, from labelled units of training samples only: the split
stays by stimulus, never by token. When it holds every labelled training unit the fit is the
in-memory one (same standardisation, same objective, same optimum). Workers here import torch
(the solver), unlike the statistics kinds of probes/stream.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from probes.features import as_float32, read_features
from store.heap import tune_malloc
from store.location import ArrayRoot
from store.records import ArrayInfo


@dataclass
class Column:
    """One label column of a Solve: a probe's target, or its shuffled-label control."""

    job: int
    control: bool
    labels: np.ndarray           # int64 [n, R] class codes, -1: no label; per-sample kinds: the target's values
    labelled: np.ndarray | None = None   # per-sample kinds: bool [n], the samples this column has a label for


@dataclass
class IterSolve:
    """Columns that share their parameters and split: one batched L-BFGS problem per layer."""

    params: Any                  # the kind's validated parameters
    train: np.ndarray            # bool [n]: training samples
    test: np.ndarray             # bool [n]
    pick: np.ndarray             # bool [n, R]: training units fitted (the subsample); per-sample kinds [n]
    columns: list[Column]
    candidates: int              # labelled training units the subsample was drawn from
    cap: int | None              # max_train_rows in force (None: every unit)
    seed: int                    # the draw's seed (the fold's)

    def real_column(self, c: int) -> int:
        """The column of column ``c``'s probe (``c`` itself unless ``c`` is a control): a control's
        per-sample output is scored against its probe's real labels."""
        col = self.columns[c]
        if not col.control:
            return c
        return next((k for k, o in enumerate(self.columns) if o.job == col.job and not o.control), c)


@dataclass
class IterSpec:
    """What every layer task of one group needs (paths, rows, masks, labels; never features)."""

    root: ArrayRoot
    rows: np.ndarray             # array rows of the selection, ascending
    kind: type[Any]              # a LinearProbe subclass: its sample_rows turns a block into units
    units: int                   # R: units per sample (tokens, or 1 when pooled)
    block_rows: int
    solves: list[IterSolve]
    dense_tokens: int | None = None
    per_sample: bool = False     # a kind trained on whole samples (conv_spatial, detect): fit_samples


@dataclass
class LayerFit:
    """A layer task's output, numpy only: per Solve, the standardisation, each column's weights
    and, over the test samples, hits and labelled units per sample (and R = 1: the prediction)."""

    mean: list[np.ndarray] = field(default_factory=list)
    scale: list[np.ndarray] = field(default_factory=list)
    weights: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = field(default_factory=list)  # coef, b, classes
    hits: list[np.ndarray] = field(default_factory=list)      # [C, n]
    #: [C, n]: hits against the column's probe's real labels (a control's per-sample score; the
    #: real column's own hits again, so one index serves both)
    real_hits: list[np.ndarray] = field(default_factory=list)
    count: list[np.ndarray] = field(default_factory=list)     # [C, n]
    pred: list[np.ndarray | None] = field(default_factory=list)   # [C, n] codes when R = 1
    fitted_rows: list[np.ndarray] = field(default_factory=list)   # [C]: labelled rows each column trained on
    n_iter: list[int] = field(default_factory=list)
    # per-sample kinds, [solve][column]: the fitted probe's (state_, meta_) and its test predictions
    states: list[list[tuple[dict[str, np.ndarray], dict[str, Any]]]] = field(default_factory=list)
    tested: list[list[list[Any]]] = field(default_factory=list)
    converged: list[bool] = field(default_factory=list)
    flops: float = 0.0
    read_bytes: int = 0
    seconds: float = 0.0
    rss_peak: int = 0


class Moments:
    """Streamed mean and centred XᵀX (float64), shifted by the first block's mean so the sums
    stay well conditioned; only the diagonal when no whitening needs the rest."""

    def __init__(self, d: int, gram: bool) -> None:
        self.n, self.k, self.s1 = 0, np.zeros(d), np.zeros(d)
        self.xx = np.zeros((d, d), order="F") if gram else np.zeros(d)

    def add(self, X: np.ndarray) -> float:
        if self.n == 0:
            self.k = X.mean(0, dtype=np.float64)
        Xk = X.astype(np.float64) - self.k
        self.n += len(Xk)
        self.s1 += Xk.sum(0)
        if self.xx.ndim == 2:   # the upper triangle (half the flops of Xk.T @ Xk)
            from scipy.linalg.blas import dsyrk

            self.xx = dsyrk(1.0, Xk.T, beta=1.0, c=self.xx, trans=0, lower=0, overwrite_c=1)
            return float(len(Xk)) * len(self.k) * (len(self.k) + 1)
        self.xx += (Xk * Xk).sum(0)
        return 3.0 * Xk.size

    def mean_cov(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean [d], covariance [d, d] or its diagonal [d]) over the rows added (population).
        Once: the covariance is made in place of the sums (one d x d temporary at a time)."""
        n = max(self.n, 1)
        m = self.s1 / n
        cov = self.xx
        if cov.ndim == 2:
            cov += np.triu(cov, 1).T          # dsyrk filled the upper triangle; the lower one is still 0
            cov /= n
            cov -= np.outer(m, m)
        else:
            cov = cov / n - m * m
        return self.k + m, cov


def _units(spec: IterSpec, X: Any, params: Any, cache: dict[Any, np.ndarray]) -> np.ndarray:
    key = getattr(params, "pool", None)
    if key not in cache:   # a per-sample kind's unit is the sample's token grid [T, d] as read
        cache[key] = as_float32(X) if spec.per_sample else spec.kind.sample_rows(X, params)
    return cache[key]


def _read(spec: IterSpec, info: ArrayInfo, idx: np.ndarray) -> tuple[Any, int]:
    X = read_features(spec.root, info, spec.rows[idx], spec.dense_tokens)
    values = X.values if hasattr(X, "offsets") else X
    return X, int(np.asarray(values).size * np.dtype(info.stored_dtype).itemsize)


def train_pass(spec: IterSpec, info: ArrayInfo, out: LayerFit, gram: list[bool]
               ) -> tuple[list[Moments], list[np.ndarray], list[np.ndarray]]:
    """Moments over every training unit, and the picked units with their labels, per Solve."""
    d = info.item_shape[-1]
    moments = [Moments(d, g) for g in gram]
    subs = [np.empty((int(s.pick.sum()), d), np.float32) for s in spec.solves]
    labels = [np.empty((len(subs[i]), len(s.columns)), np.int64) for i, s in enumerate(spec.solves)]
    filled = [0] * len(spec.solves)
    for s, solve, idx, mask, U in _blocks(spec, info, [v.train for v in spec.solves], out):   # U [m, R, d]
        out.flops += moments[s].add(U.reshape(-1, d))
        pick = solve.pick[idx][mask]                                            # [m, R]
        got = U[pick]
        subs[s][filled[s] : filled[s] + len(got)] = got
        for c, col in enumerate(solve.columns):
            labels[s][filled[s] : filled[s] + len(got), c] = col.labels[idx][mask][pick]
        filled[s] += len(got)
    return moments, subs, labels


def _blocks(spec: IterSpec, info: ArrayInfo, masks: list[np.ndarray], out: Any) -> Iterator[tuple[Any, ...]]:
    """(solve index, Solve, rows, mask, units) per block of the rows any of ``masks`` selects and
    per Solve with rows in it; each block is read once for every Solve (bytes added to ``out``)."""
    pos = np.flatnonzero(np.logical_or.reduce(masks))
    for a in range(0, len(pos), spec.block_rows):
        idx = pos[a : a + spec.block_rows]
        X, nbytes = _read(spec, info, idx)
        out.read_bytes += nbytes
        cache: dict[Any, np.ndarray] = {}
        for s, (solve, rows) in enumerate(zip(spec.solves, masks, strict=True)):
            mask = rows[idx]
            if mask.any():
                yield s, solve, idx, mask, _units(spec, X, solve.params, cache)[mask]
        del X, cache   # freed before the next block is read


def fit_layer(spec: IterSpec, info: ArrayInfo) -> LayerFit:
    """The layer task: the training pass, one batched L-BFGS per Solve, the test pass."""
    import torch
    from threadpoolctl import threadpool_limits

    from probes.logreg import MAX_PRECONDITION_DIM, solve_standardized
    from probes.rss import peak_rss

    tune_malloc()
    t0 = time.perf_counter()
    out = LayerFit()
    d = info.item_shape[-1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            if spec.per_sample:
                fit_samples(spec, info, out)
            else:
                gram = [bool(s.params.precondition) and d <= MAX_PRECONDITION_DIM for s in spec.solves]
                moments, subs, labels = train_pass(spec, info, out, gram)
                solved = []
                for s, solve in enumerate(spec.solves):
                    sub, lab = subs[s], labels[s]
                    subs[s] = labels[s] = np.empty(0)          # the solve owns the buffer: freed after it
                    solved.append(_solve(solve, moments[s], sub, lab, gram[s], out, solve_standardized))
                    del sub, lab
                score_pass(spec, info, solved, out)
    finally:
        torch.set_num_threads(threads)
    out.seconds = time.perf_counter() - t0
    out.rss_peak = peak_rss()
    return out


def _solve(solve: IterSolve, mom: Moments, sub: np.ndarray, lab: np.ndarray, gram: bool, out: LayerFit,
           solve_standardized: Any) -> Any:
    """Standardise the subsample in place with the streamed statistics and fit every column."""
    import torch

    mean, cov = mom.mean_cov()
    var = np.diag(cov) if cov.ndim == 2 else cov
    if solve.params.standardize:   # as probes.logreg.standardization_stats: population std, ~0 -> 1
        scale = np.sqrt(np.maximum(var, 0.0))
        scale[scale < 1e-8] = 1.0
        shift = mean
    else:
        scale, shift = np.ones_like(mean), np.zeros_like(mean)
    mean32, scale32 = shift.astype(np.float32), scale.astype(np.float32)
    sub -= mean32
    sub /= scale32
    moments = None
    if gram:
        mu = (mean - shift) / scale
        cov /= scale[:, None]
        cov /= scale[None, :]
        moments = (torch.from_numpy(mu[None, None]), torch.from_numpy(cov)[None])
    cols = [lab[:, c] for c in range(lab.shape[1])]
    solved = solve_standardized(torch.from_numpy(sub)[None], cols, solve.params,
                                torch.from_numpy(mean32)[None, None], torch.from_numpy(scale32)[None, None], moments)
    out.mean.append(mean32)
    out.scale.append(scale32)
    out.weights.append([(*solved.weights(0, c), np.asarray(solved.classes[c])) for c in range(len(cols))])
    out.fitted_rows.append((lab >= 0).sum(0))
    out.n_iter.append(int(solved.info.n_iter))
    out.converged.append(bool(solved.info.converged))
    out.flops += solved.info.flops
    return solved


def score_pass(spec: IterSpec, info: ArrayInfo, solved: list[Any], out: LayerFit) -> None:
    """Every test unit predicted, block by block; hits and labelled units summed per sample."""
    import torch

    n, R = len(spec.rows), spec.units
    for solve in spec.solves:
        C = len(solve.columns)
        out.hits.append(np.zeros((C, n), np.int64))
        out.real_hits.append(np.zeros((C, n), np.int64))
        out.count.append(np.zeros((C, n), np.int64))
        out.pred.append(np.full((C, n), -1, np.int64) if R == 1 else None)
    for s, solve, idx, mask, U in _blocks(spec, info, [v.test for v in spec.solves], out):
        at = idx[mask]
        Z = (torch.from_numpy(U.reshape(1, -1, U.shape[-1])) - torch.from_numpy(out.mean[s])) / torch.from_numpy(
            out.scale[s])
        preds = solved[s].predict(Z)
        out.flops += 2.0 * Z.shape[1] * Z.shape[2] * len(solve.columns)
        for c, col in enumerate(solve.columns):
            y = col.labels[at]                                              # [m, R]
            p = preds[c][0].reshape(y.shape)
            ok = y >= 0
            out.hits[s][c, at] = ((p == y) & ok).sum(1)
            out.count[s][c, at] = ok.sum(1)
            real = solve.columns[solve.real_column(c)].labels[at]
            out.real_hits[s][c, at] = ((p == real) & (real >= 0)).sum(1)
            pred = out.pred[s]
            if pred is not None:
                pred[c, at] = p[:, 0]


# ----------------------------------------------------------------------------- per-sample kinds


def fit_samples(spec: IterSpec, info: ArrayInfo, out: LayerFit) -> None:
    """conv_spatial / detect: per column (a probe or its control) one model fitted on the picked
    training samples it has labels for, standardised with its own training samples' moments
    (every token, streamed), then predictions over its test samples, block by block."""
    moments, subs = sample_pass(spec, info, out)
    probes: list[list[Any]] = []
    for s, solve in enumerate(spec.solves):
        sub, subs[s] = subs[s], np.empty(0)                 # freed once the solve's columns are fitted
        at = np.flatnonzero(solve.pick)                      # buffer row i holds sample at[i]
        probes.append([_fit_column(spec, solve, col, sub, at, moments[s][c]) for c, col in enumerate(solve.columns)])
        out.states.append([(p.state_, p.meta_) for p in probes[-1]])
        del sub
    out.tested = [[[] for _ in solve.columns] for solve in spec.solves]
    for s, solve, idx, mask, U in _blocks(spec, info, [v.test for v in spec.solves], out):
        for c in range(len(solve.columns)):
            sel = predicted(solve, c)[idx][mask]
            if sel.any():
                out.tested[s][c].append(probes[s][c].predict(U[sel]))


def predicted(solve: IterSolve, c: int) -> np.ndarray:
    """bool [n]: the samples column ``c`` is predicted on (among the test split): those it has a
    label for and, a control, those its probe has a label for (its per-sample output is scored
    there, against the real labels). Predictions follow in ascending sample order."""
    return labelled_of(solve.columns[c]) | labelled_of(solve.columns[solve.real_column(c)])


def labelled_of(col: Column) -> np.ndarray:
    assert col.labelled is not None, "a per-sample column says which samples it has labels for"
    return col.labelled


def sample_pass(spec: IterSpec, info: ArrayInfo, out: LayerFit) -> tuple[list[list[Moments]], list[np.ndarray]]:
    """Per column, per-feature moments over every token of its training samples; per Solve, the
    picked samples' tokens [k, T, d] in one float32 buffer (ascending sample order)."""
    d = info.item_shape[-1]
    moments = [[Moments(d, gram=False) for _ in s.columns] for s in spec.solves]
    subs = [np.empty((int(s.pick.sum()), spec.units, d), np.float32) for s in spec.solves]
    filled = [0] * len(spec.solves)
    for s, solve, idx, mask, U in _blocks(spec, info, [v.train for v in spec.solves], out):   # U [m, T, d]
        for c, col in enumerate(solve.columns):
            sel = labelled_of(col)[idx][mask]
            if sel.any():
                out.flops += moments[s][c].add(U[sel].reshape(-1, d))
        got = U[solve.pick[idx][mask]]
        subs[s][filled[s] : filled[s] + len(got)] = got
        filled[s] += len(got)
    return moments, subs


def _fit_column(spec: IterSpec, solve: IterSolve, col: Column, sub: np.ndarray, at: np.ndarray, mom: Moments) -> Any:
    """One model on the buffer's samples this column has labels for (the buffer itself when all)."""
    from probes.kinds import _torch as T
    from probes.kinds.base import wide_codes

    has = labelled_of(col)[at]
    probe = spec.kind(random_state=solve.seed, **solve.params)
    mean, var = mom.mean_cov()
    X = sub if has.all() else sub[has]
    y = wide_codes(col.labels[at[has]])
    return probe.fit_scaled(X, y, *T.standardizer(mean, var, probe.standardizes))
