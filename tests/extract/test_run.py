"""The extraction run end to end: a tiny Qwen2-VL over a G2M set into a real workspace.

Stored values are checked against transformers' own outputs for the same inputs; an interrupted
run resumes to exactly what an uninterrupted one stores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from devices import allclose, load, model_config, numpy

from extract.manifest import ManifestError, parse_manifest
from extract.models import prepare_batch
from extract.run import run_extraction
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

N_SAMPLES = 6
# Stored values are float16 (fp32 tolerances below); the reference runs in the model's dtype
# (AGNOSIA_TEST_DTYPE): in bf16 the run (left-padded batch, "capture" attention) and the reference (one
# sample, eager) round apart, and devices.allclose applies its magnitude-relative bound.
STORED_TOL = dict(rtol=1e-3, atol=1e-4)
ATTN_TOL = dict(rtol=1e-3, atol=1e-5)


@pytest.fixture(scope="module")
def g2m_set(tmp_path_factory):
    family = get_family("g2m")
    out = tmp_path_factory.mktemp("stimuli") / "g2m"
    return write_set(family, family.config(grid_sizes=(3, 4), colors=(3,), image_size=112),
                     n=N_SAMPLES // 2, seed=0, split="test", out=out)


def manifest_for(model, stimuli, run="r1", **extra):
    data = {
        "run": run,
        "model": {"path": str(model), **model_config()},
        "stimuli": [{"set": str(stimuli)}],
        "taps": [
            {"tap": "vision", "layers": [-1]},
            {"tap": "llm", "layers": "all", "tokens": ["image", "last", "answer"]},
        ],
        "attention": {"layers": [-1], "queries": ["last", "answer"]},
        "generation": {"max_new_tokens": 5},
        "batch_size": 4,
        "chunk_samples": 2,
        **extra,
    }
    return parse_manifest(data)


@pytest.fixture(scope="module")
def extracted(tiny_dir, g2m_set, tmp_path_factory):
    model = tiny_dir("qwen2_vl")
    data = tmp_path_factory.mktemp("ws") / "data"
    summary = run_extraction(manifest_for(model, g2m_set), workspace=data, progress=False)
    return model, data, summary


def test_run_finishes_and_verifies(extracted):
    _, data, summary = extracted
    assert summary.samples == N_SAMPLES and summary.computed == N_SAMPLES
    ws = Workspace.open(data, readonly=True)
    assert ws.rows("SELECT status, n_samples FROM runs") == [("finished", N_SAMPLES)]
    assert ws.verify().ok
    n_gen, n_spans = ws.rows("SELECT (SELECT count(*) FROM generations),"
                             " (SELECT count(*) FROM samples WHERE recorded_at IS NOT NULL)")[0]
    assert n_gen == N_SAMPLES and n_spans == N_SAMPLES
    taps = {(a.tap, a.tokens) for a in ws.arrays("r1")}
    assert taps == {("vision", "image"), ("llm", "image"), ("llm", "last"), ("llm", "answer"),
                    ("attn", "last"), ("attn", "answer")}


@pytest.mark.slow
def test_stored_values_match_transformers_outputs(extracted):
    model, data, _ = extracted
    ws = Workspace.open(data, readonly=True)
    lm = load(model, attn_implementation="eager")
    rows = ws.rows(
        "SELECT array_row, set_path, image, prompt, image_start, image_count, last_prompt, answer_count, grid_h,"
        " grid_w FROM v_samples WHERE run = 'r1' ORDER BY array_row"
    )
    gens = ws.rows("SELECT array_row, n_tokens FROM generations WHERE run = 'r1' ORDER BY array_row")
    n_layers = lm.adapter.n_layers("llm")
    image_acts = {layer: ws.read("r1", "llm", layer, tokens="image") for layer in range(n_layers)}
    last_acts = ws.read("r1", "llm", n_layers - 1, tokens="last")
    attn_last = ws.read("r1", "attn", n_layers - 1, site="probs", tokens="last")
    for (row, set_path, image, prompt, i0, n_img, last, n_ans, gh, gw), (_, n_tok) in zip(rows, gens, strict=False):
        assert gh * gw == n_img
        batch = prepare_batch(lm, [f"{set_path}/{image}"], [prompt])
        ids = batch.inputs["input_ids"][0]
        assert int(ids[i0:i0 + n_img].eq(lm.model.config.image_token_id).sum()) == n_img
        assert int(ids.shape[0]) == last + 1
        with torch.inference_mode():
            out = lm.model(**batch.inputs, output_hidden_states=True, output_attentions=True)
        for layer in range(n_layers - 1):  # the last hidden state is post-norm; checked via `last` below
            want = numpy(out.hidden_states[layer + 1][0, i0:i0 + n_img])
            allclose(image_acts[layer][row], want, **STORED_TOL)
        final_norm = lm.model.model.language_model.norm
        with torch.inference_mode():
            normed = final_norm(torch.from_numpy(last_acts[row]).to(lm.device, lm.dtype))
        allclose(numpy(normed), numpy(out.hidden_states[-1][0, last:last + 1]), **STORED_TOL)
        allclose(attn_last[row], numpy(out.attentions[-1][0, :, last, :].T), **ATTN_TOL)
        assert n_ans <= n_tok


def test_answer_tokens_equal_a_teacher_forced_pass(extracted):
    model, data, _ = extracted
    ws = Workspace.open(data, readonly=True)
    lm = load(model)
    row, set_path, image, prompt, text, n_ans = ws.rows(
        "SELECT array_row, set_path, image, prompt, generated, answer_count FROM v_samples WHERE run = 'r1'"
        " ORDER BY answer_count DESC, array_row LIMIT 1"
    )[0]
    answer = ws.read("r1", "llm", 0, tokens="answer")[row]
    assert answer.shape[0] == n_ans
    if n_ans == 0:
        pytest.skip("the random model ended its answer at once")
    from extract.models import capture

    batch = prepare_batch(lm, [f"{set_path}/{image}"], [prompt], answers=[text])
    forced = capture(lm, batch, ["llm.0"], tokens=("answer",))[("llm", 0, "resid_post", "answer")][0]
    k = min(n_ans, forced.shape[0])
    allclose(answer[:k], numpy(forced[:k]), **STORED_TOL)


@pytest.mark.slow  # two more extractions of the set
def test_interrupted_run_resumes_to_the_same_store(tiny_dir, g2m_set, extracted, tmp_path):
    model, reference, _ = extracted
    data = tmp_path / "data"
    manifest = manifest_for(model, g2m_set)

    def crash(done):
        if done >= 4:
            raise KeyboardInterrupt("simulated crash after the second batch")

    with pytest.raises(KeyboardInterrupt):
        run_extraction(manifest, workspace=data, progress=False, on_batch=crash)
    resumed = run_extraction(manifest, workspace=data, progress=False)
    assert resumed.computed < N_SAMPLES  # committed chunks were not recomputed
    ws, ref = Workspace.open(data, readonly=True), Workspace.open(reference, readonly=True)
    assert ws.verify().ok
    assert ws.rows("SELECT count(*), count(DISTINCT array_row) FROM generations") == [(N_SAMPLES, N_SAMPLES)]
    # The summary's accuracy is the run's (every stored row), the resumed rows' is given apart.
    (stored,) = ws.rows("SELECT avg(correct::INT) FROM generations WHERE run = 'r1'")[0]
    assert (resumed.scored, resumed.accuracy) == (N_SAMPLES, pytest.approx(stored))
    assert f"of {N_SAMPLES} scored rows; the {resumed.computed} computed now:" in str(resumed)
    for info in ref.arrays("r1"):
        got = ws.read("r1", info.tap, info.layer, site=info.site, tokens=info.tokens)
        want = ref.read("r1", info.tap, info.layer, site=info.site, tokens=info.tokens)
        if info.layout == "ragged":
            np.testing.assert_array_equal(got.offsets, want.offsets)
            got, want = got.values, want.values
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # two extractions of the set
@pytest.mark.parametrize("copy_fails", [False, True], ids=["copy-lands", "copy-fails"])
def test_a_crash_keeps_the_batch_whose_host_copy_was_pending(tiny_dir, g2m_set, tmp_path, monkeypatch, copy_fails):
    """On CUDA a batch is written once the next one has run, while its host copy runs beside that
    (``BatchDone.ready``); a crash in between still stores it, and a copy that fails too does not hide
    the crash. Here on any device: each batch's ``ready`` is one of the test's."""
    import extract.run as run

    computed = run.run_batch

    def with_copy(*args, **kwargs):
        done = computed(*args, **kwargs)

        def ready() -> None:
            if copy_fails:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        done.ready = ready
        return done

    def crash(done):
        if done >= 4:
            raise KeyboardInterrupt("simulated crash after the first batch")

    monkeypatch.setattr(run, "run_batch", with_copy)
    manifest = manifest_for(tiny_dir("qwen2_vl"), g2m_set)
    with pytest.raises(KeyboardInterrupt, match="simulated crash"):
        run_extraction(manifest, workspace=tmp_path / "data", progress=False, on_batch=crash)
    ws = Workspace.open(tmp_path / "data", readonly=True)
    assert ws.verify().ok
    assert ws.rows("SELECT count(*) FROM generations") == [(0 if copy_fails else 4,)]
    monkeypatch.undo()
    resumed = run_extraction(manifest, workspace=tmp_path / "data", progress=False)
    assert resumed.computed == (N_SAMPLES if copy_fails else N_SAMPLES - 4)


def test_bad_layer_fails_before_any_work(tiny_dir, g2m_set, tmp_path):
    manifest = manifest_for(tiny_dir("qwen2_vl"), g2m_set, taps=[{"tap": "llm", "layers": [7]}])
    with pytest.raises(ManifestError, match="layer 7 does not exist"):
        run_extraction(manifest, workspace=tmp_path / "data", progress=False)
    assert not (tmp_path / "data").exists()


def test_unknown_task_names_the_tasks(tiny_dir, g2m_set, tmp_path):
    data = {"run": "r", "model": {"path": str(tiny_dir("qwen2_vl"))},
            "stimuli": [{"set": str(g2m_set), "task": "count"}], "taps": [{"tap": "llm", "layers": 0}]}
    with pytest.raises(ManifestError, match=r"'count' is not a task .* \['transcribe'\]"):
        run_extraction(parse_manifest(data), workspace=tmp_path / "data", progress=False)


def test_missing_model_folder_is_a_clear_error(g2m_set, tmp_path):
    from extract.models import ModelError

    manifest = manifest_for(tmp_path / "no-such-model", g2m_set)
    with pytest.raises(ModelError):
        run_extraction(manifest, workspace=tmp_path / "data", progress=False)


def test_dry_run_plans_the_arrays_the_run_writes(extracted, g2m_set):
    from extract.dry_run import dry_run

    model, data, _ = extracted
    text = dry_run(manifest_for(model, g2m_set))
    ws = Workspace.open(data, readonly=True)
    infos = ws.arrays("r1")
    assert f"{len(infos)} arrays" in text
    for info in infos:
        if info.layout == "dense":  # fixed-size arrays are planned exactly
            name = f"{info.tap}.{info.layer}.{info.site}"
            per_sample = int(np.prod(info.item_shape))
            assert any(line.split()[:3] == [name, info.tokens, f"{per_sample:,}"] for line in text.splitlines()), name


def test_dry_run_summary_holds_without_the_logit_lens(extracted, g2m_set):
    from extract.dry_run import dry_run

    model, _, _ = extracted
    text = dry_run(manifest_for(model, g2m_set, logit_lens=False))
    assert "arrays," in text.splitlines()[-1] and "logit lens" not in text


def test_a_resumed_summary_prints_the_runs_accuracy_and_the_new_rows_apart(tmp_path):
    from extract.run import RunSummary

    resumed = RunSummary(run="r", workspace=tmp_path, samples=484, computed=120, seconds=2.0, accuracy=0.804,
                         arrays=3, new_accuracy=0.721, scored=484)
    assert "accuracy 80.4% (of 484 scored rows; the 120 computed now: 72.1%)" in str(resumed)
    fresh = RunSummary(run="r", workspace=tmp_path, samples=484, computed=484, seconds=2.0, accuracy=0.804,
                       arrays=3, new_accuracy=0.804, scored=484)
    assert "accuracy 80.4% ->" in str(fresh)
