"""``lda`` and ``nearest_centroid``: linear discriminant analysis and nearest centroid, trained
from the same streamed statistics as ``ridge``.

Both are classifiers whose decision is linear in the features, so they reuse ridge's streamed
map, merge and score passes (probes/stream.py) and differ only in the solve. Ridge's ±1 one-hot
columns already hold what they need: a class column's centred XᵀY is ``2 n_k (μ_k - μ)`` and its
mean ``2 n_k / n - 1``, so the class counts n_k and means μ_k come from XᵀY and the sums, and the
pooled within-class scatter is the centred XᵀX minus the between-class part,
``S_w = XᵀX - Σ_k n_k (μ_k - μ)(μ_k - μ)ᵀ``.

* ``lda`` follows scikit-learn's ``LinearDiscriminantAnalysis(solver="lsqr", shrinkage=s)`` with
  priors from the class frequencies: Σ = S_w / n shrunk to ``(1 - s) Σ + s tr(Σ)/d I`` (shrinking
  each class covariance and weighting by the priors is the same, shrinkage being linear),
  ``w_k = Σ⁻¹ μ_k``, ``b_k = -½ μ_kᵀ w_k + log(n_k / n)``; prediction = the arg-max class.
* ``nearest_centroid`` is ``NearestCentroid()`` (Euclidean): the nearest class mean, i.e. the arg-max of
  ``2 xᵀμ_k - ‖μ_k‖²``; the stream skips XᵀX for it.

``fit`` here is the in-memory reference (class means and scatter straight from the rows), which
the streamed result is tested against; a fitted probe stores ``coef`` [K, d], ``intercept`` [K]
and ``classes`` as ridge does, so it predicts and scores with ridge's code.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from probes.class_solve import centroid_weights, lda_solve, lda_weights, lw_covariance
from probes.errors import ProbeError
from probes.kinds.base import ProbeParams, register_kind
from probes.kinds.ridge import RidgeProbe
from probes.moments import Moments


class LDAParams(ProbeParams):
    shrinkage: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = Field(
        0.0, description="scikit-learn's shrinkage: (1-s) Σ + s tr(Σ)/d I; > 0 when d nears the rows; auto: Ledoit–Wolf"
                         " per class (streams 3 d×d float64 moments per class)")
    pool: Literal["mean", "max", "first", "last"] = Field("mean", description="sample targets: how tokens become one vector")
    precision: Literal["float64", "float32"] = Field("float64", description="XᵀX accumulation (float32: half the memory)")


class CentroidParams(ProbeParams):
    pool: Literal["mean", "max", "first", "last"] = Field("mean", description="sample targets: how tokens become one vector")
    precision: Literal["float64", "float32"] = Field("float64", description="feature sums accumulation")


class _ClassMeans(RidgeProbe):
    """In-memory fit from the rows; decision, predict and score are ridge's (linear, arg-max)."""


    def _regress(self, y: np.ndarray) -> bool:
        return False

    def _weights(self, means: np.ndarray, counts: np.ndarray, F: np.ndarray, labels: np.ndarray) -> tuple[Any, Any]:
        raise NotImplementedError

    def fit(self, X: Any, y: Any) -> _ClassMeans:
        y = np.asarray(y)
        if y.dtype.kind == "f" and not np.all(y[~np.isnan(y)] == np.round(y[~np.isnan(y)])):
            raise ProbeError(f"kind {self.name} classifies; this target holds non-integer numbers: use kind ridge")
        F, labels = self.units(X, y)
        labels = labels.astype(np.int64)
        classes = np.unique(labels)
        if len(F) < 2:
            raise ProbeError(f"{self.name} needs at least 2 labelled training rows, got {len(F)}")
        means = np.stack([F[labels == k].mean(0) for k in classes])
        counts = np.array([(labels == k).sum() for k in classes], dtype=np.float64)
        W, b = self._weights(means, counts, F, labels)
        self.state_ = {"coef": np.ascontiguousarray(W.T), "intercept": b, "classes": classes}
        self.meta_ = {"task": "classify"}
        return self


@register_kind("lda")
class LDAProbe(_ClassMeans):
    """X ``[n, T, d]`` (or Ragged for sample targets); y ``[n]`` or ``[n, T]`` class codes."""

    Params = LDAParams
    stream_solver = "lda"

    @classmethod
    def stream_alphas(cls, params: Any) -> tuple[float, ...]:
        return (0.0 if params.shrinkage == "auto" else params.shrinkage,)

    def _weights(self, means: np.ndarray, counts: np.ndarray, F: np.ndarray, labels: np.ndarray) -> tuple[Any, Any]:
        classes = np.unique(labels)
        if self.params.shrinkage == "auto":
            moments = [Moments.empty(m) for m in means]
            for m, k in zip(moments, classes, strict=True):
                m.add(F[labels == k])
            return lda_solve(means, counts, lw_covariance(list(moments), counts))
        R = F - means[np.searchsorted(classes, labels)]
        return lda_weights(means, counts, R.T @ R, self.params.shrinkage)


@register_kind("nearest_centroid")
class NearestCentroidProbe(_ClassMeans):
    """X ``[n, T, d]`` (or Ragged for sample targets); y ``[n]`` or ``[n, T]`` class codes."""

    Params = CentroidParams
    stream_solver = "centroid"

    @classmethod
    def stream_alphas(cls, params: Any) -> tuple[float, ...]:
        return (0.0,)

    def _weights(self, means: np.ndarray, counts: np.ndarray, F: np.ndarray, labels: np.ndarray) -> tuple[Any, Any]:
        return centroid_weights(means)
