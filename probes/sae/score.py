"""Every SAE feature scored against the stimuli's exact truth, on the held-out samples.

For each truth variable (a probe target, probes/targets.py) and each feature:

* a binary or categorical per-sample target: AUROC of the feature's per-sample activation (its
  mean over the sample's tokens) for each class against the rest;
* an ordinal per-sample target (numbers with more than two values, e.g. a count): Spearman's rho;
* a per-token target (``token`` shape, or ``boxes`` turned into the object mask over the patch
  grid): IoU of the tokens where the feature is active with the tokens of each class.

Each score sits beside its control: the same feature against the truth shuffled across samples
(a sample's whole mask moves with it), averaged over ``shuffles`` permutations. p-values are
normal approximations (Mann-Whitney for AUROC, ``rho * sqrt(n - 1)`` for Spearman, the
hypergeometric overlap for IoU) and ``q_value`` is Benjamini-Hochberg over every test of the SAE.
The best feature of each (target, class) gets a percentile bootstrap interval over test samples,
with the resamples, level and seed of queries/intervals.py (docs/verdicts.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from probes.prepare import JobBuilder
from probes.sae.model import SparseAutoencoder, encode_numpy
from probes.sae.plan import SaeTask
from probes.sae.source import ActivationSource
from probes.targets import TargetValues, get_target, token_grid
from store import Workspace

#: As queries/intervals.py: resamples per interval, its level, the generator's seed.
RESAMPLES, LEVEL, SEED = 2000, 0.95, 20261206


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (1-based) of each column of ``x`` [n, m]: ties (the many zeros) share a rank."""
    x = x.reshape(len(x), -1)
    out = np.empty(x.shape, np.float64)
    n = len(x)
    for j in range(x.shape[1]):
        col = x[:, j]
        order = np.argsort(col, kind="stable")
        s = col[order]
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
        ends = np.r_[starts[1:], n]
        avg = (starts + ends + 1) / 2.0
        out[order, j] = np.repeat(avg, ends - starts)
    return out


def auroc(ranks: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """AUROC of every column (given its ranks) for ``positive`` samples against the rest."""
    n1 = int(positive.sum())
    n0 = len(positive) - n1
    if n1 == 0 or n0 == 0:
        return np.full(ranks.shape[1], np.nan)
    return (ranks[positive].sum(0) - n1 * (n1 + 1) / 2) / (n1 * n0)


def spearman(ranks: np.ndarray, y_ranks: np.ndarray) -> np.ndarray:
    """Spearman's rho of every column with ``y`` (both as average ranks); NaN for a constant column."""
    xc = ranks - ranks.mean(0)
    yc = y_ranks - y_ranks.mean()
    den = np.sqrt((xc ** 2).sum(0) * (yc ** 2).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (xc * yc[:, None]).sum(0) / np.where(den > 0, den, 1), np.nan)


def _p_two_sided(z: np.ndarray) -> np.ndarray:
    return np.array([math.erfc(abs(v) / math.sqrt(2)) if np.isfinite(v) else 1.0 for v in np.ravel(z)])


def benjamini_hochberg(p: np.ndarray) -> np.ndarray:
    """q-values (Benjamini-Hochberg) of ``p``."""
    p = np.asarray(p, np.float64)
    m = len(p)
    if m == 0:
        return p
    order = np.argsort(p)
    q = p[order] * m / np.arange(1, m + 1)
    q = np.minimum.accumulate(q[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(q, 1.0)
    return out


def _percentile(stats: np.ndarray) -> tuple[float, float]:
    a = (1 - LEVEL) / 2
    good = stats[np.isfinite(stats)]
    if not len(good):
        return float("nan"), float("nan")
    return float(np.quantile(good, a)), float(np.quantile(good, 1 - a))


def _object_mask(tv: TargetValues, infos: list[Any], T: int) -> np.ndarray:
    """Per token: inside an object's box (boxes are image-normalised xyxy), from the patch grid."""
    out = np.full((len(infos), T), -1, np.int64)
    for i, (boxes, info) in enumerate(zip(tv.values, infos, strict=True)):
        if boxes is None:
            continue
        h, w = token_grid(info, T)
        cy, cx = np.meshgrid((np.arange(h) + 0.5) / h, (np.arange(w) + 0.5) / w, indexing="ij")
        inside = np.zeros((h, w), bool)
        for x0, y0, x1, y1 in np.asarray(boxes, np.float64).reshape(-1, 4):
            inside |= (cx >= x0) & (cx <= x1) & (cy >= y0) & (cy <= y1)
        out[i] = inside.reshape(-1)
    return out


class _Scorer:
    """The test samples' features, pooled per sample and sparse per token, and the scores."""

    def __init__(self, sae: SparseAutoencoder, src: ActivationSource, test_rows: np.ndarray) -> None:
        self.rows = np.asarray(test_rows, np.int64)
        self.T = src.per_sample
        n, f = len(self.rows), sae.d_sae
        self.pooled = np.zeros((n, f), np.float64)
        parts: dict[str, list[np.ndarray]] = {"pos": [], "token": [], "feature": [], "value": []}
        for batch in src.batches(0):
            ids = batch[-1]
            acts = encode_numpy(sae, batch[0])
            pos = np.searchsorted(self.rows, ids[:, 0])
            # per-sample sums by sorting the batch's rows by sample (np.add.at is unbuffered: ~50x slower)
            order = np.argsort(pos, kind="stable")
            p = pos[order]
            starts = np.flatnonzero(np.r_[True, p[1:] != p[:-1]])
            self.pooled[p[starts]] += np.add.reduceat(acts[order], starts, axis=0)
            r, c = np.nonzero(acts)
            parts["pos"].append(pos[r])
            parts["token"].append(ids[r, 1].astype(np.int32))
            parts["feature"].append(c.astype(np.int32))
            parts["value"].append(acts[r, c])
        self.pooled /= self.T
        self.sparse = {k: np.concatenate(v) if v else np.zeros(0) for k, v in parts.items()}
        self.n_features = f
        self.out: list[dict[str, Any]] = []
        self.rng = np.random.default_rng(SEED)

    def activations(self) -> dict[str, np.ndarray]:
        s = self.sparse
        return {"array_row": self.rows[s["pos"].astype(np.int64)], "token": s["token"], "feature": s["feature"],
                "value": s["value"].astype(np.float32)}

    def _emit(self, target: str, cls: str, metric: str, score: np.ndarray, control: np.ndarray, p: np.ndarray,
              n: int, n_pos: int) -> None:
        for f in range(self.n_features):
            self.out.append({"feature": f, "target": target, "class": cls, "metric": metric,
                             "score": float(score[f]), "control_score": float(control[f]), "p_value": float(p[f]),
                             "n": n, "n_positive": n_pos})

    # -------------------------------------------------------------- per-sample truth

    def sample_target(self, tv: TargetValues, keep: np.ndarray, shuffles: int) -> None:
        x = self.pooled[keep]
        ranks = _ranks(x)
        codes = tv.values[keep]
        n = len(codes)
        perms = [self.rng.permutation(n) for _ in range(shuffles)]
        ordinal = tv.numeric is not None and tv.classes is not None and len(tv.classes) > 2
        if ordinal:
            assert tv.numeric is not None
            y = tv.numeric[keep]
            yr = _ranks(y)[:, 0]
            rho = spearman(ranks, yr)
            ctrl = np.mean([spearman(ranks, yr[p]) for p in perms], axis=0)
            p = _p_two_sided(np.nan_to_num(rho) * math.sqrt(max(n - 1, 1)))
            self._emit(tv.name, "", "spearman", rho, ctrl, p, n, n)
            return
        classes = tv.classes or ()
        for c in (range(1, 2) if len(classes) == 2 else range(len(classes))):
            pos = codes == c
            a = auroc(ranks, pos)
            ctrl = np.mean([auroc(ranks, pos[p]) for p in perms], axis=0)
            n1, n0 = int(pos.sum()), int((~pos).sum())
            sd = math.sqrt(n1 * n0 * (n + 1) / 12) if n1 and n0 else float("inf")
            p = _p_two_sided((a - 0.5) * n1 * n0 / sd)
            self._emit(tv.name, str(classes[c]), "auroc", a, ctrl, p, n, n1)

    # -------------------------------------------------------------- per-token truth

    def token_target(self, name: str, codes: np.ndarray, classes: tuple[Any, ...], shuffles: int) -> None:
        s = self.sparse
        n = len(codes)
        labelled = codes >= 0
        n_tok = int(labelled.sum())
        active = np.bincount(s["feature"].astype(np.int64), minlength=self.n_features).astype(np.float64)
        perms = [self.rng.permutation(n) for _ in range(shuffles)]
        pos_i, tok_i, feat_i = s["pos"].astype(np.int64), s["token"].astype(np.int64), s["feature"].astype(np.int64)
        for c in (range(1, 2) if len(classes) == 2 else range(len(classes))):
            mask = codes == c
            b = float(mask.sum())

            def iou(m: np.ndarray, b: float = b) -> np.ndarray:
                inter = np.bincount(feat_i, weights=m[pos_i, tok_i].astype(np.float64), minlength=self.n_features)
                union = active + b - inter
                return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)

            score = iou(mask)
            ctrl = np.mean([iou(mask[p]) for p in perms], axis=0)
            inter = score * (active + b) / (1 + score)
            N = max(n_tok, 2)
            mean = active * b / N
            var = active * b * (N - active) * (N - b) / (N * N * (N - 1))
            with np.errstate(invalid="ignore", divide="ignore"):
                z = np.where(var > 0, (inter - mean) / np.sqrt(np.where(var > 0, var, 1)), 0.0)
            p = np.array([0.5 * math.erfc(v / math.sqrt(2)) for v in z])     # one-sided: more overlap than chance
            self._emit(name, str(classes[c]), "iou", score, ctrl, p, n_tok, int(b))

    # -------------------------------------------------------------- intervals of the best features

    def intervals(self, sample_truth: dict[str, tuple[TargetValues, np.ndarray]],
                  token_truth: dict[str, np.ndarray]) -> None:
        best: dict[tuple[str, str, str], dict[str, Any]] = {}
        for r in self.out:
            k = (r["target"], r["class"], r["metric"])
            if np.isfinite(r["score"]) and (k not in best or r["score"] > best[k]["score"]):
                best[k] = r
        for (target, cls, metric), r in best.items():
            f = r["feature"]
            draws = self.rng.integers(0, 1 << 30, 1)[0]
            g = np.random.default_rng([SEED, int(draws)])
            if metric == "iou":
                codes = token_truth[target]
                c = _class_code(cls, r)
                m = codes == c
                act = np.zeros(codes.shape, bool)
                sel = self.sparse["feature"] == f
                act[self.sparse["pos"][sel].astype(np.int64), self.sparse["token"][sel].astype(np.int64)] = True
                inter, union = (act & m).sum(1), (act | m).sum(1)
                idx = g.integers(0, len(codes), (RESAMPLES, len(codes)))
                stats = inter[idx].sum(1) / np.maximum(union[idx].sum(1), 1)
            else:
                tv, keep = sample_truth[target]
                x = self.pooled[keep, f]
                idx = g.integers(0, len(x), (RESAMPLES, len(x)))
                if metric == "spearman":
                    assert tv.numeric is not None
                    y = tv.numeric[keep]
                    stats = np.array([spearman(_ranks(x[i]), _ranks(y[i])[:, 0])[0] for i in idx])
                else:
                    pos = tv.values[keep] == _class_code(cls, r, tv.classes)
                    stats = np.array([auroc(_ranks(x[i]), pos[i])[0] for i in idx])
            r["ci_low"], r["ci_high"] = _percentile(stats)


def _class_code(cls: str, row: dict[str, Any], classes: tuple[Any, ...] | None = None) -> int:
    if classes is not None:
        return [str(c) for c in classes].index(cls)
    return int(row["code"])


def score_features(ws: Workspace, task: SaeTask, sae: SparseAutoencoder, test_src: ActivationSource,
                   test_rows: np.ndarray) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Scores of every feature against the entry's targets, and the sparse test activations.

    Parameters
    ----------
    ws : Workspace
        The workspace (read only).
    task : SaeTask
        The SAE's task (run, where, targets, shuffles).
    sae : SparseAutoencoder
        The trained SAE.
    test_src : ActivationSource
        The held-out rows, with ids.
    test_rows : numpy.ndarray
        The held-out samples' array rows, ascending.

    Returns
    -------
    tuple
        Rows for ``sae_feature_scores`` and columns for ``sae_activations``.
    """
    e = task.entry
    # Only the builder's sample and target readers are used: they need no probe plan.
    jb = JobBuilder(ws, None)  # type: ignore[arg-type]
    rows_all, infos = jb.samples(task.run, e["where"])
    at = np.searchsorted(rows_all, test_rows)
    sc = _Scorer(sae, test_src, test_rows)
    sample_truth: dict[str, tuple[TargetValues, np.ndarray]] = {}
    token_truth: dict[str, np.ndarray] = {}
    for name in e["targets"]:
        spec = get_target(name)
        if spec.shape == "sample":
            tv = jb.target(task.run, e["where"], name, None)
            tv = TargetValues(tv.name, tv.shape, tv.values[at], tv.classes, None if tv.numeric is None else tv.numeric[at])
            keep = tv.labelled()
            sample_truth[name] = (tv, keep)
            sc.sample_target(tv, keep, e["shuffles"])
        elif spec.shape in ("token", "boxes") and sc.T > 1:
            tv = jb.target(task.run, e["where"], name, sc.T)
            if spec.shape == "boxes":
                codes, classes = _object_mask(tv, infos, sc.T)[at], ("background", "object")
            else:
                codes, classes = tv.values[at], tuple(tv.classes or ())
            token_truth[name] = codes
            before = len(sc.out)
            sc.token_target(name, codes, classes, e["shuffles"])
            for r in sc.out[before:]:
                r["code"] = [str(c) for c in classes].index(r["class"])
    p = np.array([r["p_value"] for r in sc.out])
    for r, q in zip(sc.out, benjamini_hochberg(p), strict=True):
        r["q_value"] = float(q)
    sc.intervals(sample_truth, token_truth)
    for r in sc.out:
        r.pop("code", None)
        r["sae"] = task.key
    return sc.out, sc.activations()
