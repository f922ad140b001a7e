"""The class-mean solvers of ``lda`` and ``nearest_centroid``, in memory (probes/kinds/lda.py) and
from ridge's streamed statistics (probes/stream.py) alike: class means and counts, a pooled (or
Ledoit–Wolf, per class) within-class covariance, and the linear arg-max rule they make. Imports
numpy and scipy only: streamed workers import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from probes.errors import ProbeError

if TYPE_CHECKING:
    from probes.moments import Moments
    from probes.ridge_solve import Stats
    from probes.stream import Solve


def lda_weights(means: np.ndarray, counts: np.ndarray, scatter: np.ndarray,
                shrinkage: float) -> tuple[np.ndarray, np.ndarray]:
    """(W [d, K], b [K]) of LDA from class means [K, d], counts [K] and the within-class scatter."""
    n, d = float(counts.sum()), scatter.shape[0]
    cov = scatter / n
    if shrinkage:
        cov = (1.0 - shrinkage) * cov
        cov.flat[:: d + 1] += shrinkage * np.trace(scatter / n) / d
    return lda_solve(means, counts, cov)


def lda_solve(means: np.ndarray, counts: np.ndarray, cov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W [d, K], b [K]) of LDA from class means, counts and the (shrunk) within-class covariance."""
    from scipy.linalg import LinAlgError, cho_factor, cho_solve

    n, d = float(counts.sum()), cov.shape[0]
    try:
        W = cho_solve(cho_factor(cov, lower=False, check_finite=False), means.T, check_finite=False)
    except LinAlgError:
        raise ProbeError(f"lda: the within-class covariance ({d} features, {int(n)} rows) is singular:"
                         " set the kind's shrinkage above 0 (e.g. 0.1)") from None
    return W, -0.5 * np.einsum("kd,dk->k", means, W) + np.log(counts / n)


def lw_covariance(moments: list[Moments | None], counts: np.ndarray) -> np.ndarray:
    """Σ_k (n_k / n) Σ_k with Σ_k each class's Ledoit–Wolf-shrunk covariance (scikit-learn's ``_class_cov``)."""
    cov = np.zeros((len(moments[0].shift),) * 2) if moments and moments[0] is not None else None
    for m, n_k in zip(moments, counts, strict=True):
        if m is None or cov is None:
            raise ProbeError("lda shrinkage auto: a class has no training rows; select rows holding every class")
        cov += (n_k / counts.sum()) * m.covariance()[1]
    assert cov is not None, "at least one class"
    return cov


def centroid_weights(means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W [d, K], b [K]): arg-max of 2 xᵀμ_k - ‖μ_k‖² is the nearest mean."""
    return 2.0 * means.T, -(means * means).sum(1)


def solve_classes(st: Stats, solve_: Solve, method: str,
                  shrinkage: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(W [d, c, 1], b [c, 1], GCV zeros, flops) of LDA or nearest centroid per variant of a
    Solve, from ridge's statistics: a ±1 class column's centred XᵀY is 2 n_k (μ_k - μ) and its
    mean 2 n_k / n - 1 (probes/kinds/lda.py)."""
    d, c = st.xy.shape
    W, b = np.zeros((d, c, 1)), np.zeros((c, 1))
    flops = 0.0
    full = None
    for v, var in enumerate(solve_.variants):
        cols = slice(var.start, var.stop)
        counts = np.maximum(np.round(st.n * (st.my[cols] + 1.0) / 2.0), 1.0)
        between = st.xy[:, cols] / 2.0                       # [d, K]: n_k (μ_k - μ)
        means = st.mx[None, :] + (between / counts).T        # [K, d]
        if method == "centroid":
            w, bias = centroid_weights(means)
        elif st.moments is not None:      # Ledoit–Wolf: each class's own shrunk covariance, prior-weighted
            w, bias = lda_solve(means, counts, lw_covariance(st.moments[v], counts))
            flops += d**3 / 3 + 2.0 * d * d * (var.stop - var.start)
        else:
            if full is None:
                upper = np.triu(st.xx.astype(np.float64))
                full = upper + np.triu(upper, 1).T
            w, bias = lda_weights(means, counts, full - (between / counts) @ between.T, shrinkage)
            flops += d**3 / 3 + 2.0 * d * d * (var.stop - var.start)
        W[:, cols, 0], b[cols, 0] = w, bias
    return W, b, np.zeros((c, 1)), flops
