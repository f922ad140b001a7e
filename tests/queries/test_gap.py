"""The gap primitive on hand-built stores whose loss point is known: a count read-out that is exact
through the vision tower and the projector and saturates at the training edge from LLM block 1 on."""

from __future__ import annotations

import numpy as np
import pytest

from queries.__main__ import main as cli
from queries.gap import GapError, gap
from store import ArraySpec, Generation, ProbeResult, RunInfo, TokenSpans, Workspace

# (tap, layer, site) in data-path order: depths 0, 1, 3, 4, 5, 6, 7 (2 is the absent pre_merger)
PATH = [("vision", 0, "resid_post"), ("vision", 1, "resid_post"), ("projector", 0, "in"), ("projector", 0, "out"),
        ("llm", 0, "resid_post"), ("llm", 1, "resid_post"), ("llm", 2, "resid_post")]
COUNTS = [10, 20, 30, 40, 60, 70, 80, 90, 110, 120]  # ID <= 49 < VE <= 99 < FE


def _regime(c: int) -> str:
    return "ID" if c <= 49 else "VE" if c <= 99 else "FE"


@pytest.fixture
def ws(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    rows = [{"id": f"b{i}", "family": "go", "truth": {"count": c, "regime": _regime(c)}} for i, c in enumerate(COUNTS)]
    # The model answers in-range counts right and says 49 past the edge.
    gens = [Generation(text=str(min(c, 49)), prediction=min(c, 49), parse_ok=True, correct=c <= 49) for c in COUNTS]
    with ws.writer(RunInfo(run="r", model="m")) as w:
        w.set_samples(w.register_stimuli(rows, dataset="go"))
        for tap, layer, site in PATH:
            w.array(ArraySpec(tap=tap, layer=layer, site=site, tokens="image", shape=(2, 4)))
        w.record_tokens(0, [TokenSpans(seq_len=8, image_start=1, image_count=2, grid_h=1, grid_w=2)] * len(COUNTS))
        w.record_generations(0, gens)
    truth = np.array(COUNTS, float)
    results = []
    for tap, layer, site in PATH:
        lost = tap == "llm" and layer >= 1
        pred = np.minimum(truth, 49.0) if lost else truth + 0.2  # saturates at the training edge inside the LLM
        for seed in (0, 1):
            results.append(ProbeResult(
                run="r", tap=tap, layer=layer, site=site, target="truth:count", kind="pooled", seed=seed, metric="r2",
                score=0.5, control_score=-0.1, series="count-readout",
                predictions={"array_row": list(range(len(COUNTS))), "prediction": pred.tolist(),
                             "truth": truth.tolist()}))
    ws.record_probes(results)
    return ws


def test_gap_returns_the_read_out_per_depth_and_group(ws):
    table = gap(ws, {"group_by": "truth->>'regime'", "target": "truth:count"})
    rows = table.to_pylist()
    ve = [r for r in rows if r["group"] == "VE"]
    assert [r["depth"] for r in ve] == [0, 1, 3, 4, 5, 6, 7]  # ordered along the data path
    assert [r["probe_mae"] for r in ve] == [0.2] * 5 + [26.0] * 2
    assert ve[-1]["mean_prediction"] == 49.0 and ve[0]["n_seeds"] == 2
    assert ve[0]["model_accuracy"] == 0.0 and ve[0]["model_mae"] == 26.0 and ve[0]["gap_mae"] == 25.8
    assert ve[0]["selectivity"] == pytest.approx(0.5)  # R^2 minus max(control R^2, 0): a control at -0.1 is chance
    fe = [r for r in rows if r["group"] == "FE"]
    assert [r["probe_mae"] for r in fe][-2:] == [66.0, 66.0]  # the read-out saturates at the edge in the LLM


def test_gap_and_lost_without_per_sample_predictions_are_an_error_that_says_why(ws, capsys):
    """Probes that stored no per-sample test predictions (kind ridge before this version) leave the
    queries nothing to compute from: an error naming the kind, never an empty table and exit 0."""
    ws.record_probes([ProbeResult(run="r", tap="vision", layer=0, target="truth:n", kind="ridge", score=0.9,
                                  metric="r2")])
    for name in ("gap", "lost", "curves"):
        assert cli([name, "--data", str(ws.path), "--param", "target=truth:n"]) == 2
        err = capsys.readouterr().err
        assert "kind ridge (1 probes) stored no per-sample test predictions" in err, err
    assert cli(["lost", "--data", str(ws.path), "--param", "target=truth:nothing"]) == 2
    assert "no probe in" in capsys.readouterr().err


@pytest.mark.slow
def test_gap_groups_by_any_expression_and_bad_sql_is_one_clear_error(ws, capsys):
    rows = gap(ws, {"group_by": "(truth->>'count')::INT >= 100", "where": "correct = false"}).to_pylist()
    assert {r["group"] for r in rows} == {"true", "false"} and sum(r["n"] for r in rows if r["depth"] == 0) == 6
    with pytest.raises(GapError, match="group_by and where are SQL over v_samples"):
        gap(ws, {"group_by": "no_such_column"})
    with pytest.raises(GapError, match="no parameter colour"):
        gap(ws, {"colour": "x"})
    assert cli(["lost", "--data", str(ws.path), "--param", "group_by=truth->>'regime'"]) == 0
    out = capsys.readouterr().out
    assert out.count("not distinguishable") == 3 and "control none stored" in out  # no control: no claim
    assert cli(["gap", "--data", str(ws.path), "--param", "group_by=nope"]) == 2
    assert "error: gap on" in capsys.readouterr().err


@pytest.mark.slow
def test_the_report_opens_with_where_the_count_is_lost(ws, tmp_path):
    from queries.report import write_report

    index = write_report(ws.path, tmp_path / "report")
    page = index.read_text()
    assert page.index("Where is the count lost? r, truth:count") < page.index("Probes along the model")
    verdicts = (tmp_path / "report" / "lost_r_truth_count_verdicts.csv").read_text()
    # These hand-made probes stored no control predictions: the page claims no loss it cannot back.
    assert verdicts.count('"not distinguishable"') == 3 and "lost from" not in verdicts
    assert (tmp_path / "report" / "lost_r_truth_count.png").stat().st_size > 0


def test_a_runaway_answer_counts_as_wrong_but_not_as_a_number(tmp_path):
    """An answer cut at the generation cap (digits until the cap) is no number the model meant: it
    stays in the accuracy, as wrong, and out of the model's MAE, which one such string would
    otherwise turn into ~10^9."""
    ws = Workspace.open(tmp_path / "ws")
    counts = [60, 70]
    rows = [{"id": f"b{i}", "family": "go", "truth": {"count": c, "regime": "VE"}} for i, c in enumerate(counts)]
    gens = [Generation(text="49", prediction=49, parse_ok=True, correct=False),
            Generation(text="1111111111", prediction=1111111111, parse_ok=True, correct=False, stop_reason="cap")]
    with ws.writer(RunInfo(run="r", model="m")) as w:
        w.set_samples(w.register_stimuli(rows, dataset="go"))
        w.array(ArraySpec(tap="llm", layer=0, site="resid_post", tokens="image", shape=(2, 4)))
        w.record_tokens(0, [TokenSpans(seq_len=8, image_start=1, image_count=2, grid_h=1, grid_w=2)] * 2)
        w.record_generations(0, gens)
    ws.record_probes([ProbeResult(
        run="r", tap="llm", layer=0, site="resid_post", target="truth:count", kind="pooled", seed=0, metric="r2",
        score=0.5, control_score=0.0, predictions={"array_row": [0, 1], "prediction": [60.0, 70.0], "truth": [60.0, 70.0]})])
    (row,) = gap(ws, {"group_by": "truth->>'regime'", "target": "truth:count"}).to_pylist()
    assert row["model_accuracy"] == 0.0 and row["n"] == 2
    assert row["model_mae"] == 11.0  # |49 - 60| alone
