"""``python -m bench._gpu_decode``: the GPU check behind docs/scale.md's decode constants (needs CUDA).

Random-initialised bf16 models built from the committed config-only folders (manifests/configs/),
text-only prompts of 473 tokens (the G2M prompt length the planner estimates), transformers'
``generate`` with 1 and 1 + STEPS new tokens: the difference over STEPS is one decode step.
Prints per model and batch: ms per step, ms per decoder layer, the weight-read rate that step
would imply, and the prefill TFLOP/s. Not a ``make bench`` topic: it needs a GPU and ~1 min.
"""

from __future__ import annotations

import json
import time
from typing import Any

PROMPT = 473
STEPS = 128
CASES = [  # (name, config folder, decoder layers kept or None for all, batch)
    ("Qwen2.5-VL-7B", "manifests/configs/qwen2.5-vl-7b-instruct", None, 8),
    ("Qwen2.5-VL-7B", "manifests/configs/qwen2.5-vl-7b-instruct", None, 32),
    ("Qwen2.5-VL-7B, first 8 layers", "manifests/configs/qwen2.5-vl-7b-instruct", 8, 8),
    ("Qwen2.5-VL-72B, first 20 layers", "manifests/configs/qwen2.5-vl-72b-instruct", 20, 8),
    ("LLaVA-1.5-7B", "manifests/configs/llava-1.5-7b-hf", None, 8),
]


def build(path: str, layers: int | None):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(path)
    text = cfg.get_text_config()
    if layers:
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None):
            text.layer_types = text.layer_types[:layers]
    with torch.device("cuda"):
        return AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def generate_seconds(model, batch: int, new_tokens: int) -> float:
    import torch

    ids = torch.randint(100, 30000, (batch, PROMPT), device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(quick: bool = False) -> None:
    import torch

    built: dict[tuple[str, int | None], Any] = {}
    for name, path, layers, batch in CASES:
        key = (path, layers)
        if key not in built:
            built.clear()
            torch.cuda.empty_cache()
            built[key] = build(path, layers)
        model = built[key]
        lm = model.model.language_model
        decoder = sum(p.numel() for p in lm.layers.parameters()) + sum(p.numel() for p in model.lm_head.parameters())
        generate_seconds(model, batch, 4)  # warm-up
        prefill = min(generate_seconds(model, batch, 1) for _ in range(3))
        step = (min(generate_seconds(model, batch, 1 + STEPS) for _ in range(2)) - prefill) / STEPS
        print(json.dumps({"model": name, "layers": len(lm.layers), "batch": batch, "ms_per_step": round(step * 1e3, 2),
                          "ms_per_layer": round(step * 1e3 / len(lm.layers), 3),
                          "weights_over_step_gbs": round(2 * decoder / step / 1e9),
                          "prefill_tflops": round(2 * decoder * PROMPT * batch / prefill / 1e12)}), flush=True)


if __name__ == "__main__":
    main()
