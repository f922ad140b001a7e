"""Head ablation batches well: one forward per head over a batch of stimuli vs one per (head, stimulus).

The toy counting model over Go boards: ``extract.interventions.heads.ablate`` on batches of B
boards, side by side with the same boards one at a time, in one run. Also checks that both give
the same flip masks (a wrong shortcut would be fast and useless).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench import record

TOY = Path(__file__).resolve().parents[1] / "lab" / "checkpoints" / "toy-counter"


def main(quick: bool) -> None:
    from extract.interventions.heads import ablate, head_site
    from extract.models import load_model, prepare_batch
    from stimuli import get_family
    from stimuli.io import read_set, write_set

    torch.set_num_threads(1)
    n, batch = (16, 8) if quick else (64, 32)
    with tempfile.TemporaryDirectory() as tmp:
        family = get_family("go")
        cfg = family.config(preset="small", counts=f"0-{n - 1}", variation="mild")
        rows = read_set(write_set(family, cfg, n=1, seed=3, split="test", out=Path(tmp) / "go")).rows()
        lm = load_model(TOY, device="cpu")
        sites = [head_site(lm, "llm", layer) for layer in range(lm.adapter.n_layers("llm"))]
        folder = Path(tmp) / "go"
        images = [folder / r["image"] for r in rows]
        prompts = [r["prompts"]["multimodal_num"] for r in rows]
        answers = [r["answers"]["multimodal_num"] for r in rows]

        def batched() -> list[int]:
            masks = []
            for lo in range(0, n, batch):
                b = prepare_batch(lm, images[lo:lo + batch], prompts[lo:lo + batch], answers=answers[lo:lo + batch])
                rows = sorted(ablate(lm, b, sites), key=lambda r: (r["sample"], r["layer"], r["head"]))
                masks += [r["flip_mask"] for r in rows]
            return masks

        def single() -> list[int]:
            masks = []
            for i in range(n):
                b = prepare_batch(lm, images[i:i + 1], prompts[i:i + 1], answers=answers[i:i + 1])
                masks += [r["flip_mask"] for r in ablate(lm, b, sites)]
            return masks

        batched()  # warm-up
        t0 = time.perf_counter()
        got = batched()
        t_batched = time.perf_counter() - t0
        t0 = time.perf_counter()
        want = single()
        t_single = time.perf_counter() - t0
    heads = sum(s.n_heads for s in sites)
    print(f"   head ablation, toy model, {n} boards x {heads} heads: batches of {batch} {t_batched:.2f} s,"
          f" one board at a time {t_single:.2f} s -> {t_single / t_batched:.1f}x faster batched;"
          f" flip masks identical: {got == want}")
    record.figure("", "head ablation, batched / one board at a time", t_single / t_batched, "x faster",
                  setting=f"toy model, {n} Go boards x {heads} heads, batches of {batch}, torch 1 thread;"
                  f" flip masks identical: {got == want}")
