"""Interventions as variant runs: head ablation, vision RoPE scaling, token compression."""

from __future__ import annotations

import pytest
import torch
from devices import load
from tiny_cases import IMAGE, noise_image, quick

from extract.generation import stop_ids
from extract.interventions.compression import compress, greedy, merge_runs, punctuation_ids, run_starts
from extract.interventions.heads import ablate, head_site, zeroed
from extract.interventions.rope import gain, scaled_vision_rope
from extract.manifest import ManifestError, RopeScalingSpec, parse_manifest
from extract.models import capture, prepare_batch
from extract.models.errors import ModelError
from extract.run import run_extraction
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

TOY = "lab/checkpoints/toy-counter"
QUESTION = "How many black stones are there on the chessboard ?"


@pytest.fixture(scope="module")
def toy():
    return load(TOY)


@pytest.fixture(scope="module")
def go_set(tmp_path_factory):
    family = get_family("go")
    cfg = family.config(preset="small", counts="2,7,30,45", variation="mild")
    return write_set(family, cfg, n=1, seed=9, split="test", out=tmp_path_factory.mktemp("go") / "go")


def _toy_batch(toy, n=2, answers=None):
    images = [noise_image(88, 88, i + 1) for i in range(n)]
    return prepare_batch(toy, images, [QUESTION] * n, answers=answers)


# ------------------------------------------------------------------------------------------ heads

@pytest.mark.parametrize("tap", ["llm", "vision"])
@pytest.mark.slow
def test_zeroing_a_head_changes_exactly_that_heads_slice(toy, tap):
    site = head_site(toy, tap, 0)
    assert (site.n_heads, site.head_dim) == (2, 16)
    seen = {}

    def grab(name):
        def hook(module, args, output):
            seen[name] = (args[0].detach().clone(), output.detach().clone())
        return hook

    proj = toy.model.get_submodule(site.out_proj)
    batch = _toy_batch(toy)
    handle = proj.register_forward_hook(grab("plain"))
    with torch.no_grad():
        toy.model(**batch.inputs)
    handle.remove()
    with zeroed(toy, site, 1):
        handle = proj.register_forward_hook(grab("ablated"))
        with torch.no_grad():
            toy.model(**batch.inputs)
        handle.remove()
    x_plain, _ = seen["plain"]
    x_abl, y_abl = seen["ablated"]
    # Upstream of the zeroed head nothing changed (layer 0 is the first block of its tower).
    torch.testing.assert_close(x_abl[..., :16], x_plain[..., :16], rtol=0, atol=0)
    assert torch.count_nonzero(x_abl[..., 16:]) == 0
    manual = torch.nn.functional.linear(torch.cat([x_plain[..., :16], torch.zeros_like(x_plain[..., 16:])], -1),
                                        proj.weight, proj.bias)
    torch.testing.assert_close(y_abl, manual)
    with pytest.raises(ModelError, match="heads 0..1"):
        with zeroed(toy, site, 2):
            pass


def test_qwen_vision_and_llm_heads_are_found(tiny_lm):
    lm = tiny_lm("qwen2_vl")
    vis, llm = head_site(lm, "vision", 0), head_site(lm, "llm", 0)
    assert vis.out_proj.endswith(".attn.proj") and llm.out_proj.endswith(".self_attn.o_proj")
    assert vis.n_heads * vis.head_dim == lm.model.get_submodule(vis.out_proj).in_features


@pytest.mark.slow
def test_one_forward_per_head_covers_a_batch(toy):
    batch = _toy_batch(toy, 3, answers=["1 2", "3", "4 5"])
    sites = [head_site(toy, "llm", layer) for layer in (0, 1)]
    rows = ablate(toy, batch, sites)
    assert len(rows) == 3 * 2 * 2
    for b in range(3):
        alone = prepare_batch(toy, [noise_image(88, 88, b + 1)], [QUESTION], answers=[["1 2", "3", "4 5"][b]])
        expected = ablate(toy, alone, sites)
        got = [r for r in rows if r["sample"] == b]
        assert [(r["layer"], r["head"], r["flip_mask"], r["n_positions"]) for r in got] == \
               [(r["layer"], r["head"], r["flip_mask"], r["n_positions"]) for r in expected]
        for g, e in zip(got, expected, strict=False):
            assert g["logit_drop"] == pytest.approx(e["logit_drop"], abs=1e-3)


@pytest.mark.slow
def test_head_ablation_run_records_every_head_and_resumes(go_set, tmp_path):
    data = {"run": "heads", "model": {"path": TOY}, "stimuli": [{"set": str(go_set), "task": "multimodal_num"}],
            "intervention": {"kind": "head_ablation"}, "generation": {"max_new_tokens": 4}, "batch_size": 3}
    summary = run_extraction(parse_manifest(data), workspace=tmp_path / "ws", progress=False)
    assert summary.computed == 4
    ws = Workspace.open(tmp_path / "ws", readonly=True)
    assert ws.rows("SELECT count(*), count(DISTINCT stimulus) FROM head_ablations") == [(16, 4)]
    assert ws.rows("SELECT intervention->>'kind', status FROM runs") == [("head_ablation", "finished")]
    assert ws.rows("SELECT count(*) FROM generations WHERE run = 'heads'") == [(4,)]
    assert ws.rows("SELECT bool_and(flipped = (flip_mask > 0)) AND bool_and(n_flipped <= n_positions)"
                   " FROM head_ablations") == [(True,)]
    again = run_extraction(parse_manifest(data), workspace=tmp_path / "ws", progress=False)
    assert again.computed == 0  # every stimulus already has all its heads
    # A crash between the ablation rows' commit and the generation's: that stimulus is redone.
    import duckdb

    con = duckdb.connect(str(tmp_path / "ws" / "manifest.duckdb"))
    con.execute("DELETE FROM generations WHERE stimulus = (SELECT min(stimulus) FROM generations)")
    con.close()
    third = run_extraction(parse_manifest(data), workspace=tmp_path / "ws", progress=False)
    assert third.computed == 1
    assert ws.rows("SELECT count(*), count(DISTINCT stimulus) FROM head_ablations") == [(16, 4)]
    assert ws.rows("SELECT count(*) FROM generations WHERE run = 'heads'") == [(4,)]


def test_head_ablation_manifest_is_checked():
    base = {"run": "h", "model": {"path": TOY}, "stimuli": [{"set": "x"}]}
    with pytest.raises(ManifestError, match="remove taps"):
        parse_manifest({**base, "intervention": {"kind": "head_ablation"}, "taps": [{"tap": "llm"}]})
    with pytest.raises(ManifestError, match="did you mean 'alpha'"):
        parse_manifest({**base, "intervention": {"kind": "rope_scaling", "alhpa": 1}})


# ------------------------------------------------------------------------------------------ RoPE scaling

def test_gain_matches_the_studys_numbers():
    assert float(gain(20, p=6)[19]) == pytest.approx(73.77, abs=0.01)
    assert float(gain(20, p=8)[19]) == pytest.approx(66.68, abs=0.01)
    assert float(gain(20, p=10)[19]) == pytest.approx(60.27, abs=0.01)
    assert float(gain(20, p=8)[10]) == pytest.approx(1.39, abs=0.01)
    assert torch.equal(gain(20, alpha=0.0), torch.ones(20))
    sig = gain(20, form="sigmoid", alpha=99, m=0.6, k=40)
    assert float(sig[0]) == pytest.approx(1 + 99 / (1 + torch.e ** 24), rel=1e-6)


@pytest.mark.parametrize("arch", quick(["toy_counter", "qwen2_vl", "qwen2_5_vl"], "toy_counter", "qwen2_vl"))
def test_rope_scaling_alpha_zero_is_bit_for_bit_and_alpha_99_is_not(arch, tiny_lm, toy):
    lm = toy if arch == "toy_counter" else tiny_lm(arch)
    width, height, _ = IMAGE.get(arch, (88, 88, None))
    batch = prepare_batch(lm, [noise_image(width, height, 3)], ["Describe."] if arch != "toy_counter" else [QUESTION])
    taps = ["vision.-1", "llm.-1"]

    def run():
        res = capture(lm, batch, taps, tokens=("image", "last"))
        return {k: res[k].clone() for k in res.keys()}

    plain = run()
    with scaled_vision_rope(lm, RopeScalingSpec(kind="rope_scaling", alpha=0.0)):
        same = run()
    with scaled_vision_rope(lm, RopeScalingSpec(kind="rope_scaling", alpha=99.0, p=8)):
        scaled = run()
    after = run()
    for k in plain:
        assert torch.equal(plain[k], same[k]), k
        assert torch.equal(plain[k], after[k]), k  # the model is restored
    assert not torch.equal(plain[("vision", lm.adapter.n_layers("vision") - 1, "resid_post", "image")],
                           scaled[("vision", lm.adapter.n_layers("vision") - 1, "resid_post", "image")])


def test_rope_scaling_needs_a_rotary_vision_tower(tiny_lm):
    with pytest.raises(ModelError, match="no rotary position table"):
        with scaled_vision_rope(tiny_lm("llava"), RopeScalingSpec(kind="rope_scaling")):
            pass


@pytest.mark.slow
def test_rope_scaled_run_with_alpha_zero_stores_the_plain_run(go_set, tmp_path):
    def manifest(run, alpha):
        data = {"run": run, "model": {"path": TOY}, "stimuli": [{"set": str(go_set)}],
                "taps": [{"tap": "vision", "layers": [-1]}, {"tap": "llm", "layers": [1], "tokens": ["last"]}],
                "generation": {"max_new_tokens": 4}}
        if alpha is not None:
            data["intervention"] = {"kind": "rope_scaling", "alpha": alpha}
        return parse_manifest(data)

    for run, alpha in (("plain", None), ("alpha0", 0.0), ("alpha99", 99.0)):
        run_extraction(manifest(run, alpha), workspace=tmp_path / "ws", progress=False)
    ws = Workspace.open(tmp_path / "ws", readonly=True)
    plain, zero, big = (ws.read(r, "vision", 1, tokens="image") for r in ("plain", "alpha0", "alpha99"))
    assert (plain == zero).all() and not (plain == big).all()
    assert ws.rows("SELECT run, intervention->>'kind', (intervention->>'alpha')::DOUBLE FROM runs ORDER BY run") == [
        ("alpha0", "rope_scaling", 0.0), ("alpha99", "rope_scaling", 99.0), ("plain", None, None)]


# ------------------------------------------------------------------------------------------ compression

def test_runs_merge_and_drop():
    tokens = torch.tensor([5, 5, 7, 9, 9, 9, 5])
    emb = torch.arange(7, dtype=torch.float32)[:, None].repeat(1, 2)
    assert run_starts(tokens).tolist() == [0, 2, 3, 6]
    assert merge_runs(tokens, emb, set())[:, 0].tolist() == [0, 2, 3, 6]
    assert merge_runs(tokens, emb, set(), keep="mean")[:, 0].tolist() == [0.5, 2, 4, 6]
    assert merge_runs(tokens, emb, {9})[:, 0].tolist() == [0, 2, 6]
    distinct = torch.tensor([3, 1, 4, 2])
    assert torch.equal(merge_runs(distinct, emb[:4], set()), emb[:4])  # no repeats: every token kept


def test_punctuation_ids_are_only_punctuation(toy):
    vocab = {i: t for t, i in toy.tokenizer.get_vocab().items()}
    ids = punctuation_ids(toy.tokenizer)
    assert all(not any(ch.isalnum() for ch in vocab[i]) for i in ids)
    assert toy.tokenizer.convert_tokens_to_ids("c") not in ids


def test_greedy_from_embeddings_matches_generate(toy):
    batch = prepare_batch(toy, [noise_image(88, 88, 4)], [QUESTION], padding_side="left")
    with torch.no_grad():
        ref = toy.model.generate(**batch.inputs, max_new_tokens=4, do_sample=False)[0, batch.seq_len:].tolist()
    no_merge = compress(toy, batch, toy.model.get_output_embeddings().weight, set(), "first")
    # Rebuild the uncompressed prefill: same text embeddings, all image features in place.
    ids = batch.inputs["input_ids"][0]
    with torch.no_grad():
        full = toy.model.get_input_embeddings()(ids).clone()
        full[ids == toy.adapter.image_token_id] = toy.model.get_image_features(batch.inputs["pixel_values"])[0]
    stop = stop_ids(toy)
    want = [t for t in ref]
    want = want[: next((i for i, t in enumerate(want) if t in stop), len(want))]
    assert greedy(toy, full[None], 4, stop) == want
    assert 0 < no_merge.n_kept <= no_merge.n_image == 121


@pytest.mark.slow
def test_compression_run_records_retained_ratio(go_set, tmp_path):
    data = {"run": "rle", "model": {"path": TOY}, "stimuli": [{"set": str(go_set)}],
            "intervention": {"kind": "token_compression"}, "generation": {"max_new_tokens": 4}}
    run_extraction(parse_manifest(data), workspace=tmp_path / "ws", progress=False)
    ws = Workspace.open(tmp_path / "ws", readonly=True)
    rows = ws.rows("SELECT (metrics->>'retained_ratio')::DOUBLE, (metrics->>'image_tokens')::INT,"
                   " (metrics->>'kept_tokens')::INT FROM generations")
    assert len(rows) == 4
    for ratio, n, kept in rows:
        assert n == 121 and 0 < kept <= n and ratio == pytest.approx(kept / n)


def test_compression_refuses_other_families(tiny_lm):
    lm = tiny_lm("qwen2_vl")
    width, height, _ = IMAGE["qwen2_vl"]
    batch = prepare_batch(lm, [noise_image(width, height, 1)], ["Describe."])
    with pytest.raises(ModelError, match="implemented for toy_counter"):
        compress(lm, batch, lm.model.get_output_embeddings().weight, set())


def test_dry_run_shows_the_variant(go_set):
    from extract.dry_run import dry_run

    base = {"run": "v", "model": {"path": TOY}, "stimuli": [{"set": str(go_set)}], "batch_size": 3}
    heads = dry_run(parse_manifest({**base, "intervention": {"kind": "head_ablation", "layers": [1]}}))
    assert "layers [1], 2 heads each" in heads
    assert "2 batches x (3 teacher-forced forwards + 1 greedy generate) = 6 forwards; 8 head_ablations rows" in heads
    rle = dry_run(parse_manifest({**base, "intervention": {"kind": "token_compression", "keep": "mean"}}))
    assert "keep mean" in rle and "4 generations with retained ratios" in rle
    rope = dry_run(parse_manifest({**base, "taps": [{"tap": "vision", "layers": [0]}],
                                   "intervention": {"kind": "rope_scaling", "p": 6}}))
    assert rope.startswith("intervention rope_scaling: form poly, alpha 99.0, p 6.0") and "vision.0" in rope
