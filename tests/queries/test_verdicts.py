"""Verdicts on stores with planted signals whose right answer is known.

Each store holds Go-like boards with counts 0..120 (ID <= 49 < VE <= 99 < FE) and image-token
activations at four depths (vision.0, vision.1, llm.0, llm.1) in which the count is planted as the
scenario says; the demo's two count read-outs (ridge on the mean image token, 5-fold by board, two
seeds: one trained on every count, one on in-range boards only) are trained by the real farm, and
``where_lost`` must name the planted verdict. The last test shows the rule is not the old one:
today's step-size threshold calls the within-noise step of (d) a loss.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from probes import parse_plan, run_plan
from queries.__main__ import main as cli
from queries.evidence import answer_gaps, curves, curves_table, expressed, truths_of
from queries.intervals import mean_interval
from queries.verdicts import LOST, REENCODED, TRANSFERABLE_VERDICT, UNDECIDED, verdicts_table, where_lost
from store import ArraySpec, Generation, RunInfo, TokenSpans, Workspace

LAYERS = [("vision", 0), ("vision", 1), ("llm", 0), ("llm", 1)]   # depths 0, 1, 5, 6 (store/depth.py)
COUNTS = np.repeat(np.arange(121), 2)                             # 242 boards
T, D = 4, 12
GROUP = {"group_by": "truth->>'regime'", "target": "truth:count%"}

PLAN = {
    "name": "planted",
    "defaults": {"seeds": [0, 1], "split": "kfold", "folds": 5},
    "probes": [
        {"taps": ["vision", "llm"], "runs": ["r"], "targets": ["truth:count"],
         "kinds": {"pooled": {"pool": "mean", "task": "regress"}}, "tag": "all-counts"},
        {"taps": ["vision", "llm"], "runs": ["r"], "targets": ["truth:count"], "train_where": "(truth->>'count')::INT <= 49",
         "kinds": {"pooled": {"pool": "mean", "task": "regress"}}, "tag": "in-range"},
    ],
}


def _regime(c: int) -> str:
    return "ID" if c <= 49 else "VE" if c <= 99 else "FE"


def _features(scenario: str, depth: int, rng: np.random.Generator) -> np.ndarray:
    """[boards, T, D] image tokens (unit noise) with the count planted as ``scenario`` says at
    this depth (index along LAYERS: 0, 1 vision; 2, 3 LLM)."""
    c = COUNTS.astype(np.float64)[:, None]
    u, v = np.eye(D)[0], np.eye(D)[1]
    if scenario == "linear":                         # (a) the count along one direction everywhere
        signal = 0.5 * c * u
    elif scenario == "reencoded" and depth >= 2:     # (b) past the edge, along another direction from llm.0
        signal = 0.5 * (np.minimum(c, 49) * u + np.maximum(c - 49, 0) * v)
    elif scenario == "reencoded":
        signal = 0.5 * c * u
    elif scenario == "lost":                         # (c) replaced by noise from llm.0
        signal = 0.5 * c * u if depth < 2 else 0.0 * c * u
    else:                                            # (d) a faint count, a little fainter from llm.0
        signal = (WEAK[0] if depth < 2 else WEAK[1]) * c * u
    return (signal[:, None, :] + rng.normal(0, 1.0, (len(COUNTS), T, D))).astype(np.float32)


#: A count this faint beats its control on VE by a hair, and a little fainter does not (scenario d).
WEAK = (0.018, 0.015)


def planted(path, scenario: str) -> Workspace:
    ws = Workspace.open(path)
    rows = [{"id": f"b{i}", "family": "go", "truth": {"count": int(c), "regime": _regime(int(c))}}
            for i, c in enumerate(COUNTS)]
    rng = np.random.default_rng(7)
    feats = [_features(scenario, depth, rng) for depth in range(len(LAYERS))]
    # The model answers in-range counts right and 49 past the edge; a tenth of FE answers run away.
    gens = [Generation(text=str(min(c, 49)), prediction=int(min(c, 49)), parse_ok=True, correct=bool(c <= 49),
                       stop_reason="eos") for c in COUNTS]
    with ws.writer(RunInfo(run="r", model="planted", dtype="float32", chunk_samples=64)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="go"))
        handles = [w.array(ArraySpec(tap=tap, layer=layer, tokens="image", shape=(T, D))) for tap, layer in LAYERS]
        n = len(COUNTS)
        for s in range(0, n, 64):
            e = min(s + 64, n)
            w.write_batch(s, {h: f[s:e] for h, f in zip(handles, feats, strict=True)}, generations=gens[s:e],
                          tokens=[TokenSpans(seq_len=T + 4, image_start=1, image_count=T, grid_h=2, grid_w=2,
                                             last_prompt=T + 3)] * (e - s))
        w.finish()
    run_plan(parse_plan(PLAN), ws.path, in_process=True, progress=False, log=lambda s: None)
    return Workspace.open(ws.path, readonly=True)


def _verdicts(ws: Workspace) -> dict[str, dict]:
    rows = verdicts_table(where_lost(curves(ws, GROUP))).to_pylist()
    assert len(rows) == 3, rows  # one per regime: the seeds and folds of each read-out are one series
    return {r["group"]: r for r in rows}


@pytest.mark.slow
def test_a_linear_count_is_present_and_transferable(tmp_path):
    got = _verdicts(planted(tmp_path / "ws", "linear"))
    assert {g: r["verdict"] for g, r in got.items()} == dict.fromkeys(("ID", "VE", "FE"), TRANSFERABLE_VERDICT)
    assert got["FE"]["n"] == 42 and got["FE"]["n_seeds"] == 2  # every FE board, held out once per seed


@pytest.mark.slow
def test_a_count_whose_code_turns_past_the_edge_is_reencoded_not_lost(tmp_path):
    ws = planted(tmp_path / "ws", "reencoded")
    got = _verdicts(ws)
    assert got["ID"]["verdict"] == TRANSFERABLE_VERDICT
    assert (got["VE"]["present_probe"], got["VE"]["transfer_probe"]) == ("truth:count#all-counts", "truth:count#in-range")
    for regime in ("VE", "FE"):
        assert got[regime]["verdict"] == REENCODED.format(depth=5), got[regime]["reason"]
        assert got[regime]["at"] == "llm.0"
        assert got[regime]["present_high"] < got[regime]["control_low"]  # present, with room to spare
        assert got[regime]["transfer_low"] > got[regime]["transfer_before_high"]
    # The old rule reads the same store as a loss: the verdict test fails on it.
    old = {r["group"]: r for r in old_where_lost(_old_gap(ws)).to_pylist()}
    assert old["VE"]["lost_at_depth"] == 5


@pytest.mark.slow
def test_a_count_replaced_by_noise_is_lost_from_that_depth(tmp_path):
    got = _verdicts(planted(tmp_path / "ws", "lost"))
    for regime in ("ID", "VE", "FE"):
        assert got[regime]["verdict"] == LOST.format(depth=5), got[regime]["reason"]
        assert got[regime]["control_low"] <= got[regime]["present_high"]  # fell to its control


@pytest.mark.slow
def test_a_step_within_noise_is_not_distinguishable(tmp_path, capsys):
    ws = planted(tmp_path / "ws", "weak")
    got = _verdicts(ws)["VE"]
    assert got["verdict"] == UNDECIDED, got["reason"]
    assert got["control_low"] <= got["present_high"]  # the faint count never clears its control's interval
    old = {r["group"]: r for r in old_where_lost(_old_gap(ws)).to_pylist()}
    assert old["VE"]["lost_at"] != "not lost"  # the old threshold calls the noise a loss
    assert cli(["lost", "--data", str(ws.path), "--param", "group_by=truth->>'regime'", "--format", "csv"]) == 0
    assert "not distinguishable" in capsys.readouterr().out


def _old_gap(ws: Workspace):
    from queries.gap import gap

    return gap(ws, {"group_by": "truth->>'regime'", "target": "truth:count#in-range"})


@pytest.mark.slow
def test_curves_and_expressed_carry_n_intervals_and_controls(tmp_path):
    ws = planted(tmp_path / "ws", "reencoded")
    found = curves(ws, GROUP)
    table = curves_table(found).to_pylist()
    assert {r["role"] for r in table} == {"present", "transferable"}
    assert all(r["low"] <= r["value"] <= r["high"] and r["control"] is not None for r in table)
    ve = [r for r in table if r["group"] == "VE" and r["role"] == "present"]
    assert [r["depth"] for r in ve] == [0, 1, 5, 6] and {r["n"] for r in ve} == {100}
    said = {e.group: e for e in expressed(ws, GROUP, truths_of(ws, GROUP))}
    assert said["ID"].accuracy.mean == 1.0 and said["VE"].accuracy.mean == 0.0
    assert said["VE"].mae.mean == pytest.approx(np.mean(COUNTS[(COUNTS > 49) & (COUNTS <= 99)] - 49))
    assert said["FE"].n == said["FE"].n_numbers == 42
    # The Language Gap |prediction - the model's number| of the read-out trained on every count: the
    # model says 49 past the edge, the read-out the count, so on VE it is about the distance to 49.
    language = answer_gaps(ws, {**GROUP, "target": "truth:count#all-counts"})
    ve_counts = COUNTS[(COUNTS > 49) & (COUNTS <= 99)]
    assert language[("VE", 0)].mean == pytest.approx(np.mean(ve_counts - 49), abs=1.5)
    assert language[("ID", 0)].mean < 2 and language[("VE", 0)].n == 100


def test_mean_interval_bootstraps_samples_and_seeds():
    rng = np.random.default_rng(0)
    one = mean_interval(rng.normal(5.0, 1.0, 400))
    assert one.n == 400 and one.n_seeds == 1 and one.low < 5.0 < one.high and one.high - one.low < 0.3
    # Two seeds that disagree: the interval covers both seeds' means, and their spread is reported.
    two = mean_interval(np.stack([rng.normal(4.0, 1.0, 400), rng.normal(6.0, 1.0, 400)]))
    assert two.n_seeds == 2 and two.sd == pytest.approx(np.sqrt(2), abs=0.2) and two.low < 4.5 and two.high > 5.5
    # A sample a seed did not test is left out of that seed's mean, not counted as zero.
    gappy = np.array([[1.0, np.nan, 1.0], [1.0, 1.0, np.nan]])
    assert mean_interval(gappy).mean == 1.0 and mean_interval(gappy) == mean_interval(gappy)  # seeded: repeatable


# ------------------------------------------------------------------ the old rule, for comparison

def old_where_lost(table: pa.Table) -> pa.Table:
    """The rule `lost` followed before the verdicts: per series and group, the largest step from one
    depth to the next, a loss when above LOSS_ACCURACY or LOSS_SD of the truth's spread."""
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        if row["depth"] is not None:
            by.setdefault((row["run"], row["target"], row["kind"], row["series"], row["group"]), []).append(row)
    out = []
    for (run, target, kind, _, group), rows in by.items():
        rows.sort(key=lambda r: r["depth"])
        regress = all(r["probe_mae"] is not None for r in rows)
        value = "probe_mae" if regress else "probe_accuracy"
        sign = 1.0 if regress else -1.0  # a loss raises the error, or lowers the accuracy
        steps = [(sign * (b[value] - a[value]), a, b) for a, b in pairwise(rows)
                 if a[value] is not None and b[value] is not None]
        best = max(steps, key=lambda s: s[0], default=None)
        lost = best is not None and best[0] > _min_loss(rows, regress)
        at = best[2] if lost and best else None
        out.append({
            "run": run, "target": target, "kind": kind, "group": group, "n": rows[0]["n"], "measure": value,
            "first": f"{rows[0]['tap']}.{rows[0]['layer']}", "first_value": rows[0][value],
            "lost_at_depth": at["depth"] if at else None,
            "lost_at": f"{at['stage']}: {at['tap']}.{at['layer']}/{at['site']}" if at else "not lost",
            "before": best[1][value] if lost and best else None, "after": at[value] if at else None,
            "last": f"{rows[-1]['tap']}.{rows[-1]['layer']}", "last_value": rows[-1][value],
            "last_mean_prediction": rows[-1]["mean_prediction"],
            "model_accuracy": rows[-1]["model_accuracy"], "model_mae": rows[-1]["model_mae"],
        })
    return pa.Table.from_pylist(out) if out else pa.table({"run": pa.array([], pa.string())})


def _min_loss(rows: list[dict[str, Any]], regress: bool) -> float:
    """The smallest step that counts as a loss: accuracy down by ``LOSS_ACCURACY``, or MAE up by
    ``LOSS_SD`` of the group's true values (a read-out's noise is no loss)."""
    if not regress:
        return LOSS_ACCURACY
    sds = [r["truth_sd"] for r in rows if r["truth_sd"]]
    return LOSS_SD * max(sds) if sds else 0.0


#: Steps smaller than these are noise, not a loss (where_lost).
LOSS_ACCURACY = 0.05
LOSS_SD = 0.1
