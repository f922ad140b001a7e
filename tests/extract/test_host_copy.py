"""Captured values reach the store with one copy: the hook's gather.

On the CPU the store reads the tensor the hook made (no clone, no stack of per-sample slices); an
adapter that splits its one gather per image hands back a view of it, not a second copy. On CUDA the
copy to host runs on a side stream into pinned memory (``host_copy="async"``), checked here against
the synchronous copy when a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE

from extract.models import capture_first_token, prepare_batch
from extract.models.capture import _all_finite, _stack
from extract.run import batch_values
from stimuli import get_family
from stimuli.io import read_set, write_set
from store import ArraySpec

TAPS = {"vision.0": ["image"], "vision.-1": ["image"], "llm.0": ["image", "last"], "llm.-1": ["image"]}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    family = get_family("g2m")
    out = tmp_path_factory.mktemp("stimuli") / "g2m"
    folder = write_set(family, family.config(grid_sizes=(3,), colors=(3,), image_size=112), n=3, seed=0,
                       split="test", out=out)
    stim = read_set(folder)
    rows = stim.rows()
    return [stim.path / r["image"] for r in rows], [r["prompts"][next(iter(r["prompts"]))] for r in rows]


def _capture(lm, images, host_copy="sync"):
    paths, prompts = images
    batch = prepare_batch(lm, paths, prompts, padding_side="left")
    return batch, capture_first_token(lm, batch, TAPS, host_copy=host_copy)


def test_adjacent_pieces_of_one_gather_are_stacked_as_a_view():
    gathered = torch.arange(24.0).reshape(6, 4)
    stacked = _stack(list(gathered.split([2, 2, 2])))
    assert stacked.shape == (3, 2, 4)
    assert stacked.data_ptr() == gathered.data_ptr()  # no second copy
    assert torch.equal(stacked, gathered.reshape(3, 2, 4))
    apart = _stack([gathered[0:2], gathered[3:5]])  # a gap: the pieces are not one buffer
    assert apart.data_ptr() != gathered.data_ptr()
    assert torch.equal(apart, torch.stack([gathered[0:2], gathered[3:5]]))


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_cpu_store_values_are_the_captured_tensors(arch, tiny_lm, images):
    if DEVICE != "cpu":
        pytest.skip("the CPU path: on an accelerator the host copy is the one copy")
    lm = tiny_lm(arch)
    batch, res = _capture(lm, images)
    assert res.ready is None
    specs = {}
    for key in res.keys():
        value = res[key]
        assert isinstance(value, torch.Tensor)
        specs[key] = ArraySpec(tap=key.tap, layer=key.layer, site=key.site, tokens=key.kind,
                               shape=tuple(value.shape[1:]), dtype="float32")
    n = len(images[0])
    firsts = [lay.first_position for lay in res.layouts]
    out = batch_values(res, specs, lm.dtype, False, firsts, batch.seq_len, [0] * n)
    for key, value in out.items():
        assert value.data_ptr() == res[key].data_ptr(), f"{key.name}: the store got a copy"
        assert torch.equal(value, torch.stack([res[key][b] for b in range(n)]))


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_async_host_copy_equals_the_sync_one(arch, tiny_lm, images):
    lm = tiny_lm(arch)
    _, sync = _capture(lm, images)
    _, lazy = _capture(lm, images, host_copy="async")
    if lm.device.type == "cuda":
        assert lazy.ready is not None
        lazy.ready()
        for key in sync.keys():
            assert lazy[key].is_pinned()
    else:
        assert lazy.ready is None
    for key in sync.keys():
        assert lazy[key].device.type == "cpu"
        assert torch.equal(lazy[key], sync[key]), key.name


def test_finite_check_is_exact():
    big = torch.full((4,), 3e38)  # finite values whose float32 sum overflows
    assert _all_finite([big, torch.ones(3)]) == [True, True]
    assert _all_finite([torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf"), 2.0])]) == [False, False]
    assert _all_finite([torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.zeros(0)]) == [True, True]
    assert _all_finite([]) == []


def test_points_resolved_once_capture_what_names_capture(tiny_lm, images):
    from extract.models import resolve_points
    from extract.models.errors import TapError

    lm = tiny_lm("qwen2_vl")
    points = resolve_points(lm, TAPS, ())
    assert resolve_points(lm, points, ()) == points
    with pytest.raises(TapError, match="not a mix"):
        resolve_points(lm, [points[0], "llm.0"], ("image",))
    paths, prompts = images
    batch = prepare_batch(lm, paths, prompts, padding_side="left")
    by_name = capture_first_token(lm, batch, TAPS)
    by_point = capture_first_token(lm, batch, points)
    assert set(by_name.keys()) == set(by_point.keys())
    for key in by_name.keys():
        assert torch.equal(by_name[key], by_point[key]), key.name
