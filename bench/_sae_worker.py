"""One side of the SAE benchmark alone in a fresh process (so its peak RSS is its own).

    python -m bench._sae_worker '{"side": "store" | "saelens", "data": "/tmp/ws", "run": "bench",
                                  "array": "llm:0", "d_sae": 2048, "k": 32, "batch": 1024, "steps": 20,
                                  "buffer_rows": 8192}'

``store``: agnosia's TopK SAE trained out of core from the store (probes/sae/: the shuffled source,
one buffer held). ``saelens``: SAELens's ``TopKTrainingSAE`` and ``SAETrainer`` fed batches of an
in-memory tensor holding the same rows (read from the store before the clock starts). Both run
``steps`` Adam steps of ``batch`` rows after one untimed warm-up step, on one torch thread.
Prints one JSON line: rows/s, the seconds timed, peak RSS (MiB).
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _rss_mib() -> float:
    """This process's peak RSS: VmHWM (ru_maxrss keeps the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def store_side(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from probes.sae import ActivationSource
    from probes.sae.train import TrainSettings, train
    from store import Workspace

    torch.set_num_threads(1)
    ws = Workspace.open(cfg["data"], readonly=True)
    src = ActivationSource(ws, cfg["run"], [cfg["array"]], batch_size=cfg["batch"], buffer_rows=cfg["buffer_rows"],
                           dtype="stored")
    settings = TrainSettings(architecture="topk", d_sae=cfg["d_sae"], k=cfg["k"], lr=1e-4, epochs=1,
                             batch_size=cfg["batch"], buffer_rows=cfg["buffer_rows"], checkpoint_every=0)
    with tempfile.TemporaryDirectory() as tmp:
        # one run of steps + 1: the first step (allocations, warm-up) is left out of the rate, as on
        # SAELens's side, and the process holds one SAE, as a farm worker does
        _, out = train(src, settings, Path(tmp) / "timed", stop_after=cfg["steps"] + 1)
    secs = out.seconds - out.first_step_seconds
    rows = out.rows - cfg["batch"]
    return {"rows_per_s": rows / secs, "seconds": secs, "rows": rows, "rss_mib": _rss_mib()}


def saelens_side(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from sae_lens import LoggingConfig, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    from store import Workspace

    torch.set_num_threads(1)
    ws = Workspace.open(cfg["data"], readonly=True)
    tap, layer = cfg["array"].split(":")
    n_rows = (cfg["steps"] + 1) * cfg["batch"]
    per = ws.array_info(cfg["run"], tap, int(layer)).item_shape[0]
    x = ws.read(cfg["run"], tap, int(layer), rows=slice(0, -(-n_rows // per)))
    rows = torch.from_numpy(x.reshape(-1, x.shape[-1])[:n_rows].astype("float32"))

    def batches() -> Iterator[torch.Tensor]:
        while True:
            for s in range(0, len(rows) - cfg["batch"] + 1, cfg["batch"]):
                yield rows[s:s + cfg["batch"]]

    def trainer(steps: int) -> Any:
        sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=rows.shape[1], d_sae=cfg["d_sae"], k=cfg["k"]))
        tcfg = SAETrainerConfig(total_training_samples=steps * cfg["batch"], train_batch_size_samples=cfg["batch"],
                                lr=1e-4, lr_end=1e-4, device="cpu", logger=LoggingConfig(log_to_wandb=False))
        return SAETrainer(tcfg, sae, batches())

    trainer(1).fit()
    t = trainer(cfg["steps"])
    t0 = time.perf_counter()
    t.fit()
    secs = time.perf_counter() - t0
    return {"rows_per_s": cfg["steps"] * cfg["batch"] / secs, "seconds": secs, "rows": cfg["steps"] * cfg["batch"],
            "rss_mib": _rss_mib()}


if __name__ == "__main__":
    conf = json.loads(sys.argv[1])
    print(json.dumps(store_side(conf) if conf["side"] == "store" else saelens_side(conf)))
