"""A stimulus family added as one module plus one registration line runs through a real extraction
(tiny Qwen2-VL): its answers are scored by its own scorer, and its truth reaches probe targets
from the store. The non-model parts of this path are in tests/stimuli/test_new_family.py."""

from __future__ import annotations

import json
import sys
import textwrap

from devices import model_config

import stimuli as stimuli
from extract.manifest import parse_manifest
from extract.run import run_extraction
from probes.targets import SampleInfo, get_target, typed_truth
from stimuli.cli import main as stimuli_cli
from store import Workspace

SHADE = '''
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from stimuli.base import Family, Score, Stimulus, Truth, option


@dataclass(frozen=True)
class Config:
    size: int = option(56, "image side in pixels")


@dataclass(frozen=True)
class ShadeTruth(Truth):
    shade: int


def generate(config, n, seed, split):
    for i in range(n):
        shade = 40 * i % 256
        image = Image.fromarray(np.full((config.size, config.size, 3), shade, np.uint8))
        yield Stimulus(id=f"shade_{i:02d}", family="shade", split=split, seed=seed, image=image,
                       prompts={"words": "Describe the image."}, answers={"words": "3"},
                       truth={"shade": shade}, params={"size": config.size})


def score(task, text, answer, truth):
    # Distinctive on purpose: words counted, characters recorded, so the test can tell it ran.
    words = len(text.split())
    return Score(prediction=words, parse_ok=True, correct=words == int(answer), score=float(words == int(answer)),
                 metrics={"chars": len(text), "shade": truth.shade})


FAMILY = Family(name="shade", description="flat grey squares", config=Config, generate=generate,
                truth=ShadeTruth, score=score, small_set_n=3)
'''


def test_a_one_module_family_runs_through_an_extraction(tiny_dir, tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "shade_family.py").write_text(textwrap.dedent(SHADE))
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.setattr(stimuli, "FAMILIES", stimuli.FAMILIES.copy())
    monkeypatch.delitem(sys.modules, "shade_family", raising=False)
    stimuli.register_family("shade", "shade_family")

    assert stimuli_cli(["shade", "--out", str(tmp_path / "shade")]) == 0
    manifest = parse_manifest({
        "run": "r", "model": {"path": str(tiny_dir("qwen2_vl")), **model_config()},
        "stimuli": [{"set": str(tmp_path / "shade")}],
        "taps": [{"tap": "llm", "layers": [-1], "tokens": ["last"]}],
        "generation": {"max_new_tokens": 4}, "batch_size": 3,
    })
    summary = run_extraction(manifest, workspace=tmp_path / "data", progress=False)
    assert summary.samples == 3

    ws = Workspace.open(tmp_path / "data", readonly=True)
    gens = ws.rows("SELECT stimulus, text, prediction, metrics FROM generations ORDER BY stimulus")
    assert [g[0] for g in gens] == ["shade/shade_00", "shade/shade_01", "shade/shade_02"]
    for _, text, prediction, metrics in gens:
        assert json.loads(prediction) == len(text.split())
        assert json.loads(metrics)["chars"] == len(text)
    assert [json.loads(g[3])["shade"] for g in gens] == [0, 40, 80]

    rows = ws.rows("SELECT stimulus, family, split, truth, params FROM v_samples WHERE run = 'r' ORDER BY array_row")
    infos = [SampleInfo(s, f, sp, json.loads(t), json.loads(p)) for s, f, sp, t, p in rows]
    assert [typed_truth(r, "shade").shade for r in infos] == [0, 40, 80]
    assert get_target("truth:shade")(infos).as_numeric().tolist() == [0.0, 40.0, 80.0]
