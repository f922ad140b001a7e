"""Every family, as a tiny random model loaded back from disk: captured taps equal transformers' own
outputs for the same inputs, and the image tokens of every tap are in raster order of the image."""

from __future__ import annotations

import inspect

import pytest
import torch
from devices import close, cpu
from tiny_cases import ARCHS, IMAGE, IMAGE_ALL, noise_image, quick

from extract.models import RaggedTokens, capture, hook_points, prepare_batch, readout

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # PaliGemma's processor
# fp16-level agreement; fp32 tiny models agree far better. In bf16 (AGNOSIA_TEST_DTYPE) `close` uses
# its magnitude-relative bound (devices.py): attention rows come from eager code where the reference's
# outputs come from sdpa, and a capture's masks differ from a plain sdpa forward's in form.
TOL = dict(rtol=1e-3, atol=1e-3)
KINDS = ("image", "last", "answer")
CLS_TOKENS = {"llava": 1, "llava_next": 1, "internvl": 1}  # CLIP / InternViT prepend a CLS token


def row(value, b: int, attention: bool = False) -> torch.Tensor:
    """Sample b of a capture: [tokens, dim], or [heads, query rows, keys] for attention."""
    if isinstance(value, RaggedTokens):
        r = value.row(b)
        return r.permute(1, 0, 2) if attention else r
    return value[b]


def image_token_id(lm) -> int:
    cfg = lm.model.config
    return cfg.image_token_id if getattr(cfg, "image_token_id", None) is not None else cfg.image_token_index


def reference_vision(arch: str, lm, batch, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample raster tokens from a raw vision-tower hidden state, derived independently of the adapter."""
    if arch.startswith("qwen"):
        # packed [n_patches, C]: per image 2x2-block-major, as the processor's patchify writes it
        vc = lm.model.config.vision_config
        if arch == "qwen2_5_vl":
            from transformers.vision_utils import get_vision_window_index

            window, _ = get_vision_window_index(
                batch.inputs["image_grid_thw"], vc.spatial_merge_size, vc.window_size, vc.patch_size
            )
            order = torch.argsort(torch.as_tensor(window)).cpu()
            hidden = hidden.view(-1, 4, hidden.shape[-1])[order].reshape(hidden.shape)
        out, start = [], 0
        for _, h, w in batch.inputs["image_grid_thw"].tolist():
            x = hidden[start : start + h * w]
            start += h * w
            # G2M's reorder: view(H/2, W/2, 2, 2, D).permute(0, 2, 1, 3, 4) -> raster
            out.append(x.view(h // 2, w // 2, 2, 2, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1))
        return out
    n_rows = [lay.geometry.n_views for lay in batch.layouts]
    assert sum(n_rows) == hidden.shape[0]
    parts = hidden[:, CLS_TOKENS.get(arch, 0) :].split(n_rows)
    return [p.reshape(-1, p.shape[-1]) for p in parts]


# make test-fast: Qwen2-VL (packed tokens, merger) and LLaVA (CLIP with CLS); make test runs every family
@pytest.mark.parametrize("arch", quick(ARCHS, "qwen2_vl", "llava"))
def test_taps_equal_transformers_outputs(arch, tiny_lm):
    lm = tiny_lm(arch)
    width, height, _ = IMAGE[arch]
    images = [noise_image(width, height, 1), noise_image(width, height, 2)]
    # different prompt and answer lengths: padding and ragged answers are exercised
    batch = prepare_batch(lm, images, ["Describe.", "How many red cells are there?"], answers=["A grid.", "7"])
    n_llm = lm.adapter.n_layers("llm")
    taps = ["vision.0", "vision.-1", "projector.0.out", "llm.0", f"llm.{n_llm - 1}", "attn.0", "attn.-1", "logits"]
    res = capture(lm, batch, taps, tokens=KINDS)
    last = n_llm - 1

    with torch.no_grad():
        out = lm.model(**batch.inputs, output_hidden_states=True)
        get = lm.model.model.get_image_features
        wanted = inspect.signature(get).parameters
        vis = get(**{k: v for k, v in batch.inputs.items() if k in wanted}, output_hidden_states=True).hidden_states
        prev = lm.model.config._attn_implementation
        lm.model.set_attn_implementation("eager")
        try:
            att = lm.model(**batch.inputs, output_attentions=True).attentions
        finally:
            lm.model.set_attn_implementation(prev)
    hs = [cpu(h) for h in out.hidden_states]
    vis = [cpu(h) for h in vis]
    att = [cpu(a) for a in att]
    logits = cpu(out.logits)
    lens = readout(lm)
    ids = cpu(batch.inputs["input_ids"])
    for b, lay in enumerate(batch.layouts):
        # image tokens are exactly where input_ids hold the image token; answers follow the prompt
        assert lay.image_positions.tolist() == torch.nonzero(ids[b] == image_token_id(lm)).flatten().tolist()
        assert lay.answer_positions[0] == lay.last_position + 1
        assert ids[b, lay.answer_positions].tolist() == lm.tokenizer(batch.answers[b], add_special_tokens=False)["input_ids"]
        for kind in KINDS:
            pos = torch.as_tensor(lay.positions(kind))
            # hidden_states[i + 1] is layer i's output ...
            close(row(res[("llm", 0, "resid_post", kind)], b), hs[1][b, pos], **TOL)
            # ... except the last, which transformers returns after the final norm
            final = row(res[("llm", last, "resid_post", kind)], b)
            close(lens.norm(final), hs[-1][b, pos], **TOL)
            close(row(res[("logits", 0, "out", kind)], b), logits[b, pos], **TOL)
            close(lens.logits(final), logits[b, pos], **TOL)
            for layer in (0, last):
                mine = row(res[("attn", layer, "probs", kind)], b, attention=True)
                close(mine, att[layer][b][:, pos], **TOL)
        # the LLM receives the projector output at the image positions (tiling: via llm_source)
        proj = row(res[("projector", 0, "out", "image")], b)
        received = hs[0][b, torch.as_tensor(lay.image_positions)]
        source = lay.geometry.llm_source
        if source is not None:
            keep = torch.as_tensor(source >= 0)
            received, proj = received[keep], proj[torch.as_tensor(source[source >= 0])]
        close(proj, received, **TOL)
    # vision blocks: the tower's own hidden states, CLS dropped, raster-ordered
    for layer in (0, lm.adapter.n_layers("vision") - 1):
        ref = reference_vision(arch, lm, batch, vis[layer + 1])
        for b in range(batch.size):
            close(row(res[("vision", layer, "resid_post", "image")], b), ref[b], **TOL)
    assert res.module_paths[("llm", 0, "resid_post", "last")] == f"{lm.adapter.llm_layers}.0"
    assert not res.nonfinite
    points = hook_points(lm)
    assert f"vision.{lm.adapter.n_layers('vision') - 1}.resid_post" in points and "logits.0.out" in points
    for path in points.values():
        lm.model.get_submodule(path)  # every advertised hook point exists


def _zero_attention(lm) -> list:
    """Make every block token-wise: a pixel patch can then only change its own tokens."""

    def zero(module, args, kwargs, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    ad, handles = lm.adapter, []
    for tower, attn in ((ad.vision_layers, ad.vision_attention), (ad.llm_layers, ad.llm_attention)):
        for i in range(len(lm.model.get_submodule(tower))):
            module = lm.model.get_submodule(f"{tower}.{i}.{attn}")
            handles.append(module.register_forward_hook(zero, with_kwargs=True))
    return handles


# make test-fast: Qwen2.5-VL, whose window order the adapter undoes (the order most easily broken)
@pytest.mark.parametrize("arch", quick(sorted(IMAGE_ALL), "qwen2_5_vl"))
def test_image_tokens_are_raster_ordered(arch, tiny_lm):
    """Invert one pixel patch (r, c): exactly the tokens of grid cell (r, c) of every tap change."""
    import numpy as np
    from PIL import Image

    lm = tiny_lm(arch)
    width, height, patch = IMAGE_ALL[arch]
    rows, cols = height // patch, width // patch
    taps = ["vision.0", "vision.-1", "projector.0.in", "projector.0.out", "llm.0"]
    if "pre_merger" in lm.adapter.sites("vision"):
        taps.append("vision.-1.pre_merger")
    base = np.asarray(noise_image(width, height, 3))

    def run(pixels):
        batch = prepare_batch(lm, [Image.fromarray(pixels)], ["Look."])
        return batch.layouts[0], capture(lm, batch, taps, tokens=("image",))

    handles = _zero_attention(lm)
    try:
        layout, ref = run(base)
        for r, c in [(0, 0), (0, 1), (1, 0), (rows - 1, cols - 1), (rows // 2, cols - 2)]:
            pixels = base.copy()
            pixels[r * patch : (r + 1) * patch, c * patch : (c + 1) * patch] ^= 0xFF
            _, res = run(pixels)
            for key in ref.keys():
                changed = (res[key][0] - ref[key][0]).abs().amax(-1) > 1e-6
                grid = layout.grid(key.tap, key.site)
                # each segment (view) covers the whole image at its own resolution
                expected = {s.index(r * s.rows // rows, c * s.cols // cols) for s in grid}
                assert set(torch.nonzero(changed).flatten().tolist()) == expected, (key.name, (r, c))
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", quick(["qwen2_vl", "qwen3_vl", "qwen2_5_vl"], "qwen2_5_vl"))
def test_pre_merger_is_g2m_vision_tap(arch, tiny_lm):
    """G2M: merger input -> merger pre-norm -> 2x2 block-major to raster. Qwen2.5's merger input is in
    window order, so there the G2M reorder alone is *not* raster (the adapter undoes the windows)."""
    lm = tiny_lm(arch)
    width, height, _ = IMAGE[arch]
    batch = prepare_batch(lm, [noise_image(width, height, 4)], ["Grid?"])
    seen = []
    merger = lm.model.get_submodule(lm.adapter.projector)
    handle = merger.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        res = capture(lm, batch, ["vision.-1.pre_merger"], tokens=("image",))
    finally:
        handle.remove()
    _, h, w = batch.inputs["image_grid_thw"][0].tolist()
    norm = lm.model.get_submodule(lm.adapter.merger_norm)
    with torch.no_grad():
        g2m = cpu(norm(seen[0]).view(h // 2, w // 2, 2, 2, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1))
    mine = res[("vision", 1, "pre_merger", "image")][0]
    if arch == "qwen2_5_vl":
        assert not torch.allclose(mine, g2m)
        close(mine.sort(0).values, g2m.sort(0).values)  # same tokens, other order
    else:
        close(mine, g2m)


@pytest.mark.slow  # the only fast-loop user of a tiny PaliGemma: its build is most of the time
def test_teacher_forced_paligemma_answer_is_causal_suffix(tiny_lm):
    """PaliGemma: appended answers must be the causal suffix, as the processor's own ``suffix`` makes them."""
    lm = tiny_lm("paligemma")
    image = noise_image(112, 112, 5)
    batch = prepare_batch(lm, [image], ["caption en"], answers=["a cat"])
    res = capture(lm, batch, ["llm.0"], tokens=("answer",))
    ref_inputs = lm.processor(text=["<image>caption en"], images=[image], suffix=["a cat"], return_tensors="pt")
    ref_inputs.pop("labels")
    ref_inputs = {k: v.to(lm.device, lm.dtype) if v.is_floating_point() else v.to(lm.device)
                  for k, v in ref_inputs.items()}
    with torch.no_grad():
        hs = [cpu(h) for h in lm.model(**ref_inputs, output_hidden_states=True).hidden_states]
    pos = torch.as_tensor(batch.layouts[0].answer_positions)
    # the processor's suffix adds <eos> after the answer; the answer tokens themselves must agree
    close(res[("llm", 0, "resid_post", "answer")][0], hs[1][0, pos])
