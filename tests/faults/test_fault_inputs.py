"""Bad inputs to a real `python -m extract MANIFEST --data WS` process: a wrong `--data`, a
read-only workspace, broken model folders, a device the machine lacks, a bad manifest value,
damaged stimulus sets and images. Each must end with exit code 2 and one `error: …` line that
names the problem and the fix (no traceback), and leave the workspace byte-identical, its
finished run still `finished`.

Every case runs against a copy of one workspace that holds a finished run (`toy`, 8 Go boards on
the committed toy VLM); the bad manifest writes a second run, `bad`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from faultlib import REPO, TOY_MODEL, env, go_set, python, write_manifest
from PIL import Image

from store import Workspace

pytestmark = pytest.mark.slow  # fault injection drives real extraction or farm processes; `make faults` runs these

N = 8  # two chunks of 4


@pytest.fixture(scope="module")
def stimuli(tmp_path_factory) -> Path:
    return go_set(tmp_path_factory.mktemp("stimuli") / "go-inputs", counts=f"0-{N - 1}")


@pytest.fixture(scope="module")
def finished(zygote, stimuli, tmp_path_factory) -> Path:
    """A workspace holding one finished run, `toy`."""
    folder = tmp_path_factory.mktemp("finished")
    data = folder / "ws"
    child = zygote.run(write_manifest(folder / "toy.yaml", stimuli), data)
    assert child.rc == 0, child.log
    assert _status(data) == {"toy": "finished"}
    return data


def _status(data: Path) -> dict[str, str]:
    return dict(Workspace.open(data, readonly=True).rows("SELECT run, status FROM runs"))


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by content hash: what "byte-identical" compares."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _error_line(log: str) -> str:
    """The process's output must be exactly one `error: …` line (manifest errors add one indented
    line per key, as every manifest error does)."""
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error: "), log
    assert all(line.startswith("  ") for line in lines[1:]), log
    return "\n".join(lines)


def _model_copy(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(TOY_MODEL, model)
    return model


def _set_copy(stimuli: Path, tmp_path: Path) -> Path:
    copy = tmp_path / stimuli.name
    shutil.copytree(stimuli, copy)
    return copy


def _model_manifest(tmp_path: Path, stimuli: Path, model: Path, device: str = "cpu") -> Path:
    return write_manifest(tmp_path / "bad.yaml", stimuli, run="bad",
                          model={"path": str(model), "dtype": "float32", "device": device})


def _image_of(stim_set: Path, i: int) -> Path:
    return stim_set / pq.read_table(stim_set / "truth.parquet").column("image")[i].as_py()


def _png_header(width: int, height: int) -> bytes:
    """A valid PNG whose header claims ``width`` x ``height`` (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


class _RunsCode:
    """Unpickling this runs a shell command (what a malicious pytorch_model.bin does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


# Each case: (tmp_path, stimuli) -> (manifest, --data or None: the finished copy), and what the error says.
Case = Callable[[Path, Path], Path]


def config_empty(tmp_path: Path, stimuli: Path) -> Path:
    model = _model_copy(tmp_path)
    (model / "config.json").write_text("{}")
    return _model_manifest(tmp_path, stimuli, model)


def config_unknown_model_type(tmp_path: Path, stimuli: Path) -> Path:
    model = _model_copy(tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "nosuchvlm"}))
    return _model_manifest(tmp_path, stimuli, model)


def truncated_safetensors(tmp_path: Path, stimuli: Path) -> Path:
    model = _model_copy(tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return _model_manifest(tmp_path, stimuli, model)


def pickled_weights(tmp_path: Path, stimuli: Path) -> Path:
    model = _model_copy(tmp_path)
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(tmp_path / "ran"), protocol=2))
    return _model_manifest(tmp_path, stimuli, model)


def cuda_without_cuda(tmp_path: Path, stimuli: Path) -> Path:
    return _model_manifest(tmp_path, stimuli, TOY_MODEL, device="cuda")


def negative_max_new_tokens(tmp_path: Path, stimuli: Path) -> Path:
    return write_manifest(tmp_path / "bad.yaml", stimuli, run="bad", generation={"max_new_tokens": -3})


def set_json_not_json(tmp_path: Path, stimuli: Path) -> Path:
    copy = _set_copy(stimuli, tmp_path)
    (copy / "set.json").write_text('{"family": "go", "n": 8')
    return write_manifest(tmp_path / "bad.yaml", copy, run="bad")


def truncated_truth(tmp_path: Path, stimuli: Path) -> Path:
    copy = _set_copy(stimuli, tmp_path)
    truth = copy / "truth.parquet"
    truth.write_bytes(truth.read_bytes()[: truth.stat().st_size // 2])
    return write_manifest(tmp_path / "bad.yaml", copy, run="bad")


def truth_without_prompts(tmp_path: Path, stimuli: Path) -> Path:
    copy = _set_copy(stimuli, tmp_path)
    pq.write_table(pq.read_table(copy / "truth.parquet").drop(["prompts"]), copy / "truth.parquet")
    return write_manifest(tmp_path / "bad.yaml", copy, run="bad")


def empty_set(tmp_path: Path, stimuli: Path) -> Path:
    copy = _set_copy(stimuli, tmp_path)
    pq.write_table(pq.read_table(copy / "truth.parquet").slice(0, 0), copy / "truth.parquet")
    manifest = write_manifest(tmp_path / "bad.yaml", copy, run="bad")
    data = yaml.safe_load(manifest.read_text())
    del data["stimuli"][0]["task"]  # unnamed, the set's first task is taken: an empty set has none (an IndexError)
    manifest.write_text(yaml.safe_dump(data, sort_keys=False))
    return manifest


def decompression_bomb(tmp_path: Path, stimuli: Path) -> Path:
    copy = _set_copy(stimuli, tmp_path)
    _image_of(copy, 5).write_bytes(_png_header(60000, 60000))
    return write_manifest(tmp_path / "bad.yaml", copy, run="bad")


def image_of_the_wrong_size(tmp_path: Path, stimuli: Path, index: int = 5) -> Path:
    copy = _set_copy(stimuli, tmp_path)
    Image.new("RGB", (120, 100), "white").save(_image_of(copy, index))
    return write_manifest(tmp_path / "bad.yaml", copy, run="bad")


def first_image_of_the_wrong_size(tmp_path: Path, stimuli: Path) -> Path:
    """The first image is the one the shapes forward prepares (extract/run.py array_specs)."""
    return image_of_the_wrong_size(tmp_path, stimuli, index=0)


CASES: dict[str, tuple[Case, tuple[str, ...]]] = {
    "config.json is {}": (config_empty, ("names no model_type", "save the model again")),
    "config.json has an unknown model_type": (
        config_unknown_model_type, ("model type `nosuchvlm`", "agnosia reads the model types", "toy_counter")),
    "model.safetensors truncated": (truncated_safetensors, ("model.safetensors file is truncated or damaged",)),
    "weights only as a pickle": (pickled_weights, ("are a pickle (.bin)", "refuses", "safetensors copy")),
    "device cuda without CUDA": (cuda_without_cuda, ("device 'cuda' is not available", "device: cpu")),
    "max_new_tokens -3": (negative_max_new_tokens, ("generation.max_new_tokens", "must be at least 1", "got -3")),
    "set.json is not JSON": (set_json_not_json, ("set.json is not readable JSON", "regenerate the set")),
    "truth.parquet truncated": (truncated_truth, ("truth.parquet cannot be read", "truncated or damaged")),
    "truth table without prompts": (truth_without_prompts, ("has no column 'prompts'", "regenerate the set")),
    "empty set": (empty_set, ("holds no stimuli (0 rows)",)),
    "60000x60000 PNG header": (decompression_bomb, ("DecompressionBombError", "exceeds limit", "replace the file")),
    "image of the wrong size": (image_of_the_wrong_size, ("(120x100 px)", "the model reads 88x88")),
    "first image of the wrong size": (first_image_of_the_wrong_size, ("(120x100 px)", "the model reads 88x88")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_the_workspace_is_untouched(name, zygote, stimuli, finished, tmp_path):
    """Injects: one bad input (the case's name) into an extraction whose workspace holds a
    finished run. Asserts: exit code 2 (the zygote's children exit 3 on an uncaught exception),
    one `error: …` line with the case's phrases and no traceback, every file of the workspace
    byte-identical, the finished run still `finished` and no `bad` run; a pickle's code never ran."""
    if name == "device cuda without CUDA" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    make, phrases = CASES[name]
    data = tmp_path / "ws"
    shutil.copytree(finished, data)
    before = _files(data)
    bad = zygote.run(make(tmp_path, stimuli), data)
    assert bad.rc == 2, bad.log
    message = _error_line(bad.log)
    for phrase in phrases:
        assert phrase in message, message
    assert _files(data) == before
    assert _status(data) == {"toy": "finished"}
    assert not (tmp_path / "ran").exists()


def test_data_naming_a_file_is_one_line_before_the_model_loads(zygote, stimuli, tmp_path):
    """Injects: `--data` naming an existing file. Asserts: exit 2, one line naming the file and
    that a workspace is a folder, and the file is unchanged (it used to be a FileExistsError
    traceback from the workspace's mkdir)."""
    target = tmp_path / "notes.txt"
    target.write_text("not a workspace\n")
    bad = zygote.run(write_manifest(tmp_path / "m.yaml", stimuli), target)
    assert bad.rc == 2, bad.log
    assert f"workspace '{target}' is a file, not a folder" in _error_line(bad.log)
    assert target.read_text() == "not a workspace\n"


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    got = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return got.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs a private mount namespace (unshare -m, CAP_SYS_ADMIN)")
def test_read_only_workspace_is_one_line_and_unchanged(stimuli, finished, tmp_path):
    """Injects: the workspace on a read-only file system (EROFS, even for root): a real
    read-only bind mount in a private mount namespace, then a real `python -m extract` of a new
    run into it. Asserts: exit 2, one line saying the workspace is on a read-only file system,
    every file byte-identical, the finished run still finished."""
    data = tmp_path / "ws"
    shutil.copytree(finished, data)
    before = _files(data)
    manifest = write_manifest(tmp_path / "new.yaml", stimuli, run="new")
    script = (f'mount --bind "{data}" "{data}" && mount -o remount,bind,ro "{data}" && touch "{data}/x" 2>/dev/null'
              f' && echo "mount is writable" && exit 9;'
              f' exec "{sys.executable}" -m extract "{manifest}" --data "{data}" --no-progress')
    got = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 2, got.stdout + got.stderr
    assert "is on a read-only file system" in _error_line(got.stderr)
    assert _files(data) == before
    assert _status(data) == {"toy": "finished"}


def test_a_known_model_type_with_auto_map_code_says_it_is_not_run(zygote, stimuli, finished, tmp_path):
    """Injects: the toy model's config.json naming its own code (`auto_map`) while its model_type
    is one transformers and agnosia know. transformers then loads its own classes and ignores
    the code. Asserts: the run succeeds (exit 0), one `warning:` line says the code is not run
    and how to run it, and the code never ran (it would touch a marker)."""
    model = _model_copy(tmp_path)
    marker = tmp_path / "ran"
    (model / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForImageTextToText": "modeling_evil.Evil"}
    (model / "config.json").write_text(json.dumps(config))
    data = tmp_path / "ws"
    shutil.copytree(finished, data)
    child = zygote.run(_model_manifest(tmp_path, stimuli, model), data)
    assert child.rc == 0, child.log
    warnings = [line for line in child.log.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, child.log
    assert "names its own code in config.json (auto_map: AutoModelForImageTextToText)" in warnings[0]
    assert "it is not run" in warnings[0] and "trust_remote_code: true" in warnings[0]
    assert not marker.exists()
    assert _status(data) == {"toy": "finished", "bad": "finished"}


# ---------------------------------------------------------------- python -m probes --scheduler ADDR

class _Listener:
    """A TCP server on loopback that is not Dask: it answers every connection with ``reply`` (an
    HTTP error, say) or keeps silent. Bounded: it stops itself after ``lifetime`` seconds."""

    def __init__(self, reply: bytes | None, lifetime: float = 60.0) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.reply, self.deadline = reply, time.monotonic() + lifetime
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        held = []
        while time.monotonic() < self.deadline and self.sock.fileno() >= 0:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            if self.reply is not None:
                conn.sendall(self.reply)
            held.append(conn)  # kept open: the client must give up by itself
        for conn in held:
            conn.close()

    def close(self) -> None:
        self.deadline = 0.0
        self.thread.join(5)
        self.sock.close()


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@pytest.mark.parametrize("service", ["closed port", "HTTP server", "silent server"])
def test_an_unreachable_or_foreign_scheduler_is_one_line_within_the_timeout(service, tmp_path):
    """Injects: `python -m probes PLAN --scheduler tcp://127.0.0.1:PORT --connect-timeout 2` where
    nothing listens, where a plain TCP server answers with an HTTP error (Dask read its bytes as
    a 3.07 EiB frame length: "Unable to allocate"), and where a server accepts and says nothing
    (Dask waited 30 s). Asserts: exit 2, one `error: cannot reach the Dask scheduler at …` line
    with the reason, no traceback, the check itself under 2 s + slack, and the workspace
    byte-identical."""
    data = tmp_path / "ws"
    Workspace.open(data)
    before = _files(data)
    listener = None
    if service == "closed port":
        port, reason = _closed_port(), "connection refused"
    else:
        reply = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" if service == "HTTP server" else None
        listener = _Listener(reply)
        port = listener.port
        reason = "the service on that port does not speak Dask's protocol" if reply else "no Dask answer within 2 s"
    address = f"tcp://127.0.0.1:{port}"
    code = ("import sys, time; from probes.cli import main; t = time.monotonic(); rc = main(sys.argv[1:]);"
            " print(f'took {time.monotonic() - t:.1f}'); sys.exit(rc)")
    try:
        got = subprocess.run([sys.executable, "-c", code, str(REPO / "manifests" / "probes-demo.yaml"),
                              "--data", str(data), "--scheduler", address, "--connect-timeout", "2"],
                             cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    finally:
        if listener is not None:
            listener.close()
    assert got.returncode == 2, got.stdout + got.stderr
    message = _error_line(got.stderr)
    assert message.startswith(f"error: cannot reach the Dask scheduler at {address} ({reason}"), message
    # main() only, imports excluded: well under Dask's own 30 s of retries, even on a loaded machine
    assert float(got.stdout.split("took ")[1]) < 20, got.stdout
    if listener is not None:
        assert listener.accepted >= 1
    assert _files(data) == before


def test_queries_out_into_a_missing_folder_is_one_line(finished, tmp_path):
    """Injects: `python -m queries --sql … --format csv --out <missing folder>/x.csv`. Asserts:
    exit 2, one line naming the missing folder (it was a FileNotFoundError traceback after the
    query ran), nothing created, the workspace byte-identical."""
    before = _files(finished)
    out = tmp_path / "missing" / "x.csv"
    got = python("-m", "queries", "--data", str(finished), "--sql", "SELECT run, status FROM runs", "--format", "csv",
                 "--out", str(out))
    assert got.returncode == 2, got.stdout + got.stderr
    assert f"the folder {out.parent} does not exist" in _error_line(got.stderr)
    assert not out.parent.exists()
    assert _files(finished) == before
