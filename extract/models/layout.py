"""Where the image is in a sample: token positions and the patch grids they form.

Probes never guess positions: for every sample the extraction records which LLM positions hold
image tokens, which position is the last prompt token, which hold the answer, and how the image
tokens of each tap (vision tower, projector input/output, LLM) tile the image in raster order.
A grid is a tuple of :class:`GridSegment`; most models have one segment, tiling models one per
view (LLaVA-OneVision: base image, then the tiles with a newline token closing each row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from store.vocab import TAPS


@dataclass(frozen=True)
class GridSegment:
    """``rows`` x ``cols`` tokens in raster order: token (r, c) sits at ``start + r*row_stride + c``.

    ``row_stride`` exceeds ``cols`` when each row is followed by separator tokens (LLaVA-OneVision's
    image newline). Indices are into the tap's own token list (e.g. into ``image_positions`` for
    the LLM), not into the sequence.
    """

    start: int
    rows: int
    cols: int
    row_stride: int = 0  # 0 means == cols
    view: str = "image"

    def __post_init__(self) -> None:
        if self.row_stride == 0:
            object.__setattr__(self, "row_stride", self.cols)

    @property
    def n_tokens(self) -> int:
        return self.rows * self.row_stride

    def index(self, row: int, col: int) -> int:
        return self.start + row * self.row_stride + col

    def indices(self) -> np.ndarray:
        """[rows, cols] array of token indices."""
        r = np.arange(self.rows)[:, None] * self.row_stride
        return self.start + r + np.arange(self.cols)[None, :]


Grid = tuple[GridSegment, ...]


def single(rows: int, cols: int, view: str = "image") -> Grid:
    return (GridSegment(0, rows, cols, view=view),)


def views(n_views: int, rows: int, cols: int, names: list[str] | None = None) -> Grid:
    """``n_views`` equal grids one after another (tiles of one image)."""
    names = names or (["image"] if n_views == 1 else [f"view{i}" for i in range(n_views)])
    return tuple(GridSegment(i * rows * cols, rows, cols, view=names[i]) for i in range(n_views))


def extent(grid: Grid) -> int:
    """Tokens spanned from index 0 to the end of the last segment."""
    return max((s.start + s.n_tokens for s in grid), default=0)


@dataclass(frozen=True)
class ImageGeometry:
    """How one sample's image is tokenised by each tap (all grids raster-ordered).

    ``vision`` covers the vision-tap tokens (CLS dropped), ``projector_in`` / ``projector_out`` the
    connector's input and output tokens, ``llm`` the image tokens of the LLM sequence.
    ``llm_tokens`` counts the image tokens in the sequence (grid extent unless tokens outside any
    grid follow, e.g. a closing newline). ``llm_source`` maps each LLM image token to the vision
    token it was made from (-1: none, e.g. a newline) where that is not the identity (tiling).
    """

    vision: Grid
    projector_in: Grid
    projector_out: Grid
    llm: Grid
    n_views: int = 1
    llm_tokens: int = 0
    llm_source: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.llm_tokens == 0:
            object.__setattr__(self, "llm_tokens", extent(self.llm))

    @classmethod
    def none(cls) -> ImageGeometry:
        """A text-only sample: no views, no image tokens anywhere."""
        return cls((), (), (), (), n_views=0)


@dataclass(frozen=True, eq=False)
class SampleLayout:
    """Token positions of one sample of a batch (positions index the padded batch row, each kind's
    in increasing order, none twice).

    ``answer_positions`` is empty unless the batch was built with teacher-forced answers.
    """

    geometry: ImageGeometry
    image_positions: np.ndarray
    last_position: int
    answer_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    first_position: int = 0  # first non-pad position (left padding moves it)
    length: int = 0  # number of real (non-pad) tokens

    def positions(self, kind: str) -> np.ndarray:
        if kind == "image":
            return self.image_positions
        if kind == "last":
            return np.array([self.last_position], dtype=np.int64)
        return self.answer_positions

    def grid(self, tap: str, site: str) -> Grid | None:
        """The grid that a tap's ``image`` tokens form (None for taps without one)."""
        if tap == "vision":
            # pre_merger is the merger input on the vision-tap grid
            return self.geometry.vision
        if tap == "projector":
            return self.geometry.projector_in if site == "in" else self.geometry.projector_out
        if tap in TAPS:  # every other tap reads the LLM's sequence
            return self.geometry.llm
        return None
