"""Bootstrap intervals of a mean over test samples, and over seeds where there are several.

Every interval agnosia prints comes from :func:`mean_interval`: percentile intervals from
``RESAMPLES`` resamples drawn with a fixed seed (``SEED``), so the same stored numbers always give
the same interval. With values ``E[seed, sample]`` (NaN where a seed did not test the sample) each
resample draws the samples with replacement and, when there are several seeds, the seeds too;
its statistic is the mean over the drawn seeds of each seed's mean over the drawn samples. With
one seed that is the plain bootstrap of a mean over samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Resamples per interval, the interval's level, and the generator's seed (docs/verdicts.md).
RESAMPLES = 2000
LEVEL = 0.95
SEED = 20261206


@dataclass(frozen=True)
class Interval:
    """A mean with its bootstrap interval; ``n`` samples, ``n_seeds`` seeds, ``sd``: spread of the
    per-seed means (None with one seed)."""

    mean: float
    low: float
    high: float
    n: int
    n_seeds: int
    sd: float | None = None

    def overlaps(self, other: Interval) -> bool:
        return not (self.high < other.low or other.high < self.low)

    def text(self, digits: int = 3) -> str:
        seeds = f", {self.n_seeds} seeds" if self.n_seeds > 1 else ""
        return f"{self.mean:.{digits}g} [{self.low:.{digits}g}, {self.high:.{digits}g}] (n={self.n}{seeds})"


def mean_interval(values: np.ndarray, resamples: int = RESAMPLES, level: float = LEVEL,
                  seed: int = SEED) -> Interval | None:
    """The mean of ``values`` ([seeds, samples] or [samples]; NaN = not measured) with its
    bootstrap interval; None when no value is measured."""
    E = np.atleast_2d(np.asarray(values, dtype=np.float64))
    measured = ~np.isnan(E)
    E = E[measured.any(1)][:, measured.any(0)]
    measured = ~np.isnan(E)
    if not measured.any():
        return None
    S, N = E.shape
    filled = np.where(measured, E, 0.0)
    per_seed = filled.sum(1) / measured.sum(1)
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(N, np.full(N, 1.0 / N), size=resamples).astype(np.float64)   # [B, N]
    sums, counts = draws @ filled.T, draws @ measured.T.astype(np.float64)              # [B, S]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / counts
    if S > 1:
        seeds = rng.multinomial(S, np.full(S, 1.0 / S), size=resamples).astype(np.float64)
        seeds = np.where(np.isnan(means), 0.0, seeds)
        with np.errstate(invalid="ignore", divide="ignore"):   # a draw of only unmeasured seeds: dropped below
            stats = np.where(np.isnan(means), 0.0, means * seeds).sum(1) / seeds.sum(1)
    else:
        stats = means[:, 0]
    stats = stats[np.isfinite(stats)]
    tail = (1.0 - level) / 2
    low, high = np.quantile(stats, [tail, 1.0 - tail]) if len(stats) else (np.nan, np.nan)
    return Interval(float(per_seed.mean()), float(low), float(high), int(N), int(S),
                    float(per_seed.std(ddof=1)) if S > 1 else None)


def share_interval(flags: np.ndarray) -> Interval | None:
    """A share (mean of 0/1 flags over samples) with its bootstrap interval."""
    return mean_interval(np.asarray(flags, dtype=np.float64)[None])
