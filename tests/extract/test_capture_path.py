"""The prompt-only capture path: with one new token, one forward stores what ``generate`` stores.

Two runs of one manifest over the same tiny model and stimuli, one on the path chosen automatically
(forward) and one forced through ``generate``, must store the same arrays, generations and token spans;
the run's config says which path ran and why.
"""

from __future__ import annotations

import numpy as np
import pytest
from devices import allclose, model_config

from extract.manifest import ManifestError, parse_manifest
from extract.run import capture_path, collect_samples, run_extraction
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

N_SAMPLES = 6  # batches of 4 and 2: left padding inside a batch, and a short last batch


@pytest.fixture(scope="module")
def g2m_set(tmp_path_factory):
    family = get_family("g2m")
    out = tmp_path_factory.mktemp("stimuli") / "g2m"
    return write_set(family, family.config(grid_sizes=(3, 4), colors=(3,), image_size=112),
                     n=N_SAMPLES // 2, seed=0, split="test", out=out)


def manifest_for(model, stimuli, run, **generation):
    return parse_manifest({
        "run": run,
        "model": {"path": str(model), **model_config()},
        "stimuli": [{"set": str(stimuli)}],
        "taps": [
            {"tap": "vision", "layers": [-1]},
            {"tap": "projector", "layers": [0], "site": "out"},
            {"tap": "llm", "layers": "all", "tokens": ["image", "last", "answer"]},
        ],
        "attention": {"layers": [0, -1], "queries": ["last", "answer"]},
        "generation": {"max_new_tokens": 1, **generation},
        "batch_size": 4,
        "chunk_samples": 2,
        "logit_lens": True,
    })


def _same(a, b) -> None:
    """Equal in float32; in a reduced dtype within its bound (an accelerator may pick other kernels
    for a cached and an uncached pass)."""
    allclose(a, b, rtol=0, atol=0)


def _table(ws: Workspace, table: str, run: str) -> list[tuple]:
    return ws.rows(f"SELECT * EXCLUDE (run, recorded_at) FROM {table} WHERE run = ? ORDER BY array_row", [run])


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava", "gemma3", "paligemma"])
@pytest.mark.slow
def test_forward_path_stores_what_generate_stores(arch, tiny_dir, g2m_set, tmp_path):
    model = tiny_dir(arch)
    data = tmp_path / "data"
    run_extraction(manifest_for(model, g2m_set, "fwd"), workspace=data, progress=False)
    run_extraction(manifest_for(model, g2m_set, "gen", path="generate"), workspace=data, progress=False)
    ws = Workspace.open(data, readonly=True)
    paths = dict(ws.rows("SELECT run, config->'$.capture.path' FROM runs"))
    assert paths == {"fwd": '"forward"', "gen": '"generate"'}

    arrays = {(a.tap, a.layer, a.site, a.tokens) for a in ws.arrays("fwd")}
    assert arrays == {(a.tap, a.layer, a.site, a.tokens) for a in ws.arrays("gen")}
    assert ("llm", 0, "resid_post", "answer") in arrays and ("attn", 0, "probs", "answer") in arrays
    for tap, layer, site, tokens in sorted(arrays):
        got = ws.read("fwd", tap, layer, site=site, tokens=tokens)
        want = ws.read("gen", tap, layer, site=site, tokens=tokens)
        if tokens == "answer":  # one new token, nothing fed back: no answer rows on either path
            assert got.values.shape[0] == 0 and want.values.shape[0] == 0
        elif hasattr(got, "offsets"):
            np.testing.assert_array_equal(got.offsets, want.offsets)
            _same(got.values, want.values)
        else:
            _same(got, want)
    gens = _table(ws, "generations", "fwd")
    assert len(gens) == N_SAMPLES and gens == _table(ws, "generations", "gen")
    assert _table(ws, "samples", "fwd") == _table(ws, "samples", "gen")
    n_tokens = ws.rows("SELECT n_tokens FROM generations WHERE run = 'fwd'")
    assert {n for (n,) in n_tokens} <= {0, 1}


def test_generate_when_an_answer_can_be_longer(tiny_lm, tiny_dir, g2m_set):
    lm = tiny_lm("qwen2_vl")
    model = tiny_dir("qwen2_vl")
    for generation, why in [({"max_new_tokens": 2}, "up to 2 tokens"),
                            ({"max_new_tokens": "from_stimulus"}, "tokens need decode steps"),
                            ({"max_new_tokens": 1, "path": "generate"}, "generation.path: generate")]:
        manifest = manifest_for(model, g2m_set, "r", **generation)
        path, reason = capture_path(lm, manifest, collect_samples(manifest)[1])
        assert path == "generate" and why in reason
    manifest = manifest_for(model, g2m_set, "r")
    assert capture_path(lm, manifest, collect_samples(manifest)[1])[0] == "forward"


@pytest.mark.parametrize("setting", [("repetition_penalty", 1.3), ("suppress_tokens", [5]),
                                     ("forced_eos_token_id", 2), ("min_new_tokens", 1), ("num_beams", 2)])
def test_generate_when_the_generation_config_moves_the_token(setting, tiny_lm, tiny_dir, g2m_set):
    lm = tiny_lm("llava")
    manifest = manifest_for(tiny_dir("llava"), g2m_set, "r")
    samples = collect_samples(manifest)[1]
    config = lm.model.generation_config
    name, value = setting
    before = getattr(config, name)
    setattr(config, name, value)
    try:
        path, why = capture_path(lm, manifest, samples)
    finally:
        setattr(config, name, before)
    assert path == "generate" and f"generation_config.{name}" in why
    assert capture_path(lm, manifest, samples)[0] == "forward"


def test_path_is_validated(tiny_dir, g2m_set):
    with pytest.raises(ManifestError, match="generation.path"):
        manifest_for(tiny_dir("llava"), g2m_set, "r", path="forward_please")


@pytest.mark.slow
def test_a_run_stored_before_capture_paths_resumes_on_generate(tiny_dir, g2m_set, tmp_path):
    """A run whose config predates the recorded capture path (it ran ``generate``) and the manifest's
    generation.path setting is resumed, not refused over settings the user never wrote, and goes on
    as it was: on ``generate``, with no path recorded."""
    import duckdb

    model = tiny_dir("qwen2_vl")
    data = tmp_path / "data"
    run_extraction(manifest_for(model, g2m_set, "old"), workspace=data, progress=False)
    con = duckdb.connect(str(Workspace.open(data, readonly=True).manifest_path))
    # what an older agnosia left: no capture key, stopped after its first chunk (2 samples)
    con.execute("""UPDATE runs SET config = json_merge_patch(config, '{"capture": null, "generation": {"path": null}}'),"""
                """ status = 'failed'""")
    con.execute("DELETE FROM chunks WHERE chunk > 0")
    con.close()
    summary = run_extraction(manifest_for(model, g2m_set, "old"), workspace=data, progress=False)
    assert summary.computed == N_SAMPLES - 2
    ws = Workspace.open(data, readonly=True)
    assert ws.rows("SELECT status, config->'$.capture' FROM runs") == [("finished", None)]
