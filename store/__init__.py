"""The agnosia activation store: Zarr v3 arrays + a DuckDB manifest in one workspace folder.

Write (the extraction stage)::

    from store import Workspace, RunInfo, ArraySpec, TokenSpans, Generation
    ws = Workspace.open("data")
    with ws.writer(RunInfo(run="r1", model="Qwen/Qwen2-VL-2B-Instruct", dtype="bfloat16")) as w:
        w.set_samples(w.register_stimulus_set("sets/g2m"))
        a = w.array(ArraySpec(tap="llm", layer=12, tokens="image", shape=(64, 1536), dtype="bfloat16"))
        for rows in w.todo():
            ...
            w.write_batch(start, {a: acts}, tokens=spans, generations=gens)
        w.finish()

Read (probes, queries)::

    ws = Workspace.open("data", readonly=True)
    x = ws.read("r1", tap="llm", layer=12, tokens="image", where="family = 'g2m'")
    ws.query("SELECT tap, layer, count(*) FROM activations GROUP BY ALL")

See docs/store.md for the layout, tables, dtype policy, codecs and concurrency model.
"""

from store.errors import (
    DiskFullError,
    DtypeOverflowError,
    ManifestBusyError,
    NotCommittedError,
    SchemaVersionError,
    SpecMismatchError,
    StoreError,
    WorkspaceError,
    WriterError,
    WriterLockError,
)
from store.records import (
    ArrayInfo,
    ArraySpec,
    Generation,
    ProbeResult,
    Ragged,
    RunInfo,
    Selection,
    Shard,
    TokenSpans,
)
from store.sizing import SizeEstimate, size_estimate
from store.verify import VerifyReport
from store.workspace import Workspace, resolve_path
from store.writer import ArrayHandle, Writer, WriterStats

__all__ = [
    "ArrayHandle", "ArrayInfo", "ArraySpec", "DiskFullError", "DtypeOverflowError", "Generation", "ManifestBusyError",
    "NotCommittedError", "ProbeResult", "Ragged", "RunInfo", "SchemaVersionError", "Selection", "Shard",
    "SizeEstimate", "SpecMismatchError", "StoreError", "TokenSpans", "VerifyReport", "Workspace", "WorkspaceError",
    "Writer", "WriterError", "WriterLockError", "WriterStats", "resolve_path", "size_estimate",
]
