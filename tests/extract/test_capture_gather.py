"""Token positions -> captured rows: a slice when every sample has the same run of positions, an
index gather otherwise, with the same values either way."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from extract.models.layout import ImageGeometry, SampleLayout

capture = importlib.import_module("extract.models.capture")  # the package re-exports a function of that name


def _layout(image: list[int], last: int) -> SampleLayout:
    return SampleLayout(geometry=ImageGeometry.none(), image_positions=np.array(image, dtype=np.int64),
                        last_position=last)


def _indexed(x: torch.Tensor, layouts: list[SampleLayout], kind: str, dim: int) -> list[torch.Tensor]:
    """Each sample's rows, one position at a time: the reference."""
    return [torch.stack([x.select(0, b).select(dim - 1, int(p)) for p in lay.positions(kind)])
            for b, lay in enumerate(layouts)]


def _rows(got: capture.Captured, dim: int) -> list[torch.Tensor]:
    if isinstance(got, capture.RaggedTokens):
        return got.rows()
    return [got[b].movedim(dim - 1, 0) for b in range(got.shape[0])]


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize(("image", "span"), [
    ([[3, 4, 5, 6], [3, 4, 5, 6]], (3, 4)),          # one run, the same in every sample: a slice
    ([[3, 4, 5, 6], [4, 5, 6, 7]], None),            # the same count, another start
    ([[3, 4, 6, 7], [3, 4, 6, 7]], None),            # a gap
    ([[3, 4, 5], [3, 4, 5, 6]], None),               # ragged
])
def test_slice_and_gather_keep_the_same_rows(dim, image, span):
    layouts = [_layout(pos, last=9) for pos in image]
    g = capture.gather_positions(layouts, "image", torch.device("cpu"))
    assert g.span == span
    x = torch.randn(2, 3, 10, 5) if dim == 2 else torch.randn(2, 10, 5)
    got = capture._take(x, g, dim=dim)
    want = _indexed(x, layouts, "image", dim)
    assert all(torch.equal(a, b) for a, b in zip(_rows(got, dim), want, strict=True))
    if isinstance(got, torch.Tensor):
        assert got.shape[dim] == len(image[0])


def test_a_slice_is_a_copy_of_its_own():
    """The module's output may be reused once the forward moves on: the kept rows must not alias it."""
    layouts = [_layout([2, 3, 4], last=6)]
    g = capture.gather_positions(layouts, "image", torch.device("cpu"))
    x = torch.randn(1, 8, 4)
    got = capture._take(x, g, dim=1)
    assert isinstance(got, torch.Tensor) and got.is_contiguous()
    before = got.clone()
    x.zero_()
    assert torch.equal(got, before)


def test_a_shift_counts_the_positions_the_output_lacks():
    """generate's logits exist for the last positions only: position p is row p - shift."""
    layouts = [_layout([2, 3], last=7), _layout([2, 3], last=7)]
    g = capture.gather_positions(layouts, "last", torch.device("cpu"))
    assert g.span == (7, 1)
    full = torch.randn(2, 8, 3)
    got = capture._take(full[:, 6:], g, dim=1, shift=6)
    assert torch.equal(got, full[:, 7:8])
    assert capture._reaches_before(g, 8) and not capture._reaches_before(g, 7)
    ragged = capture.gather_positions([_layout([2, 3], 7), _layout([5], 7)], "image", torch.device("cpu"))
    assert ragged.span is None and capture._reaches_before(ragged, 3) and not capture._reaches_before(ragged, 2)


def test_submodule_matches_get_submodule():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    assert capture._submodule(model, "0.1") is model.get_submodule("0.1")
    assert capture._submodule(model, "") is model
    with pytest.raises(AttributeError):
        capture._submodule(model, "0.7")
