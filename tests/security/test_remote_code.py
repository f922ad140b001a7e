"""Rule 4: ``trust_remote_code`` stays off unless the manifest sets it.

A model folder or hub repo can ship Python files that transformers runs when asked to
(``auto_map`` in config.json). agnosia never asks unless ``model.trust_remote_code: true`` is in
the manifest: such a model fails with a clear error, before any of its code runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network

import extract.__main__ as extract_cli  # noqa: E402
from extract.manifest import parse_manifest  # noqa: E402
from extract.models import ModelError, UntrustedCodeError, load_model  # noqa: E402


def code_shipping_model(folder, marker):
    """A model folder whose config.json points at its own Python code; running it touches ``marker``."""
    folder.mkdir()
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('remote code ran')\n"
    (folder / "configuration_custom.py").write_text(code + "from transformers import PretrainedConfig\n"
                                                    "class CustomConfig(PretrainedConfig):\n    model_type = 'custom_vlm'\n")
    (folder / "modeling_custom.py").write_text(code)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "custom_vlm", "architectures": ["CustomForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForImageTextToText": "modeling_custom.CustomForConditionalGeneration"}}))
    return folder


@pytest.mark.slow
def test_a_model_shipping_code_is_refused_before_its_code_runs(tmp_path):
    marker = tmp_path / "ran"
    folder = code_shipping_model(tmp_path / "custom", marker)
    with pytest.raises(UntrustedCodeError, match="trust_remote_code: true"):
        load_model(folder)
    assert not marker.exists()


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_extraction_cli_refuses_it_with_a_clear_error(tmp_path, capsys, dry_run):
    from stimuli import get_family
    from stimuli.io import write_set

    marker = tmp_path / "ran"
    folder = code_shipping_model(tmp_path / "custom", marker)
    family = get_family("g2m")
    stimuli = write_set(family, family.config(grid_sizes=(3,), colors=(3,), image_size=64), n=1, seed=0,
                        split="test", out=tmp_path / "g2m")
    manifest = tmp_path / "m.yaml"
    manifest.write_text(json.dumps({"run": "r", "model": {"path": str(folder)}, "stimuli": [{"set": str(stimuli)}],
                                    "taps": [{"tap": "llm", "layers": [0]}]}))
    args = [str(manifest), "--data", str(tmp_path / "data")] + (["--dry-run"] if dry_run else [])
    assert extract_cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "trust_remote_code: true" in err
    assert not marker.exists() and not (tmp_path / "data").exists()


@pytest.fixture
def modules_cache(monkeypatch, tmp_path):
    """transformers copies code it runs into its modules cache: keep that copy in tmp_path, not in $HOME."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("transformers_modules"):
            del sys.modules[name]


def _known_family_naming_code(folder: Path, file: str, auto_class: str) -> Path:
    """A tiny llava (a model_type transformers knows) whose ``file`` names its own code for
    ``auto_class``; running that code touches the returned marker."""
    from extract.models import tiny

    tiny.build("llava", folder, seed=0)
    marker = folder / "ran"
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    data = json.loads((folder / file).read_text())
    (folder / file).write_text(json.dumps({**data, "auto_map": {auto_class: "evil.Evil"}}))
    return marker


@pytest.mark.parametrize("file,auto_class", [
    pytest.param("config.json", "AutoModelForImageTextToText", id="weights"),
    pytest.param("processor_config.json", "AutoProcessor", id="processor", marks=pytest.mark.slow),
])
def test_weights_and_processor_run_the_folders_code_only_when_asked(tmp_path, modules_cache, file, auto_class):
    """The weights and processor loads pass load_model's choice on: off, the known family's own classes load
    and the folder's code never runs; on, transformers runs it (here it then fails: it defines no class)."""
    marker = _known_family_naming_code(tmp_path / "m", file, auto_class)
    assert type(load_model(tmp_path / "m").model).__name__ == "LlavaForConditionalGeneration"
    assert not marker.exists()
    with pytest.raises(AttributeError, match="has no attribute 'Evil'"):
        load_model(tmp_path / "m", trust_remote_code=True)
    assert marker.exists()


def test_the_dry_run_passes_the_manifests_choice_to_the_config(tmp_path, modules_cache):
    import extract.dry_run as dry

    marker = tmp_path / "ran"
    folder = code_shipping_model(tmp_path / "custom", marker)
    for flag in (False, True):
        m = parse_manifest({"run": "r", "model": {"path": str(folder), "trust_remote_code": flag},
                            "stimuli": [{"set": "s"}]})
        with pytest.raises(UntrustedCodeError if not flag else ModelError, match="trust_remote_code" if not flag
                           else "custom_vlm"):
            dry.meta_model(m)
        assert marker.exists() == flag
