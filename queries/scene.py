"""Scene objects and the image tokens they cover: shared by the analyses that score attention or
token maps against object positions (CountingTricks objects, spatial scenes' subject/reference)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def objects_in(truth: Any) -> list[dict[str, Any]]:
    """The objects a stimulus' truth names, each with a pixel ``bbox`` [x0, y0, x1, y1]: the
    ``objects`` list (CountingTricks) or ``subject`` / ``reference`` (spatial scenes)."""
    truth = json.loads(truth) if isinstance(truth, str) else (truth or {})
    found = [o for o in truth.get("objects") or [] if isinstance(o, dict) and "bbox" in o]
    found += [truth[k] for k in ("subject", "reference") if isinstance(truth.get(k), dict) and "bbox" in truth[k]]
    return found


def object_patches(bbox: list[float], image_size: tuple[float, float], grid: tuple[int, int]) -> np.ndarray:
    """Raster indices of the patches of a ``grid`` (rows, cols) laid over an image of
    ``image_size`` (width, height) px that overlap ``bbox``."""
    (w, h), (rows, cols) = image_size, grid
    x0, y0, x1, y1 = bbox
    c0, c1 = int(np.floor(x0 / w * cols)), int(np.ceil(x1 / w * cols))
    r0, r1 = int(np.floor(y0 / h * rows)), int(np.ceil(y1 / h * rows))
    rr, cc = np.meshgrid(np.arange(max(r0, 0), min(r1, rows)), np.arange(max(c0, 0), min(c1, cols)), indexing="ij")
    return (rr * cols + cc).ravel()
