"""Variant runs beside the plain run on exactly the stimuli both answered, on their study's page."""

from __future__ import annotations

from queries.pages_variants import variants_section
from store import Generation, RunInfo, Workspace


def _run(ws: Workspace, run: str, rows: list[dict], right: list[bool], intervention: dict | None = None) -> None:
    info = RunInfo(run=run, model="hand-built", intervention=intervention,
                   config={"stimuli": [{"set": "sets/go", "task": "multimodal_num"}]})
    with ws.writer(info) as w:
        w.set_samples(w.register_stimuli(rows, dataset="go"))
        w.record_generations(0, [Generation(text="1", prediction=1, parse_ok=True, correct=c) for c in right])
        w.finish()


def test_a_variant_is_compared_on_the_stimuli_it_covers(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    rows = [{"id": f"b{i}", "family": "go", "truth": {"count": i, "regime": "ID"}} for i in range(8)]
    _run(ws, "plain", rows, [True] * 6 + [False] * 2)
    # The variant covers the first 4 boards only (limit: 4) and gets 1 of them right.
    _run(ws, "rope", rows[:4], [True, False, False, False], {"kind": "rope_scaling", "alpha": 99.0})
    sec = variants_section(Workspace.open(ws.path, readonly=True), tmp_path, "images-as-text")
    assert sec is not None and sec.figures and "n = 4 stimuli per pair" in sec.figures[0].caption
    pair = sec.tables[0][1].to_pylist()
    assert pair == [{"variant": "rope", "intervention": "rope_scaling", "plain": "plain", "n": 4, "variant_right": 1,
                     "plain_right": 4, "retained_ratio": None}]   # the plain run on the same 4 boards: 4 of 4
    assert variants_section(Workspace.open(ws.path, readonly=True), tmp_path, "counting-tricks") is None
