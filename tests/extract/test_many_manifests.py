"""`python -m extract M1 M2 ...`: several manifests in one process (torch and transformers imported
once: `make demo` ran ten processes for its ten manifests). The runs stored are those of separate
invocations, and a bad manifest anywhere in the list stops the command before any run starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extract.__main__ import main
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

REPO = Path(__file__).resolve().parents[2]
TOY = str(REPO / "lab" / "checkpoints" / "toy-counter")


def _manifest(path: Path, run: str, task: str, taps: list[dict], **more: object) -> str:
    body = {"run": run, "model": {"path": TOY, "dtype": "float32", "device": "cpu"},
            "stimuli": [{"set": "sets/go-toy", "task": task}], "taps": taps,
            "generation": {"max_new_tokens": 4}, "batch_size": 2, "chunk_samples": 2, **more}
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return str(path)


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, list[str]]:
    go = get_family("go")
    write_set(go, go.config(preset="small", variation="mild", counts="0-2"), n=1, seed=1, split="test",
              out=tmp_path / "sets" / "go-toy")
    manifests = [
        _manifest(tmp_path / "a.yaml", "visual", "multimodal_num",
                  [{"tap": "projector", "layers": 0}, {"tap": "llm", "layers": [-1], "tokens": ["image", "last"]}]),
        _manifest(tmp_path / "b.yaml", "text", "text_only_num", [{"tap": "llm", "layers": "all", "tokens": ["last"]}]),
    ]
    return tmp_path, manifests


def _stored(data: Path) -> dict[str, object]:
    """What a run leaves that does not depend on when it ran: rows, answers, array specs and bytes."""
    ws = Workspace.open(data, readonly=True)
    arrays = {p.relative_to(data).as_posix(): p.read_bytes()
              for p in sorted((data / "arrays").rglob("*")) if p.is_file()}
    return {
        "samples": ws.rows("SELECT run, array_row, stimulus FROM v_samples ORDER BY ALL"),
        "generations": ws.rows("SELECT run, stimulus, array_row, text, prediction, correct, n_tokens FROM generations"
                               " ORDER BY ALL"),
        "arrays": ws.rows("SELECT run, tap, layer, site, tokens, shape, n_chunks FROM activations ORDER BY ALL"),
        "chunks": ws.rows("SELECT run, zarr_path, chunk, n_rows, crc32c FROM chunks ORDER BY ALL"),
        "bytes": arrays,
    }


@pytest.mark.slow
def test_many_manifests_store_what_separate_invocations_store(setup, capsys):
    root, manifests = setup
    common = ["--stimuli-root", str(root / "sets"), "--no-progress"]
    for m in manifests:
        assert main([m, "--data", str(root / "one-by-one"), *common]) == 0
    assert main([*manifests, "--data", str(root / "together"), *common]) == 0
    summaries = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert [line.split(":")[0] for line in summaries] == ["run visual", "run text"] * 2  # one summary per run
    one, together = _stored(root / "one-by-one"), _stored(root / "together")
    assert one["generations"] and len(one["arrays"]) == 5  # projector, llm image + last, 2 x llm last
    assert together == one


@pytest.mark.parametrize("fault", ["bad key", "missing set", "one run twice"])
def test_a_bad_manifest_among_several_stops_before_any_run(fault, setup, capsys):
    root, manifests = setup
    bad = Path(manifests[1])
    if fault == "bad key":
        bad.write_text(bad.read_text().replace("taps:", "tapz:"))
        needles = [str(bad), "unknown key 'tapz'"]
    elif fault == "missing set":
        bad.write_text(bad.read_text().replace("sets/go-toy", "sets/no-such-set"))
        needles = [str(bad), "no-such-set"]
    else:
        bad.write_text(bad.read_text().replace("run: text", "run: visual"))
        needles = [str(bad), manifests[0], "both write run 'visual'"]
    data = root / "data"
    rc = main([*manifests, "--data", str(data), "--stimuli-root", str(root / "sets"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err  # a schema error lists its keys below
    for needle in needles:
        assert needle in err, err
    assert not data.exists()  # the good manifest before it did not run
