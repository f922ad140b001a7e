"""CountingTricks (study counting-tricks): 32 counting cases that move objects against the patch grid.

A ``image_size`` canvas (384 px, white) is cut into a ``patch_size`` grid (P = 27 or 14 in the
study; ``grid = image_size // P``); ``R0 = P // 2`` makes the base diameter about one patch.
Objects are filled shapes (circle by default, or square / triangle) in one colour (red).
Cases 1-8 follow the MAS ``generate.py`` rule for rule (docs/studies.md#counting-tricks-cases); 1C/1D and 9-15
are this project's definitions (the code has none). Full rules: ``docs/stimuli/counting-tricks.md``.

=====  ==================================================  ============================  =======
case   centre (1-8) or arrangement (9-15)                  size (radius / half side)     spacing
=====  ==================================================  ============================  =======
1A-1D  patch centre ``(i·P+P//2, j·P+P//2)``               A,C: R0  B,D: U(0.3,1.2)·R0   min_gap 3
2A-2D  vertical patch boundary, x -> ``(x//P)·P``          as 1                          min_gap 3
3A-3D  horizontal patch boundary, y -> ``(y//P)·P``        as 1                          min_gap 3
4A-4D  intersection ``(round(x/P)·P, round(y/P)·P)``       as 1                          min_gap 3
 C, D  + ``U(±0.5·R0) + choice(±0.25·R0)`` on x (2), y (3), x and y (1, 4); clamp; int()
5A-8A  patch centre, diameter 2.5 / 3 / 3.5 / 4 patches    k·P/2                         3/4/3/5
9A/B   side-by-side pairs (horizontal or vertical)         A: R0  B: U(0.3,1.2)·R0       gap g
10A/B  horizontal rows (long rows wrap, balanced)          as 9                          gap g
11A/B  one ring, neighbours g apart, closed                as 9                          gap g
12A/B  one compact cluster grown object by object          as 9                          gap g
13A/B  vertical columns                                    as 9                          gap g
14A    row at pitch P, centres on patch centres            P/2: one object per patch     gap 0
15A    row at pitch P, centres on vertical boundaries      P/2: each object cut in two   gap 0
=====  ==================================================  ============================  =======

``min_gap``: the code keeps base cells ``min_gap+1`` cells apart along at least one axis.
``g ~ U(adjacency_gap)·2·R0`` per sample (default 0 to ¼ of the base diameter); separate
groups keep two patches apart. Objects that break the code's edge rule (closer than P//2 to an
edge) or that cannot be placed are not drawn: ``count`` is what was drawn (the answer),
``requested_count`` what was asked for.

Sample ``i`` of every case shares its requested count, and of every min_gap-3 case its base
positions, like the code (one base set per image), so cases compare the same scenes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageColor

from stimuli.answers import parse_number
from stimuli.base import (
    Family,
    Score,
    Stimulus,
    StimulusError,
    Truth,
    check_choice,
    check_int_range,
    compare,
    option,
)

SHAPES = ("circle", "square", "triangle")
GRID_PLACEMENTS = ("cell_centre", "vertical_line", "horizontal_line", "intersection")
ARRANGEMENTS = ("pairs", "rows", "ring", "cluster", "columns", "patch_row", "boundary_row")
# Edge gap kept between objects of different adjacency groups, in patches.
GROUP_CLEARANCE_PATCHES = 2.0
# The code tries at most this many candidate cells when spreading base positions.
MAX_BASE_ATTEMPTS = 5000
GROUP_PLACEMENT_TRIES = 300
MIN_GRID = 8
MAX_COUNT = 254  # the mask stores object index + 1 in one byte
GRID_LINE_RGB = (211, 211, 211)  # PIL 'lightgray', the code's draw_grid colour

STANDARD_PROMPT = (
    "How many {plural} are there in the image? Respond concisely with shape counts using the"
    " following format: {plural}: {{number}}"
)
CONFLICT_PREFIX = "The caption says the image contains {distractor} {noun}. "


@dataclass(frozen=True)
class Case:
    """One of the 32 cases: where centres go, how big objects are, how they are spaced."""

    id: str
    placement: str  # a GRID_PLACEMENTS or ARRANGEMENTS entry
    size: str  # "fixed" (R0), "varied" (U(varied_radius)·R0), "dilated" (k·P/2), "patch" (P/2)
    jitter_axes: str = ""  # "", "x", "y" or "xy"
    diameter_patches: float = 0.0  # dilated cases only
    min_gap: int = 3  # the code's base-position spacing rule, in cells

    @property
    def adjacency(self) -> bool:
        return self.placement in ARRANGEMENTS

    @property
    def description(self) -> str:
        where = self.placement.replace("_", " ")
        size = f"{self.diameter_patches:g}-patch diameter" if self.size == "dilated" else f"{self.size} size"
        jitter = f", jittered along {self.jitter_axes}" if self.jitter_axes else ""
        return f"{where}, {size}{jitter}"


def _build_cases() -> dict[str, Case]:
    cases: list[Case] = []
    jitter_of = {"cell_centre": "xy", "vertical_line": "x", "horizontal_line": "y", "intersection": "xy"}
    for number, placement in enumerate(GRID_PLACEMENTS, start=1):
        for letter, size, jittered in (("A", "fixed", False), ("B", "varied", False),
                                       ("C", "fixed", True), ("D", "varied", True)):
            cases.append(Case(f"{number}{letter}", placement, size, jitter_of[placement] if jittered else ""))
    for number, diameter, min_gap in ((5, 2.5, 3), (6, 3.0, 4), (7, 3.5, 3), (8, 4.0, 5)):
        cases.append(Case(f"{number}A", "cell_centre", "dilated", diameter_patches=diameter, min_gap=min_gap))
    for number, arrangement in ((9, "pairs"), (10, "rows"), (11, "ring"), (12, "cluster"), (13, "columns")):
        cases.append(Case(f"{number}A", arrangement, "fixed"))
        cases.append(Case(f"{number}B", arrangement, "varied"))
    cases.append(Case("14A", "patch_row", "patch"))
    cases.append(Case("15A", "boundary_row", "patch"))
    return {case.id: case for case in cases}


CASES: dict[str, Case] = _build_cases()
ALL_CASES: tuple[str, ...] = tuple(CASES)


@dataclass(frozen=True)
class Config:
    cases: tuple[str, ...] = option(ALL_CASES, "case ids to generate, n samples each (e.g. 1A 4D 9B)")
    shape: str = option("circle", "object shape", choices=SHAPES)
    colour: str = option("red", "object colour: a PIL colour name or #rrggbb")
    background: str = option("white", "background colour: a PIL colour name or #rrggbb")
    count_min: int = option(1, "smallest requested object count (the paper uses 3..12)")
    count_max: int = option(10, "largest requested object count")
    patch_size: int = option(27, "patch side P in pixels (the study uses 27 and 14)")
    image_size: int = option(384, "canvas side in pixels")
    adjacency_gap: tuple[float, ...] = option(
        (0.0, 0.25), "cases 9-13: neighbour gap range LO HI as a fraction of the base diameter 2·R0")
    varied_radius: tuple[float, ...] = option(
        (0.3, 1.2), "varied-size cases: radius range LO HI as a fraction of R0 = P//2")
    draw_grid: bool = option(False, "draw the patch grid in light grey (for looking, not for models)")

    def __post_init__(self) -> None:
        validate(self)

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def r0(self) -> int:
        return self.patch_size // 2


def validate(config: Config) -> None:
    """Raise a :class:`StimulusError` naming the first bad parameter and how to fix it."""
    if not config.cases:
        raise StimulusError(
            "cases is empty: name at least one case, e.g. --cases 1A, or leave it out for all 32")
    for case_id in config.cases:
        if case_id not in CASES:
            raise StimulusError(f"cases: unknown case {case_id!r}; choose from {' '.join(ALL_CASES)}")
    if len(set(config.cases)) != len(config.cases):
        raise StimulusError(f"cases lists a case twice ({' '.join(config.cases)}): name each case once")
    check_choice("shape", config.shape, SHAPES)
    colour, background = _rgb("colour", config.colour), _rgb("background", config.background)
    if colour == background:
        raise StimulusError(
            f"colour={config.colour!r} equals background={config.background!r}: pick two different colours")
    check_int_range("count_min", config.count_min, 0, MAX_COUNT, "Counts cannot be negative.")
    check_int_range("count_max", config.count_max, 0, MAX_COUNT,
                    f"The mask holds at most {MAX_COUNT} objects.")
    if config.count_max < config.count_min:
        raise StimulusError(
            f"the count range {config.count_min}..{config.count_max} is empty: make count_min <= count_max")
    check_int_range("image_size", config.image_size, 32, 8192)
    check_int_range("patch_size", config.patch_size, 4, None, "Use a patch side of at least 4 px.")
    if config.grid < MIN_GRID:
        raise StimulusError(
            f"patch_size={config.patch_size} is too big for image_size={config.image_size}: the grid would be"
            f" {config.grid} patches a side and the cases need {MIN_GRID}; use patch_size <="
            f" {config.image_size // MIN_GRID} or a larger image_size")
    _check_range("adjacency_gap", config.adjacency_gap, 0.0, 1.0)
    _check_range("varied_radius", config.varied_radius, 0.0, 4.0)
    smallest = config.varied_radius[0] * config.r0
    if smallest < 1:
        raise StimulusError(
            f"varied_radius LO={config.varied_radius[0]} gives {smallest:.2g} px objects at"
            f" patch_size={config.patch_size}: raise LO to at least {1 / config.r0:.2g}"
            " so every object is a pixel wide")


def _rgb(name: str, value: str) -> tuple[int, int, int]:
    try:
        rgb = ImageColor.getrgb(value)
    except (ValueError, AttributeError) as err:
        raise StimulusError(
            f"{name}={value!r} is not a colour: use a name such as red or a hex code such as #ff0000") from err
    return (rgb[0], rgb[1], rgb[2])


def _check_range(name: str, value: tuple[float, ...], lo: float, hi: float) -> None:
    if len(value) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        flag = "--" + name.replace("_", "-")
        raise StimulusError(f"{name}={value!r} must be two numbers LO HI, e.g. {flag} {lo} {hi}")
    a, b = value
    if not (lo <= a <= b <= hi):
        raise StimulusError(f"{name}={a} {b} is out of range: need {lo} <= LO <= HI <= {hi}")


# ---------------------------------------------------------------------------------------------
# Objects and their geometry

@dataclass(frozen=True)
class Obj:
    """One object before drawing: centre, size (radius / half side), grid anchor, group."""

    x: float
    y: float
    r: float
    anchor_x: float
    anchor_y: float
    group: int


GapFn = Callable[[float, float, float, float, float, float], float]


def circle_gap(x1: float, y1: float, r1: float, x2: float, y2: float, r2: float) -> float:
    """Edge-to-edge distance of two discs (negative: they overlap)."""
    return math.hypot(x1 - x2, y1 - y2) - r1 - r2


def box_gap(x1: float, y1: float, r1: float, x2: float, y2: float, r2: float) -> float:
    """Edge-to-edge distance of two axis-aligned squares of half sides r1, r2 (negative: overlap).

    Squares are these boxes; triangles are spaced by them too (a triangle fills its box's top
    apex and bottom corners), so for triangles the true outline gap is at least this.
    """
    ex = abs(x1 - x2) - r1 - r2
    ey = abs(y1 - y2) - r1 - r2
    if ex > 0 and ey > 0:
        return math.hypot(ex, ey)
    return max(ex, ey)


def gap_fn(shape: str) -> GapFn:
    return circle_gap if shape == "circle" else box_gap


def nearest_gaps(objects: list[Obj], gap: GapFn) -> list[float]:
    """Each object's gap to its nearest neighbour; -1.0 for a lone object."""
    out = []
    for a in objects:
        gaps = [gap(a.x, a.y, a.r, b.x, b.y, b.r) for b in objects if b is not a]
        out.append(min(gaps) if gaps else -1.0)
    return out


# ---------------------------------------------------------------------------------------------
# Cases 1-8: the MAS generator, step for step

def requested_count(config: Config, seed: int, index: int) -> int:
    """Counts cycle through a fresh permutation of the range every K samples, so every block of
    K consecutive samples is balanced (the code balances per run) while sample ``index``
    never depends on ``n``."""
    k = config.count_max - config.count_min + 1
    perm = np.random.default_rng([seed, index // k, 1]).permutation(k)
    return config.count_min + int(perm[index % k])


def base_positions(config: Config, count: int, min_gap: int,
                   rng: np.random.Generator) -> list[tuple[int, int]]:
    """Case 1A positions: random cell centres, one cell in from every edge, spread by min_gap."""
    p, grid = config.patch_size, config.grid
    available = [(i * p + p // 2, j * p + p // 2) for i in range(1, grid - 1) for j in range(1, grid - 1)]
    chosen: list[tuple[int, int]] = []
    attempts = 0
    while len(chosen) < count and available and attempts < MAX_BASE_ATTEMPTS:
        coord = available.pop(int(rng.integers(len(available))))
        if not any(_too_close(coord, other, p, min_gap) for other in chosen):
            chosen.append(coord)
        attempts += 1
    return chosen


def _too_close(a: tuple[int, int], b: tuple[int, int], p: int, min_gap: int) -> bool:
    # The code's rule: far enough if min_gap+1 cells apart along either axis.
    dx, dy = abs(a[0] // p - b[0] // p), abs(a[1] // p - b[1] // p)
    return not (dx >= min_gap + 1 or dy >= min_gap + 1)


def _to_line(v: int, p: int, size: int) -> int:
    """The code's move onto a patch boundary: the lower line unless that is the image edge."""
    lower = (v // p) * p
    new = lower if lower >= p else lower + p
    return lower if new >= size - p else new


def _to_intersection(v: int, p: int, size: int) -> int:
    # Python's round() is banker's rounding: with even P a cell centre is exactly x.5 patches
    # and goes to the even line; the code relies on this, so it is kept.
    g = round(v / p) * p
    return p if g <= p else size - p if g >= size - p else g


def anchor(placement: str, x: int, y: int, config: Config) -> tuple[int, int]:
    """Where a base position goes for a grid placement, before any jitter."""
    p, s = config.patch_size, config.image_size
    if placement == "vertical_line":
        return _to_line(x, p, s), y
    if placement == "horizontal_line":
        return x, _to_line(y, p, s)
    if placement == "intersection":
        return _to_intersection(x, p, s), _to_intersection(y, p, s)
    return x, y


def jitter(v: float, config: Config, rng: np.random.Generator) -> int:
    """The code's C/D translation: U(-0.5·R0, 0.5·R0) + choice(±0.25·R0), clamped, truncated.

    The code's comment says "25%-75% of the radius", but the sum spans -0.75..0.75·R0 and can be
    near 0; this keeps what the code does.
    """
    r0, p, s = config.r0, config.patch_size, config.image_size
    shift = rng.uniform(-0.5 * r0, 0.5 * r0) + (0.25 * r0 if rng.integers(2) else -0.25 * r0)
    margin = p + r0
    return int(max(margin, min(s - margin, v + shift)))


def radii(case: Case, config: Config, count: int, rng: np.random.Generator) -> list[float]:
    if case.size == "varied":
        lo, hi = config.varied_radius
        return [float(rng.uniform(lo * config.r0, hi * config.r0)) for _ in range(count)]
    if case.size == "dilated":
        return [case.diameter_patches * config.patch_size / 2] * count
    if case.size == "patch":
        return [config.patch_size / 2] * count
    return [float(config.r0)] * count


def within_edges(x: float, y: float, r: float, config: Config) -> bool:
    """The code's edge rule: an object is drawn only if it stays P//2 clear of every edge."""
    m, s = config.patch_size // 2, config.image_size
    return x - r >= m and y - r >= m and x + r <= s - m and y + r <= s - m


def grid_case_objects(case: Case, config: Config, base: list[tuple[int, int]],
                      rng: np.random.Generator) -> list[Obj]:
    anchors = [anchor(case.placement, x, y, config) for x, y in base]
    centres: list[tuple[int, int]] = []
    for ax, ay in anchors:
        x = jitter(ax, config, rng) if "x" in case.jitter_axes else ax
        y = jitter(ay, config, rng) if "y" in case.jitter_axes else ay
        centres.append((x, y))
    sizes = radii(case, config, len(centres), rng)
    objects: list[Obj] = []
    for (ax, ay), (x, y), r in zip(anchors, centres, sizes, strict=True):
        if within_edges(x, y, r, config):
            objects.append(Obj(float(x), float(y), r, float(ax), float(ay), group=len(objects)))
    return objects


# ---------------------------------------------------------------------------------------------
# Cases 9-15: adjacency. Groups are laid out in local coordinates, then placed on the canvas.

Local = list[tuple[float, float, float]]  # (dx, dy, r) within one group


def _line(sizes: list[float], gap: float, vertical: bool) -> Local:
    out: Local = []
    pos = 0.0
    for k, r in enumerate(sizes):
        if k:
            pos += sizes[k - 1] + gap + r
        out.append((0.0, pos, r) if vertical else (pos, 0.0, r))
    return out


def _split_evenly(n: int, parts: int) -> list[int]:
    """Lengths of ``parts`` consecutive runs covering n items, differing by at most one."""
    bounds = [k * n // parts for k in range(parts + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def _chunk_lines(sizes: list[float], gap: float, room: float) -> list[list[float]]:
    """Split a row into the fewest rows of near-equal count that each fit ``room`` pixels, so a
    long row wraps into balanced rows rather than leaving one object alone at the end."""
    for parts in range(1, len(sizes) + 1):
        lengths, start, lines = _split_evenly(len(sizes), parts), 0, []
        for length in lengths:
            lines.append(sizes[start:start + length])
            start += length
        if all(sum(2 * r for r in line) + gap * (len(line) - 1) <= room for line in lines):
            return lines
    return [[r] for r in sizes]  # a lone object too big for the canvas is dropped on placement


def _bisect(f: Callable[[float], float], lo: float, hi: float, steps: int = 60) -> float:
    """The smallest t in [lo, hi] with f(t) >= 0, given f(lo) < 0 <= f(hi) (f increasing)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        if f(mid) >= 0:
            hi = mid
        else:
            lo = mid
    return hi


def _on_ray(px: float, py: float, pr: float, angle: float, r: float, gap: float,
            fn: GapFn) -> tuple[float, float]:
    """The point along ``angle`` from (px, py) where an object of size r sits at ``gap``."""
    c, s = math.cos(angle), math.sin(angle)
    if fn is circle_gap:
        d = pr + r + gap
        return px + d * c, py + d * s
    d = _bisect(lambda t: fn(px, py, pr, px + t * c, py + t * s, r) - gap, 0.0, 2 * (pr + r + gap) + 1)
    return px + d * c, py + d * s


def _ring(sizes: list[float], gap: float, fn: GapFn, phase: float) -> Local:
    """Objects on one circle going round from ``phase``: each as close to the one before as the
    gap allows (or closer objects allow), the radius chosen so the last meets the first.

    Every pair ends at least ``gap`` apart and every object has a neighbour at exactly ``gap``;
    with varied sizes or box shapes that neighbour may be the one two steps back.
    """
    if len(sizes) < 3:
        return _line(sizes, gap, vertical=False)
    ring = _Ring(sizes, gap, fn, phase)
    radius = _bisect(ring.closing, 0.0, sum(2 * r + gap for r in sizes), 40)  # perimeter-sized: closes
    thetas = ring.place(radius)
    assert thetas is not None
    return [(*_Ring.point(radius, t), r) for t, r in zip(thetas, sizes, strict=False)]


@dataclass(frozen=True)
class _Ring:
    """The steps of :func:`_ring` for one set of objects: angles at a radius, and how far a ring of
    that radius is from closing."""

    sizes: list[float]
    gap: float
    fn: GapFn
    phase: float

    @staticmethod
    def point(radius: float, theta: float) -> tuple[float, float]:
        return radius * math.cos(theta), radius * math.sin(theta)

    def clear(self, radius: float, thetas: list[float], ks: range, theta: float, r: float) -> float:
        x, y = self.point(radius, theta)
        return min(self.fn(*self.point(radius, thetas[k]), self.sizes[k], x, y, r) for k in ks) - self.gap

    def next_to(self, radius: float, t0: float, r_prev: float, r: float) -> float | None:
        """The angle step that puts an object exactly ``gap`` from the previous one."""
        if self.fn is circle_gap:
            chord = r_prev + r + self.gap
            return 2 * math.asin(chord / (2 * radius)) if chord <= 2 * radius else None
        x0, y0 = self.point(radius, t0)

        def f(d: float) -> float:
            return self.fn(x0, y0, r_prev, *self.point(radius, t0 + d), r) - self.gap
        return _bisect(f, 0.0, math.pi, 40) if f(math.pi) >= 0 else None

    def place(self, radius: float) -> list[float] | None:
        """Each object's angle, going round from ``phase``; None if one cannot be placed."""
        sizes, thetas = self.sizes, [self.phase]
        for i in range(1, len(sizes)):
            t0 = thetas[-1]
            d = self.next_to(radius, t0, sizes[i - 1], sizes[i])
            if d is None:
                return None
            # A small object between big ones lets the next big one reach the one before; then
            # step on until every earlier object (but the first, settled by closing) is clear.
            if i > 2 and self.clear(radius, thetas, range(1, i - 1), t0 + d, sizes[i]) < 0:
                def f(x: float, i: int = i, t0: float = t0) -> float:
                    return self.clear(radius, thetas, range(1, i), t0 + x, sizes[i])
                if f(math.pi) < 0:
                    return None
                d = _bisect(f, d, math.pi, 40)
            thetas.append(t0 + d)
        return thetas

    def closing(self, radius: float) -> float:
        # >= 0 once the ring leaves room for the first object (the root: it just fits). Object
        # 1 is left out: its gap to the first is ``gap`` by construction, and float noise
        # around that would flip the sign.
        thetas = self.place(radius)
        if thetas is None or thetas[-1] - self.phase >= 2 * math.pi:
            return -1.0
        x0, y0 = self.point(radius, self.phase)
        others = [self.fn(x0, y0, self.sizes[0], *self.point(radius, t), self.sizes[k])
                  for k, t in enumerate(thetas) if k >= 2]
        return min(others) - self.gap


def _cluster(sizes: list[float], gap: float, fn: GapFn, rng: np.random.Generator) -> Local:
    """Grow a blob: each new object touches (at ``gap``) an earlier one, as near the middle as
    possible without coming closer than ``gap`` to any other."""
    out: Local = []
    for r in sizes:
        if not out:
            out.append((0.0, 0.0, r))
            continue
        cx = sum(p[0] for p in out) / len(out)
        cy = sum(p[1] for p in out) / len(out)
        phase = float(rng.uniform(0, 2 * math.pi))
        best: tuple[float, float, float] | None = None
        for px, py, pr in out:
            for k in range(16):
                x, y = _on_ray(px, py, pr, phase + k * math.pi / 8, r, gap, fn)
                if all(fn(x, y, r, qx, qy, qr) >= gap - 1e-6 for qx, qy, qr in out):
                    score = math.hypot(x - cx, y - cy)
                    if best is None or score < best[0]:
                        best = (score, x, y)
        assert best is not None  # the outermost object always has free directions
        out.append((best[1], best[2], r))
    return out


def _fits(group: Local, config: Config) -> bool:
    m, s = config.patch_size // 2, config.image_size
    width = max(x + r for x, _, r in group) - min(x - r for x, _, r in group)
    height = max(y + r for _, y, r in group) - min(y - r for _, y, r in group)
    return width <= s - 2 * m and height <= s - 2 * m


def free_groups(case: Case, config: Config, sizes: list[float], gap: float,
                rng: np.random.Generator) -> list[Local]:
    """The groups of cases 9-13 in local coordinates, each small enough to fit the canvas."""
    fn = gap_fn(config.shape)
    room = config.image_size - 2 * (config.patch_size // 2)
    if case.placement == "pairs":
        groups = []
        for k in range(0, len(sizes), 2):
            groups.append(_line(sizes[k:k + 2], gap, vertical=bool(rng.integers(2))))
        return groups
    if case.placement in ("rows", "columns"):
        vertical = case.placement == "columns"
        return [_line(line, gap, vertical) for line in _chunk_lines(sizes, gap, room)]
    # One ring or one cluster: leave objects off the end until it fits (count goes down).
    if case.placement == "cluster":
        grown = _cluster(sizes, gap, fn, rng)
        # Growth only looks back, so every prefix is the cluster of that many objects.
        candidates = (grown[:n] for n in range(len(grown), 0, -1))
    else:
        phase = float(rng.uniform(0, 2 * math.pi))
        candidates = (_ring(sizes[:n], gap, fn, phase) for n in range(len(sizes), 0, -1))
    return next(([group] for group in candidates if _fits(group, config)), [])


def place_free(groups: list[Local], config: Config, rng: np.random.Generator) -> list[Obj]:
    """Drop each group at a random spot inside the edge margin, clear of earlier groups;
    a group with no such spot in the tries allowed is left out."""
    fn = gap_fn(config.shape)
    clearance = GROUP_CLEARANCE_PATCHES * config.patch_size
    m, s = config.patch_size // 2, config.image_size
    placed: list[Obj] = []
    order = sorted(range(len(groups)), key=lambda g: -len(groups[g]))  # big groups first
    for g in order:
        group, gid = groups[g], len({o.group for o in placed})
        lo_x, hi_x = m - min(x - r for x, _, r in group), s - m - max(x + r for x, _, r in group)
        lo_y, hi_y = m - min(y - r for _, y, r in group), s - m - max(y + r for _, y, r in group)
        if lo_x > hi_x or lo_y > hi_y:
            continue
        for _ in range(GROUP_PLACEMENT_TRIES):
            tx, ty = rng.uniform(lo_x, hi_x), rng.uniform(lo_y, hi_y)
            moved = [Obj(x + tx, y + ty, r, x + tx, y + ty, gid) for x, y, r in group]
            if all(fn(a.x, a.y, a.r, b.x, b.y, b.r) >= clearance for a in moved for b in placed):
                placed.extend(moved)
                break
    return placed


def place_snapped_rows(case: Case, config: Config, count: int, rng: np.random.Generator) -> list[Obj]:
    """Cases 14A/15A: rows of one-patch objects at pitch P, centres on patch centres (14A) or on
    vertical patch boundaries (15A), rows on patch-centre lines, rows 2 patches apart."""
    p, grid, r = config.patch_size, config.grid, config.patch_size / 2
    centre = p // 2
    mid = config.image_size / 2  # stands in for the other axis when testing one axis's edges
    if case.placement == "patch_row":
        xs_all = [c * p + centre for c in range(grid)]
    else:
        xs_all = [k * p for k in range(grid + 1)]
    xs = [x for x in xs_all if within_edges(x, mid, r, config)]
    ys = [y for y in (j * p + centre for j in range(grid)) if within_edges(mid, y, r, config)]
    if not xs or not ys:
        return []
    fn = gap_fn(config.shape)
    clearance = GROUP_CLEARANCE_PATCHES * p
    lengths = _split_evenly(count, -(-count // len(xs))) if count else []
    placed: list[Obj] = []
    for length in lengths:
        gid = len({o.group for o in placed})
        spots = [(s0, y) for s0 in range(len(xs) - length + 1) for y in ys]
        for k in rng.permutation(len(spots)):
            s0, y = spots[int(k)]
            row = [Obj(float(x), float(y), r, float(x), float(y), gid) for x in xs[s0:s0 + length]]
            if all(fn(a.x, a.y, a.r, b.x, b.y, b.r) >= clearance for a in row for b in placed):
                placed.extend(row)
                break
    return placed


def adjacency_gap_px(case: Case, config: Config, rng: np.random.Generator) -> float:
    if case.size == "patch":
        return 0.0
    lo, hi = config.adjacency_gap
    return float(rng.uniform(lo, hi) * 2 * config.r0)


# ---------------------------------------------------------------------------------------------
# Drawing: one rasteriser for image and mask, so they agree pixel for pixel

def inside(shape: str, xs: np.ndarray, ys: np.ndarray, x: float, y: float, r: float) -> np.ndarray:
    """Pixels (integer coordinates, PIL's convention) that belong to an object.

    Circle: within r of the centre. Square: within r along both axes. Triangle: apex (x, y−r),
    base corners (x±r, y+r), i.e. the triangle filling the square's top middle and bottom corners.
    """
    eps = 1e-9  # exact tangencies stay stable across platforms
    if shape == "circle":
        return (xs - x) ** 2 + (ys - y) ** 2 <= r * r + eps
    if shape == "square":
        return (np.abs(xs - x) <= r + eps) & (np.abs(ys - y) <= r + eps)
    return (ys >= y - r - eps) & (ys <= y + r + eps) & (np.abs(xs - x) <= (ys - y + r) / 2 + eps)


def render(objects: list[Obj], config: Config) -> tuple[np.ndarray, np.ndarray]:
    """(RGB image, object-index mask). Later objects win shared pixels (only exact tangencies)."""
    s = config.image_size
    image = np.empty((s, s, 3), dtype=np.uint8)
    image[:] = _rgb("background", config.background)
    if config.draw_grid:
        image[:, :: config.patch_size] = GRID_LINE_RGB
        image[:: config.patch_size, :] = GRID_LINE_RGB
    mask = np.zeros((s, s), dtype=np.uint8)
    for k, o in enumerate(objects):
        x0, x1 = max(0, math.floor(o.x - o.r)), min(s - 1, math.ceil(o.x + o.r))
        y0, y1 = max(0, math.floor(o.y - o.r)), min(s - 1, math.ceil(o.y + o.r))
        ys, xs = np.mgrid[y0:y1 + 1, x0:x1 + 1]
        hit = inside(config.shape, xs, ys, o.x, o.y, o.r)
        mask[y0:y1 + 1, x0:x1 + 1][hit] = k + 1
    for k, o in enumerate(objects):
        # The pixel nearest the centre is always the object's own, so even a sub-pixel object
        # is drawn and a later neighbour's rim never takes an object's centre.
        mask[_centre_pixel(o.y, s), _centre_pixel(o.x, s)] = k + 1
    image[mask > 0] = _rgb("colour", config.colour)
    return image, mask


def _centre_pixel(v: float, size: int) -> int:
    return min(size - 1, max(0, math.floor(v + 0.5)))


def patch_ids(mask: np.ndarray, value: int, config: Config) -> tuple[list[int], int]:
    """Row-major ids (row·grid + col) of the patches holding any pixel of object ``value``, and
    its pixel count. Pixels in the strip past the last full patch count for the last patch, as
    in the code's ``get_patch_id``."""
    ys, xs = np.nonzero(mask == value)
    g, p = config.grid, config.patch_size
    ids = np.minimum(ys // p, g - 1) * g + np.minimum(xs // p, g - 1)
    return sorted(int(v) for v in np.unique(ids)), int(ys.size)


# ---------------------------------------------------------------------------------------------
# Prompts

def plural(shape: str) -> str:
    return shape + "s"


def distractor_offset(count: int, rng: np.random.Generator) -> int:
    """N±1 or N±2, never below 1, so the inserted number is always a real, wrong count."""
    offsets = [d for d in (-2, -1, 1, 2) if count + d >= 1]
    return offsets[int(rng.integers(len(offsets)))]


def prompts(shape: str, count: int, distractor: int) -> dict[str, str]:
    standard = STANDARD_PROMPT.format(plural=plural(shape))
    noun = shape if distractor == 1 else plural(shape)
    conflict = CONFLICT_PREFIX.format(distractor=distractor, noun=noun) + standard
    return {"standard": standard, "conflict": conflict}


# ---------------------------------------------------------------------------------------------
# Samples

def case_objects(case: Case, config: Config, seed: int, index: int,
                 requested: int) -> tuple[list[Obj], float, np.random.Generator]:
    """The objects of sample ``index`` of ``case``, the adjacency gap (-1.0 for grid cases) and
    the case's random stream (for the remaining per-sample draws)."""
    rng = np.random.default_rng([seed, index, 1000 + ALL_CASES.index(case.id)])
    if not case.adjacency:
        base_rng = np.random.default_rng([seed, index, 200 + case.min_gap])
        base = base_positions(config, requested, case.min_gap, base_rng)
        return grid_case_objects(case, config, base, rng), -1.0, rng
    gap = adjacency_gap_px(case, config, rng)
    if case.size == "patch":
        return place_snapped_rows(case, config, requested, rng), gap, rng
    sizes = radii(case, config, requested, rng)
    return place_free(free_groups(case, config, sizes, gap, rng), config, rng), gap, rng


def object_truth(objects: list[Obj], mask: np.ndarray, config: Config) -> list[dict[str, Any]]:
    gaps = nearest_gaps(objects, gap_fn(config.shape))
    out = []
    for k, (o, gap) in enumerate(zip(objects, gaps, strict=False)):
        ids, pixels = patch_ids(mask, k + 1, config)
        out.append({
            "index": k,
            "x": o.x,
            "y": o.y,
            "size": float(o.r),
            "bbox": [o.x - o.r, o.y - o.r, o.x + o.r, o.y + o.r],
            "anchor_x": o.anchor_x,
            "anchor_y": o.anchor_y,
            "group": o.group,
            "nearest_gap": float(gap),
            "pixels": pixels,
            "patch_ids": ids,
        })
    return out


def make_stimulus(case: Case, config: Config, seed: int, index: int, split: str) -> Stimulus:
    requested = requested_count(config, seed, index)
    objects, gap, rng = case_objects(case, config, seed, index, requested)
    image, mask = render(objects, config)
    count = len(objects)
    offset = distractor_offset(count, rng)
    per_object = object_truth(objects, mask, config)
    text = prompts(config.shape, count, count + offset)
    return Stimulus(
        id=f"counting-{case.id}-{index:05d}",
        family="counting",
        split=split,
        seed=seed,
        image=Image.fromarray(image),
        prompts=text,
        answers={task: str(count) for task in text},
        truth={
            "case": case.id,
            "arrangement": case.placement,
            "count": count,
            "requested_count": requested,
            "shape": config.shape,
            "image_size": config.image_size,
            "patch_size": config.patch_size,
            "grid_size": config.grid,
            "gap_px": gap,
            "distractor": count + offset,
            "distractor_offset": offset,
            "patch_ids": sorted({i for o in per_object for i in o["patch_ids"]}),
            "objects": per_object,
        },
        params={
            "case": case.id,
            "index": index,
            "requested_count": requested,
            "shape": config.shape,
            "colour": config.colour,
            "background": config.background,
            "patch_size": config.patch_size,
            "image_size": config.image_size,
            "description": case.description,
        },
        extra_images={"masks": Image.fromarray(mask)},
    )


def generate(config: Config, n: int, seed: int = 0, split: str = "test") -> Iterator[Stimulus]:
    """``n`` samples per case in ``config.cases``, case by case. Checks run before the first
    sample, so a bad parameter fails at the call, not mid-way through a write."""
    validate(config)
    check_int_range("n", n, 1, None, "Ask for at least one sample per case.")
    check_int_range("seed", seed, 0, None, "Use a non-negative seed.")
    return _samples(config, n, seed, split)


def _samples(config: Config, n: int, seed: int, split: str) -> Iterator[Stimulus]:
    for case_id in config.cases:
        for index in range(n):
            yield make_stimulus(CASES[case_id], config, seed, index, split)


@dataclass(frozen=True)
class CountingTruth(Truth):
    """``count``: objects drawn; ``objects``: one dict per object, ``bbox`` in pixels (x1, y1, x2,
    y2); ``image_size``: the image side in pixels; ``patch_size``: the patch side it is drawn against."""

    count: int
    objects: list[dict[str, Any]]
    image_size: int
    patch_size: int


def score_answer(task: str, text: str, answer: str, truth: CountingTruth) -> Score:
    """The first number in the answer (digits or words) equals the drawn count, for both tasks."""
    return compare(parse_number(text), truth.count)


FAMILY = Family(
    name="counting",
    description="CountingTricks: count shapes placed against the patch grid (32 cases, counting-tricks)",
    config=Config,
    generate=generate,
    cells=lambda config: len(config.cases),
    truth=CountingTruth,
    score=score_answer,
    small_set_n=4,  # per case: 4 x 32 cases
)
