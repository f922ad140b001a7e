"""A run whose one chunk holds every sample commits nothing until it ends (one such run lost 16
minutes): it says so at the start, in one line naming the fix (issue 21 item 8)."""

from __future__ import annotations

import pytest
from devices import model_config

from extract.manifest import parse_manifest
from extract.run import one_chunk_warning, run_extraction
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace


def _manifest(stimuli: str, model: str = "m", **extra: object):
    return parse_manifest({"run": "r", "model": {"path": model, **model_config()}, "stimuli": [{"set": stimuli}],
                           "taps": [{"tap": "llm", "layers": [0], "tokens": ["last"]}],
                           "generation": {"max_new_tokens": 2}, **extra})


def test_the_warning_names_the_sizes_and_the_fix() -> None:
    got = one_chunk_warning(_manifest("s", chunk_samples=256, batch_size=8), 200)
    assert got == ("chunk_samples 256 >= 200 samples: nothing is committed until the run ends;"
                   " set chunk_samples below 200 in the manifest (e.g. 48) to commit as you go")
    assert one_chunk_warning(_manifest("s", chunk_samples=64, batch_size=8), 200) is None  # 4 commits on the way
    # One batch is the whole run: every row is written at once, no chunk size commits any sooner.
    assert one_chunk_warning(_manifest("s", chunk_samples=64, batch_size=8), 8) is None


@pytest.fixture(scope="module")
def g2m_set(tmp_path_factory):
    family = get_family("g2m")
    return write_set(family, family.config(grid_sizes=(3,), colors=(3,), image_size=56), n=6, seed=0, split="test",
                     out=tmp_path_factory.mktemp("stimuli") / "g2m")


@pytest.mark.slow
def test_a_one_chunk_run_warns_at_the_start_and_a_finished_one_does_not(tiny_dir, g2m_set, tmp_path, capsys):
    model = str(tiny_dir("qwen2_vl"))
    one_chunk = _manifest(str(g2m_set), model, batch_size=2, chunk_samples=64)
    run_extraction(one_chunk, workspace=tmp_path / "a", progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: chunk_samples 64 >= 6 samples: nothing is committed until the run ends; set chunk_samples"
                   " below 6 in the manifest (e.g. 2) to commit as you go"], err
    run_extraction(one_chunk, workspace=tmp_path / "a", progress=False)  # finished: nothing left to lose
    assert capsys.readouterr().err == ""
    assert Workspace.open(tmp_path / "a", readonly=True).rows("SELECT status FROM runs") == [("finished",)]
    run_extraction(_manifest(str(g2m_set), model, batch_size=2, chunk_samples=2), workspace=tmp_path / "b",
                   progress=False)
    assert capsys.readouterr().err == ""
