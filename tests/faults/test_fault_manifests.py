"""Malformed extraction manifests: a friendly error that names the key, exit code 2, and nothing
written (no workspace folder appears)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from faultlib import TOY_MODEL, python

from extract.__main__ import main

GOOD = {
    "run": "toy",
    "model": {"path": str(TOY_MODEL), "dtype": "float32", "device": "cpu"},
    "stimuli": [{"set": "stimuli/go-toy", "task": "multimodal_num"}],
    "taps": [{"tap": "llm", "layers": [-1], "tokens": ["image", "last"]}],
    "batch_size": 2,
}
GOOD_TEXT = yaml.safe_dump(GOOD, sort_keys=False)

CASES = {
    # what is injected: (manifest text, what the error must say)
    "yaml syntax error": ("run: toy\nmodel: {path: m, dtype: float32\nstimuli: []\n", ["is not valid YAML", "line"]),
    "wrong type": (GOOD_TEXT.replace("batch_size: 2", "batch_size: eight"),
                   ["batch_size: Input should be a valid integer", "'eight'"]),
    "typo key": (GOOD_TEXT.replace("taps:", "tapz:"), ["unknown key 'tapz'", "did you mean 'taps'?"]),
    "typo in a nested key": (GOOD_TEXT.replace("dtype:", "dtpye:"),
                             ["model.dtpye: unknown key", "did you mean 'dtype'?"]),
    "wrong value": (GOOD_TEXT.replace("tap: llm", "tap: decoder"), ["taps.0.tap", "'vision', 'projector' or 'llm'"]),
    "not a mapping": ("- run: toy\n", ["expected a YAML mapping at the top level, got list"]),
    "truncated file": (GOOD_TEXT[: GOOD_TEXT.index("stimuli:")], ["stimuli: required key is missing"]),
    "empty file": ("", ["expected a YAML mapping at the top level, got NoneType"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_manifest_gives_the_friendly_error_and_writes_nothing(case, tmp_path, capsys):
    """Injects: an extraction manifest with the fault named by ``case`` (YAML syntax error, wrong
    type, typo key, typo in a nested key, an invalid value, a list instead of a mapping, a file
    cut before its required keys, an empty file). Asserts: `python -m extract` (its main) exits 2
    with `error: ...` naming the key and what was expected, no traceback, and no workspace
    folder was created."""
    text, needles = CASES[case]
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(text)
    data = tmp_path / "ws"
    assert main([str(manifest), "--data", str(data), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not data.exists()


def test_malformed_manifest_through_the_real_command(tmp_path):
    """Injects: a typo key in a manifest given to a real `python -m extract` process. Asserts:
    exit code 2, the did-you-mean message on stderr, no traceback, no workspace folder."""
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(GOOD_TEXT.replace("generation", "generaton") + "generaton: {max_new_tokens: 4}\n")
    data = tmp_path / "ws"
    got = python("-m", "extract", str(manifest), "--data", str(data), "--no-progress")
    assert got.returncode == 2, got.stderr
    assert "unknown key 'generaton' — did you mean 'generation'?" in got.stderr, got.stderr
    assert "Traceback" not in got.stderr
    assert not data.exists()


def test_manifest_naming_a_missing_stimulus_set(tmp_path):
    """Injects: a manifest whose stimulus set folder does not exist, run by a real `python -m
    extract`. Asserts: exit code 2 with `error: ... is not a stimulus set ... write one with
    python -m extract.stimuli`, no traceback (before the fix: a StimulusError traceback), no
    workspace folder."""
    manifest = tmp_path / "m.yaml"
    manifest.write_text(GOOD_TEXT.replace("stimuli/go-toy", str(tmp_path / "no-such-set")))
    data = tmp_path / "ws"
    got = python("-m", "extract", str(manifest), "--data", str(data), "--no-progress")
    assert got.returncode == 2, got.stderr
    assert f"error: {tmp_path / 'no-such-set'} is not a stimulus set" in got.stderr, got.stderr
    assert "python -m extract.stimuli" in got.stderr and "Traceback" not in got.stderr
    assert not data.exists()


def test_the_good_manifest_is_valid(tmp_path):
    """Guard for the cases above: the good manifest itself is valid (so each case fails for its
    own fault, not for another)."""
    from extract.manifest import load_manifest

    path = Path(tmp_path / "good.yaml")
    path.write_text(GOOD_TEXT)
    assert load_manifest(path).run == "toy"
