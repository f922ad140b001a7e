"""Named queries over variant runs, on hand-built stores where the answer is known."""

from __future__ import annotations

import pytest

from queries.named import run as run_query
from store import Generation, RunInfo, Workspace


def _stimuli(ws: Workspace, run: str, n: int, intervention=None, generations=None):
    rows = [{"id": f"s{i}", "family": "go", "prompts": {"t": "q"}, "answers": {"t": "1"}, "truth": {"count": i}}
            for i in range(n)]
    with ws.writer(RunInfo(run=run, model="m", intervention=intervention)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="set"))
        for i, g in enumerate(generations or []):
            w.record_generations(i, [g])
        w.finish()


def _heads(stimulus: str, masks: list[int]) -> list[dict]:
    """Four heads (2 layers x 2) with the given flip masks."""
    return [{"stimulus": stimulus, "tap": "llm", "layer": k // 2, "head": k % 2, "n_positions": 2,
             "n_flipped": bin(m).count("1"), "flipped": m > 0, "flip_mask": m, "logit_drop": float(m)}
            for k, m in enumerate(masks)]


@pytest.fixture
def ws(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    for run in ("visual", "text"):
        _stimuli(ws, run, 3, intervention={"kind": "head_ablation"})
    # s0: same tensors; s1: same critical heads, another digit flips; s2: disjoint heads.
    ws.record_head_ablations("visual", _heads("set/s0", [1, 0, 0, 2]) + _heads("set/s1", [1, 0, 0, 0])
                             + _heads("set/s2", [3, 0, 0, 0]))
    ws.record_head_ablations("text", _heads("set/s0", [1, 0, 0, 2]) + _heads("set/s1", [2, 0, 0, 0])
                             + _heads("set/s2", [0, 1, 1, 0]))
    return ws


def test_head_overlap(ws):
    row = run_query(ws, "head_overlap", {"a": "visual", "b": "text"}).to_pylist()[0]
    assert row["stimuli"] == 3
    assert row["equal_share"] == pytest.approx(1 / 3, abs=1e-4)
    assert row["unequal_share"] == pytest.approx(2 / 3, abs=1e-4)
    # Jaccard of critical sets: s0 {0,3} vs {0,3} = 1; s1 {0} vs {0} = 1; s2 {0} vs {1,2} = 0
    assert row["mean_jaccard"] == pytest.approx(2 / 3, abs=1e-4)
    assert row["mean_critical_a"] == pytest.approx(4 / 3, abs=1e-3)


def test_critical_heads(ws):
    rows = run_query(ws, "critical_heads", {"run": "visual"}).to_pylist()
    assert [(r["layer"], r["head"], r["critical_share"]) for r in rows] == [
        (0, 0, 1.0), (0, 1, 0.0), (1, 0, 0.0), (1, 1, pytest.approx(1 / 3, abs=1e-4))]
    first = {(r["layer"], r["head"]): r["first_token_share"] for r in rows}
    assert first[(0, 0)] == 1.0 and first[(1, 1)] == 0.0  # head (1,1) flips the second digit only


@pytest.mark.slow
def test_interventions_compares_variants(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    _stimuli(ws, "plain", 2, generations=[Generation(text="1", correct=True), Generation(text="1", correct=True)])
    _stimuli(ws, "rle", 2, intervention={"kind": "token_compression", "keep": "first"}, generations=[
        Generation(text="1", correct=True, metrics={"retained_ratio": 0.25}),
        Generation(text="9", correct=False, metrics={"retained_ratio": 0.75})])
    rows = {r["run"]: r for r in run_query(ws, "interventions", {}).to_pylist()}
    assert rows["plain"]["intervention"] == "none" and rows["plain"]["accuracy"] == 1.0
    assert rows["plain"]["retained_ratio"] is None
    assert rows["rle"]["intervention"] == "token_compression"
    assert rows["rle"]["accuracy"] == 0.5 and rows["rle"]["retained_ratio"] == 0.5
