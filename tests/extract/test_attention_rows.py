"""Row-selective attention capture (issue 42): the weights of the requested query rows only, computed
beside the model's own kernel, equal transformers' ``output_attentions`` of a plain eager forward, at
the prompt pass and at every decode step, for every family; and no requested layer builds the full
query x key map.

Grouped-query attention: every tiny recipe but the toy's has one key/value head for its two query heads,
and a LLaVA below has two for four (where a wrong head mapping would show). Soft-capping: PaliGemma 2
(Gemma2) with a cap small enough to matter (Gemma3 keeps the option in its config but never applies it).
Sliding windows: test_attention_windows.py, which runs the same path.
"""

from __future__ import annotations

import pytest
import torch
from devices import close, load
from test_attention_windows import reference_attentions
from tiny_cases import IMAGE_ALL, noise_image, quick

from extract.models import RaggedTokens, capture, capture_generate, compat, prepare_batch

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # PaliGemma's processor
STEPS = 3
TOL = dict(rtol=1e-4, atol=1e-5)  # KV-cache decoding vs one full forward: float rounding only
PROMPTS = ["Count.", "How many stones are on the board? Answer with one number."]  # left padding matters


def _generate(lm, arch: str, prompts: list[str] = PROMPTS, **extra):
    width, height, _ = IMAGE_ALL[arch]
    images = [noise_image(width, height, 3 + i) for i in range(len(prompts))]
    batch = prepare_batch(lm, images, prompts, padding_side="left")
    taps = [f"attn.{i}" for i in range(lm.adapter.n_layers("attn"))]
    # min_new_tokens keeps EOS away so that every row feeds back STEPS - 1 tokens; suppressing the added
    # tokens keeps image tokens out of the answer (a plain forward over the sequence refuses them)
    gen = capture_generate(lm, batch, taps, tokens=("image", "last", "answer"), max_new_tokens=STEPS,
                           min_new_tokens=STEPS, suppress_tokens=sorted(lm.tokenizer.added_tokens_decoder), **extra)
    return batch, gen


def _check_rows(lm, batch, gen, label: str) -> None:
    ref = reference_attentions(lm, batch, gen.sequences)
    T, n = batch.seq_len, STEPS - 1
    for layer in range(lm.adapter.n_layers("attn")):
        want = ref[layer]
        answer = gen[("attn", layer, "probs", "answer")]
        assert answer.shape == (batch.size, want.shape[1], n, T + n)
        for k in range(n):  # decode step k + 1: the query at T + k sees keys 0 .. T + k
            close(answer[:, :, k], want[:, :, T + k, : T + n], **TOL, msg=f"{label} layer {layer} step {k + 1}")
        close(gen[("attn", layer, "probs", "last")], want[:, :, T - 1 : T, :T], **TOL, msg=f"{label} layer {layer} last")
        image = gen[("attn", layer, "probs", "image")]
        for b, lay in enumerate(batch.layouts):
            mine = image.row(b).permute(1, 0, 2) if isinstance(image, RaggedTokens) else image[b]
            close(mine, want[b][:, torch.as_tensor(lay.image_positions), :T], **TOL, msg=f"{label} layer {layer} image")


@pytest.mark.parametrize("arch", quick(sorted(IMAGE_ALL), "qwen2_vl", "gemma3"))
def test_selected_rows_equal_output_attentions(arch, tiny_lm):
    """Every family: prompt rows (image, last) and every decode step's row equal eager output_attentions."""
    lm = tiny_lm(arch)
    tc = lm.model.config.get_text_config()
    if arch != "toy_counter":  # the tiny recipes map several query heads onto one key/value head
        assert tc.num_key_value_heads < tc.num_attention_heads
    batch, gen = _generate(lm, arch)
    _check_rows(lm, batch, gen, arch)


@pytest.mark.parametrize("arch", quick(sorted(IMAGE_ALL), "llava", "qwen3_vl"))
def test_rows_without_a_mask_equal_output_attentions(arch, tiny_lm):
    """One unpadded prompt: transformers skips the mask for sdpa's causal kernel (Gemma3 and PaliGemma keep
    theirs for the image blocks), and the selected rows get the causal rows built beside it."""
    lm = tiny_lm(arch)
    batch, gen = _generate(lm, arch, PROMPTS[1:])
    _check_rows(lm, batch, gen, f"{arch} unpadded")
    with compat.attention_rows("full"):
        _, full = _generate(lm, arch, PROMPTS[1:])
    for key in gen.keys():
        close(gen[key], full[key], **TOL, msg=f"{key.name} selected vs full")


def test_selected_rows_equal_full_rows(tiny_lm):
    """The selected path and the former full-eager path keep the same values, teacher-forced answers too."""
    lm = tiny_lm("llava")
    width, height, _ = IMAGE_ALL["llava"]
    batch = prepare_batch(lm, [noise_image(width, height, 5), noise_image(width, height, 6)], PROMPTS,
                          answers=["A grid.", "7"])
    taps = {"attn.0": ["image", "last", "answer"], "attn.1": ["last"]}
    selected = capture(lm, batch, taps)
    with compat.attention_rows("full"):
        full = capture(lm, batch, taps)
    assert selected.keys() == full.keys()
    for key in selected.keys():
        a, b = selected[key], full[key]
        if isinstance(a, RaggedTokens):
            assert isinstance(b, RaggedTokens) and (a.offsets == b.offsets).all()
            a, b = a.values, b.values
        close(a, b, **TOL, msg=key.name)


def test_requested_layers_never_build_the_full_map(tiny_lm, monkeypatch):
    """The eager function of a requested layer sees only the kept query rows: at the prompt the union of
    the requested kinds' positions over the batch, at a decode step its one query; never all T."""
    lm = tiny_lm("qwen2_vl")
    seen: list[tuple[int, int]] = []  # (query rows given to eager, query rows of the call)
    original = compat._eager_for

    def spying(module):
        eager = original(module)

        def wrapped(module, query, key, value, attention_mask, **kwargs):
            seen.append((query.shape[-2], attention_mask.shape[-2] if attention_mask is not None else -1))
            return eager(module, query, key, value, attention_mask, **kwargs)

        return wrapped

    monkeypatch.setattr(compat, "_eager_for", spying)
    batch, gen = _generate(lm, "qwen2_vl")
    T = batch.seq_len
    n_layers = lm.adapter.n_layers("attn")
    # left padding shifts each sample's image tokens: each sample's own rows, not their union over the batch
    per_sample = [{*map(int, lay.image_positions), int(lay.last_position)} for lay in batch.layouts]
    assert per_sample[0] != per_sample[1]
    prompt_rows = max(map(len, per_sample))
    assert prompt_rows < T
    # per layer: one prompt call with each sample's rows, then one call per fed-back decode step with one row
    assert seen[:n_layers] == [(prompt_rows, prompt_rows)] * n_layers
    assert seen[n_layers:] == [(1, 1)] * (n_layers * (STEPS - 1))
    assert gen[("attn", 0, "probs", "last")].shape[2] == 1


def test_prompt_only_taps_compute_nothing_at_decode_steps(tiny_lm, monkeypatch):
    lm = tiny_lm("llava")
    calls: list[int] = []
    original = compat._eager_for

    def spying(module):
        eager = original(module)

        def wrapped(module, query, *args, **kwargs):
            calls.append(query.shape[-2])
            return eager(module, query, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(compat, "_eager_for", spying)
    width, height, _ = IMAGE_ALL["llava"]
    batch = prepare_batch(lm, [noise_image(width, height, 1)], ["Count."])
    capture_generate(lm, batch, {"attn.0": ["last"]}, max_new_tokens=3, min_new_tokens=3)
    assert calls == [1]  # the prompt's last row, once; decode steps keep nothing of this tap


def _rebuilt(tiny_dir, tmp_path, arch: str, attn_implementation: str | None = None, **text_changes):
    """The tiny ``arch`` model with its text config changed, saved and loaded back."""
    from transformers import AutoConfig

    from extract.models.tiny import init_model

    base = load(tiny_dir(arch))
    config = base.model.config
    text = {**config.text_config.to_dict(), **text_changes}
    config.text_config = AutoConfig.for_model(text.pop("model_type"), **text)
    model = init_model(type(base.model), config, 0)
    model.save_pretrained(tmp_path)
    base.processor.save_pretrained(tmp_path)
    return load(tmp_path, **({"attn_implementation": attn_implementation} if attn_implementation else {}))


def test_grouped_query_rows_equal_output_attentions(tiny_dir, tmp_path):
    """Four query heads over two key/value heads: each query head's rows use its own group's keys."""
    lm = _rebuilt(tiny_dir, tmp_path, "llava", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tc = lm.model.config.get_text_config()
    assert (tc.num_attention_heads, tc.num_key_value_heads) == (4, 2)
    batch, gen = _generate(lm, "llava")
    _check_rows(lm, batch, gen, "llava 4 heads / 2 kv heads")


@pytest.mark.slow
def test_softcapped_rows_equal_output_attentions(tiny_dir, tmp_path):
    """PaliGemma 2 (a Gemma2 text model) with a small attention logit cap, so that the cap changes the
    weights: the module's own eager function caps the selected rows as it caps the full map. Gemma2 has
    no sdpa (sdpa cannot soft-cap), so its layers' outputs come from eager code, as without capture."""
    lm = _rebuilt(tiny_dir, tmp_path, "paligemma", model_type="gemma2", attn_logit_softcapping=0.05,
                  attn_implementation="eager")
    assert lm.model.config.get_text_config().attn_logit_softcapping == 0.05
    batch, gen = _generate(lm, "paligemma")
    _check_rows(lm, batch, gen, "paligemma 2 softcapped")


def test_full_path_is_noted_in_the_runs_provenance(tiny_lm, monkeypatch):
    """The selected path (every supported family) leaves the run's config as before; the full path, chosen
    or forced by a family listed in FULL_QUERY_EAGER, is recorded with why."""
    from types import SimpleNamespace

    from extract.run import attention_rows_note

    lm = tiny_lm("llava")
    with_attention = SimpleNamespace(attention=SimpleNamespace(layers="all", queries=["last"]), taps=[])
    assert attention_rows_note(lm, with_attention) is None
    assert attention_rows_note(lm, SimpleNamespace(attention=None, taps=[])) is None
    with compat.attention_rows("full"):
        assert attention_rows_note(lm, with_attention)["path"] == "full"
    module = type(lm.model.get_submodule(f"{lm.adapter.llm_layers}.0.{lm.adapter.llm_attention}")).__module__
    monkeypatch.setattr(compat, "FULL_QUERY_EAGER", frozenset({module}))
    note = attention_rows_note(lm, with_attention)
    assert note is not None and module in note["why"]
