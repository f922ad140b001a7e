"""Fixtures every test folder may use: a real S3-compatible server on loopback, and a count of
DuckDB instances built (``connects``).

``s3`` starts moto's server (``python -m moto.server``) as its own process once per test
session (per xdist worker), and gives each test a fresh bucket plus the environment that the
store and any subprocess (extraction, Dask workers) read their endpoint and credentials from.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class S3:
    endpoint: str
    bucket: str
    env: dict[str, str]

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    @property
    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(key="agnosia", secret="agnosia", endpoint_url=self.endpoint,
                                 use_listings_cache=False, skip_instance_cache=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extras: make setup")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start on {endpoint} (rc {proc.poll()})") from None
            time.sleep(0.1)
    try:
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def s3(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    env = {
        "AWS_ACCESS_KEY_ID": "agnosia", "AWS_SECRET_ACCESS_KEY": "agnosia", "AWS_ENDPOINT_URL": s3_server,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AGNOSIA_STORAGE_OPTIONS", raising=False)
    got = S3(s3_server, f"agnosia-{uuid.uuid4().hex[:12]}", env)
    got.fs.mkdir(got.bucket)
    return got


@pytest.fixture
def connects(monkeypatch):
    """Every duckdb.connect of this process, by path (the real connect still runs)."""
    import duckdb

    calls: list[str] = []
    real = duckdb.connect

    def counting(database=":memory:", *args, **kwargs):
        calls.append(str(database))
        return real(database, *args, **kwargs)

    monkeypatch.setattr(duckdb, "connect", counting)
    return calls
