"""``python -m extract.scale_table``: the planning table of docs/scale.md, from config files only.

Plans the full Grid2Matrix sweep (the study's N = 3..64 by C = 3..10, 100 grids per cell, 512 px:
6,400 stimuli) for the committed config-only model folders in ``manifests/configs/`` with the same
code as ``python -m extract MANIFEST --dry-run`` (:func:`extract.dry_run.estimate_run`), without
writing the 6,400 images: each stimulus's image size, prompt and answer budget come from
``stimuli.g2m`` exactly as its generator makes them (tested against a written set).

    python -m extract.scale_table [--n 100] [--batch-size 8] [--gpu-tflops 400] [--gpu-bandwidth-gbs 3000]
                                  [--step-ms-per-layer 1.0] [--disk-mbps 1000]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extract.dry_run import DrySample, Hardware, RunEstimate, duration, estimate_run, meta_model
from extract.manifest import Manifest, parse_manifest
from stimuli import g2m
from store.sizing import human

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "manifests" / "configs"
MODELS = {
    "Qwen2.5-VL-7B-Instruct": CONFIGS / "qwen2.5-vl-7b-instruct",
    "Qwen2.5-VL-72B-Instruct": CONFIGS / "qwen2.5-vl-72b-instruct",
    "LLaVA-1.5-7B (llava-hf)": CONFIGS / "llava-1.5-7b-hf",
}
SWEEP_COLORS = tuple(range(g2m.MIN_COLORS, g2m.MAX_COLORS + 1))


def g2m_sweep(n: int = 100, grid_sizes: Sequence[int] = g2m.PAPER_GRID_SIZES, colors: Sequence[int] = SWEEP_COLORS,
              image_size: int = 512) -> list[DrySample]:
    """The sweep's stimuli in ``g2m.generate``'s order, as planning sees them (no image drawn)."""
    return [DrySample(image_size, image_size, g2m.prompt(grid, grid, c), g2m.max_new_tokens(grid, grid))
            for grid in grid_sizes for c in colors for _ in range(n)]


@dataclass(frozen=True)
class Variant:
    label: str
    taps: list[dict[str, Any]]
    attention: dict[str, Any] | None = None


def spaced(n_layers: int, k: int = 8) -> list[int]:
    """``k`` layers evenly spread from the first to the last."""
    return sorted({round(i * (n_layers - 1) / (k - 1)) for i in range(k)})


def variants(n_llm: int) -> list[Variant]:
    sub = spaced(n_llm)
    return [
        Variant("all LLM layers × image tokens", [{"tap": "llm", "layers": "all", "tokens": ["image"]}]),
        Variant("all LLM layers × last token", [{"tap": "llm", "layers": "all", "tokens": ["last"]}]),
        Variant(f"{len(sub)} LLM layers × image tokens", [{"tap": "llm", "layers": sub, "tokens": ["image"]}]),
        Variant(f"{len(sub)} LLM layers × image + last", [{"tap": "llm", "layers": sub, "tokens": ["image", "last"]}]),
        Variant("all vision blocks × image tokens", [{"tap": "vision", "layers": "all"}]),
        Variant("all LLM layers × answer tokens", [{"tap": "llm", "layers": "all", "tokens": ["answer"]}]),
        Variant("all LLM layers × image + attention rows of the last token",
                [{"tap": "llm", "layers": "all", "tokens": ["image"]}], {"layers": "all", "queries": ["last"]}),
        Variant("attention rows of every answer token, all layers", [], {"layers": "all", "queries": ["answer"]}),
    ]


def manifest(model: Path, variant: Variant, batch_size: int, chunk_samples: int = 64) -> Manifest:
    data: dict[str, Any] = {
        "run": "scale", "model": {"path": str(model), "dtype": "bfloat16", "device": "cuda"},
        "stimuli": [{"set": "sets/g2m-sweep"}], "taps": variant.taps,
        "generation": {"max_new_tokens": "from_stimulus"}, "batch_size": batch_size, "chunk_samples": chunk_samples,
    }
    if variant.attention:
        data["attention"] = variant.attention
    return parse_manifest(data, "scale_table")


def estimates(samples: Sequence[DrySample], batch_size: int, hardware: Hardware,
          models: dict[str, Path] = MODELS) -> Iterable[tuple[str, Variant, RunEstimate, RunEstimate]]:
    """(model, variant, estimate with codec none, estimate with bitround7) for every model and variant."""
    for name, folder in models.items():
        lm = None
        for v in variants(_llm_layers(folder)):
            m = manifest(folder, v, batch_size)
            lm = lm or meta_model(m)
            yield (name, v, estimate_run(m, lm, samples, hardware=hardware),
                   estimate_run(m, lm, samples, codec="bitround7", hardware=hardware))


def _llm_layers(folder: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(folder).get_text_config().num_hidden_layers)


def table(samples: Sequence[DrySample], batch_size: int = 8, hardware: Hardware | None = None,
          other_batches: Sequence[int] = (32, 128)) -> str:
    hardware = hardware or Hardware()
    head = ("| model | kept | arrays | fp16 | bitround7 | chunk files | files | write at "
            f"{hardware.disk_mbps:g} MB/s | GPU | estimate |")
    lines = [head, "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    models: dict[str, RunEstimate] = {}
    for name, v, p, b in estimates(samples, batch_size, hardware):
        models.setdefault(name, p)
        lines.append(f"| {name} | {v.label} | {len(p.arrays):,} | {human(p.raw_bytes)} | {human(b.bytes)} |"
                     f" {p.chunk_files:,} | {p.files:,} | {duration(p.time.write_seconds)} | {duration(p.time.gpu_seconds)} |"
                     f" {duration(p.time.seconds)} |")
    others = "".join(f" GPU time at batch {b} |" for b in other_batches)
    lines += ["", "| model | parameters | GPU memory (bf16) | image tokens / LLM prompt tokens per sample |"
                  f" prefill | decode steps (batch {batch_size}), bound by | GPU time |{others}",
              "|---|--:|--:|--:|--:|--:|--:|" + "--:|" * len(other_batches)]
    for name, p in models.items():
        t = p.time
        cells = []
        for batch in other_batches:
            m = manifest(MODELS[name], variants(1)[1], batch)
            other = estimate_run(m, meta_model(m), samples, hardware=hardware)
            cells.append(f"{duration(other.time.gpu_seconds)} (KV {human(other.kv_bytes)})")
        lines.append(f"| {name} | {p.params.total / 1e9:.2f} B | {human(p.weight_bytes)} (KV at batch {batch_size}:"
                     f" {human(p.kv_bytes)}) |"
                     f" {p.first_image_tokens} / ~{p.first_seq} |"
                     f" {t.prefill_flops / 1e15:,.0f} PFLOP, {duration(t.prefill_seconds)} |"
                     f" {t.decode_steps:,}, {t.decode_bound} | {duration(t.gpu_seconds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    d = Hardware()
    parser = argparse.ArgumentParser(prog="python -m extract.scale_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="grids per (N, C) cell (default 100: 6,400 stimuli)")
    parser.add_argument("--batch-size", type=int, default=8, help="generation batch (default 8)")
    parser.add_argument("--gpu-tflops", type=float, default=d.gpu_tflops)
    parser.add_argument("--gpu-bandwidth-gbs", type=float, default=d.gpu_bandwidth_gbs)
    parser.add_argument("--disk-mbps", type=float, default=d.disk_mbps)
    parser.add_argument("--step-ms-per-layer", type=float, default=d.step_ms_per_layer)
    args = parser.parse_args(argv)
    samples = g2m_sweep(args.n)
    print(f"G2M sweep: {len(samples):,} stimuli (N {list(g2m.PAPER_GRID_SIZES)} × C {list(SWEEP_COLORS)} × {args.n}),"
          f" 512 px, answers at the study's budget min(4N²+20N+50, 2048); bf16 models, chunks of 64 samples\n")
    print(table(samples, args.batch_size,
                Hardware(args.gpu_tflops, args.gpu_bandwidth_gbs, args.disk_mbps, args.step_ms_per_layer)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
