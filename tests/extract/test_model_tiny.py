"""``python -m extract.tiny``: normal model folders, offline, deterministic by seed."""

from __future__ import annotations

import pytest
from safetensors.numpy import load_file
from tiny_cases import IMAGE_ALL

from extract.tiny import main


def test_list_names_every_family(capsys):
    assert main(["--list"]) == 0
    assert capsys.readouterr().out.split() == sorted(IMAGE_ALL)  # every family, the toy model included


def test_cli_builds_a_normal_model_folder_deterministically(tmp_path, capsys):
    assert main(["llava", "--out", str(tmp_path / "a")]) == 0
    assert "wrote tiny llava" in capsys.readouterr().out
    main(["llava", "--out", str(tmp_path / "b")])
    main(["llava", "--out", str(tmp_path / "c"), "--seed", "1"])
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                 "processor_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).is_file(), name
    a, b, c = (load_file(tmp_path / x / "model.safetensors") for x in "abc")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)

    # the folder needs nothing of ours: plain transformers reads it
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "a")
    processor = AutoProcessor.from_pretrained(tmp_path / "a")
    assert model.config.model_type == "llava" and processor.chat_template


def test_cli_rejects_unknown_family(tmp_path):
    with pytest.raises(SystemExit):
        main(["bert", "--out", str(tmp_path)])
