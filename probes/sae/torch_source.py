"""The activation source as a ``torch.utils.data.IterableDataset`` (imports torch; the source does not)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


class TorchSource(IterableDataset):
    """Batches of an :class:`~probes.sae.source.ActivationSource` as float32 tensors.

    Use with ``DataLoader(ds, batch_size=None)``: the source batches already. Under ``num_workers=k``
    worker i yields the batches of buffers i, i+k, ... so each row still comes once an epoch
    (batches then follow buffer boundaries: the last batch of a buffer may be short).
    """

    def __init__(self, source: Any, epochs: int = 1) -> None:
        self.source = source
        self.epochs = epochs

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        info = get_worker_info()
        for e in range(self.epochs):
            if info is None or info.num_workers == 1:
                for batch in self.source.batches(e):
                    yield tuple(torch.from_numpy(b) for b in batch)  # float32 unless the source says stored
                continue
            mine = range(info.id, len(self.source.buffer_plan(e)), info.num_workers)
            bs = self.source.batch_size
            for buf in self.source.read_buffers(e, mine):
                for s in range(0, len(buf[0]), bs):
                    yield tuple(torch.from_numpy(np.ascontiguousarray(b[s:s + bs])) for b in buf)
