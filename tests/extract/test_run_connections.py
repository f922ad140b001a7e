"""What an extraction costs the manifest: DuckDB opens, not just what it stores.

Found by timing each set-up step of `python -m bench extract` (issue 19): a 200-sample run opened
DuckDB 9 times (~35 ms each, and a checkpoint each time the writer's connection was closed) for
a run query, the writer's sample map, the vocabulary and the final accuracy, each on a
connection of its own, and imported pandas (~0.5 s) to read the stimulus set.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from devices import model_config

import store.db
from extract.manifest import parse_manifest
from extract.models import load_model
from extract.run import run_extraction
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace


@pytest.fixture(scope="module")
def g2m_set(tmp_path_factory):
    family = get_family("g2m")
    return write_set(family, family.config(grid_sizes=(3,), colors=(3,), image_size=112), n=4, seed=0,
                     split="test", out=tmp_path_factory.mktemp("stimuli") / "g2m")


@pytest.mark.slow
def test_an_extraction_into_a_new_workspace_opens_the_manifest_twice(tiny_dir, g2m_set, tmp_path, monkeypatch,
                                                                      connects):
    """Asserts: a whole run with the logit lens (arrays, run tensors, vocabulary, generations,
    the summary's accuracy) opens the manifest to create it (built while the model loads, in a
    temporary folder: store/ahead.py), and then only through the writer's held connection: its
    first open and its re-opens after each let-go (every 0.4 s at most, store/db.py HOLD_S, so
    how many depends on the machine's speed, never on the run's statements; before: 9 opens, one
    per use), each an attach to the process's one DuckDB instance, which is built at most once;
    and the summary's accuracy, read on the writer's connection, is the stored one."""
    opens: list[str] = []
    real_attach = store.db._attach
    held: list[store.db.HeldConnection] = []
    real_init = store.db.HeldConnection.__init__

    def attach(path, read_only=False):
        opens.append(str(path) + (" (read-only)" if read_only else ""))
        return real_attach(path, read_only)

    def init(self, *args, **kwargs):
        held.append(self)
        real_init(self, *args, **kwargs)

    manifest = parse_manifest({
        "run": "r1", "model": {"path": str(tiny_dir("qwen2_vl")), **model_config()},
        "stimuli": [{"set": str(g2m_set)}], "taps": [{"tap": "llm", "layers": [0, -1]}],
        "generation": {"max_new_tokens": 3}, "batch_size": 2, "chunk_samples": 2})
    connects.clear()  # the instances built during the run alone
    monkeypatch.setattr(store.db, "_attach", attach)
    monkeypatch.setattr(store.db.HeldConnection, "__init__", init)
    summary = run_extraction(manifest, workspace=tmp_path / "ws", progress=False)
    monkeypatch.undo()
    assert "agnosia-manifest-" in opens[0] and all(c == str(tmp_path / "ws" / "manifest.duckdb") for c in opens[1:]), opens
    assert len(opens) >= 2 and len(opens) - 1 == sum(h.connects for h in held), (opens, [h.connects for h in held])
    assert connects in ([], [":memory:"]), connects
    ws = Workspace.open(tmp_path / "ws", readonly=True)
    scored, correct = ws.rows("SELECT count(correct), count(*) FILTER (WHERE correct) FROM generations")[0]
    assert (summary.scored, summary.accuracy) == (scored, correct / scored if scored else None)
    unembed = ws.read_tensor("r1", "lm_head.weight")
    assert unembed.ndim == 2
    # token id i as decoded alone; rows of the unembedding past the tokenizer's ids decode to ''
    tok = load_model(str(tiny_dir("qwen2_vl")), device="cpu").tokenizer
    assert ws.vocab("r1") == [tok.decode([i]) if i < len(tok) else "" for i in range(unembed.shape[0])]


def test_reading_a_stimulus_set_does_not_import_pandas(g2m_set):
    """Asserts: `read_set(...).rows()` leaves pandas unimported (pyarrow's `read_table` pulls it in
    through pyarrow.dataset, ~0.5 s of every extraction's start)."""
    code = ("import sys; from stimuli.io import read_set; read_set(sys.argv[1]).rows(); "
            "print('pandas' in sys.modules, 'pyarrow.dataset' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(g2m_set)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stderr
