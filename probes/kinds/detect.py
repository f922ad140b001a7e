"""``detect``: the CountingTricks detection probe (docs/studies.md#counting-tricks-detect), compact.

Tokens -> map ``[D, h, w]`` -> 1x1 bottleneck + GroupNorm + SiLU -> two 3x3 conv blocks
(BN, SiLU) -> 1x1 head with objectness, box (tx, ty, tw, th) and class logits per cell.
Anchor-free, single scale: a box decodes as ``cx = (gx + sigmoid(tx)) / w``, ``w_box =
sigmoid(tw)`` (image-normalised). Each object is assigned to its centre cell and the 3x3 cells
around it (first object wins a cell). Loss = CIoU (positive cells) + BCE objectness (target:
the detached IoU on positives, 0 elsewhere, pos_weight 3) + BCE class (positives).
Score: class-agnostic AP@50 with 101-point interpolation, after a 0.25 confidence threshold
and NMS at IoU 0.5.

The study's bottleneck is random and frozen (``train_bottleneck: false``); here it trains by
default, since a random projection of a narrow tap mostly throws information away.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from probes.errors import ProbeError
from probes.kinds import _torch as T
from probes.kinds.base import Probe, ProbeParams, register_kind


class DetectParams(ProbeParams):
    bottleneck: int = Field(64, ge=1, description="1x1 bottleneck width (study: 512)")
    groups: int = Field(8, ge=1, description="GroupNorm groups of the bottleneck (study: 32)")
    train_bottleneck: bool = Field(True, description="false = the study's random, frozen bottleneck")
    hidden: int = Field(64, ge=1, description="width of the 3x3 blocks (study: 256)")
    iters: int = Field(400, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(2e-3, gt=0)
    weight_decay: float = Field(1e-3, ge=0)
    clip: float = Field(0.5, ge=0)
    conf: float = Field(0.25, ge=0, le=1, description="score threshold before NMS")
    nms_iou: float = Field(0.5, gt=0, le=1)
    n_classes: int = Field(1, ge=1, description="class logits; AP is class-agnostic")
    standardize: bool = True
    grid: tuple[int, int] | None = None


class DetectHead(torch.nn.Module):
    def __init__(self, d: int, p: DetectParams, grid: tuple[int, int]) -> None:
        super().__init__()
        self.grid = grid
        groups = math.gcd(p.groups, p.bottleneck)
        self.neck = torch.nn.Sequential(torch.nn.Conv2d(d, p.bottleneck, 1, bias=False),
                                        torch.nn.GroupNorm(groups, p.bottleneck, eps=1e-3), torch.nn.SiLU())
        blocks: list[torch.nn.Module] = []
        width = p.bottleneck
        for _ in range(2):
            blocks += [torch.nn.Conv2d(width, p.hidden, 3, padding=1, bias=False),
                       torch.nn.BatchNorm2d(p.hidden, eps=1e-3, momentum=0.03), torch.nn.SiLU()]
            width = p.hidden
        self.body = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Conv2d(p.hidden, 5 + p.n_classes, 1)
        bias = self.head.bias
        assert bias is not None  # Conv2d(..., bias=True)
        with torch.no_grad():  # the study's priors: few cells hold an object
            bias[4] = -1.0
            bias[5:] = -2.19
        if not p.train_bottleneck:
            for q in self.neck.parameters():
                q.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        x = x.transpose(1, 2).reshape(b, d, *self.grid)
        return self.head(self.body(self.neck(x))).permute(0, 2, 3, 1)       # [B, h, w, 5 + C]


def decode(out: torch.Tensor) -> torch.Tensor:
    """Image-normalised xyxy boxes [B, h, w, 4] from raw head outputs."""
    _, h, w, _ = out.shape
    gy, gx = torch.meshgrid(torch.arange(h, dtype=out.dtype), torch.arange(w, dtype=out.dtype), indexing="ij")
    cx = (gx + torch.sigmoid(out[..., 0])) / w
    cy = (gy + torch.sigmoid(out[..., 1])) / h
    bw, bh = torch.sigmoid(out[..., 2]), torch.sigmoid(out[..., 3])
    return torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1).clamp(0, 1)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise IoU [N, M] of xyxy boxes."""
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area = lambda z: (z[:, 2:] - z[:, :2]).clamp(min=0).prod(-1)  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter + 1e-9)


def ciou(p: torch.Tensor, g: torch.Tensor, eps: float = 1e-7) -> tuple[torch.Tensor, torch.Tensor]:
    """(CIoU, IoU) of matching rows of xyxy boxes."""
    lt, rb = torch.maximum(p[:, :2], g[:, :2]), torch.minimum(p[:, 2:], g[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    pw, ph = (p[:, 2] - p[:, 0]).clamp(min=eps), (p[:, 3] - p[:, 1]).clamp(min=eps)
    gw, gh = (g[:, 2] - g[:, 0]).clamp(min=eps), (g[:, 3] - g[:, 1]).clamp(min=eps)
    iou = inter / (pw * ph + gw * gh - inter + eps)
    cw = torch.maximum(p[:, 2], g[:, 2]) - torch.minimum(p[:, 0], g[:, 0])
    ch = torch.maximum(p[:, 3], g[:, 3]) - torch.minimum(p[:, 1], g[:, 1])
    rho2 = ((p[:, 0] + p[:, 2] - g[:, 0] - g[:, 2]) ** 2 + (p[:, 1] + p[:, 3] - g[:, 1] - g[:, 3]) ** 2) / 4
    v = (4 / math.pi**2) * (torch.atan(gw / gh) - torch.atan(pw / ph)) ** 2
    with torch.no_grad():
        alpha = v / (1 - iou + v + eps)
    return iou - rho2 / (cw**2 + ch**2 + eps) - alpha * v, iou


def assign(boxes: list[np.ndarray | None], grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell: the target box (xyxy) and whether it is positive; centre cell +- 1, first wins."""
    h, w = grid
    tgt = torch.zeros(len(boxes), h, w, 4)
    pos = torch.zeros(len(boxes), h, w, dtype=torch.bool)
    for i, bx in enumerate(boxes):
        if bx is None:
            continue
        for x1, y1, x2, y2 in np.asarray(bx, dtype=np.float32).reshape(-1, 4):
            gx = min(int((x1 + x2) / 2 * w), w - 1)
            gy = min(int((y1 + y2) / 2 * h), h - 1)
            for yy in range(max(gy - 1, 0), min(gy + 2, h)):
                for xx in range(max(gx - 1, 0), min(gx + 2, w)):
                    if not pos[i, yy, xx]:
                        pos[i, yy, xx] = True
                        tgt[i, yy, xx] = torch.tensor([x1, y1, x2, y2])
    return tgt, pos


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou: float) -> torch.Tensor:
    order = scores.argsort(descending=True)
    keep: list[int] = []
    while len(order):
        i = int(order[0])
        keep.append(i)
        if len(order) == 1:
            break
        rest = order[1:]
        order = rest[box_iou(boxes[i : i + 1], boxes[rest])[0] <= iou]
    return torch.tensor(keep, dtype=torch.long)


def ap50(preds: list[tuple[np.ndarray, np.ndarray]], truths: list[np.ndarray], thr: float = 0.5) -> float:
    """Class-agnostic AP at IoU ``thr``, 101-point interpolated (COCO-style).

    Each prediction (highest score first) matches the unmatched ground truth of its image with
    the highest IoU when that IoU reaches ``thr``; otherwise it is a false positive."""
    n_gt = sum(len(t) for t in truths)
    if n_gt == 0:
        return float("nan")
    records = []
    for img, (boxes, scores) in enumerate(preds):
        records += [(float(s), img, b) for b, s in zip(boxes, scores, strict=False)]
    records.sort(key=lambda r: -r[0])
    used = [np.zeros(len(t), dtype=bool) for t in truths]
    tp = np.zeros(len(records))
    for k, (_, img, box) in enumerate(records):
        gt = truths[img]
        if len(gt) == 0:
            continue
        ious = box_iou(torch.as_tensor(box[None]), torch.as_tensor(gt))[0].numpy()
        j = int(ious.argmax())
        if ious[j] >= thr and not used[img][j]:
            used[img][j] = True
            tp[k] = 1
    if not len(records):
        return 0.0
    ctp = np.cumsum(tp)
    recall = ctp / n_gt
    precision = ctp / np.arange(1, len(records) + 1)
    # interpolated precision: best precision at any recall >= r
    prec_env = np.maximum.accumulate(precision[::-1])[::-1]
    points = np.linspace(0, 1, 101)
    idx = np.searchsorted(recall, points, side="left")
    return float(np.mean([prec_env[i] if i < len(prec_env) else 0.0 for i in idx]))


@register_kind("detect")
class DetectProbe(Probe):
    """``X [n, T, d]`` tokens, ``y``: per sample an array [k, 4] of image-normalised xyxy boxes."""

    Params = DetectParams
    accepts = ("boxes",)
    metric = "ap50"
    uses_grid = True
    #: trained out of core on a subsample of training samples (probes/trainers/iterative.py)
    trains: ClassVar[tuple[str, ...]] = ("in_memory", "iterative")

    def fit(self, X: Any, y: Any) -> DetectProbe:
        X = _dense(X)
        return self.fit_scaled(X, y, *T.stats(X, self.standardizes))

    @property
    def standardizes(self) -> bool:
        return bool(self.params.standardize)

    @classmethod
    def train_bytes(cls, params: dict[str, Any], tokens: int, d: int, cells: int) -> tuple[int, int]:
        """Planned bytes of training beside the samples' features (the out-of-core memory plan):
        (one step: the batch's features indexed and reshaped, ~8 float32 activations and gradients
        per token of the bottleneck and both 3x3 blocks; per training sample: the standardised
        copy and the assigned target boxes)."""
        p = cls.check_params(params)
        step = p.batch_size * (2 * tokens * d * 4 + 8 * tokens * (p.bottleneck + 2 * p.hidden + 5 + p.n_classes) * 4)
        return step, tokens * d * 4 + tokens * 17

    def fit_scaled(self, X: np.ndarray, y: Any, mean: np.ndarray, scale: np.ndarray) -> DetectProbe:
        """Fit on rows X standardised with (mean, scale) given: the rows' own (fit), or moments
        streamed over every training token (out of core, probes/subsample.py)."""
        X = _dense(X)
        p = self.params
        grid = T.grid_of(X.shape[1], p.grid, "detect")
        torch.manual_seed(self.random_state)
        self.model_ = DetectHead(X.shape[2], p, grid)
        xs = torch.from_numpy((X - mean) / scale)
        tgt, pos = assign(list(y), grid)
        pos_weight = torch.tensor(3.0)

        def loss_of(idx: torch.Tensor) -> torch.Tensor:
            out = self.model_(xs[idx])
            m = pos[idx]
            obj_target = torch.zeros(m.shape)
            loss = out.new_zeros(())
            if m.any():
                c, iou = ciou(decode(out)[m], tgt[idx][m])
                loss = loss + (1 - c).mean()
                obj_target[m] = iou.detach().clamp(min=0)
                cls_t = torch.zeros(int(m.sum()), p.n_classes)
                cls_t[:, 0] = 1.0  # class-agnostic: every object is class 0
                loss = loss + F.binary_cross_entropy_with_logits(out[..., 5:][m], cls_t)
            return loss + F.binary_cross_entropy_with_logits(out[..., 4], obj_target, pos_weight=pos_weight)

        info = T.train(self.model_, loss_of, len(xs), iters=p.iters, batch_size=p.batch_size, lr=p.lr,
                       weight_decay=p.weight_decay, warmup=0.0, clip=p.clip, seed=self.random_state, floor=0.1)
        self.state_ = {"mean": mean, "scale": scale, **T.module_state(self.model_)}
        self.meta_ = {"grid": list(grid), "d": int(X.shape[2]), "iters": info.iters, "final_loss": info.final_loss}
        return self

    def load_state(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        super().load_state(tensors, meta)
        self.model_ = DetectHead(meta["d"], self.params, tuple(meta["grid"]))
        T.load_module_state(self.model_, tensors)

    def predict(self, X: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per sample: (boxes [k, 4] xyxy, scores [k]) after the threshold and NMS."""
        X = _dense(X)
        if not self.state_:
            raise ProbeError("this detect probe is not fitted: call fit(X, y) or Probe.load(path)")
        xs = torch.from_numpy((X - self.state_["mean"]) / self.state_["scale"])
        out: list[tuple[np.ndarray, np.ndarray]] = []
        with torch.no_grad():
            chunks = [self.model_(xs[i : i + 256]) for i in range(0, len(xs), 256)]
            raw = torch.cat(chunks) if chunks else torch.empty(0)
            for i in range(len(xs)):
                o = raw[i]
                boxes = decode(o[None])[0].reshape(-1, 4)
                score = (torch.sigmoid(o[..., 4]) * torch.sigmoid(o[..., 5:]).max(-1).values).reshape(-1)
                keep = score > self.params.conf
                boxes, score = boxes[keep], score[keep]
                k = nms(boxes, score, self.params.nms_iou) if len(score) else torch.zeros(0, dtype=torch.long)
                out.append((boxes[k].numpy(), score[k].numpy()))
        return out

    def score(self, X: Any, y: Any) -> float:
        return ap50(self.predict(X), _truths(y))

    def sample_predictions(self, X: Any, y: Any) -> tuple[Any, Any, Any]:
        """Per image: boxes predicted, boxes true (a count read from detection), the image's AP@50
        (NaN for an image with no true box: nothing to recall)."""
        return per_image(self.predict(X), _truths(y))

    def metrics(self, X: Any, y: Any) -> dict[str, Any]:
        return detect_metrics(self.predict(X), _truths(y))

    def scored(self, pred: list[tuple[np.ndarray, np.ndarray]], y: Any) -> tuple[float, dict[str, Any], tuple[Any, ...]]:
        """(score, metrics, per-sample (prediction, truth, score)) of predictions already made
        (out of core: predicted block by block, never holding the test features)."""
        truths = _truths(y)
        return ap50(pred, truths), detect_metrics(pred, truths), per_image(pred, truths)


def _truths(y: Any) -> list[np.ndarray]:
    return [np.asarray(b, np.float32).reshape(-1, 4) for b in y]


def per_image(preds: list[tuple[np.ndarray, np.ndarray]], truths: list[np.ndarray]) -> tuple[Any, Any, Any]:
    ap = [ap50([p], [t]) for p, t in zip(preds, truths, strict=True)]
    return (np.array([len(p[0]) for p in preds], np.float64), np.array([len(t) for t in truths], np.float64),
            np.array(ap, np.float64))


def detect_metrics(preds: list[tuple[np.ndarray, np.ndarray]], truths: list[np.ndarray]) -> dict[str, Any]:
    return {"n_pred": int(sum(len(p[0]) for p in preds)), "n_true": int(sum(len(t) for t in truths)),
            "count_exact": float(np.mean([len(p[0]) == len(t) for p, t in zip(preds, truths, strict=False)]))}


def _dense(X: Any) -> np.ndarray:
    X = np.asarray(X, dtype=np.float32)
    if X.ndim != 3:
        raise ProbeError(f"detect reads X [n, T, d] token arrays, got shape {X.shape}")
    return X
