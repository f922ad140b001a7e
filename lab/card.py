"""Write the model card (README.md) of a trained checkpoint from its training record and evaluation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .evaluate import markdown


def render(checkpoint: Path, result: dict[str, Any], commands: list[str], notes: str = "") -> str:
    train = json.loads((checkpoint / "training.json").read_text())
    cfg = train["train_config"]
    s1, s2 = cfg["stage1"], cfg["stage2"]
    seconds = train.get("seconds", {})
    total = sum(seconds.values())
    size = (checkpoint / "model.safetensors").stat().st_size
    spec = result["spec"]
    model = cfg["model"]
    lines = [
        "# toy-counter: the counting lab's toy VLM (seed 001)",
        "",
        "A transformers model (`model_type: toy_counter`; `import lab` registers it with AutoConfig,",
        "AutoModelForImageTextToText, AutoModelForCausalLM, AutoProcessor) trained on 11x11 Go boards",
        "with the decoupled curriculum of \"visual counting bottleneck\": text counts to 120, vision only",
        "to 49. See `docs/toy-lab.md` for the architecture, the IO contract and the training recipe.",
        "",
        f"- parameters: {train['parameters']:,}; `model.safetensors` {size / 1024:.0f} KiB",
        f"- dim {model['hidden_size']}, {model['num_attention_heads']} heads, MLP {model['intermediate_size']},"
        f" {model['vision_layers']} ViT + {model['decoder_layers']} decoder blocks",
        f"- board {cfg['board_size']}x{cfg['board_size']}, {cfg['cell_px']} px cells, stone radius"
        f" {cfg['radius']}; training appearance: {', '.join(cfg['variations'])}",
        f"- stage 1: {s1['steps']} steps, batch {cfg['batch_size']}, AdamW {s1['lr']:g}, text counting"
        f" 0..{cfg['text_max_count']} + text TF ({cfg['tf_share_stage1']:.0%} of steps)",
        f"- stage 2: {cfg.get('stage2_steps_total', s2['steps'])} pairs (one vision batch + one text batch), AdamW vision"
        f" {s2['vision_lr']:g}, decoder + projector {s2['lr']:g}; boards n <= {cfg['vision_max_count']};"
        f" every {cfg['tf_every_stage2']}rd pair is the contrastive task",
        "",
        "## Training",
        "",
        "Retrain from scratch (both stages, `lab/toy.yaml`): `python -m lab.train` (`make toy-model`).",
        "",
        "This checkpoint was produced by:",
        "",
        *[f"    {c}" for c in (commands or train.get("commands", []))],
        "",
        "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        + f", total {total / 60:.1f} min"
        f" ({train['threads']} torch thread(s), torch {train['torch']}).",
        "",
        notes.strip(),
        "",
        "## Evaluation",
        "",
        f"`python -m lab.evaluate {checkpoint.name and 'lab/checkpoints/' + checkpoint.name}"
        f" --per-count {spec['per_count']} --variation {spec['variation']}`: fresh boards from"
        f" `extract.stimuli.goboard` (preset small, variation `{spec['variation']}`, seed {spec['seed']},"
        f" {spec['per_count']} boards per count 0..120), greedy decoding through `generate`.",
        "",
        markdown(result),
        "",
    ]
    return "\n".join(lines)


def write(checkpoint: Path, result: dict[str, Any], commands: list[str], notes: str = "",
          extra: str = "") -> Path:
    out = checkpoint / "README.md"
    out.write_text(render(checkpoint, result, commands, notes) + ("\n" + extra.strip() + "\n" if extra else ""))
    (checkpoint / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
    return out
