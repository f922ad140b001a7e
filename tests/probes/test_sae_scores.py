"""SAE features scored against exact truth (probes/sae/score.py), the ``sae_features`` named query
and the report's SAE page, on the planted-feature workspace: each recovered feature is matched to
the truth variable it was planted for, the features tied to nothing pass no test, controls sit at
chance, and along depth the weak layer scores below the strong one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from saetest_lib import build_planted, directions

from probes.sae.farm import run_sae_plan
from probes.sae.model import load
from probes.sae.plan import parse_sae_plan
from probes.sae.score import auroc, benjamini_hochberg, spearman
from queries.named import run as run_named
from queries.pages_sae import sae_page
from store import ProbeResult, Workspace

TARGETS = ["go.intersection", "go.count", "truth:flag", "truth:level"]
#: The truth each planted direction was tied to (saetest_lib.PLANTED), as (target, class); None: nothing.
TIED = [{("go.intersection", "black"), ("go.count", "")}, {("truth:flag", "1")}, {("truth:level", "")}, None, None, None]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    ws = build_planted(tmp_path_factory.mktemp("scores") / "ws", n=240)
    plan = parse_sae_plan({"name": "t", "saes": [{
        "taps": ["vision"], "layers": "all", "architecture": "standard", "d_sae": 16, "l1": 0.1, "lr": 3e-3,
        "epochs": 25, "batch_size": 128, "buffer_rows": 2048, "targets": TARGETS, "shuffles": 5}]})
    rep = run_sae_plan(plan, ws.path, in_process=True, log=lambda _: None)
    assert rep.trained == 2, rep.errors
    ws.record_probes([ProbeResult(run="planted", tap="vision", layer=layer, target="truth:flag", kind="pooled",
                                  score=score, metric="auroc", control_score=0.5, n_test=48)
                      for layer, score in ((0, 0.71), (1, 0.99))])
    return ws


def _strong(ws: Workspace) -> tuple[str, np.ndarray]:
    key, path = ws.rows("SELECT key, path FROM sae_models WHERE layer = 1")[0]
    w = load(ws.path / path).W_dec.detach().numpy()
    return key, (directions() @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T).argmax(1)


def test_each_planted_feature_is_named_by_its_truth_and_noise_by_none(ws: Workspace) -> None:
    key, latent = _strong(ws)
    for j, f in enumerate(latent):
        rows = ws.rows("SELECT target, class, q_value, score, control_score FROM sae_feature_scores"
                       " WHERE sae = ? AND feature = ? ORDER BY q_value, score DESC", [key, int(f)])
        significant = {(t, c) for t, c, q, s, ctl in rows if q < 0.05 and s > ctl}
        if TIED[j] is None:
            assert not significant, (j, rows[:3])
        else:
            assert (rows[0][0], rows[0][1]) in TIED[j] and significant <= TIED[j], (j, rows[:3])


def test_controls_sit_at_chance_and_intervals_hold_the_score(ws: Workspace) -> None:
    key, _ = _strong(ws)
    best = ws.query("SELECT target, class, metric, max(score) AS s, arg_max(control_score, score) AS c,"
                    " arg_max(ci_low, score) AS lo, arg_max(ci_high, score) AS hi, arg_max(n, score) AS n"
                    " FROM sae_feature_scores WHERE sae = ? GROUP BY ALL", [key]).to_pylist()
    by = {(r["target"], r["class"]): r for r in best}
    assert by[("truth:flag", "1")]["s"] > 0.95 and abs(by[("truth:flag", "1")]["c"] - 0.5) < 0.15
    assert by[("truth:level", "")]["s"] > 0.5 and abs(by[("truth:level", "")]["c"]) < 0.3
    black = by[("go.intersection", "black")]
    n_test = ws.rows("SELECT n_test FROM sae_models WHERE key = ?", [key])[0][0]       # test tokens
    assert black["s"] > 0.85 and black["c"] < 0.4 and black["n"] == n_test
    assert by[("truth:flag", "1")]["n"] == n_test // 16
    for r in best:
        assert r["lo"] <= r["s"] + 1e-9 <= r["hi"] + 2e-9, r
    p, q = np.array(ws.rows("SELECT p_value, q_value FROM sae_feature_scores WHERE sae = ?", [key])).T
    assert (q >= p - 1e-12).all() and (q <= 1).all()


def test_sparse_activations_hold_the_test_samples_only(ws: Workspace) -> None:
    key, _ = _strong(ws)
    n, rows, low = ws.rows("SELECT count(*), count(DISTINCT array_row), min(value) FROM sae_activations WHERE sae = ?",
                           [key])[0]
    n_test = ws.rows("SELECT n_test FROM sae_models WHERE key = ?", [key])[0][0]
    assert rows * 16 == n_test and low > 0 and 0 < n < n_test * 16 / 2


def test_named_query_and_report_page_show_the_depth_story(ws: Workspace, tmp_path: Path) -> None:
    table = run_named(ws, "sae_features", {"target": "truth:flag"}).to_pylist()
    assert [r["layer"] for r in table] == [0, 1]
    assert table[0]["score"] < table[1]["score"] and table[1]["probe_score"] == 0.99
    assert table[1]["n_tracking"] >= 1 and table[1]["probe_kind"] == "pooled"
    page = sae_page(ws, tmp_path)
    assert page.sections and (tmp_path / "sae_features.png").stat().st_size > 1000
    assert page.sections[0].tables[0][1].num_rows == run_named(ws, "sae_features").num_rows


def test_statistics_match_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x = np.where(rng.random((200, 3)) < 0.6, 0.0, rng.random((200, 3)))     # many ties at zero
    y = rng.integers(0, 5, 200).astype(float)
    pos = y >= 3
    from probes.sae.score import _ranks  # noqa: PLC0415 - the helper under test

    r = _ranks(x)
    for j in range(3):
        u = stats.mannwhitneyu(x[pos, j], x[~pos, j]).statistic
        assert auroc(r, pos)[j] == pytest.approx(u / (pos.sum() * (~pos).sum()))
        assert spearman(r, _ranks(y)[:, 0])[j] == pytest.approx(stats.spearmanr(x[:, j], y).statistic)
    p = rng.random(50)
    assert np.allclose(benjamini_hochberg(p), stats.false_discovery_control(p))
