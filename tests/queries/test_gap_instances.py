"""counting_gaps and g2m_gap are instances of the gap primitive: on one hand-built workspace they
return what their former bespoke SQL (kept below as the oracle) returned, row for row."""

from __future__ import annotations

import pytest

from queries import available, run
from queries.gap import INSTANCES
from store import ArraySpec, Generation, ProbeResult, RunInfo, TokenSpans, Workspace

# The bespoke SQL these named queries were before they became instances of queries/gap.py.
OLD_COUNTING_GAPS = """
WITH nh AS (
    SELECT p.run, p.tap, p.layer, p.site, p.seed, pp.array_row, pp.prediction AS n_h
    FROM probes p
    JOIN probe_predictions pp USING (key)
    WHERE p.kind = 'hidden_number' AND p.run LIKE $run AND pp.prediction IS NOT NULL
)
SELECT nh.run, nh.tap, nh.layer, nh.site, s.truth->>'regime' AS regime, count(*) AS boards,
       round(avg(abs(nh.n_h - (s.truth->>'count')::DOUBLE)), 3) AS vision_gap,
       round(avg(abs(nh.n_h - s.prediction::DOUBLE)) FILTER (WHERE s.answer_kind = 'digits'), 3) AS language_gap,
       count(*) FILTER (WHERE s.answer_kind = 'digits') AS number_answers,
       round(avg((nh.n_h = (s.truth->>'count')::DOUBLE)::INTEGER), 4) AS probe_exact,
       round(avg(s.correct::INTEGER), 4) AS model_accuracy
FROM nh
JOIN v_samples s ON s.run = nh.run AND s.array_row = nh.array_row
GROUP BY ALL
ORDER BY nh.run, nh.tap, nh.layer, regime;
"""
OLD_G2M_GAP = """
WITH per_grid AS (
    SELECT p.run, p.tap, p.layer, p.site, p.seed, pp.array_row, pp.score AS probe_ca
    FROM probes p
    JOIN probe_predictions pp USING (key)
    WHERE p.kind = 'conv_spatial' AND p.run LIKE $run AND pp.score IS NOT NULL
)
SELECT g.run, g.tap, g.layer, g.site, (s.params->>'grid_size')::INTEGER AS grid_size, count(*) AS grids,
       round(avg(g.probe_ca), 4) AS probe_cell_accuracy,
       round(avg((gen.metrics->>'cells_correct')::DOUBLE / (gen.metrics->>'cells_total')::DOUBLE), 4)
           AS model_cell_accuracy,
       round(avg(g.probe_ca) - avg((gen.metrics->>'cells_correct')::DOUBLE / (gen.metrics->>'cells_total')::DOUBLE), 4)
           AS gap
FROM per_grid g
JOIN v_samples s ON s.run = g.run AND s.array_row = g.array_row
LEFT JOIN generations gen ON gen.run = g.run AND gen.stimulus = s.stimulus
GROUP BY ALL
ORDER BY g.run, g.tap, g.layer, grid_size;
"""
PATH = [("vision", 0, "resid_post"), ("projector", 0, "out"), ("llm", 1, "resid_post")]
COUNTS = [12, 30, 49, 55, 70, 99, 100, 115]
# What the model says per board: a number, a word, nothing, or a cut at the cap (runaway).
ANSWERS = {12: ("12", None), 30: ("31", None), 49: ("49", None), 55: ("49", None), 70: ("False", None),
           99: ("", None), 100: ("1111111111", "cap"), 115: ("49", None)}
GRIDS = [(3, 9, 9), (3, 7, 9), (4, 16, 16), (4, 4, 16), (5, 10, 25), (5, None, None)]  # N, cells right, cells


def _regime(c: int) -> str:
    return "ID" if c <= 49 else "VE" if c <= 99 else "FE"


def _spans(n: int) -> list[TokenSpans]:
    return [TokenSpans(seq_len=8, image_start=1, image_count=2, grid_h=1, grid_w=2)] * n


def _counting_run(ws: Workspace, seeds: tuple[int, ...]) -> None:
    rows = [{"id": f"b{i}", "family": "go", "truth": {"count": c, "regime": _regime(c)}} for i, c in enumerate(COUNTS)]
    gens = []
    for c in COUNTS:
        text, stop = ANSWERS[c]
        number = int(text) if text.isdigit() else None
        gens.append(Generation(text=text, prediction=number, parse_ok=number is not None, correct=number == c,
                               stop_reason=stop))
    with ws.writer(RunInfo(run="go", model="m")) as w:
        w.set_samples(w.register_stimuli(rows, dataset="go"))
        for tap, layer, site in PATH:
            w.array(ArraySpec(tap=tap, layer=layer, site=site, tokens="image", shape=(2, 4)))
        w.record_tokens(0, _spans(len(COUNTS)))
        w.record_generations(0, gens)
    results = []
    for d, (tap, layer, site) in enumerate(PATH):
        for seed in seeds:
            test = [i for i in range(len(COUNTS)) if i != seed]  # each seed holds out its own boards
            n_h = [float(min(COUNTS[i], 49 if d == 2 else 200) + (i + seed) % 3) for i in test]
            truth = [float(COUNTS[i]) for i in test]
            results.append(ProbeResult(
                run="go", tap=tap, layer=layer, site=site, target="go.intersection", kind="hidden_number", seed=seed,
                metric="exact_match", score=0.3, control_score=0.0,
                predictions={"array_row": test, "prediction": n_h, "truth": truth,
                             "score": [float(p == t) for p, t in zip(n_h, truth, strict=True)]}))
    ws.record_probes(results)


def _g2m_run(ws: Workspace, seeds: tuple[int, ...]) -> None:
    rows = [{"id": f"g{i}", "family": "g2m", "params": {"grid_size": n}, "truth": {}} for i, (n, _, _) in enumerate(GRIDS)]
    gens = [Generation(text="grid", score=None if right is None else right / cells, correct=right == cells,
                       metrics=None if right is None else {"cells_correct": right, "cells_total": cells})
            for _, right, cells in GRIDS]
    with ws.writer(RunInfo(run="g2m", model="m")) as w:
        w.set_samples(w.register_stimuli(rows, dataset="g2m"))
        for tap, layer, site in PATH[:2]:
            w.array(ArraySpec(tap=tap, layer=layer, site=site, tokens="image", shape=(2, 4)))
        w.record_tokens(0, _spans(len(GRIDS)))
        w.record_generations(0, gens)
    ws.record_probes([ProbeResult(
        run="g2m", tap=tap, layer=layer, site=site, target="g2m.matrix", kind="conv_spatial", seed=seed,
        metric="cell_accuracy", score=0.5, control_score=0.1,
        predictions={"array_row": list(range(len(GRIDS))),
                     "score": [round(0.1 * (i + d + seed + 1), 2) for i in range(len(GRIDS))]})
        for d, (tap, layer, site) in enumerate(PATH[:2]) for seed in seeds])


@pytest.fixture(scope="module", params=[pytest.param((0,), id="one-seed"),
                                        pytest.param((0, 1), id="two-seeds", marks=pytest.mark.slow)])
def ws(request, tmp_path_factory):
    ws = Workspace.open(tmp_path_factory.mktemp("inst") / "ws")
    _counting_run(ws, request.param)
    _g2m_run(ws, request.param)
    return Workspace.open(ws.path, readonly=True), len(request.param)


def _key(row: dict) -> tuple:
    return tuple(str(v) for v in row.values())


@pytest.mark.parametrize("name, oracle, alias", [("counting_gaps", OLD_COUNTING_GAPS, "nh"),
                                                  ("g2m_gap", OLD_G2M_GAP, "g")])
def test_the_instance_returns_what_the_bespoke_sql_did(ws, name, oracle, alias):
    ws, seeds = ws
    if seeds > 1:  # the old SQL counted one row per seed and board: its "boards" were seed x board rows
        oracle = oracle.replace("count(*)", f"count(DISTINCT {alias}.array_row)")
    for param in ("%", "go", "g2m"):
        old = ws.query(oracle, {"run": param}).to_pylist()
        new = run(ws, name, {"run": f"'{param}'"}).to_pylist()
        assert len(new) == len(old) and bool(old) == (param in ("%", "go" if name == "counting_gaps" else "g2m"))
        for row in new:
            assert row.pop("depth") == {"vision": 0, "projector": 3, "llm": 5}[row["tap"]]  # ordered along the path
            assert row.pop("target") in ("go.intersection", "g2m.matrix")
        assert sorted(new, key=_key) == sorted(old, key=_key)


def test_the_values_by_hand(ws):
    ws, seeds = ws
    gaps = {(r["tap"], r["regime"]): r for r in run(ws, "counting_gaps", {"run": "go"}).to_pylist()}
    assert [k[0] for k in gaps] == ["vision"] * 3 + ["projector"] * 3 + ["llm"] * 3  # depth order, then regime
    # FE boards 100 (runaway "1111111111": no number) and 115 ("49"); N_H 49, 50 (seed 0) and 50, 51 (seed 1)
    fe = gaps[("llm", "FE")]
    assert (fe["boards"], fe["number_answers"]) == (2, 1)
    assert (fe["vision_gap"], fe["language_gap"]) == {1: (58.0, 1.0), 2: (57.5, 1.5)}[seeds]
    assert gaps[("vision", "VE")]["model_accuracy"] == 0.0
    curve = [r for r in run(ws, "g2m_gap", {"run": "g2m"}).to_pylist() if r["tap"] == "vision"]
    assert [r["grid_size"] for r in curve] == [3, 4, 5] and [r["grids"] for r in curve] == [2, 2, 2]
    assert curve[0]["model_cell_accuracy"] == pytest.approx((1 + 7 / 9) / 2, abs=1e-4)
    assert curve[2]["model_cell_accuracy"] == 0.4  # the grid with no generation scores nothing, not zero


def test_instances_are_listed_with_their_run_parameter():
    queries = available()
    for inst in INSTANCES:
        q = queries[inst.name]
        assert "instance of the gap primitive" in q.description and [p.name for p in q.params] == ["run"]
        assert q.path.name == "gap.py"
