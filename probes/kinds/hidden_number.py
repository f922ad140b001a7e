"""``hidden_number``: the counting lab's per-token probe and its hidden number N_H (counting-bottleneck).

The study's probe: docs/studies.md#counting-bottleneck-hidden-number.

A 3-class linear probe (black / white / empty, the codes of ``go.intersection``) is trained on
boards whose count is in the vision-trained range (``train_max_count``, 49 by default; a plan's
``train_where`` narrows further). As in the study, each training board gives ``per_board``
tokens: one black plus one white (even boards) or one empty (odd boards), so black : rest is
1 : 1. N_H = number of a test board's tokens predicted black; the score is the exact match of
N_H with the board's true count, over all test boards, with the same per regime
(ID <= 49, VE <= 99, FE above) and mean |N_H - count| in the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from probes.errors import ProbeError
from probes.kinds.base import Job, Outcome, PerSample, register_kind
from probes.kinds.linear import LinearParams, LinearProbe
from probes.kinds.ridge import RidgeParams, RidgeProbe, one_hot
from probes.logreg import solve_columns
from probes.ridge_solve import fit_rows
from probes.splits import control_permutation
from probes.targets import Shape

REGIMES = ((49, "ID"), (99, "VE"), (None, "FE"))


class HiddenNumberParams(LinearParams):
    black: int = Field(0, ge=0, description="class code of 'black' in the token labels")
    train_max_count: int | None = Field(49, ge=0, description="train on boards with at most this many black stones")
    per_board: int = Field(2, ge=0, description="training tokens per board (study: 2); 0 = every token")
    max_iter: int = Field(50, ge=1, description="the study's LogisticRegression(max_iter=50)")


def regime(count: int) -> str:
    for upper, name in REGIMES:
        if upper is None or count <= upper:
            return name
    return "FE"


@register_kind("hidden_number")
class HiddenNumberProbe(LinearProbe):
    """``X [n, T, d]`` board tokens, ``y [n, T]`` black/white/empty codes; predicts N_H per board."""

    Params = HiddenNumberParams
    accepts = ("token",)
    metric = "exact_match"
    # No out-of-core path: its least-squares twin streams the same boards.
    trains = ("in_memory",)
    memory_fix = "use kind hidden_number_ridge (N_H from streamed statistics), layers_per_task: 1,"

    def _train_tokens(self, y: np.ndarray) -> np.ndarray:
        """Mask [n, T] of the tokens each training board contributes."""
        return train_tokens(y, self.params, self.random_state)

    def fit(self, X: Any, y: Any) -> HiddenNumberProbe:
        F = self.sample_rows(X, self.params)
        Y = self.sample_labels(y, F.shape[1])
        keep = self._train_tokens(Y)
        labels = np.where(keep, Y, -1).reshape(-1)
        fitted = solve_columns(torch.from_numpy(F.reshape(1, -1, F.shape[-1])), [labels], self.params)
        self._set_state(fitted, 0, 0)
        return self

    def hidden_number(self, X: Any) -> np.ndarray:
        """N_H per board: tokens predicted black."""
        return (LinearProbe.predict(self, X) == self.params.black).sum(1)

    def predict(self, X: Any) -> np.ndarray:
        return self.hidden_number(X)

    def score(self, X: Any, y: Any) -> float:
        counts = (np.asarray(y) == self.params.black).sum(1)
        return float((self.hidden_number(X) == counts).mean()) if len(counts) else float("nan")

    def metrics(self, X: Any, y: Any) -> dict[str, Any]:
        y = np.asarray(y)
        return count_metrics(self.hidden_number(X), (y == self.params.black).sum(1)) | {
            "token_accuracy": LinearProbe.score(self, X, y)}

    @classmethod
    def evaluate(cls, Xs: list[Any], jobs: list[Job]) -> list[list[Outcome]]:
        # Real and control differ in their training tokens, so each pair is its own small solve
        # (a few thousand rows); scoring predicts every token of every test board.
        out: list[list[Outcome]] = [[] for _ in Xs]
        for job in jobs:
            params = cls.check_params(job.params)
            fold = job.fold
            ys = [job.target.values]
            if job.control:
                ys.append(job.target.permuted(control_permutation(len(ys[0]), fold.seed)).values)
            for g, X in enumerate(Xs):
                F = cls.sample_rows(X, params)
                results = []
                for y in ys:
                    probe = cls.build(job, fold.seed)
                    tr = fold.train & (y >= 0).any(1)
                    probe.fit(F[tr], y[tr])
                    te = fold.test & (y >= 0).all(1)
                    results.append((probe, probe.score(F[te], y[te]), probe.metrics(F[te], y[te]), tr, te))
                probe, score, metrics, tr, te = results[0]
                boards = _per_board(probe, F, ys[0], te)
                if job.control:  # the control's N_H on the same test boards, against their real count
                    ctl = _per_board(results[1][0], F, ys[0], te)
                    boards.control_prediction, boards.control_score = ctl.prediction, ctl.score
                out[g].append(Outcome(cls.metric, score, results[1][1] if job.control else None,
                                      int(tr.sum()), int(te.sum()), metrics, probe, predictions=boards))
        return out


def _per_board(probe: Any, F: np.ndarray, y: np.ndarray, te: np.ndarray) -> PerSample:
    """Each test board's N_H beside its true count N_G, and 1/0 exact."""
    n_h = probe.hidden_number(F[te]).astype(np.float64)
    n_g = (np.asarray(y)[te] == probe.params.black).sum(1).astype(np.float64)
    return PerSample(np.flatnonzero(te), n_h, n_g, (n_h == n_g).astype(np.float64))


def train_tokens(y: np.ndarray, params: Any, seed: int) -> np.ndarray:
    """The study's sampling: per eligible board, ``per_board / 2`` black tokens and as many
    others (white on even boards, empty on odd ones, falling back to any non-black)."""
    y = np.asarray(y)
    counts = (y == params.black).sum(1)
    eligible = (y >= 0).any(1)
    if params.train_max_count is not None:
        eligible &= counts <= params.train_max_count
    if not eligible.any():
        raise ProbeError(
            f"hidden_number: no training board has <= {params.train_max_count} black stones;"
            " raise train_max_count or select in-range boards"
        )
    keep = np.zeros(y.shape, dtype=bool)
    if params.per_board == 0:
        keep[eligible] = y[eligible] >= 0
        return keep
    rng = np.random.default_rng([seed, 49])
    half = max(params.per_board // 2, 1)
    others = [c for c in range(int(y.max()) + 1) if c != params.black]
    for b in np.flatnonzero(eligible):
        row = y[b]
        black = np.flatnonzero(row == params.black)
        keep[b, rng.choice(black, min(half, len(black)), replace=False)] = True
        want = others[b % len(others)] if others else None
        pool = np.flatnonzero(row == want) if want is not None else np.zeros(0, int)
        if len(pool) == 0:
            pool = np.flatnonzero((row >= 0) & (row != params.black))
        if len(pool):
            keep[b, rng.choice(pool, min(half, len(pool)), replace=False)] = True
    return keep


def count_metrics(n_h: np.ndarray, counts: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {"mean_abs_error": float(np.abs(n_h - counts).mean()) if len(counts) else float("nan")}
    per: dict[str, Any] = {}
    names: Iterable[str] = dict.fromkeys(regime(int(c)) for c in counts)
    labels = np.array([regime(int(c)) for c in counts])
    for name in names:
        m = labels == name
        per[name] = {"n": int(m.sum()), "exact_match": float((n_h[m] == counts[m]).mean()),
                     "mean_abs_error": float(np.abs(n_h[m] - counts[m]).mean())}
    out["per_regime"] = per
    return out


class HiddenNumberRidgeParams(RidgeParams):
    task: Literal["classify"] = Field("classify", description="always classify (black / white / empty per token)")
    black: int = Field(0, ge=0, description="class code of 'black' in the token labels")
    train_max_count: int | None = Field(49, ge=0, description="train on boards with at most this many black stones")
    per_board: int = Field(2, ge=0, description="training tokens per board (study: 2); 0 = every token")


@register_kind("hidden_number_ridge")
class HiddenNumberRidgeProbe(RidgeProbe):
    """The N_H probe as a statistics kind: the same boards, tokens and N_H as ``hidden_number``,
    with ridge's least-squares classifier (scikit-learn's ``RidgeClassifier``) in place of the
    logistic one, so the farm trains it from one streamed pass (probes/stream.py counts each
    test board's tokens predicted black in its scoring pass). ``X [n, T, d]``, ``y [n, T]``."""

    Params = HiddenNumberRidgeParams
    accepts: ClassVar[tuple[Shape, ...]] = ("token",)
    accepts_ragged = False
    metric = "exact_match"

    @classmethod
    def stream_units(cls, y: np.ndarray, labelled: np.ndarray, fold: Any, params: Any,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Training tokens: ``train_tokens`` of the labelled training boards (drawn as the
        in-memory fit draws them); test units: every token of test boards labelled throughout."""
        boards = fold.train & labelled.any(1)
        train = np.zeros_like(labelled)
        train[boards] = train_tokens(y[boards], params, seed)
        return train, (fold.test & labelled.all(1))[:, None] & labelled

    @classmethod
    def stream_count_class(cls, params: Any) -> int | None:
        return int(params.black)

    def fit(self, X: Any, y: Any) -> HiddenNumberRidgeProbe:
        X, y = np.asarray(X), np.asarray(y).astype(np.int64)
        keep = train_tokens(y, self.params, self.random_state)
        F, labels = X[keep].astype(np.float64), y[keep]
        if len(F) < 2:
            raise ProbeError(f"{self.name} needs at least 2 training tokens, got {len(F)}")
        classes = np.unique(labels)
        W, b, gcv, alpha = fit_rows(F, one_hot(labels, classes), self.params.alphas, self.params.standardize)
        self.state_ = {"coef": W.T.copy(), "intercept": b, "classes": classes}
        self.meta_ = {"task": "classify", "alpha": alpha, "gcv": gcv.tolist()}
        return self

    def hidden_number(self, X: Any) -> np.ndarray:
        """N_H per board: tokens predicted black."""
        X = np.asarray(X)
        pred = RidgeProbe.predict(self, X, token_level=True).reshape(X.shape[:2])
        return (pred == self.params.black).sum(1)

    def predict(self, X: Any, token_level: bool = False) -> np.ndarray:
        return RidgeProbe.predict(self, X, token_level=True) if token_level else self.hidden_number(X)

    def score(self, X: Any, y: Any) -> float:
        counts = (np.asarray(y) == self.params.black).sum(1)
        return float((self.hidden_number(X) == counts).mean()) if len(counts) else float("nan")

    def metrics(self, X: Any, y: Any) -> dict[str, Any]:
        y = np.asarray(y)
        token = RidgeProbe.predict(self, X, token_level=True) == y.reshape(-1)
        return count_metrics(self.hidden_number(X), (y == self.params.black).sum(1)) | {
            "token_accuracy": float(token.mean())}
