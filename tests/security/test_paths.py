"""Rule 2: paths cannot escape the workspace (or a stimulus set).

Every path the store resolves is built from names it checks (run ids, taps, sites, token kinds)
or read back from the manifest (``zarr_path`` of arrays and tensors), and every image an
extraction opens is named by a stimulus set's truth.parquet. A run id, name or stored path with
``..``, an absolute path or a separator is refused with a clear error, and nothing outside is
read, written or deleted.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from extract.manifest import ManifestError, parse_manifest
from probes import load_probe
from probes.errors import ProbeError
from stimuli import get_family
from stimuli.base import StimulusError
from stimuli.io import read_set, write_set
from store import ArraySpec, RunInfo, StoreError, Workspace
from store.cli import main as store_cli

BAD_NAMES = ["../evil", "/abs/path", "a/b", "..", ".", "", "x\\..\\y", "~root"]


@pytest.mark.parametrize("run", BAD_NAMES)
def test_run_ids_with_separators_or_dots_are_rejected(run):
    with pytest.raises(StoreError, match="run must be 1-128 characters"):
        RunInfo(run=run, model="m")
    with pytest.raises(ManifestError, match="run ids use letters"):
        parse_manifest({"run": run, "model": {"path": "m"}, "stimuli": [{"set": "s"}]})


@pytest.mark.parametrize("field", ["tap", "site", "tokens"])
def test_array_names_cannot_name_a_path(field):
    spec = {"tap": "llm", "layer": 0, "tokens": "image", "shape": (4,), field: "../../outside"}
    with pytest.raises(StoreError, match=f"{field} must be"):
        ArraySpec(**spec)


def test_drop_run_refuses_a_run_id_that_leaves_the_workspace(workspace, tmp_path, capsys):
    """``drop-run ../x`` used to rename ``arrays/../x`` into the trash and delete it."""
    victim = workspace / "precious"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    for run in ("../precious", str(victim)):
        with pytest.raises(StoreError, match="run must be"):
            Workspace.open(workspace).drop_run(run)
        assert store_cli(["drop-run", run, "--yes", "--data", str(workspace)]) == 2
        assert "run must be" in capsys.readouterr().err
    assert (victim / "thesis.tex").read_text() == "years of work"


def _tamper(workspace, sql):
    con = duckdb.connect(str(workspace / "manifest.duckdb"))
    try:
        con.execute(sql)
    finally:
        con.close()


@pytest.mark.parametrize("bad", ["../../outside/x", "/tmp/outside", "r1/llm/0/../../../../outside", "r1//llm"])
@pytest.mark.slow
def test_a_tampered_zarr_path_in_the_manifest_is_refused(workspace, tmp_path, bad):
    outside = workspace.parent / "outside"
    outside.mkdir(exist_ok=True)
    _tamper(workspace, f"UPDATE activations SET zarr_path = '{bad}' WHERE tokens = 'image'")
    _tamper(workspace, f"UPDATE chunks SET zarr_path = '{bad}' WHERE zarr_path LIKE '%/image'")
    _tamper(workspace, f"UPDATE tensors SET zarr_path = '{bad}'")
    ws = Workspace.open(workspace, readonly=True)
    for read in (lambda: ws.read("r1", "llm", 0, tokens="image"),
                 lambda: ws.read("r1", "llm", 0, tokens="image", lazy=True).compute(),
                 lambda: ws.read_tensor("r1", "lm_head.weight")):
        with pytest.raises(StoreError, match="not a path inside the workspace"):
            read()
    rep = ws.verify()
    assert not rep.ok and any("not a path inside the workspace" in p for p in rep.problems)
    assert list(outside.iterdir()) == []
    assert ws.read("r1", "llm", 0, tokens="answer").values.shape == (16, 4)  # untouched arrays still read


def test_stimulus_paths_cannot_leave_their_set(tmp_path):
    family = get_family("g2m")
    good = write_set(family, family.config(grid_sizes=(3,), colors=(3,), image_size=64), n=2, seed=0,
                     split="test", out=tmp_path / "g2m")
    assert read_set(good).image(read_set(good).rows()[0]).size == (64, 64)
    table = pq.read_table(good / "truth.parquet")
    secret = tmp_path / "secret.png"
    secret.write_bytes((good / table.column("image")[0].as_py()).read_bytes())
    for bad in ("../secret.png", str(secret), "images/../../secret.png"):
        images = table.column("image").to_pylist()
        images[1] = bad
        pq.write_table(table.set_column(table.schema.get_field_index("image"), "image", pa.array(images)),
                       good / "truth.parquet")
        with pytest.raises(StimulusError, match="stay inside"):
            read_set(good)


def test_the_extraction_refuses_a_set_whose_images_leave_it(tmp_path):
    from extract.run import collect_samples

    family = get_family("g2m")
    s = write_set(family, family.config(grid_sizes=(3,), colors=(3,), image_size=64), n=1, seed=0,
                  split="test", out=tmp_path / "g2m")
    table = pq.read_table(s / "truth.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index("image"), "image", pa.array(["/etc/hostname"])),
                   s / "truth.parquet")
    manifest = parse_manifest({"run": "r", "model": {"path": "m"}, "stimuli": [{"set": str(s)}]})
    with pytest.raises(StimulusError, match="stay inside"):
        collect_samples(manifest)


@pytest.mark.parametrize("key", ["../../outside", "/etc/passwd", "a/b"])
def test_probe_keys_cannot_name_a_path(workspace, key):
    with pytest.raises(ProbeError, match="refusing a path outside"):
        load_probe(workspace, key)
