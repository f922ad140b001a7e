"""``pooled``: one vector per sample (mean / max / first / last token) -> a per-sample target:
a count as classes or as a number (ridge), a relation, equal / not equal.

Classification goes through the same batched logistic regression as ``linear``; regression is
closed-form ridge (``sklearn.linear_model.Ridge(alpha)`` on standardised features), scored by R^2.
Works on dense ``[n, T, d]`` arrays and on ragged ones (e.g. the answer tokens).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from probes.errors import ProbeError
from probes.kinds.base import Job, Outcome, PerSample, register_kind
from probes.kinds.linear import LinearParams, LinearProbe, evaluate_batched
from probes.logreg import fit_ridge, standardization_stats
from probes.pooling import pool
from probes.splits import control_permutation

#: A numeric target with more distinct values than this is a quantity (a count of stones), not
#: a few categories: task auto regresses on it (a 121-way classifier scores a near miss as wrong).
MAX_AUTO_CLASSES = 10


class PooledParams(LinearParams):
    pool: Literal["mean", "max", "first", "last"] = Field("mean", description="how tokens become one vector")
    task: Literal["auto", "classify", "regress"] = Field(
        "auto", description=f"auto: a regression when the target's values are numbers that are not whole or take"
                            f" more than {MAX_AUTO_CLASSES} values (a count), else classes")
    alpha: float = Field(1.0, gt=0, description="ridge strength when regressing")


def regresses_values(params: Any, y: np.ndarray | None, numeric: np.ndarray | None) -> bool:
    """Whether kind pooled regresses (rather than classifies) a target.

    Parameters
    ----------
    params
        The kind's checked parameters (``task``).
    y
        The labels fit gets, used when ``numeric`` is None.
    numeric
        The target's numbers, if it has any.

    Returns
    -------
    bool
        True for ``task: regress``, or under ``task: auto`` for numbers that are not whole or take
        more than MAX_AUTO_CLASSES values.
    """
    if params.task != "auto":
        return params.task == "regress"
    vals = numeric if numeric is not None else (y if y is not None and np.asarray(y).dtype.kind in "iuf" else None)
    if vals is None:
        return False
    v = np.asarray(vals, dtype=np.float64)
    v = v[~np.isnan(v)]
    return bool(len(v) and (not np.all(v == np.round(v)) or len(np.unique(v)) > MAX_AUTO_CLASSES))


@register_kind("pooled")
class PooledProbe(LinearProbe):
    """Pooled vector -> target: ``X [n, T, d]`` (or Ragged), ``y [n]`` codes or numbers."""

    Params = PooledParams
    accepts = ("sample",)
    accepts_ragged = True

    @classmethod
    def sample_rows(cls, X: Any, params: Any) -> np.ndarray:
        return pool(X, params.pool)[:, None, :]

    @classmethod
    def sample_labels(cls, y: np.ndarray, n_rows: int) -> np.ndarray:
        y = np.asarray(y)
        if y.ndim != 1:
            raise ProbeError(f"pooled needs one label per sample, y [n]; got shape {y.shape} (use linear for per-token targets)")
        return y.astype(np.int64)[:, None]

    @property
    def regressor(self) -> bool:
        return bool(self.meta_.get("task") == "regress")

    def fit(self, X: Any, y: Any) -> PooledProbe:
        y = np.asarray(y)
        if not regresses_values(self.params, y, None):
            super().fit(X, y)
            self.meta_["task"] = "classify"
            return self
        F = self.sample_rows(X, self.params)
        self._fit_ridge(torch.from_numpy(F[:, 0][None]), [y.astype(np.float64)], 0, 0)
        return self

    def _fit_ridge(self, Xtr: torch.Tensor, ys: list[np.ndarray], g: int, col: int) -> tuple[Any, Any, Any, Any]:
        mean, scale = standardization_stats(Xtr, self.params.standardize)
        W, B = fit_ridge((Xtr - mean) / scale, np.stack(ys, 1), alpha=self.params.alpha)
        self.state_ = {"mean": mean[g, 0].numpy(), "scale": scale[g, 0].numpy(), "coef": W[g, :, col].numpy()[None],
                       "intercept": B[g, col].numpy()[None], "classes": np.zeros(0, np.int64)}
        self.meta_ = {"task": "regress"}
        return mean, scale, W, B

    def predict(self, X: Any) -> np.ndarray:
        if not self.regressor:
            return super().predict(X)[:, 0]
        F = self.sample_rows(X, self.params)[:, 0]
        s = self.state_
        return ((F - s["mean"]) / s["scale"]) @ s["coef"][0] + s["intercept"][0]

    def score(self, X: Any, y: Any) -> float:
        if not self.regressor:
            return super().score(X, y)
        return r2(np.asarray(y, dtype=np.float64), self.predict(X))

    @classmethod
    def evaluate(cls, Xs: list[Any], jobs: list[Job]) -> list[list[Outcome]]:
        regress = [regresses_values(cls.check_params(j.params), None, j.target.numeric) or j.target.classes is None for j in jobs]
        out: list[list[Outcome | None]] = [[None] * len(jobs) for _ in Xs]
        classify = [j for j, r in enumerate(regress) if not r]
        if classify:
            got = evaluate_batched(cls, Xs, [jobs[j] for j in classify])
            for g in range(len(Xs)):
                for k, j in enumerate(classify):
                    out[g][j] = got[g][k]
        for j in (j for j, r in enumerate(regress) if r):
            for g, X in enumerate(Xs):
                out[g][j] = cls._evaluate_regression(X, jobs[j])
        return out  # type: ignore[return-value]

    @classmethod
    def _evaluate_regression(cls, X: Any, job: Job) -> Outcome:
        params = cls.check_params(job.params)
        F = cls.sample_rows(X, params)[:, 0]
        y = job.target.as_numeric()
        fold = job.fold
        ys = [y] + ([y[control_permutation(len(y), fold.seed)]] if job.control else [])
        tr = fold.train & ~np.isnan(y)
        te = fold.test & ~np.isnan(y)
        probe = cls.build(job, fold.seed)
        Xtr = torch.from_numpy(F[fold.train][None])
        mean, scale, W, B = probe._fit_ridge(Xtr, [v[fold.train] for v in ys], 0, 0)
        Xte = ((torch.from_numpy(F[fold.test][None]) - mean) / scale)[0]
        preds = (Xte @ W[0] + B[0]).numpy()                                  # [m, 1 or 2]
        scores = [r2(v[fold.test], preds[:, c]) for c, v in enumerate(ys)]
        mae = float(np.nanmean(np.abs(preds[:, 0] - y[fold.test])))
        return Outcome("r2", scores[0], scores[1] if job.control else None, int(tr.sum()), int(te.sum()),
                       {"mae": mae, "task": "regress"}, probe,
                       predictions=PerSample(np.flatnonzero(fold.test), preds[:, 0].astype(np.float64), y[fold.test],
                                             control_prediction=preds[:, 1].astype(np.float64) if job.control else None))


def r2(y: np.ndarray, pred: np.ndarray) -> float:
    ok = ~np.isnan(y)
    y, pred = y[ok], pred[ok]
    ss = float(((y - y.mean()) ** 2).sum())
    return float(1.0 - ((y - pred) ** 2).sum() / ss) if ss > 0 else float("nan")
