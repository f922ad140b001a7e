"""The G2M curriculum (the g2m study's "digital agnosia" in the lab): transcribe small colour grids.

The toy VLM of ``lab/`` (same architecture, same word-level tokenizer plus the words of the G2M
prompt) learns to transcribe N x N grids of C colours for small N only (``lab/toy-g2m.yaml``:
N = 3..6, C = 3) and is evaluated on larger N:

- stimuli are the project's own G2M grids (``stimuli.g2m``: matrix rule, palette,
  outline, the study's prompt), drawn at ``N * patch`` px so that one ViT token covers one cell;
- the answer is the N**2 colour indices in raster order, one digit token each (``"0 2 1 ..."``),
  which the study's parser (``g2m.parse_grid``, step 3: all integers, exactly H*W) reads as the
  matrix; scoring is ``g2m.score`` / ``g2m.metrics`` (Exact Match, Cell Accuracy), the same as
  extraction and ``queries/sql/g2m_metrics.sql`` use;
- the spatial probe is the study's probe with one token per cell (no interpolation needed): a
  per-token linear classifier (StandardScaler + LogisticRegression, C classes) on the ViT output
  tokens (``vision.norm``, the projector input), trained and tested per N, beside the same probe
  on shuffled labels (control), one trained on the trained sizes only, and one on a randomly
  initialised ViT.

``python -m lab.train --config lab/toy-g2m.yaml`` trains (``make toy-g2m``);
``python -m lab.g2m evaluate [CKPT]`` prints the table per N; ``python -m lab.g2m card CKPT``
writes the model card.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stimuli import g2m as G
from stimuli.base import Stimulus
from toyvlm import tokenizer as T
from toyvlm.processor import ToyCounterProcessor, answer_suffix, build_processor, prompt

from . import DEFAULT_CHECKPOINT
from .card import write_g2m
from .config import G2MTrainConfig, TrainConfig
from .data import IGNORE, Batch
from .trainer import Trainer

G2M_CHECKPOINT = DEFAULT_CHECKPOINT.with_name("toy-g2m")
TASK = "transcribe"
CONTROL_SHUFFLES = 5


def build_g2m_processor(cfg: TrainConfig) -> ToyCounterProcessor:
    """The counter's processor with the G2M prompt's words and images of any N x N cells."""
    return build_processor(cfg.board_size * cfg.cell_px, cfg.cell_px, extra_words=T.G2M_WORDS,
                           variable_size=True)


def answer_text(matrix: np.ndarray | Sequence[Sequence[int]]) -> str:
    """The toy's answer: the colour indices in raster order, one digit token each."""
    return " ".join(str(int(v)) for v in np.asarray(matrix).ravel())


# --- training data ------------------------------------------------------------------------------

class GridRenderer:
    """Vectorised ``g2m.render`` at ``N * cell_px`` px (pixel-identical, tested).

    At that size every cell is ``cell_px`` px with the same outline width, and each cell's
    ``cell_px`` x ``cell_px`` patch (its top/left outline, its fill, its bottom/right outline) is
    the same for every position, so a grid is assembled from one patch per colour cut from
    ``g2m.render`` itself.
    """

    def __init__(self, cell_px: int = 8, num_colors: int = 3) -> None:
        self.cell, self.colors = cell_px, num_colors
        side = 4  # 16 cells hold every palette colour once
        matrix = np.zeros((side, side), dtype=np.int64)
        matrix.flat[:len(G.PALETTE)] = np.arange(len(G.PALETTE))
        arr = torch.from_numpy(np.asarray(G.render(matrix, side * cell_px)).copy()).permute(2, 0, 1).float()
        c = cell_px
        self.templates = torch.stack([arr[:, (k // side) * c:(k // side + 1) * c, (k % side) * c:(k % side + 1) * c]
                                      for k in range(len(G.PALETTE))])  # [10, 3, c, c]

    def matrices(self, b: int, n: int, gen: torch.Generator) -> torch.Tensor:
        """[B, n, n] colour indices with ``g2m.make_matrix``'s law: uniform, every colour once."""
        flat = torch.randint(0, self.colors, (b, n * n), generator=gen)
        if self.colors <= n * n:
            flat[:, :self.colors] = torch.arange(self.colors)
            order = torch.rand(b, n * n, generator=gen).argsort(1)
            flat = flat.gather(1, order)
        return flat.view(b, n, n)

    def render(self, matrices: torch.Tensor) -> torch.Tensor:
        """uint8-range float images [B, 3, n*cell, n*cell]."""
        b, n, _ = matrices.shape
        c = self.cell
        cells = self.templates[matrices]  # [B, n, n, 3, c, c]
        return cells.permute(0, 3, 1, 4, 2, 5).reshape(b, 3, n * c, n * c)


class G2MBatchMaker:
    """Fresh batches of one grid size, on the token template the processor itself produces."""

    def __init__(self, processor: ToyCounterProcessor, cell_px: int = 8, num_colors: int = 3) -> None:
        self.processor = processor
        self.tok = processor.tokenizer
        self.renderer = GridRenderer(cell_px, num_colors)
        self.colors = num_colors
        ids = self.tok.convert_tokens_to_ids
        self.digit = torch.tensor([ids(str(d)) for d in range(10)])
        self.image_id = processor.image_token_id
        self.assistant_start = ids(T.ASSISTANT_START)
        self._templates: dict[int, tuple[torch.Tensor, int]] = {}

    def template(self, n: int) -> tuple[torch.Tensor, int]:
        """(token ids of prompt + placeholder answer + end tokens, index of the first answer token)."""
        if n not in self._templates:
            text = self.processor.expand(prompt(G.prompt(n, n, self.colors), image=True), n * n)
            text += " " + answer_suffix(answer_text(np.zeros((n, n), dtype=np.int64)))
            ids = torch.tensor(self.tok(text, add_special_tokens=False).input_ids)
            start = int((ids == self.assistant_start).nonzero()[-1]) + 1
            self._templates[n] = (ids, start)
        return self._templates[n]

    def make(self, n: int, b: int, gen: torch.Generator) -> Batch:
        ids, start = self.template(n)
        matrices = self.renderer.matrices(b, n, gen)
        input_ids = ids.repeat(b, 1)
        input_ids[:, start:start + n * n] = self.digit[matrices.view(b, -1)]
        labels = torch.full_like(input_ids, IGNORE)
        labels[:, start:] = input_ids[:, start:]  # the digits, <|assistant_end|>, <|eos|>
        pixels = self.processor.image_processor.normalize_pixels(self.renderer.render(matrices))
        return Batch(task=f"n{n}", input_ids=input_ids, labels=labels, pixel_values=pixels,
                     counts=torch.full((b,), n), image_mask=input_ids == self.image_id)


class G2MTrainer(Trainer):
    """``lab.trainer.Trainer`` (same step, schedule, progress bar, ``extra_loss`` hook) on G2M batches.

    One stage over every parameter (vision with ``stage1.vision_lr``, the rest with ``stage1.lr``);
    step i is one batch of grid size ``grid_sizes[i % len]``.
    """

    cfg: G2MTrainConfig

    def make_data(self, processor: ToyCounterProcessor) -> G2MBatchMaker:
        cfg = self.cfg
        if cfg.strategy != "random":
            raise ValueError(f"the G2M curriculum trains on random grids, not {cfg.strategy!r}")
        return G2MBatchMaker(processor, cfg.cell_px, cfg.num_colors)

    def batch(self, task: str) -> Batch:
        return self.data.make(int(task[1:]), self.cfg.batch_size, self.gen)

    def stage1(self) -> None:
        s = self.cfg.stage1
        vision = [p for n, p in self.model.named_parameters() if n.startswith("vision.")]
        rest = [p for n, p in self.model.named_parameters() if not n.startswith("vision.")]
        opt = torch.optim.AdamW([{"params": vision, "lr": s.vision_lr or s.lr}, {"params": rest, "lr": s.lr}],
                                weight_decay=s.weight_decay)
        sizes = list(self.cfg.grid_sizes)

        def tasks() -> Iterator[list[str]]:
            i = 0
            while True:
                yield [f"n{sizes[i % len(sizes)]}"]
                i += 1

        self.model.train()
        self.run_stage(1, opt, tasks(), s.steps, s.warmup)


# --- evaluation ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class G2MEvalSpec:
    grid_sizes: tuple[int, ...] = (3, 4, 5, 6, 7, 8, 9, 10, 12)
    per_n: int = 50  # test grids per N (g2m.generate seeds seed .. seed + per_n - 1)
    seed: int = 30000
    num_colors: int = 3
    probe_grids: int = 40  # probe-training grids per N, seeds probe_seed ..
    probe_seed: int = 40000
    batch_size: int = 50


def load(checkpoint: str | Path) -> tuple[Any, Any]:
    from .evaluate import load as load_model

    return load_model(str(checkpoint))


def grids(model: Any, n: int, count: int, seed: int, split: str, num_colors: int) -> list[Stimulus]:
    """``count`` G2M grids of size n drawn at n * patch px (one token per cell).

    The same stimuli as ``g2m.generate(Config(grid_sizes=(n,), image_size=n * patch), count, seed)``
    (tested), built from its own functions because its Config refuses canvases under 32 px (N = 3).
    """
    size = n * model.config.patch_size
    out = []
    for i in range(count):
        matrix = G.make_matrix(n, num_colors, "random", seed + i)
        out.append(Stimulus(
            id=f"g2m-n{n:03d}-c{num_colors:02d}-random-{i:05d}", family="g2m", split=split, seed=seed + i,
            image=G.render(matrix, size), prompts={TASK: G.prompt(n, n, num_colors)},
            answers={TASK: str(matrix.tolist())}, truth={"matrix": matrix.tolist()},
            params={"grid_size": n, "num_colors": num_colors, "strategy": "random", "image_size": size,
                    "cell_px": size / n, "line_width": G.line_width(size / n),
                    "max_new_tokens": G.max_new_tokens(n, n)}))
    return out


def budget(n: int) -> int:
    """Generation budget: the toy's answer is n**2 digit tokens (+ end tokens), within the study's."""
    return min(n * n + 8, G.max_new_tokens(n, n))


@torch.inference_mode()
def transcribe(model: Any, processor: Any, stimuli: Sequence, batch_size: int) -> list[str]:
    """Greedy transcriptions (special tokens stripped) through ``generate``; one grid size per call."""
    out: list[str] = []
    for i in range(0, len(stimuli), batch_size):
        chunk = stimuli[i:i + batch_size]
        n = chunk[0].params["grid_size"]
        inputs = processor(images=[s.image for s in chunk],
                           text=[prompt(s.prompts[TASK], image=True) for s in chunk])
        seq = model.generate(**inputs, max_new_tokens=budget(n), do_sample=False,
                             pad_token_id=processor.tokenizer.pad_token_id)
        out += processor.batch_decode(seq[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return [t.strip() for t in out]


def lenient_cells(text: str, truth: np.ndarray) -> int:
    """Correct cells when the emitted digits are read in raster order as far as they go.

    Not the G2M metric (a wrong number of cells fails the study's parser and scores 0): it says
    whether the cells the model did write are right, apart from the answer's length.
    """
    import re

    digits = np.array([int(v) for v in re.findall(r"\d", text)][:truth.size], dtype=np.int64)
    return int((digits == truth.ravel()[:digits.size]).sum())


def _tokens(model: Any, processor: Any, stimuli: Sequence, batch_size: int) -> np.ndarray:
    from .evaluate import vit_tokens

    return vit_tokens(model, processor, stimuli, batch_size)


@torch.inference_mode()
def decoder_tokens(model: Any, processor: Any, stimuli: Sequence, batch_size: int, layer: int = -1
                   ) -> np.ndarray:
    """Decoder residual stream at the image tokens (``hidden_states[layer]``, default after the last
    decoder layer, no final norm) over the prompt, [grids, n*n, d], raster order."""
    feats = []
    for i in range(0, len(stimuli), batch_size):
        chunk = stimuli[i:i + batch_size]
        inputs = processor(images=[s.image for s in chunk],
                           text=[prompt(s.prompts[TASK], image=True) for s in chunk])
        out = model(**inputs, output_hidden_states=True)
        mask = inputs["input_ids"] == model.config.image_token_id
        h = out.hidden_states[layer][mask].view(len(chunk), -1, out.hidden_states[layer].shape[-1])
        feats.append(h.float().numpy())
    return np.concatenate(feats)


@torch.inference_mode()
def readout_attention(model: Any, processor: Any, stimuli: Sequence, batch_size: int
                      ) -> tuple[np.ndarray, float]:
    """([layers, heads] share of answer queries whose strongest image-token key is the cell they
    write, mean attention mass of the answer queries on the image tokens).

    Teacher-forced on the true transcription: the query that predicts cell k (raster order) is the
    token before it; a head "reads the right cell" there when its attention over the N² image
    tokens peaks at image token k.
    """
    hits: torch.Tensor | None = None
    total, mass = 0, 0.0
    start_id = processor.tokenizer.convert_tokens_to_ids(T.ASSISTANT_START)
    for i in range(0, len(stimuli), batch_size):
        chunk = stimuli[i:i + batch_size]
        texts = [prompt(s.prompts[TASK], image=True) + " " + answer_suffix(answer_text(s.truth["matrix"]))
                 for s in chunk]
        inputs = processor(images=[s.image for s in chunk], text=texts)
        ids = inputs["input_ids"][0]
        cells = int((ids == model.config.image_token_id).sum())
        img = (ids == model.config.image_token_id).nonzero().flatten()
        first = int((ids == start_id).nonzero()[-1])  # <|assistant_start|> predicts cell 0
        out = model(**inputs, output_attentions=True)
        att = torch.stack(out.attentions, 1)[:, :, :, first:first + cells][..., img]  # [B, L, H, k, cells]
        ok = (att.argmax(-1) == torch.arange(cells)).float().sum((0, 3))  # [L, H]
        hits = ok if hits is None else hits + ok
        mass += float(att.sum(-1).mean((1, 2)).sum())  # per answer query, averaged over layers/heads
        total += len(chunk) * cells
    if hits is None:
        raise ValueError("attention_probe needs at least one stimulus")
    return (hits / total).numpy(), mass / total


def _labels(stimuli: Sequence) -> np.ndarray:
    return np.stack([np.asarray(s.truth["matrix"]).ravel() for s in stimuli])  # [grids, n*n]


def _probe_scores(probe: Any, feats: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(cell accuracy, grid exact match) of a per-token probe."""
    pred = probe.predict(feats.reshape(-1, feats.shape[-1])).reshape(labels.shape)
    return float((pred == labels).mean()), float((pred == labels).all(1).mean())


def evaluate(model: Any, processor: Any, spec: G2MEvalSpec = G2MEvalSpec(),
             trained: Sequence[int] = (3, 4, 5, 6)) -> dict[str, Any]:
    from .evaluate import fit_probe

    torch.manual_seed(0)
    rng = np.random.default_rng(spec.seed)
    torch.manual_seed(spec.seed)
    fresh = type(model)(model.config).eval()  # randomly initialised tower of the same shape
    rows: dict[str, Any] = {}
    id_x, id_y, per_n = [], [], {}
    t0 = time.perf_counter()
    for n in spec.grid_sizes:
        test = grids(model, n, spec.per_n, spec.seed, "test", spec.num_colors)
        train = grids(model, n, spec.probe_grids, spec.probe_seed, "probe", spec.num_colors)
        answers = _answer_row(model, processor, test, spec.batch_size)
        probes, (x_tr, y_tr), (x_te, y_te) = _probe_row(model, fresh, processor, train, test, spec, rng)
        if n in trained:
            id_x.append(x_tr)
            id_y.append(y_tr)
        per_n[n] = (x_te, y_te)
        metrics = {k: answers.pop(k) for k in _ANSWER_METRICS}  # evaluation.json keeps its key order
        rows[str(n)] = {"n": n, "trained": n in trained, **metrics, "expected_digits": n * n, **probes, **answers}
    # One probe trained on the trained sizes only, tested at every N: does a cell's code move?
    if id_x:
        probe_id = fit_probe(np.concatenate(id_x), np.concatenate(id_y))
        for n, (x_te, y_te) in per_n.items():
            rows[str(n)]["probe_trained_sizes_cell_accuracy"] = _probe_scores(probe_id, x_te, y_te)[0]
    return {"spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(spec).items()},
            "trained_sizes": list(trained), "chance": 1 / spec.num_colors, "per_n": rows,
            "seconds": round(time.perf_counter() - t0, 1)}


_ANSWER_METRICS = ("grids", "exact_match", "cell_accuracy", "parse_failures", "lenient_cell_accuracy", "digits_mean")


def _answer_row(model: Any, processor: Any, test: list[Stimulus], batch_size: int) -> dict[str, Any]:
    """What the model writes for the test grids: the study's metrics, the lenient cell accuracy,
    digits written, and where its read-out attends."""
    texts = transcribe(model, processor, test, batch_size)
    m = G.metrics([G.score(t, s.truth["matrix"]) for t, s in zip(texts, test, strict=False)])
    truth = [np.asarray(s.truth["matrix"]) for s in test]
    reads, image_mass = readout_attention(model, processor, test, batch_size)
    lenient = sum(lenient_cells(t, g) for t, g in zip(texts, truth, strict=False)) / sum(g.size for g in truth)
    return {"grids": m.samples, "exact_match": m.exact_match, "cell_accuracy": m.cell_accuracy,
            "parse_failures": m.parse_failures, "lenient_cell_accuracy": lenient,
            "digits_mean": float(np.mean([len([c for c in t if c.isdigit()]) for t in texts])),
            "readout_attention": np.round(reads.astype(float), 4).tolist(),
            "readout_attention_best": float(reads.max()),
            "answer_image_attention": image_mass, "example": texts[0][:80]}


def _probe_row(model: Any, fresh: Any, processor: Any, train: list[Stimulus], test: list[Stimulus],
               spec: G2MEvalSpec, rng: np.random.Generator,
               ) -> tuple[dict[str, float], tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Linear probes of a cell's colour on the ViT output tokens (with shuffled-label controls), on
    the decoder's image tokens, and on a randomly initialised tower; also the flat train features and
    labels and the test tokens, for the probe trained on every trained size."""
    from .evaluate import fit_probe

    x_tr, y_tr = _tokens(model, processor, train, spec.batch_size), _labels(train)
    x_te, y_te = _tokens(model, processor, test, spec.batch_size), _labels(test)
    d = x_tr.shape[-1]
    probe = fit_probe(x_tr.reshape(-1, d), y_tr.ravel())
    # Shuffled labels map the few colour clusters to classes at random, so one control lands
    # far from chance either way: the mean of CONTROL_SHUFFLES of them is the control.
    controls = [fit_probe(x_tr.reshape(-1, d), rng.permutation(y_tr.ravel())) for _ in range(CONTROL_SHUFFLES)]
    dec_tr, dec_te = (decoder_tokens(model, processor, train, spec.batch_size),
                      decoder_tokens(model, processor, test, spec.batch_size))
    decoder_probe = fit_probe(dec_tr.reshape(-1, d), y_tr.ravel())
    xr_tr, xr_te = _tokens(fresh, processor, train, spec.batch_size), _tokens(fresh, processor, test, spec.batch_size)
    random_init = fit_probe(xr_tr.reshape(-1, d), y_tr.ravel())
    p_ca, p_em = _probe_scores(probe, x_te, y_te)
    scores = {"probe_cell_accuracy": p_ca, "probe_exact_match": p_em,
              "control_cell_accuracy": float(np.mean([_probe_scores(c, x_te, y_te)[0] for c in controls])),
              "random_init_cell_accuracy": _probe_scores(random_init, xr_te, y_te)[0],
              "decoder_probe_cell_accuracy": _probe_scores(decoder_probe, dec_te, y_te)[0]}
    return scores, (x_tr.reshape(-1, d), y_tr.ravel()), (x_te, y_te)


def markdown(result: dict[str, Any]) -> str:
    def pct(v: float) -> str:
        return f"{100 * v:.1f}%"

    cols: list[tuple[str, str, Callable[[Any], str]]] = [("grids", "grids", str), ("end-to-end Exact Match", "exact_match", pct),
            ("end-to-end Cell Accuracy", "cell_accuracy", pct), ("parse failures", "parse_failures", str),
            ("digits emitted (mean; N² expected)", "digits_mean", "{:.1f}".format),
            ("lenient cell accuracy (raster prefix)", "lenient_cell_accuracy", pct),
            ("attention peaks on the cell being written (best head)", "readout_attention_best", pct),
            ("answer attention on the image (mean of layers and heads)", "answer_image_attention", pct),
            ("probe Cell Accuracy (per N)", "probe_cell_accuracy", pct),
            ("probe Exact Match (per N)", "probe_exact_match", pct),
            ("control: shuffled labels (mean of 5)", "control_cell_accuracy", pct),
            ("probe trained on trained N only", "probe_trained_sizes_cell_accuracy", pct),
            ("probe on a random-init ViT", "random_init_cell_accuracy", pct),
            ("probe on the decoder's last layer (image tokens)", "decoder_probe_cell_accuracy", pct)]
    rows = list(result["per_n"].values())
    head = "| metric | " + " | ".join(f"N={r['n']}{'' if r['trained'] else ' *'}" for r in rows) + " |"
    lines = [head, "|---|" + "---|" * len(rows)]
    for name, key, fmt in cols:
        lines.append(f"| {name} | " + " | ".join(fmt(r[key]) if key in r else "-" for r in rows) + " |")
    lines += ["", f"\\* beyond the trained sizes {result['trained_sizes']}; chance cell accuracy"
              f" {pct(result['chance'])} (a failed parse scores 0 cells)."]
    return "\n".join(lines)


NOTES = """\
### Reading the table

- **Deviations from the study.** The toy reads a grid drawn at N x 8 px, one ViT token per cell
  (as the counting toy has one per board intersection), instead of a fixed 512 px canvas cut into
  16 px patches, so patch/grid alignment (the study's 32 vs 48/64 effect) is not modelled. It
  answers the N² colour indices as flat digit tokens (`0 2 1 ...`) rather than a Python list of
  lists; the study's parser reads that with its third rule (all integers, exactly H·W). The
  prompt is the study's own (`g2m.prompt`), tokenised word by word.
- **What collapses.** Past the trained sizes the model does not write N² digits (parse failures,
  so Exact Match and Cell Accuracy are 0 by the study's scoring), and the digits it does write are
  at chance even when read leniently in raster order. The attention row says why: on the trained
  sizes one decoder head's attention over the image peaks on exactly the cell being written
  (teacher-forced), and which head does it depends on N (`evaluation.json`,
  `readout_attention[layer][head]`); past them no head finds the cell, although the answer
  queries still give the image most of their attention. With 1-D RoPE over the flat sequence the cell being written
  sits at a distance (N² + the prompt's length) that is fixed per N, and the decoder learned one
  rule per trained N rather than one that carries to grid sizes it never saw.
- **What does not.** A per-token linear probe on the ViT output tokens reads every cell at every
  N, a probe trained on the trained sizes only keeps reading the larger grids, and so does a probe
  on the decoder's last layer at the image tokens: the colours reach the language model and are
  lost when it writes them out, the g2m study's representation/expression gap in the toy.
- **Caveat.** The probe is at ceiling on a randomly initialised ViT too: on these clean grids a
  cell's patch is one of C fixed pictures, linearly separable whatever the weights, so "the vision
  encoder keeps the grid" is a weak statement here (as with the counter's hidden-number probe).
  The shuffled-label control is the mean of 5 shuffles; one shuffle maps the C colour clusters to
  classes at random and can land far from chance either way.
"""


# --- CLI ------------------------------------------------------------------------------------------

def _trained_sizes(checkpoint: Path) -> tuple[int, ...]:
    path = checkpoint / "training.json"
    if path.exists():
        return tuple(json.loads(path.read_text())["train_config"].get("grid_sizes", (3, 4, 5, 6)))
    return (3, 4, 5, 6)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.g2m", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("evaluate", "card"))
    ap.add_argument("checkpoint", nargs="?", default=str(G2M_CHECKPOINT))
    ap.add_argument("--per-n", type=int, default=G2MEvalSpec.per_n, help="test grids per N")
    ap.add_argument("--grid-sizes", type=int, nargs="+", default=list(G2MEvalSpec.grid_sizes))
    ap.add_argument("--seed", type=int, default=G2MEvalSpec.seed)
    ap.add_argument("--probe-grids", type=int, default=G2MEvalSpec.probe_grids)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--notes", default="", help="card: a file whose text replaces the default notes (NOTES)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = Path(args.checkpoint)
    spec = G2MEvalSpec(grid_sizes=tuple(args.grid_sizes), per_n=args.per_n, seed=args.seed,
                       probe_grids=args.probe_grids)
    model, processor = load(ckpt)
    result = evaluate(model, processor, spec, _trained_sizes(ckpt))
    table = markdown(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.command == "card":
        notes = Path(args.notes).read_text() if args.notes else NOTES
        print(write_g2m(ckpt, result, table, notes=notes))


if __name__ == "__main__":
    main()
