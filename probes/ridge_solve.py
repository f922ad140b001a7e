"""Ridge regression's one solver: centred sufficient statistics in, every alpha's weights and
GCV errors out. The streamed trainer accumulates the statistics chunk by chunk
(probes/stream.py); an in-memory ``fit`` (probes/kinds/ridge.py) computes them from its rows
(:func:`row_stats`) and solves them the same way, so a probe fitted in memory and one trained by
the farm differ only by the order of their sums. (Ridge's dual form, for fewer rows than
features, is probes/ridge_dual.py.) Imports numpy and scipy only: streamed workers import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from probes.moments import Moments


@dataclass
class Stats:
    """Centred sufficient statistics of one Solve (or of rows in memory) (``xx``: upper triangle valid, Fortran order)."""

    n: float
    mx: np.ndarray               # float64 [d]
    my: np.ndarray               # float64 [c]
    xx: np.ndarray               # [d, d] precision dtype
    xy: np.ndarray               # float64 [d, c]
    yy: np.ndarray               # float64 [c]
    moments: list[list[Moments | None]] | None = None   # ledoit_wolf: [variant][class]



def solve_stats(st: Stats, alphas: tuple[float, ...], standardize: bool,
                gcv_always: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Ridge on centred statistics, every alpha from one set of them (scikit-learn's objective:
    ‖y - Xw - b‖² + α‖w‖², intercept unpenalised): one Cholesky factor of XᵀX + αI per alpha.

    Parameters
    ----------
    st
        The training rows' statistics; ``st.xx`` is overwritten (the caller owns it).
    alphas
        The strengths.
    standardize
        Solve on z-scored features (the rows' population std), weights returned in original units.
    gcv_always
        Compute the GCV error (an eigendecomposition) with a single alpha too, where there is
        nothing to pick but the caller records it.

    Returns
    -------
    tuple
        (W [d, c, A], b [c, A], GCV [c, A] (NaN where not computed), flops).
    """
    from scipy.linalg import eigh, lapack

    C = st.xx                                  # overwritten: the task owns it
    d, c = C.shape[0], st.xy.shape[1]
    scale = np.sqrt(np.maximum(np.diag(C).astype(np.float64), 0) / st.n) if standardize else np.ones(d)
    scale[scale < 1e-8] = 1.0
    if standardize:
        inv = (1.0 / scale).astype(C.dtype)
        C *= inv[:, None]
        C *= inv[None, :]
    xy = (st.xy / scale[:, None]).astype(C.dtype)
    work = np.empty_like(C, order="F")
    potrf, potrs = (lapack.dpotrf, lapack.dpotrs) if C.dtype == np.float64 else (lapack.spotrf, lapack.spotrs)
    eig = None
    if len(alphas) > 1 or gcv_always:
        np.copyto(work, C)
        eig = eigh(work, eigvals_only=True, lower=False, overwrite_a=True, check_finite=False).astype(np.float64)
    W = np.empty((d, c, len(alphas)))
    gcv = np.full((c, len(alphas)), np.nan)
    for i, alpha in enumerate(alphas):
        np.copyto(work, C)
        work.flat[:: d + 1] += alpha
        factor, info = potrf(work, lower=0, overwrite_a=1, clean=0)
        if info != 0:
            raise ValueError(f"ridge: X'X + {alpha} I is not positive definite (LAPACK info {info}); raise alpha")
        w, info = potrs(factor, xy, lower=0)
        w = np.asarray(w, dtype=np.float64)
        W[:, :, i] = w / scale[:, None]
        if eig is not None:
            rss = st.yy - (w * xy).sum(0) - alpha * (w * w).sum(0)
            df = float((eig / (eig + alpha)).sum())
            gcv[:, i] = st.n * np.maximum(rss, 0) / max(st.n - df - 1, 1e-12) ** 2
    b = st.my[:, None] - np.einsum("d,dca->ca", st.mx, W)
    flops = len(alphas) * (d**3 / 3 + 2.0 * d * d * c) + (4 / 3 * d**3 if eig is not None else 0.0)
    del work
    return W, b, gcv, flops


def row_stats(F: np.ndarray, Y: np.ndarray) -> Stats:
    """Centred float64 statistics of rows held in memory.

    Parameters
    ----------
    F
        Features [n, d].
    Y
        Label columns [n, c] (numbers, or ±1 per class).

    Returns
    -------
    Stats
        What :func:`solve_stats` solves (``xx`` full, not only its upper triangle).
    """
    F = np.asarray(F, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    mx, my = F.mean(0), Y.mean(0)
    Xc, Yc = F - mx, Y - my
    return Stats(float(len(F)), mx, my, np.asfortranarray(Xc.T @ Xc), Xc.T @ Yc, (Yc * Yc).sum(0))


def gcv_pick(gcv: np.ndarray) -> int:
    """Index of the alpha a probe keeps: least GCV summed over its columns (the first when tied).

    Parameters
    ----------
    gcv
        [c, A] (or [A]) GCV errors.

    Returns
    -------
    int
        0 where no GCV is finite.
    """
    total = np.nansum(gcv, axis=0) if gcv.ndim == 2 else gcv
    return int(np.argmin(total)) if np.isfinite(total).any() else 0


def fit_rows(F: np.ndarray, Y: np.ndarray, alphas: list[float] | tuple[float, ...],
             standardize: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Ridge on rows in memory, through :func:`solve_stats`; GCV on the rows picks the alpha.

    Parameters
    ----------
    F
        Training features [n, d].
    Y
        Training label columns [n, c].
    alphas
        The strengths tried.
    standardize
        Z-score the features first.

    Returns
    -------
    tuple
        (W [d, c], b [c], GCV summed over columns [A], the chosen alpha).
    """
    alphas = tuple(float(a) for a in alphas)
    W, b, gcv, _ = solve_stats(row_stats(F, Y), alphas, standardize, gcv_always=True)
    pick = 0 if len(alphas) == 1 else gcv_pick(gcv)
    return W[:, :, pick], b[:, pick], np.nansum(gcv, axis=0), alphas[pick]
