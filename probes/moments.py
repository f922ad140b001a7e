"""Per-class moments up to the fourth, streamed, for LDA's Ledoit–Wolf shrinkage (``lda``'s
``shrinkage: auto``, scikit-learn's ``LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto")``).

scikit-learn shrinks each class's covariance on its *standardised* rows z = (x - μ_k) / σ_k: the
Ledoit–Wolf coefficient needs the correlation matrix C_k = Σ z zᵀ / n_k and Σ ‖z‖⁴. Both depend
on the class mean and standard deviations, known only after the pass, so a map keeps raw moments
about a shift (the class's first rows' mean, to keep the sums well conditioned): n, Σy, Σyyᵀ,
Σ(y∘y)yᵀ and Σ(y∘y)(y∘y)ᵀ with y = x - shift (three d×d float64 matrices per class). Moments about
one origin move exactly to another (:meth:`Moments.moved`), so partitions merge, and the solve
moves them to the class mean: Σ‖z‖⁴ = aᵀ M4 a with a = 1/σ².
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Moments:
    """One class's raw moments of y = x - shift."""

    shift: np.ndarray            # [d]
    n: float
    sv: np.ndarray               # Σ y [d]
    S: np.ndarray                # Σ y yᵀ [d, d]
    T3: np.ndarray               # Σ (y∘y) yᵀ [d, d]
    M4: np.ndarray               # Σ (y∘y)(y∘y)ᵀ [d, d]

    @classmethod
    def empty(cls, shift: np.ndarray) -> Moments:
        d = len(shift)
        return cls(np.asarray(shift, np.float64), 0.0, np.zeros(d), np.zeros((d, d)), np.zeros((d, d)), np.zeros((d, d)))

    def add(self, X: np.ndarray) -> float:
        """Add rows X [m, d]; the flops spent."""
        Y = X.astype(np.float64) - self.shift
        U = Y * Y
        self.n += len(Y)
        self.sv += Y.sum(0)
        self.S += Y.T @ Y
        self.T3 += U.T @ Y
        self.M4 += U.T @ U
        return 6.0 * len(Y) * len(self.shift) ** 2

    def moved(self, to: np.ndarray) -> Moments:
        """The same moments about ``to`` (y' = y - e, e = to - shift), expanded exactly."""
        e = np.asarray(to, np.float64) - self.shift
        e2, n, sv, S, T3 = e * e, self.n, self.sv, self.S, self.T3
        su = np.diag(S).copy()
        S2 = S - np.outer(sv, e) - np.outer(e, sv) + n * np.outer(e, e)
        T32 = T3 - np.outer(su, e) - 2 * e[:, None] * S + 2 * np.outer(e * sv, e) + np.outer(e2, sv) - n * np.outer(e2, e)
        te = T3 * e[None, :]
        M42 = (self.M4 - 2 * te - 2 * te.T + np.outer(su, e2) + np.outer(e2, su) + 4 * S * np.outer(e, e)
               - 2 * np.outer(e * sv, e2) - 2 * np.outer(e2, e * sv) + n * np.outer(e2, e2))
        return Moments(np.asarray(to, np.float64).copy(), n, sv - n * e, S2, T32, M42)

    def merge(self, other: Moments) -> Moments:
        """Both sets of rows, about this shift."""
        if other.n == 0:
            return self
        if self.n == 0:
            return other
        o = other.moved(self.shift)
        self.n += o.n
        self.sv += o.sv
        self.S += o.S
        self.T3 += o.T3
        self.M4 += o.M4
        return self

    def covariance(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean [d], Ledoit–Wolf-shrunk covariance [d, d]) as scikit-learn's LDA computes it."""
        c = self.moved(self.shift + self.sv / self.n)
        sd = np.sqrt(np.maximum(np.diag(c.S), 0.0) / c.n)
        sd[sd < 10 * np.finfo(np.float64).eps] = 1.0
        a = 1.0 / (sd * sd)
        C = c.S / np.outer(sd, sd) / c.n
        return c.shift, np.outer(sd, sd) * shrunk(C, float(a @ c.M4 @ a), c.n)


def shrunk(C: np.ndarray, fourth: float, n: float) -> np.ndarray:
    """Ledoit–Wolf's shrunk covariance of standardised centred rows from their covariance ``C``
    and Σ‖z‖⁴ (``fourth``), following scikit-learn's ``ledoit_wolf_shrinkage`` step by step."""
    d = C.shape[0]
    trace = np.diag(C)
    mu = trace.sum() / d
    if d == 1:
        return C.copy()
    delta_ = float((C * C).sum())
    beta = 1.0 / (d * n) * (fourth / n - delta_)
    delta = (delta_ - 2.0 * mu * trace.sum() + d * mu**2) / d
    beta = min(beta, delta)
    s = 0.0 if beta == 0 else beta / delta
    out = (1.0 - s) * C
    out.flat[:: d + 1] += s * mu
    return out
