"""Write the model card (README.md) of a trained checkpoint from its training record and evaluation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .evaluate import MAX_NEW_TOKENS, markdown


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def cap_note(spec: dict[str, Any]) -> str:
    """The generation cap the figures rest on, in words (evaluations before it was recorded used 6)."""
    cap = spec.get("max_new_tokens", 6)
    study = " (the counting-bottleneck study's cap)" if cap == MAX_NEW_TOKENS else ""
    return f"max_new_tokens = {cap}{study}; an answer with no EOS within the cap is runaway"


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
        "# toy-counter: the counting lab's toy VLM (counting-bottleneck)",
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
        f" every {ordinal(cfg['tf_every_stage2'])} pair is the contrastive task"
        + ("" if cfg.get("vision_tf_partners_in_range", True)
           else f" (unequal partner strings over 0..{cfg['text_max_count']})"),
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
        f" `stimuli.goboard` (preset small, variation `{spec['variation']}`, seed {spec['seed']},"
        f" {spec['per_count']} boards per count 0..120), greedy decoding through `generate`, {cap_note(spec)}.",
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


def render_g2m(checkpoint: Path, result: dict[str, Any], table: str, commands: list[str] | None = None,
               notes: str = "") -> str:
    """The G2M toy's card: recipe, training command and time, and ``table``, the evaluation per N
    that ``lab.g2m.markdown`` renders (passed in: the card writer is a client of no curriculum)."""
    train = json.loads((checkpoint / "training.json").read_text())
    lines = [
        *_g2m_recipe(checkpoint, train),
        "",
        *_g2m_training(train, commands),
        "",
        *_g2m_evaluation(checkpoint, result["spec"]),
        "",
        table,
        "",
        notes.strip(),
        "",
    ]
    return "\n".join(lines)


def _g2m_recipe(checkpoint: Path, train: dict[str, Any]) -> list[str]:
    """The card's title and recipe: size, architecture, grids, schedule, prompt and answer."""
    cfg = train["train_config"]
    s1, model = cfg["stage1"], cfg["model"]
    size = (checkpoint / "model.safetensors").stat().st_size
    sizes = ", ".join(str(n) for n in cfg["grid_sizes"])
    return [
        "# toy-g2m: the lab's toy VLM on Grid2Matrix colour grids (study g2m)",
        "",
        "The counting lab's architecture (`model_type: toy_counter`, `import lab` registers the Auto",
        "classes) trained to transcribe N x N grids of the project's G2M stimuli",
        "(`stimuli.g2m`: palette, matrix rule, outline, the study's prompt) for small N only,",
        "then evaluated on larger N. See `docs/toy-lab.md` (section G2M) for the recipe.",
        "",
        f"- parameters: {train['parameters']:,}; `model.safetensors` {size / 1024:.0f} KiB",
        f"- dim {model['hidden_size']}, {model['num_attention_heads']} heads, MLP {model['intermediate_size']},"
        f" {model['vision_layers']} ViT + {model['decoder_layers']} decoder blocks; vocabulary = the counter's"
        " + the words of the G2M prompt",
        f"- grids: N in {{{sizes}}}, C = {cfg['num_colors']}, `{cfg['strategy']}` strategy, drawn at N x"
        f" {cfg['cell_px']} px (one ViT token per cell)",
        f"- one stage, {s1['steps']} steps (one batch of {cfg['batch_size']} grids of one N per step, the"
        f" sizes in turn), AdamW vision {s1['vision_lr'] or s1['lr']:g}, projector + decoder {s1['lr']:g},"
        f" warmup {s1['warmup']}, cosine to 10%",
        "- prompt: the study's G2M prompt (`g2m.prompt`) in the toy's template; answer: the N² colour",
        "  indices in raster order, one digit token each, read by the study's parser (all integers,",
        "  exactly H·W) and scored by `g2m.score` (Exact Match, Cell Accuracy)",
    ]


def _g2m_training(train: dict[str, Any], commands: list[str] | None) -> list[str]:
    """How to retrain, the command that produced this checkpoint, and its wall time."""
    seconds = train.get("seconds", {})
    total = sum(seconds.values())
    return [
        "## Training",
        "",
        "Retrain from scratch (`lab/toy-g2m.yaml`): `python -m lab.train --config lab/toy-g2m.yaml`"
        " (`make toy-g2m`).",
        "",
        "This checkpoint was produced by:",
        "",
        *[f"    {c}" for c in (commands or [train["command"]])],
        "",
        "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        + f", total {total / 60:.1f} min ({train['threads']} torch thread(s), torch {train['torch']}).",
    ]


def _g2m_evaluation(checkpoint: Path, spec: dict[str, Any]) -> list[str]:
    """The evaluation's heading and method: the command, the test grids, the probe and its controls."""
    return [
        "## Evaluation",
        "",
        f"`python -m lab.g2m evaluate lab/checkpoints/{checkpoint.name} --per-n {spec['per_n']}`: per N,"
        f" {spec['per_n']} fresh grids from `stimuli.g2m` (seeds {spec['seed']}..), greedy decoding"
        " through `generate` (budget N² + 8 tokens), scored by `g2m.score`. The probe is a per-token"
        " linear classifier (StandardScaler + LogisticRegression) on the ViT output tokens (`vision.norm`,"
        f" the projector input), trained per N on {spec['probe_grids']} other grids (seeds"
        f" {spec['probe_seed']}..) and tested on the same test grids; controls: shuffled training labels,"
        " and the same probe on a randomly initialised ViT of the same shape.",
    ]


def write_g2m(checkpoint: Path, result: dict[str, Any], table: str, commands: list[str] | None = None,
              notes: str = "") -> Path:
    """Write the G2M toy's card (README.md, with ``table``: see :func:`render_g2m`) and evaluation.json."""
    out = checkpoint / "README.md"
    out.write_text(render_g2m(checkpoint, result, table, commands, notes))
    (checkpoint / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
    return out
