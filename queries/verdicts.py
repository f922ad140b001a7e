"""Where is it lost? A verdict per question and group, decided by a stated test (docs/verdicts.md).

A question is a target read by one kind of probe from one token kind of one run; its evidence is
queries/evidence.py's curves: the ``present`` series (trained on every group, tested held out),
the ``transferable`` series (trained in-distribution, tested on every group), each with its
shuffled-label control, per group along depth, every value with a bootstrap interval.

Two comparisons decide everything, both on 95 % bootstrap intervals. The control of a present
series is its own shuffled-label control; the control of a transferable series is the present
series' control at the same depth, where there is a present series (see :func:`steps_down`).

* a series **beats its control** at a depth when its interval lies entirely on the better side of
  its control's interval (lower error, or higher score);
* a series **steps down** from depth a to a later depth b when its interval at b lies entirely on
  the worse side of its interval at a, while its control's intervals at a and b overlap (the
  control does not move with it: a shift that moves the control too is no loss of the target),
  the series beats its control at a (a series at chance has nothing to lose), and the step is at
  least ``MIN_STEP`` (a tenth) of the distance from the series to its control at a (a significant
  step that closes less of that distance, 0.22 -> 0.41 stones against a control at 31, changes
  nothing a reader would act on). For a transferable series the present series must hold instead
  of its own control staying steady (:func:`steps_down` says why).

The verdict, per group:

1. ``lost from depth d``: the present series beats its control at some depth, no longer beats it
   from d on, and steps down into d (from the depth before d, or from the first depth where it
   beat its control).
2. ``present, re-encoded from depth d``: the present series beats its control from its first
   depth to the last, and the transferable series steps down into d (the first consecutive step;
   failing that, the first depth whose value steps down from the first depth's). Where the
   transferable series beats its control at no depth, d is its first depth.
3. ``present and transferable``: the present series holds, the transferable series holds (beats
   its control at every depth, no step). A transferable series that holds alone implies presence.
4. ``not distinguishable``: anything the intervals cannot decide: a series that never beats its
   control, a fall to the control within the intervals, or a transferable series that steps down
   with no present series to tell a loss from a re-encoding.

A present series without a transferable one reads ``present (transfer not measured)``; with one that
neither steps down nor beats its control everywhere, ``present (transfer not distinguishable)``.
Every number in a verdict's ``reason`` carries its interval and n.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from queries.evidence import PRESENT, TRANSFERABLE, Curve, Point, Unit
from queries.intervals import Interval

TRANSFERABLE_VERDICT = "present and transferable"
REENCODED = "present, re-encoded from depth {depth}"
LOST = "lost from depth {depth}"
UNDECIDED = "not distinguishable"
PRESENT_ONLY = "present (transfer not measured)"
PRESENT_TRANSFER_UNDECIDED = "present (transfer not distinguishable)"


def better(a: Interval, b: Interval, lower_is_better: bool) -> bool:
    """``a`` is better than ``b`` with intervals that do not overlap."""
    return a.high < b.low if lower_is_better else a.low > b.high


def beats_control(point: Point, lower_is_better: bool) -> bool:
    return point.control is not None and better(point.value, point.control, lower_is_better)


#: The smallest step that counts, as a share of the distance from the series to its control.
MIN_STEP = 0.1


def steps_down(curve: Curve, a: int, b: int, reference: Curve | None = None) -> bool:
    """Point b is worse than point a beyond both intervals, by at least ``MIN_STEP`` of the
    distance from a to its control, from a that beats its control.

    Without ``reference`` (a present series) the control is the series' own and must be steady
    (its intervals at a and b overlap). With one (a transferable series, ``reference`` its present
    series) the control is the reference's control at the same depth, and the reference must hold
    instead: an in-range map that meets a turned code extrapolates differently whether it was fitted
    to real or shuffled labels, so the transferable series' own control moves with any re-encoding."""
    pa_, pb = curve.points[a], curve.points[b]
    if not better(pa_.value, pb.value, curve.lower_is_better):
        return False
    control = pa_.control
    if reference is None:
        if pa_.control is not None and pb.control is not None and not pa_.control.overlaps(pb.control):
            return False
    else:
        control = _control_at(reference, pa_.depth, pa_.control)
    if control is None:
        return True
    if not better(pa_.value, control, curve.lower_is_better):
        return False   # nothing to lose: the series did not beat its control at a
    return abs(pb.value.mean - pa_.value.mean) >= MIN_STEP * abs(control.mean - pa_.value.mean)


def _control_at(reference: Curve, depth: int, fallback: Interval | None) -> Interval | None:
    """The reference series' control at ``depth`` (its own where the reference has no such depth)."""
    return next((p.control for p in reference.points if p.depth == depth and p.control is not None), fallback)


@dataclass
class Verdict:
    unit: Unit
    group: str
    verdict: str
    depth: int | None
    at: str | None
    reason: str
    present: Curve | None
    transfer: Curve | None
    point: Point | None           # the present series where the verdict is placed (or its last depth)
    transfer_before: Point | None
    transfer_point: Point | None


def decide(present: Curve | None, transfer: Curve | None) -> Verdict:
    """The verdict of one group from its present and transferable curves (module docstring)."""
    base = present or transfer
    assert base is not None, "a verdict needs at least one curve"
    v = Verdict(base.unit, base.group, UNDECIDED, None, None, "", present, transfer, None, None, None)
    if present is not None and present.points:
        held = _present(present, v)
        if not held:
            return v
    if transfer is None or not transfer.points:
        if present is not None and present.points:
            v.verdict = PRESENT_ONLY
            v.point = present.points[-1]
            v.reason += " No transferable series (the same probe with train_where) to test the in-range code."
        return v
    _transfer(transfer, v, present if present is not None and present.points else None)
    return v


def _present(c: Curve, v: Verdict) -> bool:
    """Fills ``v`` from the present curve; True when the target is present at every depth from its first."""
    lower = c.lower_is_better
    beats = [beats_control(p, lower) for p in c.points]
    if not any(beats):
        p = c.points[-1]
        v.point = p
        v.reason = (f"The probe trained on every group ({c.measure}) beats its shuffled-label control at no depth"
                    f" (last, {p.at}: {_iv(p.value)} vs control {_iv(p.control)}).")
        return False
    first = beats.index(True)
    fall = next((j for j in range(first + 1, len(beats)) if not any(beats[j:])), None)
    if fall is None:
        v.point = c.points[-1]
        v.reason = (f"The probe trained on every group beats its control at every depth from {c.points[first].at}"
                    f" (last, {c.points[-1].at}: {_iv(c.points[-1].value)} vs control {_iv(c.points[-1].control)}).")
        return True
    p, before = c.points[fall], c.points[fall - 1]
    v.point = p
    if steps_down(c, fall - 1, fall) or steps_down(c, first, fall):
        v.verdict, v.depth, v.at = LOST.format(depth=p.depth), p.depth, p.at
        v.reason = (f"The probe trained on every group ({c.measure}) beats its control up to {before.at}"
                    f" ({_iv(before.value)} vs control {_iv(before.control)}) and falls to it from {p.at}"
                    f" ({_iv(p.value)} vs control {_iv(p.control)}).")
    else:
        v.reason = (f"The probe trained on every group no longer beats its control from {p.at} ({_iv(p.value)} vs"
                    f" control {_iv(p.control)}), but the step from {before.at} ({_iv(before.value)}) is within the"
                    " intervals.")
    return False


def _transfer(c: Curve, v: Verdict, present: Curve | None) -> None:
    """Fills ``v`` from the transferable curve, its control the present curve's where there is one."""
    lower = c.lower_is_better
    present_held = present is not None
    m = len(c.points)
    step = next((j for j in range(1, m) if steps_down(c, j - 1, j, present)), None)
    before = None if step is None else step - 1
    if step is None:
        step = next((j for j in range(1, m) if steps_down(c, 0, j, present)), None)
        before = None if step is None else 0
    controls = [_control_at(present, p.depth, p.control) if present else p.control for p in c.points]
    beats = [ctl is not None and better(p.value, ctl, lower) for p, ctl in zip(c.points, controls, strict=True)]
    ctl_name = "the present probe's control" if present else "its control"
    if step is None and not any(beats):
        step, before = 0, None
    if step is None:
        if all(beats):
            v.verdict = TRANSFERABLE_VERDICT
            v.transfer_point = c.points[-1]
            v.reason += (f" The probe trained in-distribution ({c.probe_target}) {'also ' if present_held else ''}beats"
                         f" {ctl_name} at every depth with no step (last, {c.points[-1].at}: {_iv(c.points[-1].value)}"
                         f" vs {_iv(controls[-1])})"
                         + ("." if present_held else ": a transferable series that holds implies presence."))
        else:
            misses = ", ".join(p.at for p, b in zip(c.points, beats, strict=True) if not b)
            v.verdict = PRESENT_TRANSFER_UNDECIDED if present_held else UNDECIDED
            v.reason += (f" The probe trained in-distribution ({c.probe_target}) shows no step but does not beat"
                         f" {ctl_name} at {misses}.")
        return
    p = c.points[step]
    v.transfer_point, v.transfer_before = p, None if before is None else c.points[before]
    if before is None:
        what = f"beats {ctl_name} at no depth (first, {p.at}: {_iv(p.value)} vs {_iv(controls[step])})"
    else:
        b = c.points[before]
        what = (f"steps down from {b.at} ({_iv(b.value)}; {ctl_name} {_iv(controls[before])}) to {p.at}"
                f" ({_iv(p.value)})")
    what += _largest_step(c, step, present)
    if present_held:
        v.verdict, v.depth, v.at = REENCODED.format(depth=p.depth), p.depth, p.at
        v.reason += f" The probe trained in-distribution ({c.probe_target}) {what}."
    else:
        v.verdict = UNDECIDED
        v.depth, v.at = p.depth, p.at
        v.reason += (f" The probe trained in-distribution ({c.probe_target}) {what}; with no probe trained on every"
                     " group, a loss cannot be told from a re-encoding (add the same entry without train_where,"
                     " split: kfold).")


def _largest_step(c: Curve, first: int, present: Curve | None) -> str:
    """The largest counted step after the first, where it is another one (a curve may step twice)."""
    sign = 1.0 if c.lower_is_better else -1.0
    counted = [(sign * (c.points[j].value.mean - c.points[j - 1].value.mean), j) for j in range(1, len(c.points))
               if steps_down(c, j - 1, j, present)]
    if not counted:
        return ""
    size, j = max(counted)
    if j == first:
        return "; it is the largest step"
    a, b = c.points[j - 1], c.points[j]
    return f"; the largest step is into {b.at} (depth {b.depth}: {_iv(a.value)} -> {_iv(b.value)})"


def _iv(iv: Interval | None) -> str:
    return "none stored" if iv is None else iv.text()


def where_lost(found: list[Curve]) -> list[Verdict]:
    """One verdict per question, group and pair of (present, transferable) series."""
    by: dict[tuple[Unit, str], dict[str, list[Curve]]] = defaultdict(lambda: {PRESENT: [], TRANSFERABLE: []})
    for c in found:
        by[(c.unit, c.group)][c.role].append(c)
    out = []
    for roles in by.values():
        presents: list[Curve | None] = list(roles[PRESENT]) or [None]
        transfers: list[Curve | None] = list(roles[TRANSFERABLE]) or [None]
        out += [decide(present, transfer) for present in presents for transfer in transfers]
    return out


def verdicts_table(verdicts: list[Verdict]) -> pa.Table:
    rows = []
    for v in verdicts:
        row: dict[str, Any] = {"run": v.unit.run, "target": v.unit.target, "kind": v.unit.kind, "tokens": v.unit.tokens,
                               "group": v.group, "verdict": v.verdict, "depth": v.depth, "at": v.at}
        curve = v.present or v.transfer
        assert curve is not None
        row["measure"] = curve.measure
        # Which probes: entries that differ only in where/tag (G2M's one per N) are told apart here.
        row["present_probe"] = v.present.probe_target if v.present else None
        row["transfer_probe"] = v.transfer.probe_target if v.transfer else None
        for name, point in (("present", v.point), ("transfer_before", v.transfer_before), ("transfer", v.transfer_point)):
            iv = point.value if point else None
            row |= {name: _num(iv, "mean"), f"{name}_low": _num(iv, "low"), f"{name}_high": _num(iv, "high")}
            if name == "present":
                ctl = point.control if point else None
                row |= {"control": _num(ctl, "mean"), "control_low": _num(ctl, "low"), "control_high": _num(ctl, "high"),
                        "n": iv.n if iv else None, "n_seeds": iv.n_seeds if iv else None}
        row["reason"] = v.reason.strip()
        rows.append(row)
    return pa.Table.from_pylist(rows) if rows else pa.table({"run": pa.array([], pa.string())})


def _num(iv: Interval | None, field: str) -> float | None:
    return None if iv is None else round(float(getattr(iv, field)), 4)
