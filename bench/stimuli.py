"""Stimulus generation speed: 1,000 G2M 512 px images (the paper's grid sizes), written as a set."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import record
from stimuli import get_family
from stimuli.g2m import PAPER_GRID_SIZES
from stimuli.io import write_set


def main(quick: bool = False) -> None:
    family = get_family("g2m")
    per_size = 12 if quick else 125  # 8 sizes x 125 = 1,000 images
    config = family.config(grid_sizes=PAPER_GRID_SIZES, colors=(3,))
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        out = write_set(family, config, n=per_size, seed=0, split="test", out=Path(tmp) / "g2m")
        seconds = time.perf_counter() - started
        images = per_size * len(PAPER_GRID_SIZES)
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"   g2m 512 px, N in {PAPER_GRID_SIZES}: {images} images in {seconds:.1f} s"
          f" = {images / seconds:.0f} images/s, {size / images / 1024:.1f} KiB/image (aim: 1,000 in < 60 s)")
    setting = f"{images} G2M 512 px images, N in {PAPER_GRID_SIZES}, C=3, written as a set (PNG + Parquet), one process"
    record.figure("", "write a set", seconds, "s", aim="< 60 s for 1,000", setting=setting)
    record.figure("", "image size", size / images / 1024, "KiB/image", setting=setting)
