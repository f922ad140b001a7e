"""``ridge``: closed-form ridge regression / classification, trained from streamed statistics.

Classification follows scikit-learn's ``RidgeClassifier``: one column per class, +1 for the
sample's class and -1 elsewhere, least squares with ``alpha * ||w||²`` (intercept unpenalised,
``fit_intercept=True``), prediction = the arg-max column. Regression is ``Ridge(alpha)`` on the
target's numbers, scored by R². Sample targets read one vector per sample (``pool``); token
targets read every token as a row, with the split still by sample.

In the farm the kind never holds a layer in memory: probes/stream.py accumulates XᵀX, XᵀY and
sums chunk by chunk in a Dask map-reduce and solves every target, every shuffled-label control
and every alpha of the layer from that one pass. With several ``alphas`` each probe takes the
one with the lowest generalised cross-validation error on its *training* rows (GCV, from the
eigenvalues of the same XᵀX); every alpha's test score is kept in the probe's metrics.
``fit``/``predict``/``score`` here solve the same statistics with the same solver
(probes/ridge_solve.py), computed from the rows in memory.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from probes.errors import ProbeError
from probes.kinds.base import Job, Outcome, Probe, ProbeParams, register_kind
from probes.kinds.pooled import MAX_AUTO_CLASSES
from probes.pooling import pool
from probes.ridge_solve import fit_rows
from probes.targets import Shape


class RidgeParams(ProbeParams):
    alphas: list[float] = Field([1.0], min_length=1, max_length=64,
                                description="L2 strengths (scikit-learn's alpha); GCV on the training rows picks one")
    pool: Literal["mean", "max", "first", "last"] = Field("mean", description="sample targets: how tokens become one vector")
    task: Literal["auto", "classify", "regress"] = Field(
        "auto", description=f"auto: a regression when the target's values are numbers that are not whole or take"
                            f" more than {MAX_AUTO_CLASSES} values (a count), else classes (as kind pooled)")
    standardize: bool = Field(False, description="z-score features with the training rows' statistics first")
    precision: Literal["float64", "float32"] = Field(
        "float64", description="XᵀX accumulation and solve; float32 halves memory and doubles GEMM speed")

    @field_validator("alphas")
    @classmethod
    def _positive(cls, v: list[float]) -> list[float]:
        if any(not a > 0 for a in v):
            raise ValueError("every alpha must be > 0")
        return v


def regresses(params: Any, target: Any) -> bool:
    """Whether a job's target is regressed (numbers) rather than classified."""
    if params.task != "auto":
        return params.task == "regress"
    if target.classes is None:
        return True
    if target.shape != "sample" or target.numeric is None:
        return False
    return is_quantity(target.numeric)


def classifiable(target: Any) -> bool:
    """Whether a classifier (lda, nearest_centroid) can learn a target: it has classes, and its
    numbers, if any, are whole (a count classifies, as its values; 2.5 does not)."""
    if target.classes is None:
        return False
    if target.shape != "sample" or target.numeric is None:
        return True
    v = np.asarray(target.numeric, dtype=np.float64)
    v = v[~np.isnan(v)]
    return bool(np.all(v == np.round(v)))


def is_quantity(values: np.ndarray) -> bool:
    """Task auto's rule, kind pooled's too: numbers that are not whole, or whole numbers taking more
    than MAX_AUTO_CLASSES values (a count of stones: a 121-way classifier scores a near miss as
    wrong), are regressed; a few whole values are classes."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    return bool(len(v) and (not np.all(v == np.round(v)) or len(np.unique(v)) > MAX_AUTO_CLASSES))


def one_hot(codes: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """±1 columns per class (RidgeClassifier's coding); rows of unknown codes are all -1."""
    return np.where(codes[..., None] == classes, 1.0, -1.0)


@register_kind("ridge")
class RidgeProbe(Probe):
    """X ``[n, T, d]`` (or Ragged for sample targets); y ``[n]`` or ``[n, T]`` codes or numbers."""

    Params: ClassVar[type[ProbeParams]] = RidgeParams
    accepts: ClassVar[tuple[Shape, ...]] = ("token", "sample")
    accepts_ragged = True
    trains: ClassVar[tuple[str, ...]] = ("streamed",)
    #: which solve of probes/stream.py turns the streamed statistics into weights
    stream_solver: ClassVar[Literal["ridge", "lda", "centroid"]] = "ridge"

    @classmethod
    def stream_alphas(cls, params: Any) -> tuple[float, ...]:
        """The strengths the solve tries (the A axis of the streamed weights)."""
        return tuple(params.alphas)

    @classmethod
    def stream_units(cls, y: np.ndarray, labelled: np.ndarray, fold: Any, params: Any,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(train, test) bool [n, R]: the units a streamed probe fits and scores (labels ``y``)."""
        return fold.train[:, None] & labelled, fold.test[:, None] & labelled

    @classmethod
    def stream_count_class(cls, params: Any) -> int | None:
        """A class whose predicted units the score pass counts per sample (None: no counts)."""
        return None

    def units(self, X: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
        """(rows [m, d] float64, labels [m]) of the labelled units of X."""
        y = np.asarray(y)
        if y.ndim == 2:
            X = np.asarray(X)
            if X.ndim != 3 or X.shape[:2] != y.shape:
                raise ProbeError(
                    f"ridge on a token target needs X [n, T, d] matching y {y.shape}, got {getattr(X, 'shape', '?')}")
            F, y = X.reshape(-1, X.shape[-1]), y.reshape(-1)
        else:
            F = pool(X, self.params.pool)
        ok = ~np.isnan(y) if y.dtype.kind == "f" else y >= 0
        return np.asarray(F[ok], dtype=np.float64), y[ok]

    def _regress(self, y: np.ndarray) -> bool:
        """Task auto in memory: y holds the target's numbers (what the farm regresses on) or its
        class codes; codes are integers, so only a sample target's numbers can pass the rule."""
        if self.params.task != "auto":
            return self.params.task == "regress"
        return y.ndim == 1 and y.dtype.kind in "iuf" and is_quantity(y)

    def fit(self, X: Any, y: Any) -> RidgeProbe:
        F, labels = self.units(X, y)
        if len(F) < 2:
            raise ProbeError(f"ridge needs at least 2 labelled training rows, got {len(F)}")
        regress = self._regress(np.asarray(y))
        classes = np.zeros(0, np.int64) if regress else np.unique(labels).astype(np.int64)
        Y = labels.astype(np.float64)[:, None] if regress else one_hot(labels.astype(np.int64), classes)
        W, b, gcv, alpha = fit_rows(F, Y, self.params.alphas, self.params.standardize)
        self.state_ = {"coef": W.T.copy(), "intercept": b, "classes": classes}
        self.meta_ = {"task": "regress" if regress else "classify", "alpha": alpha, "gcv": gcv.tolist()}
        return self

    def decision(self, X: Any, y_shape: tuple[int, ...] | None = None) -> np.ndarray:
        if not self.state_:
            raise ProbeError("this ridge probe is not fitted: call fit(X, y) or Probe.load(path) first")
        if y_shape is not None and len(y_shape) == 2:
            F = np.asarray(X, dtype=np.float64).reshape(-1, np.asarray(X).shape[-1])
        else:
            F = pool(X, self.params.pool).astype(np.float64)
        return F @ self.state_["coef"].T + self.state_["intercept"]

    def predict(self, X: Any, token_level: bool = False) -> np.ndarray:
        z = self.decision(X, (0, 0) if token_level else None)
        if self.meta_.get("task") == "regress":
            return z[:, 0]
        return self.state_["classes"][z.argmax(1)]

    def score(self, X: Any, y: Any) -> float:
        y = np.asarray(y)
        pred = self.predict(X, token_level=y.ndim == 2)
        flat = y.reshape(-1)
        if self.meta_.get("task") == "regress":
            ok = ~np.isnan(flat)
            from probes.kinds.pooled import r2

            return r2(flat[ok].astype(np.float64), pred[ok])
        ok = flat >= 0
        return float((pred[ok] == flat[ok]).mean()) if ok.any() else float("nan")

    @classmethod
    def evaluate_one(cls, X: Any, job: Job) -> Outcome:
        """In memory, as every kind (fit on the fold's training rows, score on its test rows, the
        control on shuffled labels), on the labels the farm's streamed trainer reads: a regressed
        sample target's numbers, else its class codes, the task decided as there (:func:`regresses`)."""
        if "task" not in cls.Params.model_fields:   # lda, nearest_centroid: classes only
            return super().evaluate_one(X, job)
        target = job.target
        regress = regresses(cls.check_params(job.params), target)
        if regress and target.shape == "sample":
            numbers = target.as_numeric() if target.numeric is not None else target.values
            target = replace(target, values=np.asarray(numbers, dtype=np.float64))
        out = super().evaluate_one(X, replace(job, target=target,
                                              params={**job.params, "task": "regress" if regress else "classify"}))
        if regress:
            out.metric = "r2"   # as the streamed trainer records it
        return out
