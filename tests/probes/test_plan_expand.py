"""Plan expansion against a workspace's array listing: validation, the product, de-duplication."""

from __future__ import annotations

import pytest

from probes import PlanError, parse_plan
from probes.plan import ArrayRow, expand
from store.vocab import HEAD_TAPS

ARRAYS = [ArrayRow(run, tap, layer, "resid_post", "image", "dense")
          for run in ("a", "b") for tap in ("vision", "llm") for layer in (0, 1)]


def identities(tasks):
    return [(t.run, t.tap, t.layer, t.target, t.kind, t.seed) for t in tasks]


def test_a_plan_with_duplicates_yields_each_probe_key_once_in_plan_order():
    plan = parse_plan({"probes": [
        {"runs": ["b"], "taps": ["llm"], "layers": [1, 1, -1], "targets": ["go.count", "go.count"],
         "kinds": ["ridge"], "seeds": [1, 0, 1]},
        # overlaps the first entry on run b's llm layer 1, and adds run a's
        {"runs": "all", "taps": ["llm"], "layers": [1], "targets": ["go.count"], "kinds": ["ridge", "pooled"],
         "seeds": [0]},
    ]})
    tasks = expand(plan, ARRAYS)
    assert identities(tasks) == [
        ("b", "llm", 1, "go.count", "ridge", 1), ("b", "llm", 1, "go.count", "ridge", 0),
        ("a", "llm", 1, "go.count", "ridge", 0), ("a", "llm", 1, "go.count", "pooled", 0),
        ("b", "llm", 1, "go.count", "pooled", 0),
    ]
    assert len({t.key for t in tasks}) == len(tasks)
    assert [t.key for t in expand(plan, list(reversed(ARRAYS)))] == [t.key for t in tasks]


def test_an_entry_that_only_repeats_earlier_probes_is_named_as_such():
    entry = {"runs": ["a"], "layers": [0], "targets": ["go.count"], "kinds": ["ridge"]}
    with pytest.raises(PlanError, match=r"probes.1 adds no probe: every probe it selects is already asked for"):
        expand(parse_plan({"probes": [entry, entry]}), ARRAYS)


def test_validation_refuses_before_any_probe_is_made():
    plan = parse_plan({"probes": [{"runs": "all", "layers": [-1], "tokens": ["last"], "targets": ["go.count"],
                                   "kinds": ["ridge"]}]})
    with pytest.raises(PlanError, match=r"probes.0 selects no stored array \(a:llm/resid_post/last"):
        expand(plan, ARRAYS)


def test_taps_all_reads_every_stored_tap_but_the_attention_heads():
    arrays = [*ARRAYS, ArrayRow("a", "attn", 0, "probs", "last", "ragged"),
              ArrayRow("a", "llm", 0, "resid_post", "last", "dense")]
    plan = parse_plan({"probes": [{"runs": ["a"], "taps": "all", "sites": "all", "layers": [0],
                                   "tokens": ["image", "last"], "targets": ["go.count"], "kinds": ["pooled"]}]})
    taps = {t.tap for t in expand(plan, arrays)}
    assert taps == {"vision", "llm"} and not taps & HEAD_TAPS
