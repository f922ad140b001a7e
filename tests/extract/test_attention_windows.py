"""Attention rows of sliding-window layers, from prompts longer than the window.

A decode step of a sliding-window layer sees only the last ``window`` keys (the cache drops the
rest), so its weights must be filed under those keys' true positions. Every family whose language
model can have sliding-window layers is built tiny with a window of :data:`WINDOW` tokens (Gemma3's
recipe has one already) and every captured row, prompt pass and every decode step, is compared with
transformers' own ``output_attentions`` of one plain eager forward over prompt + generated tokens.
The other families' text models have no window: LLaVA 1.5, Idefics3 and SmolVLM run Llama, and
Qwen3-VL's text config has no sliding-window option.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from devices import allclose, close, cpu, load, numpy
from tiny_cases import IMAGE, SPATIAL_BATCH, SPATIAL_STEPS, noise_image

from extract.models import RaggedTokens, capture_generate, prepare_batch

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # PaliGemma's processor
WINDOW = 16
STEPS = 4
TOL = dict(rtol=1e-4, atol=1e-5)  # KV-cache decoding vs one full forward: float rounding only
STORED_TOL = dict(rtol=1e-3, atol=1e-5)  # stored values are float16
_QWEN2 = dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"])
# family -> text-config changes that give its language model sliding-window layers, as checkpoints of
# the family have or may have them; {}: the tiny recipe has them already
SLIDING: dict[str, dict] = {
    "gemma3": {},  # layer 0 slides (window 16), layer 1 is global
    "paligemma": dict(model_type="gemma2", sliding_window=WINDOW,  # PaliGemma 2
                      layer_types=["sliding_attention", "full_attention"]),
    "llava_next": dict(model_type="mistral", sliding_window=WINDOW),  # LLaVA-NeXT-Mistral: every layer slides
    "qwen2_vl": _QWEN2,  # Qwen2 text configs: use_sliding_window (off in the released checkpoints)
    "qwen2_5_vl": _QWEN2,
    "llava_onevision": _QWEN2,
    "internvl": _QWEN2,
}
PROMPTS = ["Count.", "How many stones are on the board? Answer with one number."]  # left padding matters


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """arch -> a tiny model whose text model has sliding-window layers, saved and loaded back."""
    from transformers import AutoConfig

    from extract.models.adapters import adapter_class, registry
    from extract.models.compat import patch_processors_without_torchvision
    from extract.models.tiny import init_model

    built: dict[str, object] = {}

    def get(arch: str):
        if arch not in built:
            patch_processors_without_torchvision()
            registry()
            model, processor = adapter_class(arch).build_tiny(0)
            if SLIDING[arch]:
                config = model.config
                text = {**config.text_config.to_dict(), **SLIDING[arch]}
                config.text_config = AutoConfig.for_model(text.pop("model_type"), **text)
                model = init_model(type(model), config, 0)
            out = tmp_path_factory.mktemp(f"windowed_{arch}")
            model.save_pretrained(out)
            processor.save_pretrained(out)
            eager = {"attn_implementation": "eager"} if arch == "paligemma" else {}  # Gemma2 has no sdpa
            built[arch] = load(out, **eager)
        return built[arch]

    return get


def sliding_layers(lm) -> list[int]:
    tc = lm.model.config.get_text_config()
    types = getattr(tc, "layer_types", None) or ["sliding_attention"] * tc.num_hidden_layers  # Mistral: all
    assert tc.sliding_window == WINDOW
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def reference_attentions(lm, batch, sequences: torch.Tensor) -> list[torch.Tensor]:
    """Plain eager forward over the prompt and the fed-back tokens: per layer [B, H, T, T] on the CPU."""
    fed = sequences[:, :-1].to(lm.device)
    n_new = fed.shape[1] - batch.seq_len
    inputs = dict(batch.inputs, input_ids=fed)
    # PaliGemma's token types mark the causal suffix (1) after its bidirectional prefix (0); Gemma3's
    # mark image tokens (1): generated tokens are suffix and text
    suffix = {"attention_mask", "token_type_ids"} if lm.model_type == "paligemma" else {"attention_mask"}
    for name, value in batch.inputs.items():  # per-token inputs (masks, token types) grow with the answer
        if name != "input_ids" and torch.is_tensor(value) and value.shape == (batch.size, batch.seq_len):
            fill = torch.ones if name in suffix else torch.zeros
            inputs[name] = torch.cat([value, fill(batch.size, n_new, dtype=value.dtype, device=value.device)], 1)
    previous = lm.model.config._attn_implementation
    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = lm.model(**inputs, output_attentions=True, use_cache=False)
    finally:
        lm.model.set_attn_implementation(previous)
    return [cpu(a) for a in out.attentions]


CASES = [(arch, None) for arch in sorted(SLIDING)] + [("gemma3", "static")]


@pytest.mark.parametrize(("arch", "cache"), CASES, ids=[a + (f"-{c}" if c else "") for a, c in CASES])
@pytest.mark.slow
def test_windowed_rows_equal_output_attentions(arch, cache, windowed):
    lm = windowed(arch)
    window_layers = sliding_layers(lm)
    assert window_layers
    width, height, _ = IMAGE[arch]
    images = [noise_image(width, height, 7), noise_image(width, height, 8)]
    batch = prepare_batch(lm, images, PROMPTS, padding_side="left")
    n_layers = lm.adapter.n_layers("attn")
    taps = [f"attn.{i}" for i in range(n_layers)]
    extra = {"cache_implementation": cache} if cache else {}
    # min_new_tokens keeps EOS away so that every row feeds back STEPS - 1 tokens; a random model may
    # pick an image token, which a plain forward over the sequence refuses (more tokens than features)
    gen = capture_generate(lm, batch, taps, tokens=("image", "last", "answer"), max_new_tokens=STEPS,
                           min_new_tokens=STEPS, suppress_tokens=sorted(lm.tokenizer.added_tokens_decoder), **extra)
    ref = reference_attentions(lm, batch, gen.sequences)
    T, n = batch.seq_len, STEPS - 1
    shortest = min(lay.length for lay in batch.layouts)
    assert shortest > WINDOW + 8, "the prompts must be longer than the window"
    for layer in range(n_layers):
        want = ref[layer]
        if layer in window_layers:  # the reference itself shows the window: nothing before it is attended
            assert not want[:, :, T + n - 1, : T + n - WINDOW].any() and want[:, :, T + n - 1, T + n - WINDOW].all()
        answer = gen[("attn", layer, "probs", "answer")]  # [B, H, steps, keys]
        assert answer.shape == (2, want.shape[1], n, T + n)
        for k in range(n):  # decode step k + 1: the query at T + k sees keys 0 .. T + k
            close(answer[:, :, k], want[:, :, T + k, : T + n], **TOL, msg=f"layer {layer} step {k + 1}")
        close(gen[("attn", layer, "probs", "last")], want[:, :, T - 1 : T, :T], **TOL, msg=f"layer {layer} last")
        image = gen[("attn", layer, "probs", "image")]
        for b, lay in enumerate(batch.layouts):
            mine = image.row(b).permute(1, 0, 2) if isinstance(image, RaggedTokens) else image[b]
            close(mine, want[b][:, torch.as_tensor(lay.image_positions), :T], **TOL, msg=f"layer {layer} image")


# ------------------------------------------------------------------------------------------ the stored rows

@pytest.mark.slow
def test_stored_windowed_rows_match_spans_and_transformers(spatial_run):
    """A tiny Gemma3 run over spatial scenes (conftest): one stored row per key of the sequence the spans
    describe, equal to output_attentions, on prompts of several lengths, all longer than the window."""
    from store import Workspace

    manifest, data = spatial_run
    model = manifest.model.path
    ws = Workspace.open(data, readonly=True)
    lm = load(model, attn_implementation="eager")  # as the run, which captured every layer eagerly
    assert sliding_layers(lm) == [0]
    rows = ws.rows("SELECT array_row, set_path, image, prompt, seq_len, last_prompt, answer_count FROM v_samples"
                   " WHERE run = 'w' ORDER BY array_row")
    assert min(r[5] for r in rows) + 1 > WINDOW and len({r[5] for r in rows}) > 1  # long prompts, unequal
    for layer in range(lm.adapter.n_layers("attn")):
        last = ws.read("w", "attn", layer, site="probs", tokens="last")
        answer = ws.read("w", "attn", layer, site="probs", tokens="answer")
        for i in range(0, len(rows), SPATIAL_BATCH):  # the run's batches
            pair = rows[i : i + SPATIAL_BATCH]
            batch = prepare_batch(lm, [f"{r[1]}/{r[2]}" for r in pair], [r[3] for r in pair], padding_side="left")
            with torch.no_grad():
                sequences = lm.model.generate(**batch.inputs, do_sample=False, max_new_tokens=SPATIAL_STEPS)
            want = numpy(reference_attentions(lm, batch, sequences)[layer])
            T = batch.seq_len
            for b, (row, _, _, _, seq_len, last_prompt, n_ans) in enumerate(pair):
                first = batch.layouts[b].first_position
                assert seq_len == last_prompt + 1 + n_ans
                assert last.lengths[row] == last_prompt + 1 and answer.lengths[row] == n_ans * seq_len
                keys = np.r_[first:T, T : T + n_ans]
                allclose(last[row], want[b, :, T - 1, first:T].T, **STORED_TOL)
                expected = want[b][:, T : T + n_ans][:, :, keys].transpose(1, 2, 0).reshape(-1, want.shape[1])
                allclose(answer[row], expected, **STORED_TOL, err_msg=f"layer {layer}, row {row}")
