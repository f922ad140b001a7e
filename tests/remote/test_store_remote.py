"""A workspace whose arrays live in an object store (S3 API, a real moto server on loopback):
what the writer uploads, what readers fetch, what verify finds, and the errors on bad setups."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

from store import ArraySpec, RunInfo, StoreError, Workspace, WorkspaceError
from store.location import check_url

pytestmark = pytest.mark.slow  # a real object store and Dask workers per test

N, CHUNK, TOKENS, DIM = 20, 8, 5, 6


def _values(rows) -> np.ndarray:
    r = np.asarray(rows, dtype=np.float32)[:, None, None]
    return (np.sin(r * 0.3 + np.arange(TOKENS)[None, :, None] * 0.2 + np.arange(DIM)[None, None, :] * 0.1)
            * (1 + r)).astype(np.float32)


def _answers(row: int) -> np.ndarray:
    return np.full((row % 3, DIM), row + 0.25, dtype=np.float32)


def _write(ws: Workspace, run: str = "r") -> None:
    """One run with every kind of file: dense raw, dense zstd, ragged blocks, a run tensor."""
    stimuli = [{"id": f"s{i:02d}", "family": "go", "split": "test", "seed": i, "prompt": "p", "answer": str(i),
                "truth": {"count": i}} for i in range(N)]
    with ws.writer(RunInfo(run=run, model="m", dtype="float32", chunk_samples=CHUNK)) as w:
        w.set_samples(w.register_stimuli(stimuli, dataset="set"))
        raw = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(TOKENS, DIM)))
        packed = w.array(ArraySpec(tap="llm", layer=1, tokens="image", shape=(TOKENS, DIM), codec="zstd"))
        ragged = w.array(ArraySpec(tap="llm", layer=1, tokens="answer", shape=(DIM,), ragged=True))
        for start in range(0, N, 3):  # batches straddle chunk boundaries
            stop = min(start + 3, N)
            w.write_batch(start, {raw: _values(range(start, stop)), packed: _values(range(start, stop)),
                                  ragged: [_answers(i) for i in range(start, stop)]})
        w.write_tensor("unembed", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.finish()


@pytest.fixture
def remote_ws(s3, tmp_path):
    ws = Workspace.open(tmp_path / "ws", arrays_url=s3.url("ws"))
    _write(ws)
    return ws


def test_a_run_lives_in_the_bucket_and_reads_back_exactly(remote_ws, s3, tmp_path):
    ws = Workspace.open(tmp_path / "ws", readonly=True)  # the URL is found by a plain open
    assert ws.root.url == s3.url("ws")
    expect = _values(range(N)).astype(np.float16)
    for layer in (0, 1):
        assert np.array_equal(ws.read("r", "llm", layer, tokens="image"), expect)
        rows = [0, 1, 2, 9, 15, 19]  # runs of rows inside and across chunks
        assert np.array_equal(ws.read("r", "llm", layer, tokens="image", rows=rows), expect[rows])
        assert np.array_equal(ws.read("r", "llm", layer, tokens="image", rows=rows, index=(slice(1, 3), 0)),
                              expect[rows][:, 1:3, 0])
        lazy = ws.read("r", "llm", layer, tokens="image", lazy=True)
        assert np.array_equal(lazy.compute(scheduler="sync"), expect)
    rag = ws.read("r", "llm", 1, tokens="answer")
    assert list(rag.lengths) == [i % 3 for i in range(N)]
    assert all(np.array_equal(rag[i], _answers(i).astype(np.float16)) for i in range(N))
    assert np.array_equal(ws.read_tensor("r", "unembed"), np.arange(12, dtype=np.float32).reshape(3, 4))

    # Committed chunks were uploaded, then removed from the local staging area: only metadata stays.
    local = [p.name for p in (tmp_path / "ws" / "arrays").rglob("*") if p.is_file()]
    assert set(local) == {"zarr.json"}, sorted(set(local))
    keys = s3.fs.find(f"{s3.bucket}/ws/r/llm/0/resid_post/image")
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["c.0.0.0", "c.1.0.0", "c.2.0.0", "zarr.json"]
    # The site group's stimulus-id coordinate is uploaded whole (its ids are staged like a chunk).
    coord = s3.fs.find(f"{s3.bucket}/ws/r/llm/0/resid_post/sample")
    assert sorted(k.rsplit("/", 1)[1] for k in coord) == ["c.0", "zarr.json"]

    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert rep.chunks == 9 and rep.bytes_checked > 0

    # Plain zarr-python reads the same arrays from the bucket, without agnosia.
    opts = {"key": "agnosia", "secret": "agnosia", "endpoint_url": s3.endpoint}
    z = zarr.open_array(s3.url("ws/r/llm/1/resid_post/image"), mode="r", storage_options=opts)
    assert np.array_equal(z[...], expect)
    ids = zarr.open_array(s3.url("ws/r/llm/1/resid_post/sample"), mode="r", storage_options=opts)
    assert ids[...].tolist() == [f"set/s{i:02d}" for i in range(N)]


def test_verify_and_readers_name_damaged_and_missing_objects(remote_ws, s3):
    base = f"{s3.bucket}/ws/r/llm/0/resid_post/image"
    chunk = bytearray(s3.fs.cat_file(f"{base}/c.1.0.0"))
    chunk[7] ^= 0x40
    s3.fs.pipe(f"{base}/c.1.0.0", bytes(chunk))
    s3.fs.rm(f"{base}/c.2.0.0")
    ws = Workspace.open(remote_ws.path, readonly=True)
    rep = ws.verify()
    text = "\n".join(rep.problems)
    # 20 samples in chunks of at most 8 are stored as three chunks of 7 (rows 7-13 in chunk 1)
    assert "chunk 1 (rows 7-13) checksum mismatch" in text and f"{s3.url('ws')}/r/llm/0" in text
    assert "chunk 2 unreadable" in text and "c.2.0.0 is missing" in text
    with pytest.raises(WorkspaceError, match=r"chunk 2 of .* is missing: run `python -m store verify"):
        ws.read("r", "llm", 0, tokens="image", rows=[17])
    assert ws.read("r", "llm", 0, tokens="image", rows=[3]).shape == (1, TOKENS, DIM)  # the rest still reads


def test_resume_rewrites_nothing_committed_and_drop_run_empties_the_prefix(remote_ws, s3):
    before = {k: s3.fs.info(k)["LastModified"] for k in s3.fs.find(f"{s3.bucket}/ws/r")}
    # A kill between a commit and its clean-up leaves staged copies of committed chunks behind.
    staged = remote_ws.zarr_path / "r/llm/0/resid_post/image/c.1.0.0"
    block = remote_ws.zarr_path / "r/llm/1/resid_post/answer/b2/offsets/c.0"
    for f in (staged, block):
        f.write_bytes(b"left behind")
    _write(remote_ws)  # a second pass over a finished run: every chunk is committed already
    after = {k: s3.fs.info(k)["LastModified"] for k in s3.fs.find(f"{s3.bucket}/ws/r")}
    assert after == before
    assert not staged.exists() and not block.exists()  # the resume removed them
    counts = remote_ws.drop_run("r")
    assert counts["chunks"] == 9
    assert s3.fs.find(f"{s3.bucket}/ws/r") == []
    assert s3.fs.exists(f"{s3.bucket}/ws/zarr.json")  # the workspace itself stays
    assert remote_ws.verify().ok


def test_an_orphan_prefix_is_reported_and_dropped(remote_ws, s3):
    s3.fs.pipe(f"{s3.bucket}/ws/ghost/llm/0/zarr.json", b"{}")  # left by a drop cut short
    rep = Workspace.open(remote_ws.path, readonly=True).verify()
    assert rep.ok and any("ghost" in w and "orphan" in w for w in rep.warnings), rep.warnings
    remote_ws.drop_run("ghost")
    assert not s3.fs.exists(f"{s3.bucket}/ws/ghost/llm/0/zarr.json")


def test_one_prefix_holds_one_workspace(remote_ws, s3, tmp_path):
    with pytest.raises(WorkspaceError, match="already holds the arrays of another workspace"):
        Workspace.open(tmp_path / "other", arrays_url=s3.url("ws"))
    with pytest.raises(WorkspaceError, match="keeps its arrays at s3://.*, not at s3://.*/elsewhere"):
        Workspace.open(remote_ws.path, arrays_url=s3.url("elsewhere"))
    local = Workspace.open(tmp_path / "local")
    with pytest.raises(WorkspaceError, match="keeps its arrays locally"):
        Workspace.open(local.path, arrays_url=s3.url("x"))
    # The bucket was emptied behind the workspace's back: the writer refuses to start.
    s3.fs.rm(f"{s3.bucket}/ws", recursive=True)
    with pytest.raises(WorkspaceError, match="emptied or reused"):
        _write(Workspace.open(remote_ws.path))
    rep = Workspace.open(remote_ws.path, readonly=True).verify()
    assert any("are gone" in p for p in rep.problems), rep.problems


def test_bad_urls_and_unreachable_stores_say_what_to_fix(s3, tmp_path, monkeypatch):
    for bad, why in [("bucket/prefix", "is not a URL"), ("file:///tmp/x", "names a local path"),
                     ("s3://", "is not a URL"), ("s3://b/../x", "without '.', '..'")]:
        with pytest.raises(WorkspaceError, match=why):
            check_url(bad)
    assert check_url("s3://b/p/") == "s3://b/p"
    with pytest.raises(WorkspaceError, match="fsspec knows no protocol 'nosuch'"):
        Workspace.open(tmp_path / "a", arrays_url="nosuch://b/p")
    with pytest.raises(WorkspaceError, match=r"cannot reach the arrays at s3://no-such-bucket-\w+/p.*credentials"):
        Workspace.open(tmp_path / "b", arrays_url="s3://no-such-bucket-x1/p")
    monkeypatch.setenv("AGNOSIA_STORAGE_OPTIONS", "[1, 2]")
    with pytest.raises(WorkspaceError, match="must be a JSON object"):
        Workspace.open(tmp_path / "c", arrays_url=s3.url("c"))


def test_storage_options_come_from_the_environment_and_never_enter_the_workspace(s3, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AGNOSIA_STORAGE_OPTIONS", json.dumps({"endpoint_url": s3.endpoint}))
    ws = Workspace.open(tmp_path / "ws", arrays_url=s3.url("opts"))
    _write(ws)
    assert ws.verify().ok
    stored = (tmp_path / "ws" / "arrays" / "zarr.json").read_text()
    assert s3.url("opts") in stored and s3.endpoint not in stored and "agnosia\"" not in stored
    with pytest.raises(StoreError):
        ws.drop_run("nope")


def test_a_failed_init_on_a_missing_bucket_leaves_the_folder_free(s3, tmp_path):
    """Injects (issue 40, item 11): `init` with arrays in a bucket that does not exist. Asserts: the
    refusal says to check the bucket, and the same folder then opens with the right URL (before the
    fix the failed init had bound the folder to the missing bucket, and the corrected one was refused)."""
    with pytest.raises(WorkspaceError, match="cannot reach the arrays at s3://no-such-bucket-x2/p"):
        Workspace.open(tmp_path / "ws", arrays_url="s3://no-such-bucket-x2/p")
    ws = Workspace.open(tmp_path / "ws", arrays_url=s3.url("good"))
    assert ws.root.url == s3.url("good") and ws.verify().ok



class _Refusing:
    """Loopback servers for the S3 client: one answers every request 403 AccessDenied (denied
    access), one reads the request and closes the connection (a dropped connection)."""

    def __enter__(self) -> dict[str, str]:
        import http.server
        import socketserver
        import threading

        class Deny(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _deny(self) -> None:
                body = b"<?xml version='1.0'?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _deny

            def log_message(self, *args: object) -> None:
                pass

        class Drop(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.recv(65536)
                self.request.close()

        self.servers = [socketserver.ThreadingTCPServer(("127.0.0.1", 0), h) for h in (Deny, Drop)]
        for s in self.servers:
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()
        return {name: f"http://127.0.0.1:{s.server_address[1]}" for name, s in zip(("denied", "dropped"), self.servers,
                                                                                 strict=True)}

    def __exit__(self, *exc: object) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


def test_denied_access_and_dropped_connections_are_one_line_in_verify_and_init(remote_ws, s3, tmp_path, monkeypatch,
                                                                             capsys):
    """Injects (issue 40, item 10): the object store behind a workspace's arrays answering 403
    AccessDenied to everything, or dropping every connection, for `python -m store verify` and
    `python -m store init --arrays s3://…`. Asserts: each exits non-zero with `error:` or problem
    lines naming the URL and what to check, never a traceback (was: botocore's and aiohttp's
    exceptions escaped as tracebacks)."""
    from store import location
    from store.cli import main as store_cli

    with _Refusing() as endpoints:
        for name, endpoint in endpoints.items():
            monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
            monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")   # no retries: a refusal is one request
            # fsspec keeps one client per set of options: new options, so a new client for this server
            monkeypatch.setenv("AGNOSIA_STORAGE_OPTIONS", json.dumps({"endpoint_url": endpoint}))
            location._FILESYSTEMS.clear()
            code = store_cli(["verify", "--data", str(remote_ws.path)])
            out = capsys.readouterr()
            assert code != 0 and "Traceback" not in out.err + out.out, (name, out.err[-3000:])
            assert f"the arrays at {remote_ws.root.url} cannot be reached" in out.out, (name, out.out)
            assert "Check the bucket, and the credentials and endpoint" in out.out and "not checked" in out.out
            code = store_cli(["init", "--data", str(tmp_path / f"new-{name}"), "--arrays", s3.url(f"new-{name}")])
            out = capsys.readouterr()
            assert code == 2 and "Traceback" not in out.err, (name, out.err[-3000:])
            assert out.err.startswith("error: cannot reach the arrays at s3://") and out.err.count("\n") == 1, out.err
            assert not (tmp_path / f"new-{name}" / "arrays" / "zarr.json").exists()


def test_a_writer_the_object_store_refuses_leaves_no_run_running(s3, tmp_path, monkeypatch):
    """Injects (issue 40, item 11): a run written to a workspace whose object store then answers
    403 to everything (a wrong key). Asserts: the writer is refused with an error naming the store
    and what to check, and no run row is left `running` (nothing would run it any more)."""
    from store import location

    ws = Workspace.open(tmp_path / "ws", arrays_url=s3.url("wrong-key"))
    with _Refusing() as endpoints:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoints["denied"])
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        monkeypatch.setenv("AGNOSIA_STORAGE_OPTIONS", json.dumps({"endpoint_url": endpoints["denied"]}))
        location._FILESYSTEMS.clear()
        with pytest.raises(WorkspaceError, match="cannot reach the arrays at s3://.*Forbidden"):
            _write(ws, "denied")
    # Refused before the run's row is written: no run marked running that nothing runs (was: running).
    assert ws.rows("SELECT run, status FROM runs") == []
