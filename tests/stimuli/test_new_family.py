"""A stimulus family is one module plus one registration line, end to end.

A dummy family is written as a module in a temporary folder and registered with one call (the
repository's families are one line each in ``stimuli.FAMILIES``); nothing else names it.
It then goes through the CLI (its own small-set size), the extraction's sample collection,
scoring (its own parser) and the probe targets (its truth schema and ``truth:<path>``). A
renamed truth key fails loudly, naming the key, at generation, scoring and probe time alike.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from child_env import child_env

import stimuli as stimuli
from extract.manifest import parse_manifest
from extract.scoring import score_answer
from probes.errors import ProbeError
from probes.targets import SampleInfo, get_target, typed_truth
from stimuli import StimulusError, TruthError, get_family, register_family
from stimuli.cli import main as stimuli_cli
from stimuli.io import read_set, write_set

REPO = Path(__file__).resolve().parents[2]

DOTS = '''
"""Dots: count the white pixels on a black square (a test family)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from stimuli.answers import parse_number
from stimuli.base import Family, Score, Stimulus, Truth, compare, derive_seed, option

TRUTH_KEY = "dots"


@dataclass(frozen=True)
class Config:
    size: int = option(16, "image side in pixels")


@dataclass(frozen=True)
class DotsTruth(Truth):
    dots: int


def generate(config: Config, n: int, seed: int, split: str) -> Iterator[Stimulus]:
    for i in range(n):
        rng = np.random.default_rng(derive_seed(seed, i))
        k = i % 5
        pixels = np.zeros((config.size, config.size, 3), np.uint8)
        pixels.reshape(-1, 3)[rng.choice(config.size**2, k, replace=False)] = 255
        yield Stimulus(id=f"dots_{i:03d}", family="dots", split=split, seed=seed, image=Image.fromarray(pixels),
                       prompts={"count": "How many white dots?"}, answers={"count": str(k)},
                       truth={TRUTH_KEY: k, "parity": k % 2}, params={"size": config.size})


def score(task: str, text: str, answer: str, truth: DotsTruth) -> Score:
    return compare(parse_number(text), truth.dots)


FAMILY = Family(name="dots", description="white dots to count", config=Config, generate=generate,
                truth=DotsTruth, score=score, small_set_n=7)
'''


@pytest.fixture
def add_family(tmp_path, monkeypatch):
    """Write a family module into a fresh import folder and register it; undone after the test."""
    monkeypatch.setattr(stimuli, "FAMILIES", stimuli.FAMILIES.copy())
    folder = tmp_path / "mods"
    # The folder exists before it joins sys.path: an import in between would otherwise cache
    # "no finder" for the missing folder, and the family module written later would not be found.
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))

    def add(source: str, module: str = "dots_family") -> None:
        (folder / f"{module}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, module, raising=False)
        register_family("dots", module)  # the one registration line

    yield add
    sys.modules.pop("dots_family", None)


def _rows_as_samples(rows: list[dict]) -> list[SampleInfo]:
    return [SampleInfo(r["id"], r["family"], r["split"], r["truth"], r["params"]) for r in rows]


@pytest.mark.slow
def test_a_dummy_family_works_through_generation_scoring_and_targets(add_family, tmp_path, capsys):
    from extract.run import collect_samples

    add_family(DOTS)
    assert "dots" in stimuli.family_names()
    # Generation: the CLI knows the family, its options and its small-set size, with no CLI code.
    assert stimuli_cli(["dots", "--out", str(tmp_path / "dots"), "--size", "12"]) == 0
    meta = json.loads((tmp_path / "dots" / "set.json").read_text())
    assert (meta["family"], meta["count"], meta["config"]) == ("dots", 7, {"size": 12})
    assert stimuli_cli(["all", "--out", str(tmp_path / "all")]) == 0
    assert read_set(tmp_path / "all" / "dots").meta["count"] == 7
    assert "dots:     7 stimuli" in capsys.readouterr().out

    # The extraction's view of the set: rows, prompts, answers, the image shown.
    stim_set = read_set(tmp_path / "dots")
    manifest = parse_manifest({"run": "r", "model": {"path": "m"}, "stimuli": [{"set": str(stim_set.path)}]})
    _, samples = collect_samples(manifest)
    assert [s.answer for s in samples] == ["0", "1", "2", "3", "4", "0", "1"]
    assert all(s.family == "dots" and s.image is not None and s.image.is_file() for s in samples)

    # Scoring: the family's own parser (first number, words too), not an exact string match.
    s = samples[3]
    right = score_answer(s.family, s.task, "I see three dots.", s.answer, s.truth, n_tokens=4)
    assert (right.prediction, right.parse_ok, right.correct, right.score, right.n_tokens) == (3, True, True, 1.0, 4)
    wrong = score_answer(s.family, s.task, "2", s.answer, s.truth)
    assert (wrong.prediction, wrong.correct) == (2, False)
    assert score_answer(s.family, s.task, "I cannot tell", s.answer, s.truth).parse_ok is False

    # Probe targets: the typed truth, and truth:<path> for any key the generator writes.
    infos = _rows_as_samples(stim_set.rows())
    assert [typed_truth(r, "dots").dots for r in infos] == [0, 1, 2, 3, 4, 0, 1]
    parity = get_target("truth:parity")(infos)
    assert parity.classes == (0, 1) and parity.values.tolist() == [0, 1, 0, 1, 0, 0, 1]
    counts = get_target("truth:dots")(infos)
    assert counts.as_numeric().tolist() == [0, 1, 2, 3, 4, 0, 1]


def test_a_renamed_truth_key_fails_loudly_naming_the_key(add_family, tmp_path):
    add_family(DOTS)
    family = get_family("dots")
    row = read_set(write_set(family, family.config(), n=2, seed=0, split="test", out=tmp_path / "s")).rows()[1]
    renamed = {"n_dots" if k == "dots" else k: v for k, v in row["truth"].items()}

    with pytest.raises(TruthError, match=r"the truth of dots stimulus dots_001 has no key 'dots'"):
        family.read_truth(renamed, row["id"])
    # Scoring reads the truth outside the guard that turns a parser's error into "unparsable".
    with pytest.raises(TruthError, match="no key 'dots'"):
        score_answer("dots", "count", "1", "1", renamed)
    info = SampleInfo(row["id"], "dots", "test", renamed, row["params"])
    with pytest.raises(ProbeError, match="dots_001 has no key 'dots'"):
        typed_truth(info, "dots")
    # A wrong type is as loud as a missing key; bool is never a count.
    with pytest.raises(TruthError, match="key 'dots' holds bool True, not int"):
        family.read_truth({"dots": True})


def test_a_generator_that_drifts_from_its_schema_fails_before_writing(add_family, tmp_path, capsys):
    add_family(DOTS.replace('TRUTH_KEY = "dots"', 'TRUTH_KEY = "n_dots"'))
    assert stimuli_cli(["dots", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the truth of dots stimulus dots_000 has no key 'dots'") and "\n" not in err
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.tmp-*"))


def test_a_renamed_key_stops_a_built_in_probe_target():
    go = get_family("go")
    stim = next(go.generate(go.config(counts="3", preset="small"), n=1, seed=0, split="test"))
    good = SampleInfo(stim.id, "go", "test", stim.truth, stim.params)
    assert get_target("go.count")([good]).as_numeric().tolist() == [3.0]
    renamed = {("black_count" if k == "count" else k): v for k, v in stim.truth.items()}
    bad = SampleInfo(stim.id, "go", "test", renamed, stim.params)
    # Before the schema this read as "no label" (a .get), and the probe trained on fewer rows.
    with pytest.raises(ProbeError, match=f"go stimulus {stim.id} has no key 'count'"):
        get_target("go.count")([good, bad])
    # Rows of another family carry no go label; they are not an error.
    other = SampleInfo("x", "spatial", "test", {"relation": "left"}, {})
    assert get_target("go.count")([good, other]).labelled().tolist() == [True, False]


def test_every_family_generates_truths_its_schema_reads():
    small = {"g2m": {"grid_sizes": (3,), "colors": (3,)}, "go": {"counts": "0,5", "preset": "small"},
             "counting": {"cases": ("1A",)}, "spatial": {}}
    assert set(small) == set(stimuli.family_names())
    for name, overrides in small.items():
        family = get_family(name)
        assert family.small_set_n >= 1
        for stim in family.generate(family.config(**overrides), n=2, seed=0, split="test"):
            typed = family.read_truth(stim.truth, stim.id)
            assert {f: getattr(typed, f) for f in typed.__dataclass_fields__} == {
                f: stim.truth[f] for f in typed.__dataclass_fields__}
            g = score_answer(name, next(iter(stim.answers)), stim.answer, stim.answer, stim.truth)
            assert g.correct, (name, stim.id)  # the reference answer scores as right


def test_a_module_whose_family_has_another_name_is_refused(add_family):
    add_family(DOTS.replace('FAMILY = Family(name="dots"', 'FAMILY = Family(name="spots"'))
    with pytest.raises(StimulusError, match=r"FAMILY = Family\(name='dots', ...\), found a Family named 'spots'"):
        get_family("dots")
    with pytest.raises(StimulusError, match="already registered to dots_family"):
        register_family("dots", "elsewhere")


LAZY = """
import sys
from extract.manifest import parse_manifest
from extract.run import collect_samples
from extract.scoring import score_answer
families = ("g2m", "goboard", "counting_tricks", "spatial")
loaded = lambda: sorted(f for f in families if "stimuli." + f in sys.modules)
assert loaded() == [], loaded()
_, samples = collect_samples(parse_manifest({"run": "r", "model": {"path": "m"}, "stimuli": [{"set": sys.argv[1]}]}))
s = samples[0]
assert score_answer(s.family, s.task, s.answer, s.answer, s.truth).correct
print(loaded())
"""


@pytest.mark.slow
def test_reading_and_scoring_a_set_imports_only_its_family(tmp_path):
    family = get_family("spatial")
    out = write_set(family, family.config(), n=4, seed=0, split="test", out=tmp_path / "spatial")
    got = subprocess.run([sys.executable, "-c", LAZY, str(out)], capture_output=True, text=True, cwd=REPO,
                         env=child_env(), timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "['spatial']"


def test_an_extraction_refuses_a_set_with_a_renamed_truth_key_before_loading_a_model(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from extract.run import collect_samples

    family = get_family("counting")
    out = write_set(family, family.config(cases=("1A",)), n=2, seed=0, split="test", out=tmp_path / "c")
    rows = pq.read_table(out / "truth.parquet").to_pylist()
    for row in rows:
        row["truth"]["n_objects"] = row["truth"].pop("count")  # a generator edit, the set not regenerated
    pq.write_table(pa.Table.from_pylist(rows), out / "truth.parquet")
    manifest = parse_manifest({"run": "r", "model": {"path": "m"}, "stimuli": [{"set": str(out)}]})
    with pytest.raises(TruthError, match=r"counting stimulus counting-1A-00000 has no key 'count'"):
        collect_samples(manifest)


def test_a_misspelt_truth_target_names_the_key_the_rows_have(add_family, tmp_path):
    add_family(DOTS)
    family = get_family("dots")
    infos = _rows_as_samples(read_set(write_set(family, family.config(), n=3, seed=0, split="test",
                                                out=tmp_path / "s")).rows())
    with pytest.raises(ProbeError, match=r"target truth:dot: none of the 3 selected rows has it \(families \['dots'\]\)"
                                         r" — did you mean 'dots'\?"):
        get_target("truth:dot")(infos)
    with pytest.raises(ProbeError, match=r"params:colour: .*; known: size:"):
        get_target("params:colour")(infos)
