"""Generations record why they stopped (EOS or the cap) and what the answer is; older workspaces migrate."""

from __future__ import annotations

import duckdb
import pytest
from storetest_lib import stimulus_rows

from store import Generation, RunInfo, StoreError, TokenSpans, Workspace
from store import schema as schema_mod
from store.records import answer_kind


@pytest.mark.parametrize("text, stop, kind", [
    ("", "eos", "empty"), ("  \n", None, "empty"), ("False", "eos", "word"), ("yes", None, "word"),
    ("49", "eos", "digits"), ("1 1 0 1 0 0", None, "digits"), ("There are 12.", "eos", "digits"),
    # cut at the cap: not an answer, whatever the text holds
    ("1101001010", "cap", "runaway"), ("", "cap", "runaway"), ("False", "cap", "runaway"),
])
def test_answer_kind_says_what_the_answer_is(text, stop, kind):
    assert answer_kind(text, stop) == kind
    assert Generation(text=text, stop_reason=stop).kind == kind


def test_generation_refuses_an_unknown_stop_reason():
    with pytest.raises(StoreError, match="stop_reason must be one of"):
        Generation(text="4", stop_reason="length")


def test_writer_stores_stop_reason_and_kind(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    gens = [Generation(text="False", stop_reason="eos"), Generation(text="10101", stop_reason="cap"),
            Generation(text="", stop_reason="eos"), Generation(text="7")]
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(4), dataset="set"))
        w.write_batch(0, {}, tokens=[TokenSpans(seq_len=3)] * 4, generations=gens)
        w.finish(partial_ok=True)
    assert ws.rows("SELECT text, stop_reason, answer_kind FROM generations ORDER BY array_row") == [
        ("False", "eos", "word"), ("10101", "cap", "runaway"), ("", "eos", "empty"), ("7", None, "digits")]
    assert ws.rows("SELECT generated, stop_reason, answer_kind FROM v_samples WHERE array_row = 1") == [
        ("10101", "cap", "runaway")]


def test_a_row_generated_again_replaces_its_row_in_a_new_run_and_on_resume(tmp_path):
    """A new run inserts its first rows with no DELETE; a row generated again (in a later commit,
    twice before one commit, or by a resume) still leaves one row, the last."""
    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r", model="m", chunk_samples=4)
    with ws.writer(info) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(4), dataset="set"))
        w.record_generations(0, [Generation(text=f"first {i}") for i in range(4)])
        w.flush()
        w.record_generations(2, [Generation(text="second 2")])
        w.record_generations(3, [Generation(text="second 3")])
        w.record_generations(3, [Generation(text="third 3")])
        w.finish(partial_ok=True)
    with ws.writer(info) as w:  # a resume: the run is there
        w.record_generations(0, [Generation(text="resumed 0")])
        w.finish(partial_ok=True)
    assert ws.rows("SELECT array_row, text FROM generations ORDER BY array_row") == [
        (0, "resumed 0"), (1, "first 1"), (2, "second 2"), (3, "third 3")]


def test_v2_workspace_gains_the_columns_and_kinds_from_the_text(tmp_path):
    ws = Workspace.open(tmp_path / "ws", migrations=schema_mod.MIGRATIONS[:2])
    texts = ["False", "", "110100", None]
    con = duckdb.connect(str(ws.manifest_path))
    con.executemany("INSERT INTO generations (run, stimulus, array_row, text, recorded_at) VALUES"
                    " ('r', ?, ?, ?, now())", [(f"s{i}", i, t) for i, t in enumerate(texts)])
    con.close()
    ws = Workspace.open(ws.path)
    assert ws.schema_version() == schema_mod.latest_version()
    # whether an old answer ran into the cap was never recorded: no row is called runaway
    assert ws.rows("SELECT text, stop_reason, answer_kind FROM generations ORDER BY array_row") == [
        ("False", None, "word"), ("", None, "empty"), ("110100", None, "digits"), (None, None, "empty")]


def test_a_commit_that_landed_before_its_connection_failed_is_retried_without_doubles(tmp_path):
    """Injects: the writer's manifest connection fails right after a commit's COMMIT landed.
    Asserts: the commit retried at close lands, though its chunk and generation rows are there
    already, and neither counts the chunks' bytes twice nor doubles a row; the error that surfaces
    is the injected one."""
    from contextlib import contextmanager

    import numpy as np

    from store import ArraySpec, WriterError

    ws = Workspace.open(tmp_path / "ws")
    with pytest.raises(WriterError, match="injected"):  # the writer's whole life: its close retries the commit
        with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
            w.set_samples(w.register_stimuli(stimulus_rows(4), dataset="set"))
            handle = w.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(1, 8), dtype="float32"))
            real_use, armed = w._manifest.use, [True]

            @contextmanager
            def use(*args, **kwargs):
                with real_use(*args, **kwargs) as con:
                    yield con
                if armed[0]:
                    armed[0] = False
                    raise duckdb.IOException("connection lost after COMMIT (injected)")

            w._manifest.use = use
            w.write_batch(0, {handle: np.ones((4, 1, 8), np.float32)},
                          generations=[Generation(text=f"g{i}") for i in range(4)])
            w.flush()
    assert w.stats.commits == 1  # the retry at close landed (the first raised after its COMMIT)
    assert ws.rows("SELECT count(*), sum(nbytes) FROM chunks") == [(1, 4 * 8 * 2)]
    assert ws.rows("SELECT bytes FROM activations") == [(4 * 8 * 2,)]
    assert ws.rows("SELECT array_row, text FROM generations ORDER BY array_row") == [(i, f"g{i}") for i in range(4)]
