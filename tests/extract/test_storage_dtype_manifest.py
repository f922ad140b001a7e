"""The manifest's ``storage`` keys, end to end: a tiny Qwen2-VL in bfloat16 whose token embeddings are
scaled by 1e7, so the residual stream at its text tokens holds values beyond float16's 65504 (as real
bf16 checkpoints do) while its image tokens stay in range.

Each choice is one run into one workspace: float16 (default) of the in-range array, bfloat16 (bit for
bit), float32 (exact), refuse (the message gives the manifest YAML), clip and store_float32. The
bfloat16 model's values widen to float32 exactly, so the float32 run is the reference of the others.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from devices import DEVICE

from extract.dry_run import DrySample, estimate_run, meta_model
from extract.manifest import ManifestError, StorageSpec, parse_manifest, store_policy
from extract.run import run_extraction
from stimuli import get_family
from stimuli.io import write_set
from store import DtypeOverflowError, Workspace
from store.dtypes import bf16_bits_to_float32

FP16_MAX = 65504.0
QWEN7 = Path(__file__).resolve().parents[2] / "manifests" / "configs" / "qwen2.5-vl-7b-instruct"


@pytest.fixture(scope="module")
def scaled_model(tiny_dir, tmp_path_factory):
    """The tiny Qwen2-VL with its token embeddings scaled by 1e7 (the lm_head is its own matrix)."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path_factory.mktemp("models") / "scaled-qwen2-vl"
    shutil.copytree(tiny_dir("qwen2_vl"), out)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * np.float32(1e7)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def g2m_set(tmp_path_factory):
    family = get_family("g2m")
    out = tmp_path_factory.mktemp("stimuli") / "g2m"
    return write_set(family, family.config(grid_sizes=(3,), colors=(3,), image_size=56), n=2, seed=0,
                     split="test", out=out)


def manifest_for(model, stimuli, run, storage=None, tokens=("image", "last")):
    data = {"run": run, "model": {"path": str(model), "dtype": "bfloat16", "device": DEVICE},
            "stimuli": [{"set": str(stimuli)}], "taps": [{"tap": "llm", "layers": [0], "tokens": list(tokens)}],
            "generation": {"max_new_tokens": 1}, "batch_size": 2, "chunk_samples": 2, "logit_lens": True}
    if storage:
        data["storage"] = storage
    return parse_manifest(data)


@pytest.fixture(scope="module")
def runs(scaled_model, g2m_set, tmp_path_factory):
    """The workspace after one run per storage choice, and the refusal of the default run."""
    data = tmp_path_factory.mktemp("ws") / "data"
    for run, storage in (("f32", {"dtype": "float32"}), ("bf16", {"dtype": "bfloat16"}),
                         ("clip", {"overflow": "clip"}), ("wide", {"overflow": "store_float32"})):
        run_extraction(manifest_for(scaled_model, g2m_set, run, storage), workspace=data, progress=False)
    run_extraction(manifest_for(scaled_model, g2m_set, "f16", tokens=("image",)), workspace=data, progress=False)
    with pytest.raises(DtypeOverflowError) as refused:
        run_extraction(manifest_for(scaled_model, g2m_set, "refuse"), workspace=data, progress=False)
    return Workspace.open(data, readonly=True), str(refused.value)


def _read(ws, run, kind):
    return ws.read(run, "llm", 0, tokens=kind), ws.array_info(run, "llm", 0, tokens=kind).stored_dtype


def test_the_model_overflows_float16_at_its_text_tokens_only(runs):
    ws, _ = runs
    last, _ = _read(ws, "f32", "last")
    image, _ = _read(ws, "f32", "image")
    assert np.abs(last).max() > FP16_MAX and np.abs(image).max() < FP16_MAX


def test_float16_is_the_default(runs):
    ws, _ = runs
    got, stored = _read(ws, "f16", "image")
    assert stored == "float16" and got.dtype == np.float16
    assert ws.rows("SELECT bf16_policy, overflow_policy FROM runs WHERE run = 'f16'") == [("fp16", "error")]
    # bfloat16 values in float16's range cast exactly (to the same bits as numpy's cast)
    assert np.array_equal(got, _read(ws, "f32", "image")[0].astype(np.float16))


def test_float32_stores_every_value_exactly(runs):
    ws, _ = runs
    for kind in ("image", "last"):
        got, stored = _read(ws, "f32", kind)
        assert stored == "float32" and got.dtype == np.float32 and np.isfinite(got).all()
        assert ws.zarr_group()[f"f32/llm/0/resid_post/{kind}"].dtype == np.float32
    # run tensors are float32 too (the logit lens)
    assert {r[0] for r in ws.rows("SELECT stored_dtype FROM tensors WHERE run = 'f32'")} == {"float32"}


def test_bfloat16_stores_a_bfloat16_model_bit_for_bit(runs):
    ws, _ = runs
    for kind in ("image", "last"):
        bits = ws.read("bf16", "llm", 0, tokens=kind, bf16_as="bits")
        assert bits.dtype == np.uint16 and ws.array_info("bf16", "llm", 0, tokens=kind).stored_dtype == "bfloat16"
        reference = _read(ws, "f32", kind)[0]  # the same bf16 values, widened exactly
        assert np.array_equal(bits, (reference.view(np.uint32) >> 16).astype(np.uint16))
        assert np.array_equal(ws.read("bf16", "llm", 0, tokens=kind), reference)
        assert np.array_equal(bf16_bits_to_float32(bits), reference)
    assert ws.rows("SELECT bf16_policy FROM runs WHERE run = 'bf16'") == [("bits",)]


def test_refuse_names_the_manifest_keys_that_fix_it(runs):
    _, message = runs
    assert "refuse:llm/0/resid_post/last" in message and "exceed the float16 range" in message
    for yaml in ("storage: {dtype: bfloat16}", "storage: {dtype: float32}", "storage: {overflow: store_float32}",
                 "storage: {overflow: clip}"):
        assert yaml in message
    assert "python -m store drop-run refuse" in message
    assert "ArraySpec(" not in message  # the store's own keys are not what a manifest user sets


def test_clip_saturates_and_counts(runs):
    ws, _ = runs
    got, stored = _read(ws, "clip", "last")
    reference = _read(ws, "f32", "last")[0]
    assert stored == "float16" and np.abs(got).max() == FP16_MAX
    assert np.array_equal(got, np.clip(reference, -FP16_MAX, FP16_MAX).astype(np.float16))
    clipped = ws.rows("SELECT sum(n_clipped) FROM chunks WHERE run = 'clip' AND zarr_path LIKE '%/last'")[0][0]
    assert clipped == int((np.abs(reference) > FP16_MAX).sum()) > 0
    assert ws.rows("SELECT overflow_policy FROM runs WHERE run = 'clip'") == [("clip",)]


def test_store_float32_widens_only_the_array_that_overflows(runs):
    ws, _ = runs
    last, last_stored = _read(ws, "wide", "last")
    image, image_stored = _read(ws, "wide", "image")
    assert (last_stored, image_stored) == ("float32", "float16")
    assert np.array_equal(last, _read(ws, "f32", "last")[0])
    assert np.array_equal(image, _read(ws, "f32", "image")[0].astype(np.float16))
    assert ws.zarr_group()["wide/llm/0/resid_post/last"].attrs["stored_dtype"] == "float32"
    assert ws.rows("SELECT status FROM runs WHERE run = 'wide'") == [("finished",)]
    assert ws.verify().ok


def test_a_resume_refuses_another_storage_dtype(runs, scaled_model, g2m_set):
    ws, _ = runs
    with pytest.raises(ManifestError, match=r"run f32 was stored with storage: \{dtype: float32, overflow: refuse\};"
                                            r" this manifest asks for storage: \{dtype: bfloat16.*set storage: \{dtype: float32"):
        run_extraction(manifest_for(scaled_model, g2m_set, "f32", {"dtype": "bfloat16"}), workspace=ws.path,
                       progress=False)
    # the same storage resumes (nothing left to compute)
    summary = run_extraction(manifest_for(scaled_model, g2m_set, "f32", {"dtype": "float32"}), workspace=ws.path,
                             progress=False)
    assert summary.computed == 0


def test_storage_keys_are_validated_before_anything_loads(g2m_set):
    def parse(model_dtype="bfloat16", **extra):
        return parse_manifest({"run": "r", "model": {"path": "x", "dtype": model_dtype}, "stimuli": [{"set": str(g2m_set)}],
                               "taps": [{"tap": "llm", "layers": [0]}], **extra})

    assert parse().storage == StorageSpec(dtype="float16", overflow="refuse")
    assert store_policy(parse(storage={"dtype": "bfloat16"}).storage) == ("bits", "error")
    assert store_policy(parse(storage={"overflow": "clip"}).storage) == ("fp16", "clip")
    assert store_policy(parse(storage={"overflow": "store_float32"}).storage) == ("fp16", "error")
    with pytest.raises(ManifestError, match="storage.dtype"):
        parse(storage={"dtype": "float64"})
    with pytest.raises(ManifestError, match="storage.overflow"):
        parse(storage={"overflow": "saturate"})
    with pytest.raises(ManifestError, match="model.dtype is float32, whose values bfloat16 would round"):
        parse("float32", storage={"dtype": "bfloat16"})
    with pytest.raises(ManifestError, match="overflow: clip is what float16 storage does"):
        parse(storage={"dtype": "float32", "overflow": "clip"})
    with pytest.raises(ManifestError, match="a sharded run cannot"):
        parse(storage={"overflow": "store_float32"}, shard="0/2")


@pytest.mark.parametrize(("storage", "per_value"), [({}, 2), ({"dtype": "bfloat16"}, 2), ({"dtype": "float32"}, 4)])
def test_dry_run_bytes_follow_the_storage_dtype(g2m_set, storage, per_value):
    data = {"run": "plan", "model": {"path": str(QWEN7), "dtype": "bfloat16"}, "stimuli": [{"set": str(g2m_set)}],
            "taps": [{"tap": "llm", "layers": [0, 1], "tokens": ["image", "last"]}], "batch_size": 2, "chunk_samples": 2}
    m = parse_manifest({**data, **({"storage": storage} if storage else {})})
    plan = estimate_run(m, meta_model(m), [DrySample(448, 448, "x" * 40, 4)] * 2)
    assert plan.stored_dtype == (storage.get("dtype") or "float16")
    assert all(a.bytes == a.n_chunks * 2 * a.values_per_sample * per_value for a in plan.arrays if not a.ragged)
    assert plan.lens_bytes == plan.lens_values * per_value
