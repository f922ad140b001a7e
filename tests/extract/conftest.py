"""Tiny random-init models of every family, built once per test session and loaded back from disk."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never touch the network, even by accident
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """arch -> folder of a freshly built tiny model (built on first use)."""
    from transformers.utils import logging

    from extract.models import tiny

    logging.disable_progress_bar()  # loading bars of tiny models are noise in the test log
    logging.set_verbosity_error()

    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, object] = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = tiny.build(arch, root / arch, seed=0)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_lm(tiny_dir):
    """arch -> LoadedModel read back through extract.models.load_model (loaded on first use), on the
    test device and dtype (``AGNOSIA_TEST_DEVICE`` / ``AGNOSIA_TEST_DTYPE``, see devices.py)."""
    from devices import load

    loaded: dict[str, object] = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = load(tiny_dir(arch))
        return loaded[arch]

    return get


@pytest.fixture(scope="session")
def spatial_run(tiny_dir, tmp_path_factory):
    """(manifest, workspace folder) of a finished tiny Gemma3 run over 4 spatial scenes at 112 px: prompts
    of several lengths, all longer than the model's 16-token sliding window; attention of every layer."""
    from devices import model_config
    from tiny_cases import SPATIAL_BATCH, SPATIAL_STEPS

    from extract.manifest import parse_manifest
    from extract.run import run_extraction
    from stimuli import get_family
    from stimuli.io import write_set

    family = get_family("spatial")
    stimuli = write_set(family, family.config(image_size=112), n=4, seed=0, split="test",
                        out=tmp_path_factory.mktemp("stimuli") / "spatial")
    manifest = parse_manifest({
        "run": "w", "model": {"path": str(tiny_dir("gemma3")), **model_config()},
        "stimuli": [{"set": str(stimuli)}],
        "taps": [{"tap": "vision", "layers": [-1]},
                 {"tap": "llm", "layers": [0], "tokens": ["image", "last", "answer"]}],
        "attention": {"layers": "all", "queries": ["last", "answer"]},
        # chunk_samples 3 for 4 samples: the store evens it to two chunks of 2 (not 3 + 1 stored as 3),
        # and the dry run must plan the same (test_dry_run_bytes_equal_the_bytes_the_store_writes)
        "generation": {"max_new_tokens": SPATIAL_STEPS}, "batch_size": SPATIAL_BATCH, "chunk_samples": 3,
    })
    data = tmp_path_factory.mktemp("ws") / "data"
    run_extraction(manifest, workspace=data, progress=False)
    return manifest, data
