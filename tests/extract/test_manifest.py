"""Extraction manifests: validated before any model loads, with messages that say the fix."""

from __future__ import annotations

import pytest

from extract.manifest import ManifestError, expand_layers, load_manifest, parse_manifest

BASE = {"run": "demo", "model": {"path": "models/tiny"}, "stimuli": [{"set": "sets/g2m"}]}


def with_(**changes):
    return {**BASE, **changes}


def test_typos_get_a_did_you_mean():
    with pytest.raises(ManifestError) as err:
        parse_manifest(with_(model={"path": "m", "dtyp": "float16"}, taps=[{"tap": "llm", "layerz": 1}]))
    text = str(err.value)
    assert "model.dtyp: unknown key 'dtyp' — did you mean 'dtype'?" in text
    assert "taps.0.layerz: unknown key 'layerz' — did you mean 'layers'?" in text


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (with_(taps=[{"tap": "vison"}]), "taps.0.tap"),
        (with_(model={"path": "m", "dtype": "float8"}), "model.dtype"),
        (with_(batch_size=0), "batch_size"),
        (with_(run="bad id!"), "run ids use letters"),
        (with_(stimuli=[]), "stimuli is empty"),
        (with_(taps=[{"tap": "llm", "tokens": []}]), "keep at least one"),
        ({"model": {"path": "m"}, "stimuli": [{"set": "s"}]}, "run: required key is missing"),
        ([1, 2], "expected a YAML mapping"),
    ],
)
def test_invalid_manifests_name_the_key(data, needle):
    with pytest.raises(ManifestError) as err:
        parse_manifest(data, "m.yaml")
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("spec", "expected"), [("all", [0, 1, 2, 3]), (2, [2]), ([-1, 0, 3], [0, 3]), ("1-2", [1, 2]), ("-2--1", [2, 3])]
)
def test_layer_specs_expand(spec, expected):
    assert expand_layers(spec, 4) == expected


@pytest.mark.parametrize("spec", [4, -5, [0, 9], "2-7", "first"])
def test_layers_that_do_not_exist_are_refused(spec):
    with pytest.raises(ManifestError, match="layer|expected"):
        expand_layers(spec, 4)


def test_load_manifest_reports_missing_and_broken_files(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        load_manifest(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(broken)
    good = tmp_path / "good.yaml"
    good.write_text("run: r1\nmodel: {path: m}\nstimuli:\n  - {set: s, task: transcribe}\n")
    assert load_manifest(good).stimuli[0].task == "transcribe"


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"taps": [{"tap": "vison"}]}, "taps.0.tap: Value error, unknown tap 'vison' — did you mean 'vision'?"),
        ({"taps": [{"tap": "llm", "site": "resid_pots"}]}, "taps.0.site: Value error, tap 'llm' has no site"
                                                            " 'resid_pots' — did you mean 'resid_post'?"),
        ({"taps": [{"tap": "llm", "tokens": ["lats"]}]}, "has no token kind 'lats' — did you mean 'last'?"),
        ({"taps": [{"tap": "attn"}]}, "unknown tap 'attn'"),  # attention has its own block
        ({"taps": [{"tap": "vision", "tokens": ["image", "last"]}]}, "keeps image tokens only"),
        ({"attention": {"queries": ["answr"]}}, "has no token kind 'answr' — did you mean 'answer'?"),
    ],
)
def test_words_outside_the_tap_table_fail_at_validation(entry, needle):
    """The tap, site and token words come from one table (store/vocab.py); a word outside it fails
    when the manifest is read, before any model loads, naming the closest word."""
    with pytest.raises(ManifestError) as err:
        parse_manifest(with_(**entry), "m.yaml")
    assert needle in str(err.value)
