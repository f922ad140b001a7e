"""The evidence for "where is it lost?": three curves per group of stimuli along depth.

For every probe series (one probe definition trained at every stored depth) and every group of
test samples (an SQL expression over ``v_samples``: the regime, the grid size N, the case), the
series' value at each depth with its bootstrap interval (queries/intervals.py), beside the same
for the series' shuffled-label control on the same samples. A series plays one of two roles,
read from how it was trained:

* ``present``: trained on every group (no ``train_where``, no in-range cap such as
  hidden_number's ``train_max_count``) and tested on held-out samples (split kfold: every sample
  once per seed). Is the target decodable at this depth at all?
* ``transferable``: trained on the in-distribution group only (``train_where``, or an in-range
  cap) and tested on every group. Does the in-range code extend past the training edge? (The
  counting-bottleneck study's N_H is such a series: trained in range, it extrapolates because it
  counts tokens.)

The third curve, ``expressed``, is what the model itself answers on the same samples: accuracy,
mean absolute error over the answers that are numbers, and the share of runaway answers.

The measure of a series is the mean absolute error of its per-sample numbers (``prediction`` vs
``truth``) for a probe whose metric is a regression's or a count's (``NUMBER_METRICS``: a count
read-out, N_H), else the mean per-sample score in the probe's metric (accuracy, token or cell
accuracy, AP@50). The control's value on a sample is the
control probe's output on that sample scored against the sample's *real* target: what a probe
that learned no link between features and labels gets on the group.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from queries.gap import GapError, bind, explain_empty
from queries.intervals import Interval, mean_interval
from store import StoreError, Workspace

PRESENT, TRANSFERABLE = "present", "transferable"
#: Probe metrics whose per-sample numbers are the quantity itself (a regressed count, N_H): their
#: curves measure the mean absolute error; every other metric's (accuracy, cell accuracy, AP@50)
#: the mean per-sample score, even where a kind also stores a number (detect: boxes found).
NUMBER_METRICS = ("r2", "exact_match")

_ROWS = """
WITH s AS (
    SELECT run, array_row, CAST(({group_by}) AS VARCHAR) AS grp FROM v_samples WHERE run LIKE $run AND ({where})
)
SELECT p.run, split_part(p.target, '#', 1) AS target, p.target AS probe_target, p.kind, p.tokens, p.series,
       p.kind_params::VARCHAR AS kind_params, p.train_where, p.seed, p.metric,
       a.depth, a.stage, p.tap, p.layer, p.site, pp.array_row, pp.prediction, pp.truth, pp.score,
       pp.control_prediction, pp.control_score, s.grp
FROM probes p
JOIN activations a ON a.run = p.run AND a.tap = p.tap AND a.layer = p.layer AND a.site = p.site AND a.tokens = p.tokens
JOIN probe_predictions pp USING (key)
JOIN s ON s.run = p.run AND s.array_row = pp.array_row
WHERE p.run LIKE $run AND p.target LIKE $target AND p.kind LIKE $kind AND p.tokens LIKE $tokens
"""

_EXPRESSED = """
SELECT s.run, CAST(({group_by}) AS VARCHAR) AS grp, s.array_row, ({model_score})::DOUBLE AS model_score,
       ({answer})::DOUBLE AS answer, s.answer_kind
FROM v_samples s
WHERE s.run LIKE $run AND ({where}) AND s.generated IS NOT NULL
"""


def role(kind_params: dict[str, Any] | None, train_where: str | None) -> str:
    """``transferable`` for a probe trained on part of the groups, else ``present``."""
    capped = (kind_params or {}).get("train_max_count") is not None
    return TRANSFERABLE if train_where or capped else PRESENT


@dataclass(frozen=True)
class Unit:
    """One question: a target read by one kind of probe from one token kind of one run."""

    run: str
    target: str
    kind: str
    tokens: str


@dataclass
class Point:
    """A series at one depth for one group: its value and its control's, each with an interval."""

    depth: int
    stage: str
    tap: str
    layer: int
    site: str
    value: Interval
    control: Interval | None

    @property
    def at(self) -> str:
        return f"{self.tap}.{self.layer}" + ("" if self.site == "resid_post" else f"/{self.site}")


@dataclass
class Curve:
    """One series along depth for one group; ``lower_is_better`` for an error (MAE)."""

    unit: Unit
    role: str
    series: str
    probe_target: str
    group: str
    measure: str
    lower_is_better: bool
    points: list[Point] = field(default_factory=list)


def curves(ws: Workspace, params: dict[str, str] | None = None) -> list[Curve]:
    """Every probe series selected by ``params`` (queries/gap.py's parameters) as curves per group.

    A series with no per-sample predictions in the store is an error that says so: there is
    nothing to compute a curve from."""
    p = bind(params)
    sql = _ROWS.format(group_by=p["group_by"], where=p["where"])
    bound = {k: p[k] for k in ("run", "target", "kind", "tokens")}
    try:
        table = ws.query(sql, bound)
    except StoreError as err:
        raise GapError(f"curves on {ws.path}: {err} (group_by and where are SQL over v_samples, e.g."
                       " group_by=\"truth->>'regime'\")") from err
    if not table.num_rows:
        explain_empty(ws, bound)
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    by: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i in range(table.num_rows):
        by[(cols["run"][i], cols["target"][i], cols["kind"][i], cols["tokens"][i], cols["series"][i],
            cols["grp"][i])].append(i)
    out = []
    for (run, target, kind, tokens, series, group), idx in by.items():
        rows = np.asarray(idx)
        first = rows[0]
        kind_params = json.loads(cols["kind_params"][first]) if cols["kind_params"][first] else {}
        numbers = (cols["metric"][first] in NUMBER_METRICS and not _has_null(cols["prediction"][rows])
                   and not _has_null(cols["truth"][rows]))
        curve = Curve(Unit(run, target, kind, tokens), role(kind_params, cols["train_where"][first]), series,
                      cols["probe_target"][first], str(group), "mean absolute error" if numbers else "mean score",
                      lower_is_better=numbers)
        by_depth: dict[int, list[int]] = defaultdict(list)
        for i in rows:
            if cols["depth"][i] is not None and not np.isnan(cols["depth"][i]):
                by_depth[int(cols["depth"][i])].append(i)
        for depth in sorted(by_depth):
            at = np.asarray(by_depth[depth])
            value = _interval(cols, at, "prediction", "score", numbers)
            if value is None:
                continue
            c = at[0]
            curve.points.append(Point(depth, cols["stage"][c], cols["tap"][c], int(cols["layer"][c]), cols["site"][c],
                                      value, _interval(cols, at, "control_prediction", "control_score", numbers)))
        out.append(curve)
    return sorted(out, key=lambda c: (c.unit.run, c.unit.target, c.unit.kind, c.unit.tokens, c.role, c.group))


def _has_null(values: np.ndarray) -> bool:
    return bool(any(v is None for v in values) or np.isnan(np.asarray(values, dtype=np.float64)).any())


def _interval(cols: dict[str, np.ndarray], at: np.ndarray, number: str, score: str, numbers: bool) -> Interval | None:
    """The per-sample values of rows ``at`` as [seed, sample] and their mean's interval."""
    if numbers:
        pred = np.asarray(cols[number][at], dtype=np.float64)
        if np.isnan(pred).all():
            return None
        values = np.abs(pred - np.asarray(cols["truth"][at], dtype=np.float64))
    else:
        values = np.asarray([np.nan if v is None else v for v in cols[score][at]], dtype=np.float64)
        if np.isnan(values).all():
            return None
    return seeds_samples_interval(cols["seed"][at], cols["array_row"][at], values)


def seeds_samples_interval(seeds: Any, samples: Any, values: Any) -> Interval | None:
    """Per-(seed, sample) values as the [seed, sample] matrix mean_interval bootstraps (NaN where a
    seed did not test a sample), and its interval."""
    seed_ids, seed_pos = np.unique(np.asarray(seeds), return_inverse=True)
    sample_ids, sample_pos = np.unique(np.asarray(samples), return_inverse=True)
    E = np.full((len(seed_ids), len(sample_ids)), np.nan)
    E[seed_pos, sample_pos] = values
    return mean_interval(E)


def curves_table(found: list[Curve]) -> pa.Table:
    """The curves as one long table: a row per (series, group, depth)."""
    rows = []
    for c in found:
        for p in c.points:
            ctl = p.control
            rows.append({
                "run": c.unit.run, "target": c.unit.target, "kind": c.unit.kind, "tokens": c.unit.tokens,
                "role": c.role, "probe_target": c.probe_target, "group": c.group, "depth": p.depth, "stage": p.stage,
                "at": p.at, "measure": c.measure, "n": p.value.n, "n_seeds": p.value.n_seeds,
                "value": p.value.mean, "low": p.value.low, "high": p.value.high, "seed_sd": p.value.sd,
                "control": ctl.mean if ctl else None, "control_low": ctl.low if ctl else None,
                "control_high": ctl.high if ctl else None, "series": c.series,
            })
    return pa.Table.from_pylist(rows) if rows else pa.table({"run": pa.array([], pa.string())})


@dataclass
class Expressed:
    """What the model answers on one group: accuracy, MAE over number answers, runaway share."""

    run: str
    group: str
    accuracy: Interval | None
    mae: Interval | None
    runaway: Interval | None
    n: int
    n_numbers: int


def expressed(ws: Workspace, params: dict[str, str] | None = None,
              truths: dict[tuple[str, int], float] | None = None) -> list[Expressed]:
    """The model's answers per group (``answer`` and ``model_score`` as in queries/gap.py). The
    MAE needs each sample's true number: ``truths`` by (run, array_row), e.g. from the probes'
    stored truth; without it only accuracy and the runaway share are given."""
    p = bind(params)
    sql = _EXPRESSED.format(group_by=p["group_by"], where=p["where"], model_score=p["model_score"], answer=p["answer"])
    try:
        rows = ws.query(sql, {"run": p["run"]}).to_pylist()
    except StoreError as err:
        raise GapError(f"expressed on {ws.path}: {err}") from err
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["run"], r["grp"])].append(r)
    out = []
    for (run, group), got in sorted(by.items()):
        score = np.asarray([np.nan if r["model_score"] is None else r["model_score"] for r in got], np.float64)
        runaway = np.asarray([r["answer_kind"] == "runaway" for r in got], np.float64)
        errors = [abs(r["answer"] - truths[(run, r["array_row"])]) for r in got
                  if truths and r["answer"] is not None and truths.get((run, r["array_row"])) is not None]
        out.append(Expressed(run, str(group), mean_interval(score), mean_interval(np.asarray(errors)) if errors else None,
                             mean_interval(runaway), len(got), len(errors)))
    return out


def truths_of(ws: Workspace, params: dict[str, str] | None = None) -> dict[tuple[str, int], float]:
    """Each tested sample's true number, as the probes stored it (for the model's MAE)."""
    p = bind(params)
    rows = ws.rows("SELECT p.run, pp.array_row, any_value(pp.truth) FROM probes p JOIN probe_predictions pp USING (key)"
                   " WHERE p.run LIKE $run AND p.target LIKE $target AND p.kind LIKE $kind AND p.tokens LIKE $tokens"
                   " AND pp.truth IS NOT NULL GROUP BY ALL", {k: p[k] for k in ("run", "target", "kind", "tokens")})
    return {(r[0], int(r[1])): float(r[2]) for r in rows}


def expressed_table(found: list[Expressed]) -> pa.Table:
    rows = []
    for e in found:
        row: dict[str, Any] = {"run": e.run, "group": e.group, "n": e.n}
        for name, iv in (("accuracy", e.accuracy), ("mae", e.mae), ("runaway_share", e.runaway)):
            row |= {name: iv.mean if iv else None, f"{name}_low": iv.low if iv else None,
                    f"{name}_high": iv.high if iv else None}
        row["n_number_answers"] = e.n_numbers
        rows.append(row)
    return pa.Table.from_pylist(rows) if rows else pa.table({"run": pa.array([], pa.string())})


_ANSWER_GAPS = """
WITH s AS (
    SELECT run, array_row, CAST(({group_by}) AS VARCHAR) AS grp, ({answer})::DOUBLE AS answer
    FROM v_samples WHERE run LIKE $run AND ({where})
)
SELECT a.depth, s.grp, p.seed, pp.array_row, abs(pp.prediction - s.answer) AS gap
FROM probes p
JOIN activations a ON a.run = p.run AND a.tap = p.tap AND a.layer = p.layer AND a.site = p.site AND a.tokens = p.tokens
JOIN probe_predictions pp USING (key)
JOIN s ON s.run = p.run AND s.array_row = pp.array_row
WHERE p.run LIKE $run AND p.target LIKE $target AND p.kind LIKE $kind AND p.tokens LIKE $tokens
      AND s.answer IS NOT NULL AND pp.prediction IS NOT NULL AND a.depth IS NOT NULL
"""

#: The model's answer as the counting-bottleneck study reads it for its Language Gap: digits only.
DIGITS_ANSWER = ("CASE WHEN answer_kind = 'digits' THEN try_cast(trim(CAST(prediction AS VARCHAR), '\"') AS DOUBLE)"
                 " END")


def answer_gaps(ws: Workspace, params: dict[str, str] | None = None) -> dict[tuple[str, int], Interval]:
    """Mean |probe prediction - the model's number| per (group, depth) over the samples whose answer
    is a number (counting-bottleneck's Language Gap |N_H - N_P| for the N_H probe), with intervals."""
    p = bind({"answer": DIGITS_ANSWER, **(params or {})})
    sql = _ANSWER_GAPS.format(group_by=p["group_by"], where=p["where"], answer=p["answer"])
    try:
        rows = ws.query(sql, {k: p[k] for k in ("run", "target", "kind", "tokens")}).to_pylist()
    except StoreError as err:
        raise GapError(f"answer gaps on {ws.path}: {err}") from err
    by: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(str(r["grp"]), int(r["depth"]))].append(r)
    out = {}
    for key, got in by.items():
        iv = seeds_samples_interval([r["seed"] for r in got], [r["array_row"] for r in got], [r["gap"] for r in got])
        if iv is not None:
            out[key] = iv
    return out
