"""xarray opens a site group of the store as it is: per-kind token dims, the stimulus id as the
``sample`` coordinate (issue: "conflicting sizes for dimension 'token'", nothing to join on)."""

from __future__ import annotations

import numpy as np
import pytest
from storetest_lib import DIM, TOKENS, dense_values, stimulus_rows

from store import ArraySpec, RunInfo, StoreError, Workspace

xr = pytest.importorskip("xarray", reason="xarray is in the dev extras: make setup")


def write(ws: Workspace, run: str, rows: list[int]) -> list[str]:
    with ws.writer(RunInfo(run=run, model="tiny-test", dtype="float32", chunk_samples=4)) as w:
        keys = w.register_stimuli(stimulus_rows(8), dataset="set")
        keys = [keys[i] for i in rows]
        w.set_samples(keys)
        img = w.array(ArraySpec(tap="llm", layer=3, tokens="image", shape=(TOKENS, DIM)))
        last = w.array(ArraySpec(tap="llm", layer=3, tokens="last", shape=(1, DIM)))
        ans = w.array(ArraySpec(tap="llm", layer=3, tokens="answer", shape=(DIM,), ragged=True))
        vals = dense_values(rows)
        w.write_batch(0, {img: vals, last: vals[:, :1], ans: [np.ones((1, DIM), np.float32)] * len(rows)})
        w.finish()
    return keys


@pytest.mark.slow
def test_a_site_group_opens_in_xarray_indexed_by_stimulus(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    keys_a = write(ws, "a", list(range(8)))
    keys_b = write(ws, "b", [7, 5, 3, 1])  # another run over some of the stimuli, in another order
    site = ws.zarr_path / "a" / "llm" / "3" / "resid_post"
    ds = xr.open_zarr(site, consolidated=False)
    assert dict(ds.sizes) == {"sample": 8, "image_token": TOKENS, "last_token": 1, "dim": DIM}
    assert set(ds.data_vars) == {"image", "last"}  # the ragged answer group is not an xarray variable
    assert ds["sample"].values.tolist() == keys_a
    np.testing.assert_array_equal(ds["image"].values, ws.read("a", "llm", 3, tokens="image"))
    # Join two runs on the stimulus id, as a plain xarray user would.
    db = xr.open_zarr(ws.zarr_path / "b" / "llm" / "3" / "resid_post", consolidated=False)
    both = xr.align(ds["image"], db["image"], join="inner")
    assert both[0]["sample"].values.tolist() == sorted(keys_b)
    np.testing.assert_array_equal(both[0].values, both[1].values)


def test_the_coordinate_name_is_no_token_kind():
    with pytest.raises(StoreError, match="reserved"):
        ArraySpec(tap="llm", layer=0, tokens="sample", shape=(4,))
