"""``linear``: a per-token classifier (e.g. black / white / empty at a Go intersection), and the
batched logistic-regression machinery that ``pooled`` and ``hidden_number`` share.

Every token of a training sample is one row; the split is by sample, so no image's tokens
sit on both sides. Features are standardised with the training rows' mean and std (kept in the
artifact). In the farm, all linear probes over the same features and split — every target,
every control, and several layers when the plan packs them — are one L-BFGS problem
(``probes.logreg``), which gives scikit-learn's optimum (same objective, same ``C``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from probes.errors import ProbeError
from probes.features import as_float32
from probes.kinds.base import Job, Outcome, PerSample, Probe, ProbeParams, params_json, register_kind
from probes.logreg import Solved, solve_columns
from probes.splits import control_permutation
from probes.targets import Shape


class LinearParams(ProbeParams):
    C: float = Field(1.0, gt=0, description="inverse L2 strength, as in sklearn's LogisticRegression(C)")
    max_iter: int = Field(100, ge=1, description="L-BFGS iterations (sklearn's default is 100 too)")
    tol: float = Field(1e-4, gt=0, description="stop when every gradient entry is below this")
    standardize: bool = Field(True, description="z-score features with the training rows' statistics")
    precondition: bool = Field(True, description="solve in whitened coordinates (same optimum, fewer iterations)")


@register_kind("linear")
class LinearProbe(Probe):
    """Per-token logistic regression: ``X [n, T, d]``, ``y [n, T]`` class codes (-1 = no label)."""

    Params: ClassVar[type[ProbeParams]] = LinearParams
    accepts: ClassVar[tuple[Shape, ...]] = ("token",)
    metric = "accuracy"
    #: trained out of core (probes/trainers/iterative.py) when its features exceed the worker limit;
    #: read from the class itself, not inherited: a subclass that changes evaluate opts in itself
    trains: ClassVar[tuple[str, ...]] = ("in_memory", "iterative")

    # What one sample contributes: rows [n, R, d] and labels [n, R]. pooled overrides these.
    @classmethod
    def sample_rows(cls, X: Any, params: Any) -> np.ndarray:
        X = np.asarray(X) if not hasattr(X, "offsets") else X
        if getattr(X, "ndim", 0) != 3:
            raise ProbeError(
                f"kind {cls.name} reads dense token arrays X [n, T, d]; got {type(X).__name__} {getattr(X, 'shape', '')}")
        return as_float32(X)

    @classmethod
    def sample_labels(cls, y: np.ndarray, n_rows: int) -> np.ndarray:
        y = np.asarray(y)
        if y.ndim != 2 or y.shape[1] != n_rows:
            raise ProbeError(f"kind {cls.name} needs per-token labels y [n, {n_rows}] (a token target such as"
                             f" go.intersection), got shape {y.shape}")
        return y.astype(np.int64)

    # ------------------------------------------------------------------ sklearn-like surface

    def fit(self, X: Any, y: Any) -> LinearProbe:
        F = self.sample_rows(X, self.params)
        Y = self.sample_labels(y, F.shape[1])
        fitted = solve_columns(torch.from_numpy(F.reshape(1, -1, F.shape[-1])), [Y.reshape(-1)], self.params)
        self._set_state(fitted, 0, 0)
        return self

    def _set_state(self, fitted: Solved, g: int, col: int) -> None:
        coef, intercept = fitted.weights(g, col)
        self.state_ = {"mean": fitted.mean[g, 0].numpy(), "scale": fitted.scale[g, 0].numpy(), "coef": coef,
                       "intercept": intercept, "classes": fitted.classes[col]}
        self.meta_ = {"n_iter": fitted.info.n_iter, "converged": fitted.info.converged}

    def _codes(self, F: np.ndarray) -> np.ndarray:
        if not self.state_:
            raise ProbeError(f"this {self.name} probe is not fitted: call fit(X, y) or Probe.load(path) first")
        s = self.state_
        rows = (F.reshape(-1, F.shape[-1]) - s["mean"]) / s["scale"]
        classes = s["classes"]
        if len(classes) < 2:
            return np.full(len(rows), classes[0] if len(classes) else -1, dtype=np.int64)
        z = rows @ s["coef"].T + s["intercept"]
        pick = (z[:, 0] > 0).astype(np.int64) if z.shape[1] == 1 else z.argmax(1)
        return classes[pick]

    def predict(self, X: Any) -> np.ndarray:
        F = self.sample_rows(X, self.params)
        return self._codes(F).reshape(F.shape[0], F.shape[1])

    def score(self, X: Any, y: Any) -> float:
        F = self.sample_rows(X, self.params)
        Y = self.sample_labels(y, F.shape[1]).reshape(-1)
        ok = Y >= 0
        return float((self._codes(F)[ok] == Y[ok]).mean()) if ok.any() else float("nan")

    # ------------------------------------------------------------------ the farm: batched

    @classmethod
    def evaluate(cls, Xs: list[Any], jobs: list[Job]) -> list[list[Outcome]]:
        return evaluate_batched(cls, Xs, jobs)


def evaluate_batched(cls: type[LinearProbe], Xs: list[Any], jobs: list[Job]) -> list[list[Outcome]]:
    """Jobs with the same params and split become one solve over all feature sets at once."""
    out: list[list[Outcome | None]] = [[None] * len(jobs) for _ in Xs]
    solves: dict[tuple[str, bytes, bytes], list[int]] = defaultdict(list)
    for j, job in enumerate(jobs):
        solves[(params_json(job.params), job.fold.train.tobytes(), job.fold.test.tobytes())].append(j)
    feats: dict[str, np.ndarray] = {}
    for idx in solves.values():
        params = cls.check_params(jobs[idx[0]].params)
        fold = jobs[idx[0]].fold
        fkey = params_json({k: v for k, v in params.model_dump().items() if k in ("pool",)})
        if fkey not in feats:
            feats[fkey] = np.stack([cls.sample_rows(X, params) for X in Xs])          # [G, n, R, d]
        F = feats[fkey]
        G, n, R, d = F.shape
        tr, te = np.flatnonzero(fold.train), np.flatnonzero(fold.test)
        Xtr = torch.from_numpy(np.ascontiguousarray(F[:, tr]).reshape(G, -1, d))
        Xte = torch.from_numpy(np.ascontiguousarray(F[:, te]).reshape(G, -1, d))
        cols: list[tuple[int, bool]] = []
        ytr: list[np.ndarray] = []
        yte: list[np.ndarray] = []
        for j in idx:
            job = jobs[j]
            variants = [(False, job.target.values)]
            if job.control:
                variants.append((True, job.target.permuted(control_permutation(n, fold.seed)).values))
            for is_control, y in variants:
                Y = cls.sample_labels(y, R)
                cols.append((j, is_control))
                ytr.append(Y[tr].reshape(-1))
                yte.append(Y[te].reshape(-1))
        solved = solve_columns(Xtr, ytr, params)
        preds = solved.predict((Xte - solved.mean) / solved.scale)
        share = solved.info.flops / max(G * len(idx), 1)
        column = {jc: c for c, jc in enumerate(cols)}
        for g in range(G):
            scores: dict[tuple[int, bool], float] = {}
            for c, (j, is_control) in enumerate(cols):
                ok = yte[c] >= 0
                scores[(j, is_control)] = float((preds[c][g][ok] == yte[c][ok]).mean()) if ok.any() else float("nan")
            for c, (j, is_control) in enumerate(cols):
                if is_control:
                    continue
                job = jobs[j]
                probe = cls.build(job, fold.seed)
                probe._set_state(solved, g, c)
                labelled = yte[c][yte[c] >= 0]
                majority = float(np.bincount(labelled).max() / len(labelled)) if len(labelled) else float("nan")
                samples = per_sample(te, preds[c][g], yte[c], R, job.target.classes)
                if (j, True) in column:  # the control's predictions, scored against the real labels
                    ctl = per_sample(te, preds[column[(j, True)]][g], yte[c], R, job.target.classes)
                    samples.control_prediction, samples.control_score = ctl.prediction, ctl.score
                out[g][j] = Outcome(
                    cls.metric, scores[(j, False)], scores.get((j, True)),
                    int((job.target.labelled() & fold.train).sum()), int((job.target.labelled() & fold.test).sum()),
                    {"majority": majority, "n_train_rows": int((ytr[c] >= 0).sum()), "n_iter": solved.info.n_iter,
                     "converged": solved.info.converged},
                    probe, share, predictions=samples,
                )
    return out  # type: ignore[return-value]


def per_sample(positions: np.ndarray, pred: np.ndarray, truth: np.ndarray, R: int,
               classes: tuple[Any, ...] | None) -> PerSample:
    """Test samples of a token or sample classifier: each sample's accuracy over its labelled
    rows; a one-row (pooled) sample whose classes are numbers (a count) also the predicted and
    true number (class codes of a categorical target are no numbers to average)."""
    P, Y = pred.reshape(len(positions), R), truth.reshape(len(positions), R)
    ok = Y >= 0
    with np.errstate(invalid="ignore", divide="ignore"):
        score = ((P == Y) & ok).sum(1) / ok.sum(1)
    numeric = bool(classes) and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in classes or ())
    if R != 1 or not numeric:
        return PerSample(positions, None, None, score)
    numbers = np.asarray(classes, dtype=np.float64)
    truth_v = np.where(ok[:, 0], numbers[np.where(ok[:, 0], Y[:, 0], 0)], np.nan)
    return PerSample(positions, numbers[np.clip(P[:, 0], 0, len(numbers) - 1)], truth_v, score)
