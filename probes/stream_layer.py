"""One layer of a streamed group: map -> tree of merges -> solve, then the test pass (which a
dual spec's solve does itself, over the test rows its maps gathered).

The same functions run a layer as many Dask tasks (``call`` submits each step, so a large
layer's partitions spread over the workers) or as one task (:func:`run_layer`: the same steps,
partitions and merge order inside one worker, so its results are bit for bit the graph's). The
farm picks the single task when a layer is small (probes/trainers/streamed.py ``fuses``): then the
per-task round trips, not the arithmetic, would set the pace. Imports numpy and
probes/stream.py only, so a streamed-only worker never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from probes import stream


def fit_layer(call: Callable[..., Any], spec: Any, info: Any, parts: int, rows: np.ndarray) -> Any:
    """map (partitions of whole chunks) -> tree of merges -> solve. ``call(fn, *args)`` runs a
    task here, or submits it to Dask and returns its future."""
    cuts = stream.partitions(rows, info.chunk_samples, parts)
    maps = [call(stream.accumulate, spec, info, lo, hi) for lo, hi in cuts]
    merged = stream.tree_reduce(maps, lambda a, b: call(stream.merge, a, b))
    maps.clear()   # in one process: the merged statistics alone stay held through the solve
    return call(stream.solve, spec, merged)


def score_layer(call: Callable[..., Any], spec: Any, info: Any, parts: int, sol: Any, rows: np.ndarray,
                dual: bool) -> Any:
    """map over the test rows -> tree of sums; ``dual`` (the spec's, which ``spec`` may be a future
    of): the solve already scored the rows it held."""
    if dual:
        return call(stream.solved_scores, sol)
    cuts = stream.partitions(rows, info.chunk_samples, parts)
    tested = [call(stream.score, spec, info, lo, hi, sol) for lo, hi in cuts]
    return stream.tree_reduce(tested, lambda a, b: call(stream.add_scores, a, b))


def _here(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def run_layer(spec: Any, info: Any, parts: int, rows: np.ndarray) -> tuple[stream.Solution, stream.Scores]:
    """A whole layer in this process, cut into ``parts`` partitions as the task graph would be."""
    sol = fit_layer(_here, spec, info, parts, rows)
    return sol, score_layer(_here, spec, info, parts, sol, rows, spec.dual)
