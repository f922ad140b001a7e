"""Ridge in its dual (kernel) form, for streamed designs with fewer training rows than features.

A pooled probe over a wide model trains on one row per sample: a few hundred rows at d = 3,584.
The primal solve of probes/stream.py accumulates the d×d XᵀX (n d² flops in the maps), holds it
(49 MiB float32 at d = 3,584, 2 copies per merge) and factors it once per alpha (d³/3 each, plus
an eigh of 4/3 d³ for GCV): ~20 GFLOP per layer for one alpha, ~128 for four. Here the maps keep
the training rows themselves (n×d) and the solve forms the n×n centred Gram matrix K = Z Zᵀ of the
(optionally standardised) rows Z; one eigendecomposition K = U Λ Uᵀ serves every alpha:

* dual coefficients B = U (Λ + α)⁻¹ Uᵀ Yc, weights w = Zᵀ B (the primal's w: (ZᵀZ + α)⁻¹ ZᵀYc
  = Zᵀ (ZZᵀ + α)⁻¹ Yc), mapped back to feature units by the same per-feature scale;
* residuals Yc - Z w = α U (Λ + α)⁻¹ Uᵀ Yc, and the degrees of freedom Σ λ/(λ + α) (the nonzero
  eigenvalues of ZZᵀ are those of ZᵀZ), so GCV is the primal's exactly.

The arithmetic runs in float64 whatever the kind's precision (which sets how the rows are held):
at n < d it is a small share of the layer's time. Which form a Solve takes is decided by cost
(:func:`chooses_dual`) when the client builds the spec, and recorded in every probe's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Rows:
    """A dual map's output: the training units it read (``units``: position × R + token) and
    their features ``X`` [m, d] in the kind's precision."""

    units: np.ndarray            # int64 [m]
    X: np.ndarray                # [m, d]

    @property
    def nbytes(self) -> int:
        return int(self.units.nbytes + self.X.nbytes)


def merge_rows(a: Rows | None, b: Rows | None) -> Rows | None:
    """The rows of two partitions (reduce task: the statistics are the rows themselves)."""
    if a is None or b is None:
        return a if b is None else b
    return Rows(np.concatenate([a.units, b.units]), np.concatenate([a.X, b.X]))


def primal_flops(n: float, d: int, c: int, alphas: int) -> float:
    """Flops of the primal path for one Solve: its XᵀX updates (d(d+1) per row, as probes/stream.py
    counts them), one Cholesky factor and solve per alpha, one eigh for GCV when several."""
    return n * d * (d + 1) + alphas * (d**3 / 3 + 2.0 * d * d * c) + (4 / 3 * d**3 if alphas > 1 else 0.0)


def dual_flops(n: float, d: int, c: int, alphas: int) -> float:
    """Flops of :func:`solve_rows`: the Gram matrix, an eigendecomposition with vectors (Golub and
    Van Loan's ~9n³), Uᵀ Yc, then per alpha U (Λ + α)⁻¹ Q and Zᵀ B."""
    return n * (n + 1) * d + 9.0 * n**3 + 2.0 * n * n * c + alphas * (2.0 * n * n * c + 2.0 * n * d * c)


def chooses_dual(n_solves: list[float], n_union: int, d: int, cols: list[int], alphas: int) -> bool:
    """Whether a spec's Solves (training units ``n_solves``, ``cols`` label columns each) keep their
    rows and solve in the dual: when the rows held (the union of the training units, n_union × d)
    are fewer than d and the dual's flops are fewer than the primal's."""
    if n_union >= d:
        return False
    dual = sum(dual_flops(n, d, c, alphas) for n, c in zip(n_solves, cols, strict=True))
    return dual < sum(primal_flops(n, d, c, alphas) for n, c in zip(n_solves, cols, strict=True))


def solve_rows(X: np.ndarray, Y: np.ndarray, alphas: tuple[float, ...],
               standardize: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(W [d, c, A], b [c, A], GCV [c, A], flops) of ridge on training rows X [n, d], labels Y [n, c]:
    what probes/stream.py's solve_stats gives from their statistics (GCV only when several alphas)."""
    from scipy.linalg import eigh

    n, d = X.shape
    c, A = Y.shape[1], len(alphas)
    mx = X.mean(0, dtype=np.float64)
    Z = X.astype(np.float64)                 # one n×d float64 copy (the memory plan counts it)
    Z -= mx
    # solve_stats's scale: sqrt(diag(XᵀX_centred) / n), the training rows' population std
    scale = np.sqrt(np.einsum("nd,nd->d", Z, Z) / n) if standardize else np.ones(d)
    scale[scale < 1e-8] = 1.0
    if standardize:
        Z /= scale
    my = Y.mean(0)
    lam, U = eigh(Z @ Z.T, overwrite_a=True, check_finite=False)
    lam = np.maximum(lam, 0.0)               # K is PSD; rounding may leave tiny negatives
    Q = U.T @ (Y - my)                       # [n, c]
    shrink = 1.0 / (lam[:, None, None] + np.asarray(alphas)[None, None, :])   # [n, 1, A]
    B = np.einsum("nk,kca->nca", U, Q[:, :, None] * shrink)                # [n, c, A]
    W = (Z.T @ B.reshape(n, c * A)).reshape(d, c, A) / scale[:, None, None]
    gcv = np.full((c, A), np.nan)
    if A > 1:
        for i, alpha in enumerate(alphas):
            rss = ((alpha * Q * shrink[:, :, i]) ** 2).sum(0)
            df = float((lam / (lam + alpha)).sum())
            gcv[:, i] = n * rss / max(n - df - 1, 1e-12) ** 2
    b = my[:, None] - np.einsum("d,dca->ca", mx, W)
    return W, b, gcv, dual_flops(n, d, c, A)
