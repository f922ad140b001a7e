"""Dry runs at scale: config.json alone (no weights, no tokenizer), checked by hand.

The committed folders in manifests/configs/ hold only the public config files of real models.
Their dry runs must run without weights, reproduce the published parameter counts, and give the
numbers a hand computation from the config values gives. Each family's ``config_geometry`` (what
the dry run uses without a processor) must equal what the real processor produces.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tiny_cases import IMAGE_ALL, noise_image, quick

from extract.dry_run import (
    CHARS_PER_TOKEN,
    TEMPLATE_TOKENS,
    DrySample,
    Hardware,
    estimate_manifest,
    estimate_run,
    image_processor_settings,
    main,
    meta_model,
)
from extract.manifest import parse_manifest
from extract.models import ConfigGeometryError, prepare_batch
from extract.scale_table import MODELS, g2m_sweep
from stimuli import g2m, get_family
from stimuli.io import read_set, write_set

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "manifests" / "configs"
QWEN7 = CONFIGS / "qwen2.5-vl-7b-instruct"
# published sizes (the hub's model cards: 8.29 B, 73.4 B, 7.06 B parameters)
PUBLISHED = {"qwen2.5-vl-7b-instruct": 8.29e9, "qwen2.5-vl-72b-instruct": 73.4e9, "llava-1.5-7b-hf": 7.06e9}


@pytest.fixture(scope="module")
def g2m_512(tmp_path_factory):
    """3 grids of N=3 then 3 of N=6, 512 px, as the study draws them."""
    family = get_family("g2m")
    out = tmp_path_factory.mktemp("plan") / "g2m"
    return write_set(family, family.config(grid_sizes=(3, 6), colors=(3,)), n=3, seed=0, split="test", out=out)


def manifest(model, stimuli, **extra):
    data = {"run": "plan", "model": {"path": str(model), "dtype": "bfloat16"}, "stimuli": [{"set": str(stimuli)}],
            "taps": [{"tap": "vision", "layers": -1, "site": "pre_merger"},
                     {"tap": "llm", "layers": "all", "tokens": ["image", "last"]}],
            "generation": {"max_new_tokens": "from_stimulus"}, "batch_size": 4, "chunk_samples": 4, **extra}
    return parse_manifest(data)


@pytest.mark.parametrize("folder", sorted(PUBLISHED))
def test_config_only_folders_plan_without_weights(folder, g2m_512):
    path = CONFIGS / folder
    files = {p.name for p in path.iterdir()}
    assert files <= {"config.json", "preprocessor_config.json"}  # no weights, no tokenizer
    taps = [{"tap": "llm", "layers": "all", "tokens": ["image", "last", "answer"]}]
    m = manifest(path, g2m_512, taps=taps, attention={"layers": [-1], "queries": ["last"]})
    lm = meta_model(m)
    assert lm.processor is None and next(lm.model.parameters()).is_meta
    plan = estimate_manifest(m)
    assert not plan.exact_tokens and plan.n_samples == 6
    assert plan.params.total == pytest.approx(PUBLISHED[folder], rel=0.005)
    assert plan.first_image_tokens == (576 if folder.startswith("llava") else 324)
    assert plan.raw_bytes > 0 and plan.time.seconds > 0 and plan.chunk_files > 0
    text = plan.render()
    assert "no tokenizer" in text and text.splitlines()[-1].startswith(f"{len(plan.arrays)} arrays,")


def test_qwen_7b_plan_equals_a_hand_computation(g2m_512):
    """Qwen2.5-VL-7B over six 512 px G2M grids, every number from the config values by hand."""
    cfg = json.loads((QWEN7 / "config.json").read_text())
    vc = cfg["vision_config"]
    hidden, layers, ffn, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    # 512 px -> smart_resize to a multiple of 28 -> 504 px -> 36 x 36 patches -> 18 x 18 = 324 LLM tokens
    side = round(512 / 28) * 28
    patches = (side // 14) ** 2
    tokens = patches // 4
    assert (side, patches, tokens) == (504, 1296, 324)

    plan = estimate_manifest(manifest(QWEN7, g2m_512))
    n, chunk = 6, 4
    stored_rows = math.ceil(n / chunk) * chunk  # a dense array's last chunk is stored full-size
    arrays = {(a.name, a.kind): a for a in plan.arrays}
    assert len(arrays) == 1 + 2 * layers
    assert arrays[("vision.31.pre_merger", "image")].values_per_sample == patches * vc["hidden_size"]
    assert arrays[("llm.0.resid_post", "image")].values_per_sample == tokens * hidden == 1_161_216
    expected = 2 * stored_rows * (patches * vc["hidden_size"] + layers * (tokens * hidden + hidden))
    assert plan.raw_bytes == expected == 548_372_480
    assert plan.chunk_files == (1 + 2 * layers) * 2 and plan.files == (1 + 2 * layers) * 3

    # parameters: Qwen2 decoder layer (q/k/v with bias, o without, SwiGLU MLP, two RMSNorms) and lm_head
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * ffn + 2 * hidden
    assert plan.params.llm == layers * layer == 6_525_618_176
    assert plan.params.head == vocab * hidden
    # prompt tokens estimated: image tokens + text + template
    prompt = g2m.prompt(3, 3, 3)
    assert plan.first_seq == tokens + math.ceil(len(prompt) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS

    # decode: batches of 4 in set order; budgets min(4N²+20N+50, 2048) = 146 (N=3) and 314 (N=6):
    # batch [146,146,146,314] -> 314 steps, batch [314,314] -> 314 steps. A step costs the largest of
    # generate's overhead (1 ms x 28 layers by default) and reading the bf16 weights (14.1 GB at 3 TB/s)
    budgets = [g2m.max_new_tokens(3, 3)] * 3 + [g2m.max_new_tokens(6, 6)] * 3
    assert budgets[0] == 146 and budgets[-1] == 314
    hw = Hardware()
    steps = 314 + 314
    assert plan.time.decode_steps == steps and plan.time.decode_bound == "per-layer overhead"
    assert plan.time.decode_seconds == pytest.approx(steps * 28 * 1e-3) == 17.584
    read = estimate_manifest(manifest(QWEN7, g2m_512), hardware=Hardware(step_ms_per_layer=0)).time
    step = 2 * (plan.params.llm + plan.params.head) / (hw.gpu_bandwidth_gbs * 1e9)
    assert read.decode_bound == "weight reads" and read.decode_seconds == pytest.approx(steps * step)
    assert read.decode_seconds == pytest.approx(2.9602, abs=1e-3)
    seqs = [tokens + math.ceil(len(g2m.prompt(g, g, 3)) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS for g in (3, 3, 3, 6, 6, 6)]
    prefill = sum(2 * (plan.params.vision * patches + plan.params.projector * tokens + plan.params.llm * s
                       + plan.params.head) for s in seqs)
    assert plan.time.prefill_flops == pytest.approx(prefill)
    assert plan.time.write_seconds == pytest.approx((plan.raw_bytes + plan.lens_bytes) / (hw.disk_mbps * 1e6))
    # KV cache: keys + values x 28 layers x 4 KV heads x 128 dims x 2 bytes = 57,344 B per token, batch 4
    assert plan.kv_bytes == 2 * layers * 4 * 128 * 2 * max(s + b for s, b in zip(seqs, budgets, strict=False)) * 4
    assert plan.lens_bytes == 2 * (vocab * hidden + hidden)


@pytest.mark.parametrize(("batch_size", "answers"), [(1, [145] * 3 + [313] * 3), (4, [313] * 6)])
def test_answers_and_attention_rows_count_each_bound(g2m_512, batch_size, answers):
    """Budgets 146 (N=3) and 314 (N=6): a sample keeps at most its batch's largest budget - 1 answer
    tokens (generate runs the batch to its largest budget; the last token is never fed back)."""
    taps = [{"tap": "llm", "layers": [0], "tokens": ["answer"]}]
    plan = estimate_manifest(manifest(QWEN7, g2m_512, taps=taps, attention={"layers": [0], "queries": ["last", "answer"]},
                                  batch_size=batch_size))
    arrays = {(a.name, a.kind): a for a in plan.arrays}
    answer = arrays[("llm.0.resid_post", "answer")]
    assert answer.values == sum(answers) * 3584 and answer.ragged and answer.basis == "upper bound"
    seqs = [324 + math.ceil(len(g2m.prompt(g, g, 3)) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS for g in (3, 3, 3, 6, 6, 6)]
    assert arrays[("attn.0.probs", "last")].values == 28 * sum(seqs)
    assert arrays[("attn.0.probs", "answer")].values == 28 * sum(a * (s + a) for a, s in zip(answers, seqs, strict=False))
    # attention rows' working memory: one kept row (last; answers come one per decode step) x keys per
    # sample of a batch, 28 heads, 16 bytes a value, one layer at a time: rows x keys, no keys x keys term
    batch = min(batch_size, 6)
    assert plan.attention_bytes == 16 * batch * 28 * 1 * (max(seqs) + max(answers))
    assert "attention rows add up to" in plan.render()
    # no tokenizer: prompt lengths are estimates, and the plan says so
    assert arrays[("attn.0.probs", "last")].basis == arrays[("attn.0.probs", "answer")].basis == "estimate"
    assert not plan.exact_tokens and "prompt lengths estimated" in plan.render()


def test_the_sweep_planner_sees_what_the_generator_writes(g2m_512):
    rows = read_set(g2m_512).rows()
    planned = g2m_sweep(n=3, grid_sizes=(3, 6), colors=(3,))
    assert [(p.prompt, p.answer_budget, p.width) for p in planned] == [
        (r["prompts"]["transcribe"], r["params"]["max_new_tokens"], r["params"]["image_size"]) for r in rows]
    assert len(g2m_sweep()) == 6400 and set(MODELS.values()) == {CONFIGS / f for f in PUBLISHED}


@pytest.mark.parametrize("arch", quick(
    ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "internvl", "gemma3", "paligemma", "toy_counter"],
    "qwen2_vl", "qwen2_5_vl", "llava", "toy_counter"))
def test_config_geometry_equals_the_real_processor(arch, tiny_dir, tiny_lm):
    lm = tiny_lm(arch)
    settings, _ = image_processor_settings(tiny_dir(arch))
    w0, h0, _ = IMAGE_ALL[arch]
    sizes = [(w0, h0)] if arch == "toy_counter" else [(w0, h0), (200, 150), (37, 300)]
    for w, h in sizes:
        real = prepare_batch(lm, [noise_image(w, h, 0)], ["how many?"]).layouts[0].geometry
        got = lm.adapter.config_geometry(w, h, settings)
        assert (got.vision, got.projector_in, got.projector_out, got.llm, got.n_views,
                got.llm_tokens) == (real.vision, real.projector_in, real.projector_out, real.llm, real.n_views,
                                        real.llm_tokens), (arch, w, h)


def test_families_without_config_geometry_say_so(tiny_lm):
    with pytest.raises(ConfigGeometryError, match="processor files"):
        tiny_lm("llava_next").adapter.config_geometry(56, 56, {})


def test_a_processor_folder_still_plans_with_its_processor(tiny_dir, g2m_512):
    m = manifest(tiny_dir("qwen2_5_vl"), g2m_512, taps=[{"tap": "llm", "layers": [0], "tokens": ["image"]}])
    plan = estimate_manifest(m)
    assert plan.exact_tokens and "processor" in plan.token_source
    assert plan.first_image_tokens == 324  # the tiny processor keeps 512 px within its max_pixels


def test_cli_prints_json_with_hardware_assumptions(g2m_512, tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps({"run": "plan", "model": {"path": str(QWEN7), "dtype": "bfloat16"},
                                "stimuli": [{"set": str(g2m_512)}], "taps": [{"tap": "llm", "layers": [0]}],
                                "generation": {"max_new_tokens": 8}}))
    assert main([str(path), "--json", "--gpu-bandwidth-gbs", "1500"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["gpu_bandwidth_gbs"] == 1500 and out["time"]["decode_steps"] == 8
    assert out["params"]["total"] == pytest.approx(8.29e9, rel=0.005)


def test_estimate_run_takes_samples_without_images(g2m_512):
    m = manifest(QWEN7, g2m_512)
    plan = estimate_run(m, meta_model(m), [DrySample(512, 512, "x" * 40, 10)] * 3)
    assert plan.n_samples == 3 and plan.first_seq == 324 + 10 + TEMPLATE_TOKENS


def test_text_only_samples_plan_no_image_tokens(g2m_512):
    m = manifest(QWEN7, g2m_512, taps=[{"tap": "llm", "layers": [0], "tokens": ["image", "last"]}])
    samples = [DrySample(512, 512, "x" * 40, 10), DrySample(0, 0, "y" * 40, 10, ("a b c",))]
    plan = estimate_run(m, meta_model(m), samples)
    image = next(a for a in plan.arrays if a.kind == "image")
    assert image.ragged and image.values == 324 * 3584  # the text-only row holds no image tokens


@pytest.mark.slow  # the spatial run: a tiny Gemma3 built and run
def test_dry_run_figures_equal_what_the_run_stores(spatial_run):
    """Spatial prompts differ in length: the processor runs on every one, so prompt-sized figures are
    exact, and answer figures are the bound the run reaches when every answer runs to its cap."""
    from tiny_cases import SPATIAL_STEPS

    from store import Workspace

    manifest, data = spatial_run
    plan = estimate_manifest(manifest)
    assert plan.exact_tokens and "every distinct prompt (4)" in plan.token_source
    ws = Workspace.open(data, readonly=True)
    spans = ws.rows("SELECT last_prompt + 1, answer_count FROM v_samples WHERE run = 'w' ORDER BY array_row")
    prompts, answers = np.array(spans).T
    assert len(set(prompts)) > 1  # prompts of several lengths: one processed prompt would not do
    cap = SPATIAL_STEPS - 1
    stored = {(f"{a.tap}.{a.layer}.{a.site}", a.tokens): a for a in ws.arrays("w")}
    assert {(a.name, a.kind) for a in plan.arrays} == set(stored)
    for a in plan.arrays:
        info = stored[(a.name, a.kind)]
        got = ws.read("w", info.tap, info.layer, site=info.site, tokens=info.tokens)
        values = got.values.size if info.layout == "ragged" else got.size
        assert a.ragged == (info.layout == "ragged"), a.name
        if a.basis == "exact":
            assert a.values == values, (a.name, a.kind)
        else:  # what the run stores when every answer runs to its cap, from the run's own prompt lengths
            assert a.basis == "upper bound" and a.kind == "answer"
            width = got.values.shape[-1]  # heads (attention) or hidden size
            rows = sum(cap * (p + cap) for p in prompts) if a.name.startswith("attn") else cap * len(prompts)
            assert a.values == width * rows and values <= a.values, (a.name, a.kind)
            if (answers == cap).all():
                assert a.values == values
    assert {a.basis for a in plan.arrays} == {"exact", "upper bound"}
    assert "answer arrays an upper bound" in plan.render()


@pytest.mark.slow
def test_dry_run_bytes_equal_the_bytes_the_store_writes(spatial_run):
    """Bytes per value come from the store's dtype policy, not a constant of the planner: every exact
    array's bytes, and the logit lens's run tensors, equal what the store recorded writing."""
    from store import Workspace

    manifest, data = spatial_run
    plan = estimate_manifest(manifest)
    ws = Workspace.open(data, readonly=True)
    stored = {(f"{a.tap}.{a.layer}.{a.site}", a.tokens): a for a in ws.arrays("w")}
    assert {stored[(a.name, a.kind)].stored_dtype for a in plan.arrays} == {plan.stored_dtype}
    # 4 samples, chunk_samples 3: two chunks of 2 in the store and in the plan, no padded row
    assert plan.chunk_samples == 2 and {a.chunk_samples for a in stored.values()} == {2}
    assert {a.n_chunks for a in plan.arrays} == {2}
    for a in plan.arrays:
        if a.basis == "exact":
            assert a.bytes == stored[(a.name, a.kind)].bytes, (a.name, a.kind)
    tensors = ws.rows("SELECT sum(nbytes) FROM tensors WHERE run = 'w'")[0][0]
    assert plan.lens_bytes == tensors
