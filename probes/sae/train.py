"""Training one SAE (or transcoder) from an activation source, out of core, resumable.

The loop reads shuffled batches from :class:`~probes.sae.source.ActivationSource` (one buffer
held at a time), takes Adam steps, and every ``checkpoint_every`` steps writes a checkpoint
(weights, Adam's moments and the position in the epoch, all safetensors + JSON, never a pickle).
Run again with the same settings, it resumes at the checkpoint's batch without re-reading the
batches before it. At the end the SAE is scored on the held-out rows: reconstruction MSE,
explained variance, L0 and the share of dead features.

Why not SAELens's ``SAETrainer``: importing ``sae_lens`` loads ``transformers`` and more (see
probes/sae/model.py), and its trainer keeps no resumable position in an external data source;
the loop here is the same objective (TopK MSE; ReLU MSE + L1 on ``acts * |W_dec|``) in ~100 lines.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from probes.sae.model import SparseAutoencoder, save
from probes.sae.source import ActivationSource
from store import heap

CHECKPOINT = "checkpoint"
#: glibc thresholds while an SAE trains (store/heap.py explains the two): each step allocates and
#: frees 7-60 MB temporaries (a gathered batch, its float32 copy, activations, gradients); above
#: the mmap threshold they go back to the OS when freed, below it they fragment the heap. At
#: d 3,584, d_sae 2,048 a worker held 1,120 MiB with store/heap.py's 16 / 32 MiB and 790 MiB with
#: 1 / 2 MiB, with no measurable change in speed (a step is ~1 s; its page faults, milliseconds).
TRAIN_MMAP_THRESHOLD, TRAIN_TRIM_THRESHOLD = 1 << 20, 2 << 20


@contextmanager
def _training_heap() -> Iterator[None]:
    """The thresholds above while training, store/heap.py's after (they cannot be read back)."""
    libc = None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, TRAIN_MMAP_THRESHOLD)   # M_MMAP_THRESHOLD
            libc.mallopt(-1, TRAIN_TRIM_THRESHOLD)   # M_TRIM_THRESHOLD
        except (OSError, AttributeError):
            libc = None  # not glibc
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(-3, heap.MMAP_THRESHOLD)
            libc.mallopt(-1, heap.TRIM_THRESHOLD)


@dataclass(frozen=True)
class TrainSettings:
    """How one SAE trains (a plan entry's ``sae:`` block, see probes/sae/plan.py)."""

    architecture: str = "topk"
    d_sae: int = 64
    k: int | None = 8
    l1: float = 1e-3
    lr: float = 1e-3
    epochs: int = 1
    batch_size: int = 1024
    buffer_rows: int = 65536
    seed: int = 0
    checkpoint_every: int = 200
    threads: int = 1


@dataclass
class TrainOutcome:
    """What one training run measured; ``rows_per_s`` counts the rows trained on, reading included."""

    steps: int
    rows: int
    seconds: float
    rows_per_s: float
    resumed_at: int
    first_step_seconds: float = 0.0   # the first step's share of ``seconds`` (allocations, warm-up)
    mse: float = float("nan")
    explained_variance: float = float("nan")
    l0: float = float("nan")
    dead_share: float = float("nan")
    n_test: int = 0


def _loss(sae: SparseAutoencoder, x: torch.Tensor, y: torch.Tensor, l1: float) -> torch.Tensor:
    acts = sae.encode(x)
    mse = (sae.decode(acts) - y).pow(2).sum(-1).mean()
    if sae.architecture == "topk":
        return mse
    return mse + l1 * (acts * sae.W_dec.norm(dim=1)).sum(-1).mean()


def _pair(batch: tuple[np.ndarray, ...], transcoder: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # float16 batches (the source's dtype='stored') are cast here: torch's cast is several times numpy's
    x = torch.from_numpy(batch[0]).float()
    return x, (torch.from_numpy(batch[1]).float() if transcoder else x)


def _save_checkpoint(folder: Path, sae: SparseAutoencoder, opt: torch.optim.Optimizer, pos: dict[str, int]) -> None:
    ck = folder / CHECKPOINT
    save(sae, ck)
    # One file of Adam's moments per parameter: safetensors copies a file's tensors to bytes while it
    # writes, so one file for all would hold a second copy of every moment (~240 MB at d 3,584).
    for name, p in sae.named_parameters():
        st = opt.state.get(p, {})
        if "exp_avg" not in st:
            continue
        moments = {k: torch.as_tensor(st[k]).detach().reshape(-1) for k in ("exp_avg", "exp_avg_sq", "step")}
        save_file(moments, str(ck / f"adam.{name}.safetensors.tmp"))
        (ck / f"adam.{name}.safetensors.tmp").replace(ck / f"adam.{name}.safetensors")
    (ck / "position.json.tmp").write_text(json.dumps(pos))
    (ck / "position.json.tmp").replace(ck / "position.json")


def _load_checkpoint(folder: Path, sae: SparseAutoencoder, opt: torch.optim.Optimizer,
                     settings: TrainSettings) -> dict[str, int] | None:
    ck = folder / CHECKPOINT
    if not (ck / "position.json").exists():
        return None
    pos = json.loads((ck / "position.json").read_text())
    if pos.get("settings") != _settings_id(settings):
        return None  # trained with other settings: start over rather than mix them
    state = load_file(str(ck / "sae_weights.safetensors"))
    sae.load_state_dict(state)
    for name, p in sae.named_parameters():
        if (ck / f"adam.{name}.safetensors").exists():
            m = load_file(str(ck / f"adam.{name}.safetensors"))
            opt.state[p] = {"step": m["step"].reshape(()), "exp_avg": m["exp_avg"].reshape(p.shape),
                            "exp_avg_sq": m["exp_avg_sq"].reshape(p.shape)}
    return {k: int(v) for k, v in pos.items() if k != "settings"}


def _settings_id(settings: TrainSettings) -> int:
    """A checkpoint resumes only under the settings that wrote it (how often to save and the thread
    count change no result)."""
    d = asdict(settings)
    d.pop("checkpoint_every")
    d.pop("threads")
    return zlib.crc32(json.dumps(d, sort_keys=True).encode())


def train(source: ActivationSource, settings: TrainSettings, folder: str | Path,
          metadata: dict[str, Any] | None = None, stop_after: int | None = None) -> tuple[SparseAutoencoder, TrainOutcome]:
    """Train on ``source`` (for a transcoder: its two arrays, input then output), resuming from a
    checkpoint in ``folder`` if one of the same settings is there; the final SAE is saved in
    ``folder`` (SAELens's layout). ``stop_after``: stop after that many steps (tests interrupt with it)."""
    with _training_heap():
        return _train(source, settings, folder, metadata, stop_after)


def _train(source: ActivationSource, settings: TrainSettings, folder: str | Path, metadata: dict[str, Any] | None,
           stop_after: int | None) -> tuple[SparseAutoencoder, TrainOutcome]:
    torch.set_num_threads(settings.threads)
    folder = Path(folder)
    transcoder = settings.architecture == "transcoder"
    d_in = source.dims[0]
    sae = SparseAutoencoder(settings.architecture, d_in, settings.d_sae, k=settings.k,
                            d_out=source.dims[1] if transcoder else None, seed=settings.seed, metadata=metadata)
    # foreach=False: the multi-tensor Adam makes temporaries of every parameter at once (~200 MB more
    # peak at d 3,584, d_sae 2,048); one parameter at a time costs no measurable speed here
    opt = torch.optim.Adam(sae.parameters(), lr=settings.lr, foreach=False)
    pos = _load_checkpoint(folder, sae, opt, settings)
    resumed = 0 if pos is None else pos["step"]
    if pos is None:
        first = next(source.batches(0))
        with torch.no_grad():  # start the decoder bias at the data's mean (SAELens: b_dec_init_method="mean")
            sae.b_dec.copy_(torch.from_numpy(first[1 if transcoder else 0]).float().mean(0))
        pos = {"epoch": 0, "batch": 0, "step": 0}
    step, rows, t0 = pos["step"], 0, time.perf_counter()
    first_s = 0.0
    per_epoch = source.n_batches()
    for epoch in range(pos["epoch"], settings.epochs):
        start = pos["batch"] if epoch == pos["epoch"] else 0
        for b, batch in enumerate(source.batches(epoch, start), start=start):
            x, y = _pair(batch, transcoder)
            loss = _loss(sae, x, y, settings.l1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if settings.architecture == "topk":
                sae.normalise_decoder()
            step += 1
            rows += len(x)
            if not first_s:
                first_s = time.perf_counter() - t0
            nxt = {"epoch": epoch + (b + 1 == per_epoch), "batch": (b + 1) % per_epoch, "step": step}
            if settings.checkpoint_every and step % settings.checkpoint_every == 0:
                _save_checkpoint(folder, sae, opt, {**nxt, "settings": _settings_id(settings)})
            if stop_after is not None and step - resumed >= stop_after:
                _save_checkpoint(folder, sae, opt, {**nxt, "settings": _settings_id(settings)})
                secs = time.perf_counter() - t0
                return sae, TrainOutcome(step, rows, secs, rows / max(secs, 1e-9), resumed, first_s)
    secs = time.perf_counter() - t0
    save(sae, folder)
    return sae, TrainOutcome(step, rows, secs, rows / max(secs, 1e-9), resumed, first_s)


@torch.no_grad()
def evaluate(sae: SparseAutoencoder, source: ActivationSource, outcome: TrainOutcome) -> TrainOutcome:
    """Fill ``outcome``'s test metrics from every row of ``source`` (the held-out rows)."""
    transcoder = sae.architecture == "transcoder"
    sq = 0.0
    s1: torch.Tensor | None = None
    s2 = 0.0
    n = 0
    active = 0
    fired = torch.zeros(sae.d_sae, dtype=torch.bool)
    for batch in source.batches(0):
        x, y = _pair(batch, transcoder)
        acts = sae.encode(x)
        err = sae.decode(acts) - y
        sq += float(err.pow(2).sum())
        s1 = y.sum(0).double() if s1 is None else s1 + y.sum(0).double()
        s2 += float(y.double().pow(2).sum())
        n += len(y)
        nz = acts > 0
        active += int(nz.sum())
        fired |= nz.any(0)
    if n == 0:
        return outcome
    assert s1 is not None
    tot = s2 - float((s1 * s1).sum()) / n   # total sum of squares about the mean
    outcome.mse = sq / (n * y.shape[1])
    outcome.explained_variance = 1.0 - sq / tot if tot > 0 else float("nan")
    outcome.l0 = active / n
    outcome.dead_share = float((~fired).float().mean())
    outcome.n_test = n
    return outcome
