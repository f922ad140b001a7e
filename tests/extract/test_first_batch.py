"""A new workspace's first batch gives the arrays' shapes: no forward of their own (issue 19).

Every other run (a resume, a second run in a workspace, a shard) prepares one teacher-forced
sample for the shapes first (extract/run.py ``array_specs``). Both must declare the same arrays
and store the same values.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from devices import model_config
from PIL import Image

import extract.run as run
from extract.manifest import parse_manifest
from extract.models import InputError
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

# Every token kind of an LLM layer and attention: a prompt-only run produces no answer rows, so
# their arrays take their width from the same hook point's other kinds.
TAPS = [{"tap": "vision", "layers": [-1]}, {"tap": "llm", "layers": [0, -1], "tokens": ["image", "last", "answer"]}]


@pytest.fixture(scope="module")
def g2m_set(tmp_path_factory):
    family = get_family("g2m")
    return write_set(family, family.config(grid_sizes=(3,), colors=(3,), image_size=112), n=5, seed=0,
                     split="test", out=tmp_path_factory.mktemp("stimuli") / "g2m")


def _manifest(model, stimuli, new_tokens: int, run_id: str = "r"):
    return parse_manifest({
        "run": run_id, "model": {"path": str(model), **model_config()}, "stimuli": [{"set": str(stimuli)}],
        "taps": TAPS, "attention": {"layers": [0], "queries": ["last", "answer"]},
        "generation": {"max_new_tokens": new_tokens}, "batch_size": 2, "chunk_samples": 2})


def _count_prepares(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = run.prepare_batch

    def counting(lm, images, *args, **kwargs):
        calls.append(len(images))
        return real(lm, images, *args, **kwargs)

    monkeypatch.setattr(run, "prepare_batch", counting)
    return calls


def _arrays(ws: Workspace, run_id: str) -> dict[tuple, tuple]:
    return {row[:4]: row[4:] for row in ws.rows(
        "SELECT tap, layer, site, tokens, layout, shape, dims, module, dtype, stored_dtype FROM activations"
        " WHERE run = ? ORDER BY ALL", [run_id])}


@pytest.mark.slow
@pytest.mark.parametrize("new_tokens", [1, 3], ids=["prompt-only", "generate"])
def test_a_new_workspace_declares_the_same_arrays_from_its_first_batch(tiny_dir, g2m_set, tmp_path, monkeypatch,
                                                                        new_tokens):
    """Asserts: into a new workspace, one processor call per batch (3 for 5 samples in batches of 2)
    and none for the shapes; into a workspace that exists, one more (the shapes forward); both
    declare the same arrays (shapes, dims, modules) and store the same values, answer rows included."""
    model = tiny_dir("qwen2_vl")
    calls = _count_prepares(monkeypatch)
    run.run_extraction(_manifest(model, g2m_set, new_tokens), workspace=tmp_path / "new", progress=False)
    assert calls == [2, 2, 1]

    Workspace.open(tmp_path / "old")  # the manifest exists: this run takes the shapes forward
    calls.clear()
    run.run_extraction(_manifest(model, g2m_set, new_tokens), workspace=tmp_path / "old", progress=False)
    assert calls == [1, 2, 2, 1]

    new, old = Workspace.open(tmp_path / "new", readonly=True), Workspace.open(tmp_path / "old", readonly=True)
    arrays = _arrays(new, "r")
    assert arrays == _arrays(old, "r") and len(arrays) == 9
    answers = ("llm", 0, "resid_post", "answer")
    assert arrays[answers][1] == [5, -1, arrays[("llm", 0, "resid_post", "last")][1][-1]]  # [samples, rows, dim]
    for tap, layer, site, tokens in arrays:
        a = new.read("r", tap, layer, site=site, tokens=tokens)
        b = old.read("r", tap, layer, site=site, tokens=tokens)
        got = (a.values, b.values) if hasattr(a, "values") else (a, b)
        assert np.array_equal(*got), (tap, layer, site, tokens)
    rows = new.rows("SELECT sum(answer_count) FROM samples WHERE run = 'r'")[0][0]
    assert (rows == 0) == (new_tokens == 1)


TOY_MODEL = Path(__file__).resolve().parents[2] / "lab" / "checkpoints" / "toy-counter"  # reads 88 x 88 px only


@pytest.mark.slow
def test_a_first_image_the_processor_refuses_is_named_and_leaves_no_new_workspace(tmp_path):
    """Asserts: the first batch, prepared before the workspace exists, names the image, its
    stimulus and its size when the processor refuses it, and no workspace is left behind."""
    made = subprocess.run([sys.executable, "-m", "stimuli", "go", "--out", str(tmp_path / "go"), "--preset", "small",
                           "--variation", "mild", "--counts", "3,4,5", "--n", "1", "--seed", "1"],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    image = sorted((tmp_path / "go").rglob("*.png"))[0]
    Image.new("RGB", (120, 100), "white").save(image)
    manifest = parse_manifest({
        "run": "toy", "model": {"path": str(TOY_MODEL), "dtype": "float32", "device": "cpu"},
        "stimuli": [{"set": str(tmp_path / "go"), "task": "multimodal_num"}], "taps": [{"tap": "llm", "layers": [-1]}],
        "generation": {"max_new_tokens": 1}, "batch_size": 2, "chunk_samples": 2})
    with pytest.raises(InputError, match=r"\(120x100 px\).*88x88") as err:
        run.run_extraction(manifest, workspace=tmp_path / "ws", progress=False)
    assert image.name in str(err.value)
    assert not (tmp_path / "ws").exists()
