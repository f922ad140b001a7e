"""``conv_spatial``: the Grid2Matrix probe (docs/studies.md#g2m-probe).

Tokens ``[n, s*s, D]`` -> map ``[D, s, s]`` -> bilinear resize (``align_corners=False``, float32)
to the N x N grid -> Conv1x1(hidden) -> BatchNorm -> GELU -> Conv1x1(C); cross-entropy over
cells. Score: cell accuracy on the test grids; exact match and per-colour accuracy in metrics.

Presets: ``paper`` is the study's recipe (hidden 512, batch 32, AdamW 5e-4, wd 1e-4, 5000
iterations, 5 % warmup + cosine, grad clip 1, validation every 500 iterations with patience 3,
raw features); ``cpu`` (default) is the same architecture made cheap (hidden 64, 300
iterations, lr 2e-3, standardised features, no validation hold-out). Explicit fields win over
the preset.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from probes.errors import ProbeError
from probes.kinds import _torch as T
from probes.kinds.base import Probe, ProbeParams, register_kind

PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"hidden": 64, "iters": 300, "lr": 2e-3, "standardize": True, "eval_every": None},
    "paper": {"hidden": 512, "iters": 5000, "lr": 5e-4, "standardize": False, "eval_every": 500},
}


class ConvSpatialParams(ProbeParams):
    preset: Literal["cpu", "paper"] = "cpu"
    hidden: int | None = Field(None, ge=1, description="channels of the 1x1 bottleneck (paper 512)")
    iters: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0)
    batch_size: int = Field(32, ge=1)
    weight_decay: float = Field(1e-4, ge=0)
    warmup: float = Field(0.05, ge=0, lt=1)
    clip: float = Field(1.0, ge=0)
    standardize: bool | None = None
    eval_every: int | None = Field(None, ge=1, description="validate every k iterations and keep the best")
    patience: int = Field(3, ge=1)
    valid_fraction: float = Field(0.1, gt=0, lt=1)
    grid: tuple[int, int] | None = Field(None, description="token grid h, w (default: the manifest's, else square)")

    def resolved(self) -> dict[str, Any]:
        base = dict(PRESETS[self.preset])
        base.update({k: v for k, v in self.model_dump().items() if v is not None and k in base})
        return base


class SpatialHead(torch.nn.Module):
    def __init__(self, d: int, hidden: int, n_classes: int, grid: tuple[int, int], out: tuple[int, int]) -> None:
        super().__init__()
        self.grid, self.out_size = grid, out
        self.inp = torch.nn.Conv2d(d, hidden, 1)
        self.bn = torch.nn.BatchNorm2d(hidden)
        self.out = torch.nn.Conv2d(hidden, n_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        x = x.transpose(1, 2).reshape(b, d, *self.grid)
        # A 1x1 conv and a bilinear resize are both linear and the resize's weights sum to 1, so
        # they commute (bias included): convolving first resizes `hidden` channels instead of D,
        # the same function as the paper's resize-then-conv at a fraction of the cost.
        x = self.inp(x.float())
        if tuple(self.grid) != tuple(self.out_size):
            x = F.interpolate(x, size=self.out_size, mode="bilinear", align_corners=False)
        return self.out(F.gelu(self.bn(x)))                               # [B, C, N, N]


@register_kind("conv_spatial")
class ConvSpatialProbe(Probe):
    """``X [n, T, d]`` (T = h*w tokens in raster order), ``y [n, N, N]`` class codes (-1 = none)."""

    Params = ConvSpatialParams
    accepts = ("grid",)
    metric = "cell_accuracy"
    uses_grid = True
    #: trained out of core on a subsample of training samples (probes/trainers/iterative.py)
    trains: ClassVar[tuple[str, ...]] = ("in_memory", "iterative")

    def _check(self, X: Any, y: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
        X = np.asarray(X, dtype=np.float32)
        if X.ndim != 3:
            raise ProbeError(f"conv_spatial reads X [n, T, d] token arrays, got shape {X.shape}")
        if y is not None:
            y = np.asarray(y, dtype=np.int64)
            if y.ndim != 3 or len(y) != len(X):
                raise ProbeError(f"conv_spatial needs y [n, N, N] grids for the {len(X)} samples, got shape {y.shape}")
        return X, y

    def fit(self, X: Any, y: Any) -> ConvSpatialProbe:
        X, y = self._check(X, y)
        return self.fit_scaled(X, y, *T.stats(X, self.standardizes))

    @property
    def standardizes(self) -> bool:
        return bool(self.params.resolved()["standardize"])

    @classmethod
    def train_bytes(cls, params: dict[str, Any], tokens: int, d: int, cells: int) -> tuple[int, int]:
        """Planned bytes of training beside the samples' features (the out-of-core memory plan):
        (one step: the batch's features indexed and reshaped, ~8 float32 activations and gradients
        of width ``hidden`` per token and output cell; per training sample: the standardised copy,
        the training part's copy under a hold-out and the hold-out's forward pass)."""
        p = cls.check_params(params)
        cfg = p.resolved()
        step = p.batch_size * (2 * tokens * d * 4 + 8 * (tokens + cells) * cfg["hidden"] * 4)
        per = tokens * d * 4 * (2 if cfg["eval_every"] else 1)
        if cfg["eval_every"]:
            per += int(p.valid_fraction * 3 * (tokens + cells) * cfg["hidden"] * 4)
        return step, per

    def fit_scaled(self, X: np.ndarray, y: Any, mean: np.ndarray, scale: np.ndarray) -> ConvSpatialProbe:
        """Fit on rows X standardised with (mean, scale) given: the rows' own (fit), or moments
        streamed over every training token (out of core, probes/subsample.py)."""
        X, y = self._check(X, y)
        assert y is not None
        cfg = self.params.resolved()
        grid = T.grid_of(X.shape[1], self.params.grid, "conv_spatial")
        n_classes = int(y.max()) + 1
        torch.manual_seed(self.random_state)
        self.model_ = SpatialHead(X.shape[2], cfg["hidden"], n_classes, grid, (y.shape[1], y.shape[2]))
        xs = torch.from_numpy((X - mean) / scale)
        ys = torch.from_numpy(y)
        train_idx = np.arange(len(X))
        valid_fn = None
        if cfg["eval_every"]:
            rng = np.random.default_rng(self.random_state)
            perm = rng.permutation(len(X))
            n_valid = max(1, int(round(len(X) * self.params.valid_fraction)))
            train_idx, valid_idx = np.sort(perm[n_valid:]), np.sort(perm[:n_valid])
            xv, yv = xs[valid_idx], ys[valid_idx]

            def valid_fn() -> float:
                pred = self.model_(xv).argmax(1)
                ok = yv >= 0
                return float((pred[ok] == yv[ok]).float().mean())

        # Without a hold-out every row trains: no indexed copy of the features (the same tensor).
        xt, yt = (xs, ys) if valid_fn is None else (xs[train_idx], ys[train_idx])
        info = T.train(
            self.model_, lambda idx: F.cross_entropy(self.model_(xt[idx]), yt[idx], ignore_index=-1), len(xt),
            iters=cfg["iters"], batch_size=self.params.batch_size, lr=cfg["lr"], weight_decay=self.params.weight_decay,
            warmup=self.params.warmup, clip=self.params.clip, seed=self.random_state, valid=valid_fn,
            eval_every=cfg["eval_every"], patience=self.params.patience,
        )
        self.state_ = {"mean": mean, "scale": scale, **T.module_state(self.model_)}
        self.meta_ = {"grid": list(grid), "out": [int(y.shape[1]), int(y.shape[2])], "n_classes": n_classes,
                      "d": int(X.shape[2]), "hidden": cfg["hidden"], "iters": info.iters, "best_iter": info.best_iter,
                      "stopped_early": info.stopped_early, "final_loss": info.final_loss}
        return self

    def load_state(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state(tensors, meta)
        self.model_ = SpatialHead(meta["d"], meta["hidden"], meta["n_classes"], tuple(meta["grid"]), tuple(meta["out"]))
        T.load_module_state(self.model_, tensors)

    def predict(self, X: Any) -> np.ndarray:
        X, _ = self._check(X)
        if not self.state_:
            raise ProbeError("this conv_spatial probe is not fitted: call fit(X, y) or Probe.load(path)")
        xs = torch.from_numpy((X - self.state_["mean"]) / self.state_["scale"])
        with torch.no_grad():
            return torch.cat([self.model_(xs[i : i + 256]).argmax(1) for i in range(0, len(xs), 256)]).numpy()

    def score(self, X: Any, y: Any) -> float:
        _, y = self._check(X, y)
        return cell_accuracy(self.predict(X), y)

    def sample_scores(self, X: Any, y: Any) -> np.ndarray:
        """Cell accuracy of each grid (labelled cells only): the probe side of G2M's gap curve."""
        _, y = self._check(X, y)
        return grid_scores(self.predict(X), y)

    def metrics(self, X: Any, y: Any) -> dict[str, Any]:
        _, y = self._check(X, y)
        return self.metrics_of(self.predict(X), y)

    def metrics_of(self, pred: np.ndarray, y: np.ndarray) -> dict[str, Any]:
        ok = y >= 0
        exact = ((pred == y) | ~ok).reshape(len(y), -1).all(1)
        per = {int(c): float((pred[y == c] == c).mean()) for c in np.unique(y[ok])}
        return {"exact_match": float(exact.mean()) if len(y) else float("nan"), "per_colour": per,
                "iters": self.meta_.get("iters"), "best_iter": self.meta_.get("best_iter"),
                "error_maps": error_maps(pred, y)}

    def scored(self, pred: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, Any], tuple[Any, Any, Any]]:
        """(score, metrics, per-sample (prediction, truth, score)) of predictions already made
        (out of core: predicted block by block, never holding the test features)."""
        y = np.asarray(y, np.int64)
        return cell_accuracy(pred, y), self.metrics_of(pred, y), (None, None, grid_scores(pred, y))


def cell_accuracy(pred: np.ndarray, y: np.ndarray) -> float:
    ok = y >= 0
    return float((pred[ok] == y[ok]).mean()) if ok.any() else float("nan")


def grid_scores(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    ok = (y >= 0).reshape(len(y), -1)
    hit = ((pred == y).reshape(len(y), -1) & ok).sum(1)
    return hit / np.maximum(ok.sum(1), 1)


MAX_MAP_CELLS = 64 * 64  # larger maps are left out of the recorded metrics (they would bloat params)


def error_maps(pred: np.ndarray, y: np.ndarray) -> dict[str, list[list[float]]]:
    """Per grid size N (the labelled extent of each test grid): the probe's error rate per cell,
    for the report's heatmap beside the model's own (study g2m)."""
    ok = y >= 0
    sizes = ok.any(2).sum(1)  # labelled rows per grid = N for an N x N grid in a padded frame
    out = {}
    for n in np.unique(sizes):
        n = int(n)
        if n == 0 or n * n > MAX_MAP_CELLS:
            continue
        m = sizes == n
        wrong = (pred[m, :n, :n] != y[m, :n, :n]) & ok[m, :n, :n]
        out[str(n)] = np.round(wrong.mean(0), 4).tolist()
    return out
