"""Rule 4: ``trust_remote_code`` stays off unless the manifest sets it.

A model folder or hub repo can ship Python files that transformers runs when asked to
(``auto_map`` in config.json). agnosia never asks unless ``model.trust_remote_code: true`` is in
the manifest: such a model fails with a clear error, before any of its code runs.
"""

from __future__ import annotations

import json
import os

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


def test_manifests_default_to_no_remote_code():
    m = parse_manifest({"run": "r", "model": {"path": "m"}, "stimuli": [{"set": "s"}]})
    assert m.model.trust_remote_code is False
    asked = parse_manifest({"run": "r", "model": {"path": "m", "trust_remote_code": True}, "stimuli": [{"set": "s"}]})
    assert asked.model.trust_remote_code is True


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


def test_every_loader_passes_the_manifests_choice(monkeypatch, tmp_path):
    """The config, weights and processor loads all get the manifest's value (False by default)."""
    import transformers

    import extract.dry_run as dry
    import extract.models.loading as loading

    seen = []

    def record(name):
        def fake(source, **kwargs):
            seen.append((name, kwargs.get("trust_remote_code")))
            raise OSError("stop here")
        return fake

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", record("config"))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for flag in (False, True):
        with pytest.raises(ModelError):
            load_model(folder, trust_remote_code=flag)
        m = parse_manifest({"run": "r", "model": {"path": str(folder), "trust_remote_code": flag},
                            "stimuli": [{"set": "s"}]})
        with pytest.raises(ModelError):
            dry.meta_model(m)
    assert seen == [("config", False), ("config", False), ("config", True), ("config", True)]
    # and the weights / processor loads take it from load_model's argument, never a constant
    import inspect

    src = inspect.getsource(loading.load_model)
    assert "trust_remote_code=trust_remote_code" in src and "trust_remote_code=True" not in src
