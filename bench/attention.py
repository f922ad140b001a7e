"""Attention rows at a long prompt: the row-selective capture vs the former full-eager one vs no capture.

A tiny LLaVA (its Llama text model with 8 heads, 8 key/value heads, head size 64 and 4 layers, 8,192
positions), built here with random weights, over a text-only prompt of 4,096 tokens (1,024 with
``--quick``): a greedy ``generate`` of a few tokens keeping the attention rows ``last`` + ``answer`` of
every layer. Three configurations, each alone in a fresh process (bench/_attention_worker.py) so that
its peak resident set is its own: no capture (plain ``generate``, sdpa), the former path (eager over
every query row of every requested layer: heads x T x T per layer) and the row-selective path (the
model's sdpa output, and the weights of just the kept rows beside it). Memory is what a generate adds
to the process's resident set at its peak (the largest call after a warm-up one); time is each capture's
calls paired with plain generates in the same process, in alternating order (the median ratio), since
separate processes on a shared machine differ by more than a capture costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import record

HEADS, LAYERS, HIDDEN = 8, 4, 512
STEPS = 4  # generated tokens: the prompt pass and 3 decode steps that keep an answer row


def build_model(out: Path) -> Path:
    """The tiny LLaVA recipe with a long-context, 8-head, 4-layer text model, saved as a model folder."""
    from transformers import AutoConfig
    from transformers.utils import logging

    from extract.models.adapters import adapter_class, registry
    from extract.models.compat import patch_processors_without_torchvision
    from extract.models.tiny import init_model

    logging.disable_progress_bar()
    patch_processors_without_torchvision()
    registry()
    model: Any
    model, processor = adapter_class("llava").build_tiny(0)
    config = model.config
    text = {**config.text_config.to_dict(), "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
            "num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "head_dim": HIDDEN // HEADS,
            "intermediate_size": 2 * HIDDEN, "max_position_embeddings": 8192}
    config.text_config = AutoConfig.for_model(text.pop("model_type"), **text)
    model = init_model(type(model), config, 0)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("AGNOSIA_ATTENTION_ROWS", None)  # the worker sets it for the full path only
    out = subprocess.run([sys.executable, "-m", "bench._attention_worker", json.dumps(spec)], capture_output=True,
                         text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        raise RuntimeError(f"attention worker {spec['mode']} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(quick: bool = False) -> None:
    tokens, rounds = (1024, 1) if quick else (4096, 3)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model")
        results = {}
        for mode in ("none", "full", "selected"):
            results[mode] = run_worker({"model": str(model), "tokens": tokens, "mode": mode, "steps": STEPS,
                                        "rounds": rounds, "threads": 2})
    none, full, sel = results["none"], results["full"], results["selected"]
    setting = (f"tiny LLaVA text model, {HEADS} heads x {LAYERS} layers, head size {HIDDEN // HEADS}, fp32, CPU,"
               f" torch 2 threads; text-only prompt of {tokens} tokens, greedy generate of {STEPS} tokens;"
               f" attention rows last + answer on all {LAYERS} layers; peak RSS a call adds, largest of"
               f" {rounds} after a warm-up (VmHWM reset: {sel['peak_reset']}; allocations >= 1 MiB unpooled)")
    print(f"   {tokens}-token prompt, {HEADS} heads x {LAYERS} layers, rows last + answer on every layer:")
    for mode, label in (("none", "no attention capture"), ("full", "former path (eager, all rows)"),
                        ("selected", "row-selective path")):
        r = results[mode]
        print(f"   {label:32s} peak +{r['peak_mb']:8.1f} MB   {r['time_s']:.3f} s")
    capture_full = full["peak_mb"] - none["peak_mb"]
    capture_sel = sel["peak_mb"] - none["peak_mb"]
    # a capture within the noise of no capture (or below it) counts as 1 MB: the ratio is then a lower bound
    capture_ratio = capture_full / max(capture_sel, 1.0)
    whole = full["peak_mb"] / max(sel["peak_mb"], 1.0)
    print(f"   peak memory of the capture (over no capture): former {capture_full:+.1f} MB,"
          f" row-selective {capture_sel:+.1f} MB -> >= {capture_ratio:.0f}x lower (a capture within 1 MB of no"
          f" capture counts as 1 MB); whole generate {whole:.1f}x lower")
    print(f"   time, paired with a plain generate in the same process: row-selective {sel['paired_ratio']:.3f}x,"
          f" former path {full['paired_ratio']:.3f}x")
    record.figure("", "attention capture peak memory, former / row-selective", capture_ratio, "x lower",
                  aim=">= 10", setting=setting + f"; former {capture_full:+.0f} MB, row-selective {capture_sel:+.0f} MB"
                  " over a generate without capture; a capture within 1 MB of none counts as 1 MB")
    record.figure("", "generate peak memory added, row-selective", sel["peak_mb"], "MB", setting=setting)
    record.figure("", "generate peak memory added, former path", full["peak_mb"], "MB", setting=setting)
    record.figure("", "generate peak memory added, no capture", none["peak_mb"], "MB", setting=setting)
    record.figure("", "generate time with row-selective capture / without capture", sel["paired_ratio"], "x",
                  aim="<= 1.1", setting=setting + "; paired call by call with a plain generate in the same process")
    record.figure("", "generate time with former capture / without capture", full["paired_ratio"], "x",
                  setting=setting + "; paired call by call with a plain generate in the same process")
