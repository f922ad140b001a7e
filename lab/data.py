"""Training batches for the decoupled curriculum, drawn fresh every step.

Boards follow the Go-board family (``stimuli.goboard``): the same label rule (exact black
count, white count ``min(U[max(0,n-R), n+R], cells-n)``, black placed first on a random
permutation) and the same appearance styles (``goboard.VARIATIONS``). Rendering is vectorised in
torch because drawing 128 PIL boards per step would cost more than the model's own step on two
cores. Every stone stays inside its cell, so a board is assembled cell by cell:

- ``none``: the exact 8x8 cell patches of ``goboard.render_clean`` (pixel-identical to the study);
- varied: 4x4-supersampled disc coverage per pixel, which is what ``goboard.render_varied`` gets
  from drawing at 4x and box-downsampling, then Gaussian noise, rounding and clipping.

Token ids come from a template tokenised once by the real processor, with the string slots and
the answer filled in as tensors, so a training sequence is exactly what the processor builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stimuli import goboard as G
from toyvlm import tokenizer as T
from toyvlm.processor import ToyCounterProcessor, answer_suffix, prompt

TASKS = ("text_only_num", "text_only_tf", "multimodal_num", "multimodal_tf")
MAX_DIGITS = 3  # answers up to 120
IGNORE = -100


@dataclass
class Batch:
    task: str
    input_ids: torch.Tensor  # [B, T], right-padded after <|eos|>
    labels: torch.Tensor  # [B, T], IGNORE outside the answer, <|assistant_end|> and <|eos|>
    pixel_values: torch.Tensor | None  # [B, 3, H, W] normalised, or None for text tasks
    counts: torch.Tensor  # [B] the count asked about (black stones or target letters)
    image_mask: torch.Tensor  # [B, T] True at image tokens (for attention-share losses)

    @property
    def answer_mask(self) -> torch.Tensor:
        return self.labels != IGNORE


@dataclass(frozen=True)
class Style:
    """Per-sample appearance parameters, one row per variation name (index 0 = clean)."""

    names: tuple[str, ...]
    table: torch.Tensor  # [len(names), 9]: r_lo r_hi jitter black white shift tint sigma clean

    @classmethod
    def of(cls, names: tuple[str, ...]) -> Style:
        rows: list[list[float]] = []
        for name in names:
            if name == "none":
                rows.append([1, 1, 0, 0, 0, 0, 0, 0, 1])
            else:
                v = G.VARIATIONS[name]
                rows.append([*v.radius_scale, v.jitter, v.black_shade, v.white_shade,
                             v.board_shift, v.board_tint, v.noise_sigma, 0])
        return cls(tuple(names), torch.tensor(rows, dtype=torch.float32))


class BoardRenderer:
    """Vectorised Go boards on the goboard geometry (one ``cell_px`` patch per intersection)."""

    def __init__(self, board_size: int, cell_px: int, radius: int, white_range: int = -1) -> None:
        cfg = G.Config(preset="small", board_size=board_size, cell_px=cell_px, radius=radius,
                       white_range=white_range, counts="0")
        self.layout = G.board_layout(cfg)
        self.board, self.cell, self.radius = board_size, cell_px, radius
        self.cells = board_size * board_size
        self.white_range = self.layout.white_range
        self.templates = self._clean_templates()  # [3 labels, 3, cell, cell] float
        self.base = self._plain_cell()  # [3, cell, cell]: board colour 1, grid line 0

    def _clean_templates(self) -> torch.Tensor:
        # One black, one white stone and one empty point, cut from the study's own renderer.
        labels = np.full(self.cells, G.EMPTY, dtype=np.int8)
        labels[0], labels[1] = G.BLACK, G.WHITE
        img, _ = G.render_clean(self.layout, labels)
        arr = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float()
        c = self.cell
        return torch.stack([arr[:, :c, :c], arr[:, :c, c:2 * c], arr[:, :c, 2 * c:3 * c]])

    def _plain_cell(self) -> torch.Tensor:
        empty = self.templates[G.EMPTY]
        return (empty != 0).all(0).float()  # 1 where the board shows, 0 on grid lines

    def labels(self, counts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """[B, cells] int64 labels with exactly ``counts`` black stones (goboard.draw_board's rule)."""
        b = counts.shape[0]
        lo = (counts - self.white_range).clamp(min=0)
        span = counts + self.white_range - lo + 1
        white = lo + (torch.rand(b, generator=gen) * span).long()
        white = torch.minimum(white, self.cells - counts)
        ranks = torch.rand(b, self.cells, generator=gen).argsort(1).argsort(1)
        out = torch.full((b, self.cells), G.EMPTY, dtype=torch.long)
        out[ranks < (counts + white)[:, None]] = G.WHITE
        out[ranks < counts[:, None]] = G.BLACK
        return out

    def shape_bank(self, style: Style, size: int = 4096, seed: int = 12345) -> torch.Tensor:
        """Disc coverage [styles, size, cell, cell] with goboard.render_varied's radius and offset law."""
        key = (style.names, size, seed)
        if getattr(self, "_bank_key", None) != key:
            gen = torch.Generator().manual_seed(seed)
            c, s, half = self.cell, G.SUPERSAMPLE, self.cell // 2
            banks = []
            # Pixel p covers [p, p+1); a stone is a disc centred at (half + offset + 0.5) with
            # radius rho + 0.5 (goboard's pixel-index convention).
            for row in style.table:
                r_lo, r_hi, jit = (float(v) for v in row[:3])
                rho = self.radius * (r_lo + (r_hi - r_lo) * torch.rand(1, size, generator=gen))
                reach = jit * rho
                # render_varied's offset bounds: inside the cell, within jitter*rho of the centre.
                jlo = torch.maximum(rho - half, -reach)
                jhi = torch.minimum(c - half - rho - 1, reach)
                jx = jlo + (jhi - jlo) * torch.rand(1, size, generator=gen)
                jy = jlo + (jhi - jlo) * torch.rand(1, size, generator=gen)
                banks.append(_disc_coverage(half + jx + 0.5, half + jy + 0.5, rho + 0.5, c, s)[0])
            self._bank, self._bank_key = torch.stack(banks), key
        return self._bank

    def render(self, labels: torch.Tensor, style_idx: torch.Tensor, style: Style,
               gen: torch.Generator) -> torch.Tensor:
        """uint8-range float images [B, 3, H, W]."""
        b, n = labels.shape
        c = self.cell
        p = style.table[style_idx]  # [B, 9]
        _, _, _, bshade, wshade, shift, tint, sigma, clean = p.unbind(1)
        # Clean path: exact study patches.
        clean_cells = self.templates[labels]  # [B, n, 3, c, c]
        # Varied path: board colour with one shift and a per-channel tint, as render_varied draws.
        rgb = torch.tensor(G.BOARD_RGB, dtype=torch.float32)
        sh = _uniform_int(-shift, shift, gen)[:, None]
        ti = _uniform_int(-tint[:, None].expand(b, 3), tint[:, None].expand(b, 3), gen)
        board_rgb = (rgb + sh + ti).clamp(0, 255)  # [B, 3]
        under = self.base[None, None, None] * board_rgb[:, None, :, None, None]  # [B,1,3,c,c]
        # Stone shapes (radius, sub-pixel offset) come from a bank drawn once per style:
        # exact disc coverage is the costliest part of a render and 4096 shapes per style are
        # plenty beside fresh shades, board colours, noise and stone layouts every batch.
        bank = self.shape_bank(style)  # [styles, K, c, c]
        pick = torch.randint(0, bank.shape[1], (b, n), generator=gen)
        cover = bank[style_idx[:, None].expand(b, n), pick]
        dark = _uniform_int(torch.zeros(b, n), bshade[:, None].expand(b, n), gen)
        light = _uniform_int(255 - wshade[:, None].expand(b, n), torch.full((b, n), 255.0), gen)
        shade = torch.where(labels == G.BLACK, dark, light)
        cover = cover * (labels != G.EMPTY)[..., None, None]
        varied = under + cover[:, :, None] * (shade[:, :, None, None, None] - under)
        cells = torch.where(clean[:, None, None, None, None].bool(), clean_cells, varied)
        img = cells.view(b, self.board, self.board, 3, c, c).permute(0, 3, 1, 4, 2, 5)
        img = img.reshape(b, 3, self.board * c, self.board * c)
        noise = torch.randn(img.shape, generator=gen) * sigma[:, None, None, None]
        return (img + noise).round().clamp(0, 255)


def _disc_coverage(cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor, c: int, s: int
                   ) -> torch.Tensor:
    """Share of each pixel's s x s sub-pixel centres inside a disc: [B, n, c, c].

    Sub-pixel centres are (i + 0.5) / s in pixel units. Per sub-row the disc is an x-interval,
    so counting the centres inside it per pixel is exact and 30x cheaper than testing each one.
    """
    sub = (torch.arange(c * s, dtype=torch.float32) + 0.5) / s  # [c*s]
    dy = sub - cy[..., None]  # [B, n, c*s]
    half_w = (r[..., None] ** 2 - dy ** 2).clamp(min=0).sqrt()
    inside_row = (dy.abs() <= r[..., None])
    lo = torch.ceil((cx[..., None] - half_w) * s - 0.5)  # first sub-column index inside
    hi = torch.floor((cx[..., None] + half_w) * s - 0.5)  # last sub-column index inside
    first = torch.arange(c, dtype=torch.float32) * s  # [c] first sub-column of each pixel
    count = (torch.minimum(hi[..., None], first + s - 1) - torch.maximum(lo[..., None], first) + 1)
    count = count.clamp(min=0) * inside_row[..., None]  # [B, n, c*s rows, c pixels]
    b, n = cx.shape
    return count.view(b, n, c, s, c).sum(3) / (s * s)


def _uniform_int(lo: torch.Tensor, hi: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Integers uniform in [lo, hi] (inclusive), elementwise, as floats."""
    return (lo + torch.floor(torch.rand(lo.shape, generator=gen) * (hi - lo + 1))).clamp(max=hi)


class BatchMaker:
    """Fresh batches of one task at a time, on the template the processor itself produces."""

    def __init__(self, processor: ToyCounterProcessor, board_size: int = 11, cell_px: int = 8,
                 radius: int = 3, variations: tuple[str, ...] = ("none",),
                 hard_negative_share: float = 0.5, hard_negative_span: int = 5) -> None:
        self.processor = processor
        self.tok = processor.tokenizer
        self.renderer = BoardRenderer(board_size, cell_px, radius)
        self.cells = self.renderer.cells
        self.style = Style.of(tuple(variations))
        self.hard_share = hard_negative_share
        self.hard_span = hard_negative_span
        ids = self.tok.convert_tokens_to_ids
        self.letter = torch.tensor([ids("c"), ids("b"), ids("a")])  # by TEXT_CHARS order
        self.digit = torch.tensor([ids(str(d)) for d in range(10)])
        self.true, self.false = ids("True"), ids("False")
        self.pad, self.end, self.eos = ids(T.PAD), ids(T.ASSISTANT_END), ids(T.EOS)
        self.image_id = processor.image_token_id
        self.templates = {task: self._template(task) for task in TASKS}

    def _template(self, task: str) -> tuple[torch.Tensor, list[int]]:
        n_strings = {"text_only_num": 1, "text_only_tf": 2, "multimodal_num": 0, "multimodal_tf": 1}[task]
        filler = "a" * self.cells
        text = self.processor.expand(prompt(G.QUESTIONS[task], [filler] * n_strings,
                                            image=task.startswith("multimodal")))
        ids = torch.tensor(self.tok(text, add_special_tokens=False).input_ids)
        starts = (ids == self.tok.convert_tokens_to_ids(T.STR_START)).nonzero().flatten().tolist()
        return ids, [s + 1 for s in starts]

    def strings(self, counts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """[B, cells] letter ids with exactly ``counts`` 'c's, the rest uniform 'a'/'b'."""
        b = counts.shape[0]
        ranks = torch.rand(b, self.cells, generator=gen).argsort(1).argsort(1)
        other = 1 + (torch.rand(b, self.cells, generator=gen) < 0.5).long()  # b or a
        return self.letter[torch.where(ranks < counts[:, None], 0, other)]

    def partner_counts(self, counts: torch.Tensor, max_count: int, gen: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """TF partners: equal on half of the rows; otherwise a near miss or the study's uniform draw."""
        b = counts.shape[0]
        equal = torch.rand(b, generator=gen) < 0.5
        far = torch.randint(0, max_count, (b,), generator=gen)
        far = far + (far >= counts).long()  # uniform over 0..max_count without counts
        step = torch.randint(1, self.hard_span + 1, (b,), generator=gen)
        sign = torch.where(torch.rand(b, generator=gen) < 0.5, -1, 1)
        near = counts + sign * step
        near = torch.where((near < 0) | (near > max_count), counts - sign * step, near)
        hard = torch.rand(b, generator=gen) < self.hard_share
        other = torch.where(hard, near, far).clamp(0, max_count)
        return torch.where(equal, counts, other), equal

    def make(self, task: str, counts: torch.Tensor, gen: torch.Generator, max_partner: int = 120
             ) -> Batch:
        template, slots = self.templates[task]
        b = counts.shape[0]
        prompt_ids = template.repeat(b, 1)
        answer_ids: torch.Tensor
        pixel_values = None
        if task == "text_only_num":
            prompt_ids[:, slots[0]:slots[0] + self.cells] = self.strings(counts, gen)
        if task in ("text_only_tf", "multimodal_tf"):
            partner, equal = self.partner_counts(counts, max_partner, gen)
            first = self.strings(counts, gen) if task == "text_only_tf" else None
            if first is not None:
                prompt_ids[:, slots[0]:slots[0] + self.cells] = first
            last = slots[-1]
            prompt_ids[:, last:last + self.cells] = self.strings(partner, gen)
            answer_ids = torch.where(equal, self.true, self.false)[:, None]
        else:
            answer_ids = self.digits(counts)
        if task.startswith("multimodal"):
            labels = self.renderer.labels(counts, gen)
            style_idx = torch.randint(0, len(self.style.names), (b,), generator=gen)
            raw = self.renderer.render(labels, style_idx, self.style, gen)
            pixel_values = self.processor.image_processor.normalize_pixels(raw)
        tail = torch.tensor([self.end, self.eos]).repeat(b, 1)
        answer = torch.cat([answer_ids, tail], dim=1)
        # Left-align each answer right after the prompt; pad positions stay IGNORE.
        width = answer.shape[1]
        ids = torch.cat([prompt_ids, answer], dim=1)
        labels_t = torch.full_like(ids, IGNORE)
        labels_t[:, -width:] = answer
        ids, labels_t = self._compact(ids, labels_t, prompt_ids.shape[1])
        return Batch(task, ids, labels_t, pixel_values, counts, ids == self.image_id)

    def digits(self, counts: torch.Tensor) -> torch.Tensor:
        """Answer digits, left-aligned and padded with PAD to MAX_DIGITS: 7 -> [7, pad, pad]."""
        b = counts.shape[0]
        out = torch.full((b, MAX_DIGITS), self.pad, dtype=torch.long)
        for i, n in enumerate(counts.tolist()):
            d = [int(ch) for ch in str(n)]
            out[i, : len(d)] = self.digit[d]
        return out

    def _compact(self, ids: torch.Tensor, labels: torch.Tensor, start: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        # Move PAD holes inside the answer to the end, keeping the total length fixed (static shapes).
        tail_ids, tail_lab = ids[:, start:], labels[:, start:]
        is_pad = tail_ids == self.pad
        order = is_pad.long().argsort(dim=1, stable=True)
        ids = ids.clone()
        labels = labels.clone()
        ids[:, start:] = tail_ids.gather(1, order)
        lab = tail_lab.gather(1, order)
        lab[ids[:, start:] == self.pad] = IGNORE
        labels[:, start:] = lab
        return ids, labels


def answer_text(task: str, count: int, equal: bool | None = None) -> str:
    """The reference answer as the processor would tokenize it (for tests and docs)."""
    return answer_suffix(("True" if equal else "False") if task.endswith("tf") else str(count))
