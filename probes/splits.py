"""Train/test splits that can be recomputed later from the stimulus keys alone.

The default rule hashes ``"<seed>:<stimulus key>"`` to a number u in [0, 1) and puts a sample in
the test set when it is below ``test_fraction``. ``kfold`` cuts the same u into ``folds`` equal
bins: fold i tests the samples whose u falls in bin i and trains on the rest, so the k probes of
one seed test every sample exactly once (a curve of held-out predictions for all samples).
A sample's side therefore depends only on its own key and the seed, never on which other rows a
query selected, so a probe can be re-scored from the manifest at any time (the rule, seed and
fraction are recorded with every probe).
``by="column"`` uses the stimuli table's ``split`` column instead (e.g. the study's own
train/test files).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from probes.errors import ProbeError

HASH_RULE = "test iff int(sha256('<seed>:<stimulus>')[:16], 16) / 2**64 < test_fraction"
KFOLD_RULE = "test iff floor(folds * int(sha256('<seed>:<stimulus>')[:16], 16) / 2**64) == fold"


@dataclass(frozen=True)
class Fold:
    """Boolean masks over a group's rows; ``train`` and ``test`` never overlap."""

    seed: int
    train: np.ndarray
    test: np.ndarray
    rule: dict

    @property
    def n_train(self) -> int:
        return int(self.train.sum())

    @property
    def n_test(self) -> int:
        return int(self.test.sum())

    def restrict_train(self, keep: np.ndarray | None) -> Fold:
        """The same split with training limited to ``keep`` (e.g. a train_where filter)."""
        if keep is None:
            return self
        return Fold(self.seed, self.train & keep, self.test, self.rule)


def hash_unit(stimuli: Sequence[str], seed: int) -> np.ndarray:
    out = np.empty(len(stimuli), dtype=np.float64)
    for i, key in enumerate(stimuli):
        digest = hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()
        out[i] = int(digest[:16], 16) / 2.0**64
    return out


def hash_fold(stimuli: Sequence[str], seed: int, test_fraction: float) -> Fold:
    if not 0.0 < test_fraction < 1.0:
        raise ProbeError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    test = hash_unit(stimuli, seed) < test_fraction
    if len(stimuli) >= 2 and (test.all() or not test.any()):
        # Tiny selections can land on one side by chance; the rule stays the rule.
        raise ProbeError(
            f"the hash split put all {len(stimuli)} rows on one side (test_fraction {test_fraction}, seed {seed}):"
            " select more rows (where=...) or change test_fraction"
        )
    return Fold(seed, ~test, test, {"by": "hash", "rule": HASH_RULE, "seed": seed, "test_fraction": test_fraction})


def kfold_fold(stimuli: Sequence[str], seed: int, folds: int, fold: int) -> Fold:
    if not 2 <= folds or not 0 <= fold < folds:
        raise ProbeError(f"kfold needs folds >= 2 and 0 <= fold < folds, got fold {fold} of {folds}")
    if len(stimuli) < folds:
        raise ProbeError(f"kfold with {folds} folds needs at least {folds} samples, the selection has {len(stimuli)}:"
                         " select more rows (where=...) or lower folds")
    test = np.floor(hash_unit(stimuli, seed) * folds).astype(np.int64) == fold
    if not test.any() or test.all():
        raise ProbeError(f"fold {fold} of {folds} (seed {seed}) holds {int(test.sum())} of {len(stimuli)} rows:"
                         " select more rows (where=...) or lower folds")
    return Fold(seed, ~test, test, {"by": "kfold", "rule": KFOLD_RULE, "seed": seed, "folds": folds, "fold": fold,
                                    "test_fraction": 1.0 / folds})


def column_fold(splits: Sequence[str | None], seed: int, train: str = "train", test: str = "test") -> Fold:
    col = np.asarray([s or "" for s in splits], dtype=object)
    tr, te = col == train, col == test
    if not tr.any() or not te.any():
        have = sorted(set(col.tolist()))
        raise ProbeError(
            f"split by column needs rows with split = {train!r} and {test!r}; the selected rows have {have}."
            " Use split: hash, or register stimuli with those split names"
        )
    return Fold(seed, tr, te, {"by": "column", "train": train, "test": test, "seed": seed})


def control_permutation(n: int, seed: int) -> np.ndarray:
    """The sample permutation of the shuffled-label control (fixed by the probe's seed)."""
    return np.random.default_rng([seed, 0xC0FFEE]).permutation(n)
