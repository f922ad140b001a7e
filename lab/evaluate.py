"""Evaluate a toy-counter checkpoint the way the model card reports it: ``python -m lab.evaluate CKPT``.

On fresh Go boards from ``stimuli.goboard`` (never the training renderer) it measures, per
regime (ID 0-49, VE 50-99, FE 100-120):

- greedy accuracy of the four tasks: visual count, text count, visual-vs-text "same number?"
  (contrastive), text-vs-text "same number?", generating at most ``max_new_tokens`` tokens (10,
  the counting-bottleneck study's cap; the study joins the digits of what came back);
- what the visual answers are (``store.records.answer_kind``, the classification the queries
  read): a number (digits), a word without a digit (``False``), empty, or runaway (no EOS within
  the cap: cut, not ended);
- the attractor table: the distribution of visual answers on VE and FE;
- the hidden-number probe: a per-token 3-class logistic regression (black / white / empty) on the
  ViT output tokens (after ``vision.norm``), trained on ID boards only; N_H = tokens labelled black.
  Exact match 1[N_H = N_G] per regime, beside the same probe trained on shuffled labels (control);
- Vision Gap = mean |N_H - N_G| per regime (N_G truth), and Language Gap = mean |N_H - N_P| and
  the visual mean absolute error over the visual answers that are numbers (N_P the parsed answer).
  The study's parser reads an empty answer as 0 and joins the digits of a cut one; here those are
  their own outcomes, because a cut string of digits measures the cap, not the model.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from extract.generation import answer_length, eos_ids, stop_reason
from stimuli import goboard as G
from stimuli.answers import parse_digit_string
from stimuli.progress import progress_bar
from store.records import ANSWER_KINDS, answer_kind
from toyvlm.processor import prompt

REGIMES = ("ID", "VE", "FE")
TASKS = ("multimodal_num", "text_only_num", "multimodal_tf", "text_only_tf")
# The counting-bottleneck study's generation cap (greedy, at most 10 new tokens, digits joined).
MAX_NEW_TOKENS = 10
PROBE_COUNTS = "1-49"  # the hidden-number probe trains on in-distribution boards only
TASK_LABEL = {"multimodal_num": "visual count", "text_only_num": "text count",
              "multimodal_tf": "contrastive (board vs string)", "text_only_tf": "text vs text"}


@dataclass(frozen=True)
class EvalSpec:
    per_count: int = 4
    counts: str = "0-120"
    seed: int = 20260
    variation: str = "mild"
    probe_boards: int = 20  # ID probe-training boards per count (1..49)
    probe_per_class: int = 4  # tokens per class per probe-training board
    batch_size: int = 128
    max_new_tokens: int = MAX_NEW_TOKENS


def load(checkpoint: str) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import toyvlm  # noqa: F401  (registers the Auto classes)

    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    return model, AutoProcessor.from_pretrained(checkpoint)


def board_config(model: Any, spec: EvalSpec, counts: str) -> G.Config:
    return G.Config(preset="small", board_size=model.config.board_size, cell_px=model.config.patch_size,
                    counts=counts, variation=spec.variation)


def boards(model: Any, spec: EvalSpec, counts: str, n: int, seed: int, split: str, bar: Any = None) -> list:
    out = []
    for s in G.generate(board_config(model, spec, counts), n, seed, split):
        out.append(s)
        _advance(bar, 1)
    return out


def _advance(bar: Any, n: int) -> None:
    if bar is not None:
        bar.update(n)


def request(s: Any, task: str) -> tuple[str, bool]:
    """(prompt, needs image) for one stimulus and task, exactly as in training."""
    shown = G.task_inputs(s.truth, task)
    return prompt(s.prompts[task], shown.strings, image=shown.image), shown.image


@torch.inference_mode()
def generate_answers(model: Any, processor: Any, stimuli: Sequence, task: str, batch_size: int,
                     max_new_tokens: int = MAX_NEW_TOKENS, bar: Any = None) -> list[tuple[str, str]]:
    """(text, stop reason) per stimulus: greedy ``generate``, the text up to the first EOS id with
    special tokens stripped, the reason 'eos' or 'cap' (ran out of tokens), as the extraction
    stage records them."""
    stop = eos_ids(model)
    out: list[tuple[str, str]] = []
    for i in range(0, len(stimuli), batch_size):
        chunk = stimuli[i:i + batch_size]
        texts, images = zip(*[(request(s, task)[0], s.image) for s in chunk], strict=False)
        with_image = request(chunk[0], task)[1]
        inputs = processor(images=list(images) if with_image else None, text=list(texts))
        seq = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=processor.tokenizer.pad_token_id)
        for row in seq[:, inputs["input_ids"].shape[1]:]:
            _, end = answer_length(row, stop, len(row))
            text = processor.tokenizer.decode(row[:end], skip_special_tokens=True).strip()
            out.append((text, stop_reason(row, end)))
        _advance(bar, len(chunk))
    return out


def answer(model: Any, processor: Any, stimuli: Sequence, task: str, batch_size: int,
           max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Greedy answers (special tokens stripped) through ``generate``."""
    return [t for t, _ in generate_answers(model, processor, stimuli, task, batch_size, max_new_tokens)]


def correct(s: Any, task: str, text: str) -> bool:
    if task.endswith("_tf"):
        return text == s.answers[task]
    return parse_digit_string(text) == s.truth["count"]


@torch.inference_mode()
def vit_tokens(model: Any, processor: Any, stimuli: Sequence, batch_size: int, bar: Any = None) -> np.ndarray:
    """ViT output tokens after the final LayerNorm, [boards, patches, d], raster order."""
    feats = []
    for i in range(0, len(stimuli), batch_size):
        px = processor.image_processor([s.image for s in stimuli[i:i + batch_size]])["pixel_values"]
        feats.append(model.vision(px)[0].float().numpy())
        _advance(bar, min(batch_size, len(stimuli) - i))
    return np.concatenate(feats)


def probe_training_set(stimuli: Sequence, feats: np.ndarray, per_class: int, seed: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``per_class`` tokens of each class per board, boards with >= 1 white stone (the study's filter)."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for s, f in zip(stimuli, feats, strict=False):
        labels = np.asarray(s.truth["labels"])
        if (labels == G.WHITE).sum() == 0:
            continue
        for cls in (G.BLACK, G.WHITE, G.EMPTY):
            idx = np.flatnonzero(labels == cls)
            pick = rng.choice(idx, size=min(per_class, idx.size), replace=False) if idx.size else idx
            xs.append(f[pick])
            ys.append(np.full(pick.size, cls))
    return np.concatenate(xs), np.concatenate(ys)


def fit_probe(x: np.ndarray, y: np.ndarray) -> Any:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(x, y)


def hidden_numbers(probe: Any, feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N_H per board, per-token predictions [boards, patches])."""
    pred = probe.predict(feats.reshape(-1, feats.shape[-1])).reshape(feats.shape[:2])
    return (pred == G.BLACK).sum(1), pred


def steps(model: Any, spec: EvalSpec) -> int:
    """The board-steps :func:`evaluate` advances its bar by: each test board drawn, answered in the
    four tasks and encoded by the trained and the fresh tower (7); each probe board drawn and encoded twice (3)."""
    n_test = G.FAMILY.set_size(board_config(model, spec, spec.counts), spec.per_count)
    return 7 * n_test + 3 * G.FAMILY.set_size(board_config(model, spec, PROBE_COUNTS), spec.probe_boards)


def evaluate(model: Any, processor: Any, spec: EvalSpec = EvalSpec(), bar: Any = None) -> dict[str, Any]:
    """The model card's table; ``bar`` (a progress bar of :func:`steps` items) advances as it goes."""
    torch.manual_seed(0)
    stimuli = boards(model, spec, spec.counts, spec.per_count, spec.seed, "test", bar)
    regimes = np.array([s.truth["regime"] for s in stimuli])
    truth = np.array([s.truth["count"] for s in stimuli])
    generated = {task: generate_answers(model, processor, stimuli, task, spec.batch_size, spec.max_new_tokens, bar)
                 for task in TASKS}
    ok = {task: np.array([correct(s, task, t) for s, (t, _) in zip(stimuli, generated[task], strict=False)]) for task in TASKS}
    kinds = np.array([answer_kind(t, why) for t, why in generated["multimodal_num"]])
    visual = [parse_digit_string(t) if k == "digits" else None
              for (t, _), k in zip(generated["multimodal_num"], kinds, strict=False)]
    n_p = np.array([-1 if v is None else v for v in visual])

    # Hidden-number probe: trained on separate ID boards, evaluated on every regime.
    train_set = boards(model, spec, PROBE_COUNTS, spec.probe_boards, spec.seed + 1, "probe", bar)
    x, y = probe_training_set(train_set, vit_tokens(model, processor, train_set, spec.batch_size, bar),
                              spec.probe_per_class, spec.seed)
    feats = vit_tokens(model, processor, stimuli, spec.batch_size, bar)
    token_truth = np.array([s.truth["labels"] for s in stimuli])
    probe = fit_probe(x, y)
    control = fit_probe(x, np.random.default_rng(spec.seed).permutation(y))
    n_h, pred = hidden_numbers(probe, feats)
    # Second control: the same probe on a randomly initialised tower of the same shape, which
    # says how much of the decodability the training put there.
    torch.manual_seed(spec.seed)
    fresh = type(model)(model.config).eval()
    xr, yr = probe_training_set(train_set, vit_tokens(fresh, processor, train_set, spec.batch_size, bar),
                                spec.probe_per_class, spec.seed)
    n_hr, _ = hidden_numbers(fit_probe(xr, yr), vit_tokens(fresh, processor, stimuli, spec.batch_size, bar))
    n_hc, pred_c = hidden_numbers(control, feats)

    table: dict[str, Any] = {}
    for r in REGIMES:
        m = regimes == r
        if not m.any():
            continue
        row: dict[str, Any] = {"boards": int(m.sum())}
        for task in TASKS:
            row[task] = float(ok[task][m].mean())
        num = m & (kinds == "digits")  # the answers that are numbers: the only ones an error is defined for
        for kind in ANSWER_KINDS:
            row[f"visual_{kind}"] = float((kinds[m] == kind).mean())
        row["visual_mae"] = float(np.abs(n_p[num] - truth[num]).mean()) if num.any() else None
        row["probe_exact"] = float((n_h[m] == truth[m]).mean())
        row["probe_token_acc"] = float((pred[m] == token_truth[m]).mean())
        row["control_exact"] = float((n_hc[m] == truth[m]).mean())
        row["control_token_acc"] = float((pred_c[m] == token_truth[m]).mean())
        row["random_init_exact"] = float((n_hr[m] == truth[m]).mean())
        row["vision_gap"] = float(np.abs(n_h[m] - truth[m]).mean())
        row["language_gap"] = float(np.abs(n_h[num] - n_p[num]).mean()) if num.any() else None
        table[r] = row
    texts = [t for t, _ in generated["multimodal_num"]]
    return {"spec": vars(spec), "regimes": table, "attractors": attractors(regimes, kinds, texts, visual),
            "probe_train_tokens": int(len(y))}


def attractors(regimes: np.ndarray, kinds: np.ndarray, texts: list[str], visual: list[int | None]
               ) -> dict[str, list[tuple[str, float]]]:
    """Top 10 visual answers on VE and FE with their shares: the number, the word itself, 'empty',
    or 'runaway: <the digits cut at the cap>'."""
    def label(i: int) -> str:
        kind = kinds[i]
        if kind == "digits":
            return str(visual[i])
        return {"empty": "empty", "runaway": "runaway: " + texts[i].replace(" ", "")}.get(kind, texts[i])

    out = {}
    for r in ("VE", "FE"):
        idx = np.flatnonzero(regimes == r)
        if idx.size:
            c = Counter(label(int(i)) for i in idx)
            out[r] = [(k, v / idx.size) for k, v in c.most_common(10)]
    return out


def markdown(result: dict[str, Any]) -> str:
    t = result["regimes"]
    regs = [r for r in REGIMES if r in t]
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    lines = ["| metric | " + " | ".join(f"{r} ({t[r]['boards']})" for r in regs) + " |",
             "|---|" + "---|" * len(regs)]
    for task in TASKS:
        lines.append(f"| {TASK_LABEL[task]} accuracy | " + " | ".join(pct(t[r][task]) for r in regs) + " |")
    cap = result["spec"].get("max_new_tokens", 6)
    rows = [("visual answers: a number", "visual_digits", None),
            (f"visual answers: runaway (no EOS within {cap} tokens)", "visual_runaway", None),
            ("visual answers: a word without a digit (e.g. False)", "visual_word", None),
            ("visual answers: empty", "visual_empty", None),
            ("visual mean abs error (number answers)", "visual_mae", "{:.2f}"),
            ("probe N_H exact match", "probe_exact", None), ("probe token accuracy", "probe_token_acc", None),
            ("control N_H exact match (shuffled labels)", "control_exact", None),
            ("control token accuracy", "control_token_acc", None),
            ("random-init ViT probe N_H exact match", "random_init_exact", None),
            ("Vision Gap mean abs(N_H - N_G)", "vision_gap", "{:.2f}"),
            ("Language Gap mean abs(N_H - N_P) (number answers)", "language_gap", "{:.2f}")]
    def cell(v: float | None, fmt: str | None) -> str:
        return "n/a" if v is None else fmt.format(v) if fmt else pct(v)

    for name, key, fmt in rows:
        lines.append(f"| {name} | " + " | ".join(cell(t[r].get(key), fmt) for r in regs) + " |")
    lines.append("")
    for r, dist in result["attractors"].items():
        lines.append(f"Visual answers on {r} (top 10): " + ", ".join(f"{k}: {pct(v)}" for k, v in dist))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from . import DEFAULT_CHECKPOINT

    ap = argparse.ArgumentParser(prog="python -m lab.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--per-count", type=int, default=EvalSpec.per_count, help="boards per count")
    ap.add_argument("--counts", default=EvalSpec.counts)
    ap.add_argument("--seed", type=int, default=EvalSpec.seed)
    ap.add_argument("--variation", default=EvalSpec.variation, choices=("none", *G.VARIATIONS))
    ap.add_argument("--probe-boards", type=int, default=EvalSpec.probe_boards)
    ap.add_argument("--max-new-tokens", type=int, default=EvalSpec.max_new_tokens,
                    help="generation cap (default 10, the counting-bottleneck study's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    spec = EvalSpec(args.per_count, args.counts, args.seed, args.variation, args.probe_boards,
                    max_new_tokens=args.max_new_tokens)
    if args.no_progress:  # no bar at all: transformers' weight-loading bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    model, processor = load(args.checkpoint)
    with progress_bar(steps(model, spec), unit="board", desc="evaluate", enabled=not args.no_progress) as bar:
        result = evaluate(model, processor, spec, bar)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
