"""Stimulus sets on disk: round trip, no partial sets, no silent overwrite, the CLI front."""

from __future__ import annotations

import subprocess
import sys

import duckdb
import numpy as np
import pytest

from stimuli import StimulusError, get_family
from stimuli.io import read_set, write_set

G2M = get_family("g2m")


def small_config():
    return G2M.config(grid_sizes=(3, 6), colors=(3,))


def test_round_trip_keeps_images_prompts_and_truth(tmp_path):
    out = write_set(G2M, small_config(), n=3, seed=5, split="valid", out=tmp_path / "g2m")
    stim_set = read_set(out)
    assert len(stim_set) == 6 and stim_set.family == "g2m" and stim_set.meta["count"] == 6
    originals = {s.id: s for s in G2M.generate(small_config(), n=3, seed=5, split="valid")}
    for row in stim_set.rows():
        original = originals[row["id"]]
        assert row["split"] == "valid" and row["seed"] == original.seed
        assert row["prompt"] == original.prompt and row["answers"]["transcribe"] == original.answer
        assert row["truth"]["matrix"] == original.truth["matrix"]
        assert np.array_equal(np.asarray(stim_set.image(row)), np.asarray(original.image))


def test_ground_truth_table_is_plain_parquet_for_duckdb(tmp_path):
    out = write_set(G2M, small_config(), n=2, seed=0, split="test", out=tmp_path / "g2m")
    rows = duckdb.sql(
        f"SELECT params.grid_size AS n, count(*) AS k FROM '{out}/truth.parquet' GROUP BY ALL ORDER BY n"
    ).fetchall()
    assert rows == [(3, 2), (6, 2)]


def test_existing_set_is_never_replaced_silently(tmp_path):
    out = write_set(G2M, small_config(), n=1, seed=0, split="test", out=tmp_path / "g2m")
    before = (out / "truth.parquet").read_bytes()
    with pytest.raises(StimulusError, match="--overwrite"):
        write_set(G2M, small_config(), n=2, seed=1, split="test", out=out)
    assert (out / "truth.parquet").read_bytes() == before
    write_set(G2M, small_config(), n=2, seed=1, split="test", out=out, overwrite=True)
    assert len(read_set(out)) == 4


def test_a_failing_generator_leaves_no_partial_set(tmp_path):
    def broken(config, n, seed, split):
        yield from G2M.generate(config, n=1, seed=seed, split=split)
        raise RuntimeError("disk on fire")

    family = type(G2M)(name="g2m", description="", config=G2M.config, generate=broken)
    with pytest.raises(RuntimeError):
        write_set(family, small_config(), n=2, seed=0, split="test", out=tmp_path / "g2m")
    assert list(tmp_path.iterdir()) == []


def test_reading_what_is_not_a_set_names_the_fix(tmp_path):
    with pytest.raises(StimulusError, match="python -m stimuli"):
        read_set(tmp_path)


def test_a_corrupted_image_gives_a_clear_error(tmp_path):
    out = write_set(G2M, small_config(), n=1, seed=0, split="test", out=tmp_path / "g2m")
    stim_set = read_set(out)
    row = stim_set.rows()[0]
    (out / row["image"]).write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(StimulusError, match="cannot read image"):
        stim_set.image(row)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "stimuli", *args], capture_output=True, text=True)


@pytest.mark.slow
def test_cli_writes_a_set_and_refuses_bad_values(tmp_path):
    ok = run_cli("g2m", "--n", "2", "--grid-sizes", "3", "9", "--colors", "4", "--out", str(tmp_path / "s"))
    assert ok.returncode == 0, ok.stderr
    assert "4 stimuli" in ok.stdout
    assert read_set(tmp_path / "s").meta["config"]["grid_sizes"] == [3, 9]
    bad = run_cli("g2m", "--colors", "11", "--out", str(tmp_path / "t"))
    assert bad.returncode == 2
    assert "colours C=11 is out of range: expected 3..10" in bad.stderr
    assert not (tmp_path / "t").exists()


@pytest.mark.slow  # two stimulus processes
def test_cli_help_lists_every_family_and_option():
    top = run_cli("--help")
    assert top.returncode == 0
    for name in ("g2m", "go", "counting", "spatial", "all"):
        assert name in top.stdout
    g2m = run_cli("g2m", "--help")
    for flag in ("--grid-sizes", "--colors", "--strategy", "--image-size", "--n", "--seed", "--out"):
        assert flag in g2m.stdout
