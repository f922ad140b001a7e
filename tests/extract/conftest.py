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
