from __future__ import annotations

import numpy as np
import torch

from lab.data import BatchMaker, BoardRenderer, Style, _disc_coverage
from stimuli import goboard as G
from toyvlm.processor import answer_suffix, build_processor, prompt


def test_clean_render_is_goboard_pixel_exact():
    r = BoardRenderer(11, 8, 3)
    gen = torch.Generator().manual_seed(0)
    labels = r.labels(torch.tensor([0, 30, 80, 120]), gen)
    assert (labels == G.BLACK).sum(1).tolist() == [0, 30, 80, 120]
    imgs = r.render(labels, torch.zeros(4, dtype=torch.long), Style.of(("none",)), gen)
    for lab, img in zip(labels, imgs, strict=False):
        ref, _ = G.render_clean(r.layout, lab.numpy().astype(np.int8))
        assert torch.equal(torch.from_numpy(np.array(ref)).permute(2, 0, 1).float(), img)


def test_white_count_rule():
    r = BoardRenderer(11, 8, 3)
    counts = torch.full((2000,), 40)
    labels = r.labels(counts, torch.Generator().manual_seed(1))
    white = (labels == G.WHITE).sum(1)
    assert int(white.min()) >= 30 and int(white.max()) <= 50  # U[n-10, n+10] on 11x11


def test_varied_stone_matches_goboard_supersampling():
    # Recreate goboard.render_varied's stones from its own record, without its noise.
    layout = G.board_layout(G.Config(preset="small", counts="0", variation="mild"))
    labels = np.full(layout.cells, G.EMPTY, dtype=np.int8)
    labels[[5, 17, 60, 99]] = [G.BLACK, G.WHITE, G.BLACK, G.WHITE]
    img, stones, board = G.render_varied(layout, labels, np.random.default_rng(3), G.VARIATIONS["mild"])
    ref = np.asarray(img, dtype=np.float32)
    c = layout.cell_px
    for st in stones:
        row, col = st["row"], st["col"]
        cx = torch.tensor([[st["cx"] - col * c + 0.5]])
        cy = torch.tensor([[st["cy"] - row * c + 0.5]])
        cover = _disc_coverage(cx, cy, torch.tensor([[st["radius"] + 0.5]]), c, G.SUPERSAMPLE)[0, 0]
        under = ref[row * c:(row + 1) * c, col * c:(col + 1) * c].copy()
        plain = BoardRenderer(11, 8, 3).base.numpy()  # 1 board, 0 line
        under = plain[..., None] * np.asarray(board, dtype=np.float32)
        mine = under + cover.numpy()[..., None] * (st["shade"] - under)
        patch = ref[row * c:(row + 1) * c, col * c:(col + 1) * c]
        assert np.abs(mine - patch).mean() < 4.0  # goboard adds sigma=3 noise


def test_batch_tokens_match_processor():
    proc = build_processor()
    maker = BatchMaker(proc, variations=("mild",))
    gen = torch.Generator().manual_seed(0)
    for task in ("text_only_num", "text_only_tf", "multimodal_num", "multimodal_tf"):
        batch = maker.make(task, torch.tensor([7, 104]), gen)
        tok = proc.tokenizer
        for row, lab, n in zip(batch.input_ids, batch.labels, batch.counts.tolist(), strict=False):
            text = tok.decode(row[row != tok.pad_token_id])
            words = text.split()
            strings = []
            i = 0
            while i < len(words):
                if words[i] == "<|str_start|>":
                    j = words.index("<|str_end|>", i)
                    strings.append("".join(words[i + 1:j]))
                    i = j
                i += 1
            ans = tok.decode(lab[lab != -100])
            ans_ids = lab[lab != -100].tolist()
            def expect_ids(a: str, tok=tok) -> list[int]:
                return tok(answer_suffix(a), add_special_tokens=False).input_ids

            expected = proc.expand(prompt(G.QUESTIONS[task], strings, image=task.startswith("multimodal")))
            assert text == expected + " " + ans
            if task == "text_only_num":
                assert strings[0].count("c") == n and ans_ids == expect_ids(str(n))
            if task == "multimodal_num":
                assert ans_ids == expect_ids(str(n))
            if task == "text_only_tf":
                same = strings[0].count("c") == strings[1].count("c")
                assert ans_ids == expect_ids("True" if same else "False")
        if task.startswith("multimodal"):
            assert batch.pixel_values.shape == (2, 3, 88, 88)
            assert int(batch.image_mask.sum()) == 2 * 121
