"""Where a stored generation ends: at the generation config's EOS, exactly where ``generate`` stops.

A tiny random-init Idefics3 generates its pad id mid-answer on spatial scenes; ``generate`` carries
on past it, so the stored text, token count and answer rows must too.
"""

from __future__ import annotations

import pytest
import torch
from devices import model_config

from extract.manifest import parse_manifest
from extract.models import prepare_batch
from extract.run import collect_samples, run_extraction
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

STEPS = 8


@pytest.fixture(scope="module")
def spatial_set(tmp_path_factory):
    family = get_family("spatial")
    out = tmp_path_factory.mktemp("stimuli") / "spatial"
    return write_set(family, family.config(image_size=112), n=4, seed=0, split="test", out=out)


@pytest.mark.slow
def test_answers_end_at_eos_not_at_a_generated_pad(tiny_dir, tiny_lm, spatial_set, tmp_path):
    model = tiny_dir("idefics3")
    manifest = parse_manifest({
        "run": "stop", "model": {"path": str(model), **model_config()},
        "stimuli": [{"set": str(spatial_set), "task": "choice"}],
        "taps": [{"tap": "llm", "layers": [0], "tokens": ["answer"]}],
        "generation": {"max_new_tokens": STEPS}, "batch_size": 4, "chunk_samples": 4,
    })
    run_extraction(manifest, workspace=tmp_path / "ws", progress=False)

    # transformers' own greedy generate on the same left-padded batch
    lm = tiny_lm("idefics3")
    _, samples = collect_samples(manifest)
    batch = prepare_batch(lm, [s.image for s in samples], [s.prompt for s in samples],
                          strings=[s.strings for s in samples], padding_side="left")
    with torch.inference_mode():
        seq = lm.model.generate(**batch.inputs, max_new_tokens=STEPS, do_sample=False)
    new = seq[:, batch.seq_len:].cpu().tolist()
    eos = lm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = lm.model.generation_config.pad_token_id
    ends = [next((i for i, t in enumerate(ids) if t in eos), len(ids)) for ids in new]
    # the case this test is about: a pad id generated before the row's end
    assert any(pad in ids[:end] for ids, end in zip(new, ends, strict=False)), new

    ws = Workspace.open(tmp_path / "ws", readonly=True)
    got = ws.rows("SELECT g.text, g.n_tokens, g.stop_reason, s.answer_count FROM generations g JOIN samples s"
                  " ON s.run = g.run AND s.stimulus = g.stimulus ORDER BY g.array_row")
    n_fed = len(new[0]) - 1  # the last generated token is never fed back, so it has no activation row
    want = [(lm.tokenizer.decode(ids[:end], skip_special_tokens=True), end, "eos" if end < len(ids) else "cap",
             min(end, n_fed)) for ids, end in zip(new, ends, strict=False)]
    assert got == want
    answers = ws.read("stop", "llm", 0, tokens="answer")
    assert [len(answers[i]) for i in range(len(want))] == [w[3] for w in want]
