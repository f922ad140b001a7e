"""Malformed extraction manifests: a friendly error that names the key, exit code 2, and nothing
written (no workspace folder appears). And resumes the store must refuse (another codec, another
batch size, a stimulus set regenerated in place): one line, exit 2, and the finished run exactly
as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from faultlib import TOY_MODEL, go_set, python, write_manifest

from extract.__main__ import main
from store import Workspace

pytestmark = pytest.mark.slow  # fault injection drives real extraction or farm processes; `make faults` runs these

GOOD = {
    "run": "toy",
    "model": {"path": str(TOY_MODEL), "dtype": "float32", "device": "cpu"},
    "stimuli": [{"set": "sets/go-toy", "task": "multimodal_num"}],
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
    "wrong value": (GOOD_TEXT.replace("tap: llm", "tap: decoder"),
                    ["taps.0.tap", "unknown tap 'decoder'; expected one of vision, projector, llm"]),
    "not a mapping": ("- run: toy\n", ["expected a YAML mapping at the top level, got list"]),
    "truncated file": (GOOD_TEXT[: GOOD_TEXT.index("stimuli:")], ["stimuli: required key is missing"]),
    "empty file": ("", ["expected a YAML mapping at the top level, got NoneType"]),
    "set listed twice": (GOOD_TEXT.replace("stimuli:\n", "stimuli:\n- set: sets/go-toy\n"),
                         ["stimuli.1: set sets/go-toy is already listed as stimuli.0", "list the set once"]),
    "two sets of one name": (GOOD_TEXT.replace("stimuli:\n", "stimuli:\n- set: elsewhere/go-toy\n"),
                             ["are both named 'go-toy'", "rename one folder"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_manifest_gives_the_friendly_error_and_writes_nothing(case, tmp_path, capsys):
    """Injects: an extraction manifest with the fault named by ``case`` (YAML syntax error, wrong
    type, typo key, typo in a nested key, an invalid value, a list instead of a mapping, a file
    cut before its required keys, an empty file, one stimulus set listed twice, two sets whose
    folders share a name (before the fix these two were caught only by the writer, after it had
    created the workspace and a run row, then left `failed`). Asserts: `python -m extract` (its main) exits 2
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
    python -m stimuli`, no traceback (before the fix: a StimulusError traceback), no
    workspace folder."""
    manifest = tmp_path / "m.yaml"
    manifest.write_text(GOOD_TEXT.replace("sets/go-toy", str(tmp_path / "no-such-set")))
    data = tmp_path / "ws"
    got = python("-m", "extract", str(manifest), "--data", str(data), "--no-progress")
    assert got.returncode == 2, got.stderr
    assert f"error: {tmp_path / 'no-such-set'} is not a stimulus set" in got.stderr, got.stderr
    assert "python -m stimuli" in got.stderr and "Traceback" not in got.stderr
    assert not data.exists()


def test_the_good_manifest_is_valid(tmp_path):
    """Guard for the cases above: the good manifest itself is valid (so each case fails for its
    own fault, not for another)."""
    from extract.manifest import load_manifest

    path = Path(tmp_path / "good.yaml")
    path.write_text(GOOD_TEXT)
    assert load_manifest(path).run == "toy"


def _manifest_rows(data: Path) -> dict[str, list[tuple]]:
    """Every row of every table of a workspace's manifest, in a fixed order."""
    ws = Workspace.open(data, readonly=True)
    tables = [t for (t,) in ws.rows("SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE'")]
    return {t: ws.rows(f"SELECT * FROM {t} ORDER BY ALL") for t in sorted(tables)}


def _arrays(data: Path) -> dict[str, bytes]:
    return {p.relative_to(data).as_posix(): p.read_bytes() for p in sorted((data / "arrays").rglob("*")) if p.is_file()}


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    assert main([*argv, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module", autouse=True)
def _quiet_weight_loading() -> None:
    """transformers' own "Loading weights" bar (not the extraction's, which --no-progress stops)
    would share stderr with the one error line these tests read."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A finished run of the toy VLM over 4 Go boards (codec none, batches of 2): the set, the
    manifest and the workspace."""
    root = tmp_path_factory.mktemp("finished")
    stimuli = go_set(root / "go-four", counts="0-3")
    manifest = write_manifest(root / "m.yaml", stimuli)
    data = root / "ws"
    assert main([str(manifest), "--data", str(data), "--no-progress"]) == 0
    return stimuli, manifest, data


def _copy(finished: tuple[Path, Path, Path], tmp_path: Path) -> Path:
    data = tmp_path / "ws"
    shutil.copytree(finished[2], data)
    return data


def test_a_resume_with_another_codec_leaves_the_finished_run_as_it_was(finished, tmp_path, capsys):
    """Injects (issue 16, item 3): a resume of a finished run with `--codec zstd` (it was written
    with none). Asserts: exit 2, one line naming the array and both codecs; every manifest row
    and every array file byte-identical (before the fix the writer had set the run `running`
    before the check, and its failure path left it `failed`)."""
    data = _copy(finished, tmp_path)
    rows, arrays = _manifest_rows(data), _arrays(data)
    _refused([str(finished[1]), "--data", str(data), "--codec", "zstd"], capsys,
             "already exists with a different layout", "codec: stored 'none', now 'zstd'")
    assert _manifest_rows(data) == rows and _arrays(data) == arrays
    assert rows["runs"][0][12] == "finished"


def test_a_resume_with_another_batch_size_is_refused_naming_the_original(finished, tmp_path, capsys):
    """Injects (issue 16, done-when): a resume of a finished run with batch_size 4 (it ran with 2).
    Padding makes a sample's answer-token values depend on its batch-mates, so the store cannot
    promise equal values: it refuses. Asserts: exit 2, one line naming `config.batch_size`, the
    original 2, the new 4 and why (before the fix: refused, but the line dumped both whole
    configs); every manifest row and array file byte-identical."""
    data = _copy(finished, tmp_path)
    rows, arrays = _manifest_rows(data), _arrays(data)
    manifest = tmp_path / "m4.yaml"
    manifest.write_text(finished[1].read_text().replace("batch_size: 2", "batch_size: 4"))
    line = _refused([str(manifest), "--data", str(data)], capsys,
                    "config.batch_size: stored 2, this writer 4 — ", "(its padding)", "keep the original batch_size")
    assert "stimuli" not in line  # the one key that changed, not two whole configs
    assert _manifest_rows(data) == rows and _arrays(data) == arrays


def test_a_stimulus_set_regenerated_in_place_is_refused_and_the_run_stays_finished(tmp_path, capsys):
    """Injects (issue 16, item 3): a finished run whose stimulus set is then regenerated in place
    with another seed (same folder, same ids, other boards), and the manifest re-run. Asserts:
    exit 2, one line saying the stimuli are registered with different content; every manifest
    row and array file byte-identical (before the fix: the run `failed`)."""
    stimuli = go_set(tmp_path / "go-regen", counts="0-3", seed=1)
    manifest = write_manifest(tmp_path / "m.yaml", stimuli)
    data = tmp_path / "ws"
    assert main([str(manifest), "--data", str(data), "--no-progress"]) == 0
    capsys.readouterr()
    rows, arrays = _manifest_rows(data), _arrays(data)
    shutil.rmtree(stimuli)
    go_set(stimuli, counts="0-3", seed=2)
    _refused([str(manifest), "--data", str(data)], capsys, "are already registered with different content")
    assert _manifest_rows(data) == rows and _arrays(data) == arrays
    assert rows["runs"][0][12] == "finished"


@pytest.mark.parametrize("existing", [False, True])
def test_an_unknown_codec_is_refused_before_the_workspace_is_touched(finished, tmp_path, capsys, existing):
    """Injects (issue 16, item 4): `--codec bogus`, for a new workspace and for a resume of a
    finished run. Asserts: exit 2, one line naming the codec and the valid ones; no workspace
    folder appears (before the fix: a workspace with a `failed` run row), and an existing one is
    byte-identical."""
    data = _copy(finished, tmp_path) if existing else tmp_path / "new"
    before = (_manifest_rows(data), _arrays(data)) if existing else None
    _refused([str(finished[1]), "--data", str(data), "--codec", "bogus"], capsys,
             "--codec bogus: codec must be 'none', 'zstd' or 'bitround<k>'")
    if existing:
        assert (_manifest_rows(data), _arrays(data)) == before
    else:
        assert not data.exists()


def _edit_truth(stimuli: Path, edit: str) -> None:
    """Rewrite a set's truth.parquet through DuckDB (``edit`` is a SELECT over the rows ``t``)."""
    import duckdb

    path = stimuli / "truth.parquet"
    with duckdb.connect() as con:
        con.execute(f"COPY ({edit.format(t=f'read_parquet({str(path)!r})')}) TO '{path}.new' (FORMAT parquet)")
    Path(f"{path}.new").replace(path)


@pytest.mark.parametrize("fault, needle", [
    ("null", "have no id"),
    ("repeated", "stimulus ids must be unique within a set, repeated:"),
    ("name", "names the dataset"),
])
def test_a_set_whose_keys_the_store_would_refuse_is_refused_before_the_run_row(fault, needle, tmp_path, capsys,
                                                                                 finished):
    """Injects (issue 40, item 11): a stimulus set with a null id, with a repeated id, or in a folder
    whose name cannot be a dataset name, into a new workspace and into one holding a finished run.
    Asserts: exit 2, one line naming the fault and the fix; no `failed` run row and no workspace
    left behind (before the fix the stimulus checks ran after the run row was written)."""
    stimuli = go_set(tmp_path / ("go bad name" if fault == "name" else "go-keys"), counts="0-3")
    if fault == "null":
        _edit_truth(stimuli, "SELECT * REPLACE (CASE WHEN id LIKE '%1_%' THEN NULL ELSE id END AS id) FROM {t}")
    elif fault == "repeated":
        _edit_truth(stimuli, "SELECT * REPLACE (first_value(id) OVER () AS id) FROM {t}")
    manifest = write_manifest(tmp_path / "m.yaml", stimuli)
    _refused([str(manifest), "--data", str(tmp_path / "new")], capsys, needle)
    assert not (tmp_path / "new").exists()
    data = _copy(finished, tmp_path)
    rows = _manifest_rows(data)
    _refused([str(manifest), "--data", str(data)], capsys, needle)
    assert _manifest_rows(data) == rows
