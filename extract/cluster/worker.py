"""What runs on a worker of a cluster run: the model kept between tasks, a run planned, a chunk computed.

:class:`ModelHolder` is a Dask worker plugin: the client registers it once and every worker
(those that join later too) keeps one model at a time in it, loaded by the first task that needs
it and reused by the next tasks of the same model; a task of another model replaces it.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from distributed import WorkerPlugin, get_worker

from extract.cluster.facts import WorkerFacts, worker_facts
from extract.cluster.tasks import GroupDone, GroupTask, RunPlan, RunRequest
from extract.generation import stop_ids
from extract.interventions.rope import scaled_vision_rope
from extract.manifest import Manifest, ManifestError, ModelSpec
from extract.models import LoadedModel, load_model, resolve_points
from extract.run import array_specs, check_image_sizes, lens_tensors, model_setup, overflow_in, run_batch, run_info
from extract.samples import by_modality
from store.writer.chunk_writer import ChunkWriter

PLUGIN = "agnosia-models"


class ModelHolder(WorkerPlugin):
    """A worker's model, loaded once and kept for the tasks that need it (one model at a time)."""

    name = PLUGIN

    def __init__(self) -> None:
        self.key: str | None = None
        self.model: LoadedModel | None = None
        self.loads = 0  # how often this worker loaded a model: a test and the bench read it
        self.worker = "?"

    def setup(self, worker: Any) -> None:
        # torch's threads are left as the worker process has them: a nanny starts workers with
        # OMP_NUM_THREADS=1 (Dask's pre-spawn environment), an in-process worker shares the client's.
        self.worker = str(worker.name)

    def teardown(self, worker: Any) -> None:
        self.release()

    def get(self, spec: ModelSpec) -> LoadedModel:
        """The model ``spec`` names, loading it (and letting go of another) when this worker holds none."""
        key = spec.model_dump_json()
        if self.model is None or self.key != key:
            from transformers.utils import logging as hf_logging

            self.release()
            hf_logging.disable_progress_bar()  # a worker's log is no terminal
            self.model = load_model(spec.path, dtype=spec.dtype, device=spec.device, device_map=spec.device_map,
                                    revision=spec.revision, trust_remote_code=spec.trust_remote_code)
            self.key = key
            self.loads += 1
        return self.model

    def release(self) -> None:
        if self.model is None:
            return
        cuda = str(self.model.device).startswith("cuda")
        self.model, self.key = None, None
        gc.collect()
        if cuda:
            import torch

            torch.cuda.empty_cache()


def holder() -> ModelHolder:
    """This worker's :class:`ModelHolder`."""
    plugin = get_worker().plugins.get(PLUGIN)
    if not isinstance(plugin, ModelHolder):
        raise RuntimeError(f"this worker has no {PLUGIN} plugin: the client registers it (extract/cluster/client.py)")
    return plugin


def facts_of(manifest: Manifest) -> WorkerFacts:
    """This worker's facts for ``manifest`` (run on every worker by the client before any task)."""
    return worker_facts(manifest.model.device)


@contextmanager
def client_folder(cwd: str) -> Iterator[None]:
    """Run in the client's working directory, where it exists here (a shared file system): the
    manifest's relative paths (model folder, stimulus sets, their images) then name what the client
    named, and the run records them as a single process would. A worker runs one task at a time
    (its GPU resource), so changing the process's directory for the task is safe."""
    here = os.getcwd()
    move = cwd != here and os.path.isdir(cwd)
    if move:
        os.chdir(cwd)
    try:
        yield
    finally:
        if move:
            os.chdir(here)


def _intervention(lm: LoadedModel, manifest: Manifest) -> Any:
    kind = manifest.intervention.kind if manifest.intervention else None
    return scaled_vision_rope(lm, manifest.intervention) if kind == "rope_scaling" else nullcontext()


def plan_run(req: RunRequest) -> RunPlan:
    """What ``req``'s run stores, read off the model this worker loads for it (a worker's task)."""
    keeper = holder()
    with client_folder(req.cwd):
        return _plan(keeper, req)


def _plan(keeper: ModelHolder, req: RunRequest) -> RunPlan:
    lm = keeper.get(req.manifest.model)
    with _intervention(lm, req.manifest):
        setup = model_setup(lm, req.manifest, req.samples)
        specs = array_specs(lm, setup.points, setup.first, setup.dense_images, setup.dtype, req.codec)
        check_image_sizes(lm, setup.sizes, checked=setup.first)
    return RunPlan(
        request=setup.request, specs=specs, chosen=setup.chosen,
        routed=run_info(lm, req.manifest, setup.lens, setup.chosen), unrouted=run_info(lm, req.manifest, setup.lens, None),
        dtype=setup.dtype, lens=lens_tensors(lm, setup.lens) if setup.lens is not None else None, worker=keeper.worker,
    )


def extract_group(task: GroupTask) -> GroupDone:
    """Compute ``task``'s rows and write their chunks where the arrays live (a worker's task)."""
    started = time.perf_counter()
    keeper = holder()
    mine = facts_of(task.manifest)
    if mine != task.facts:
        raise ManifestError(f"worker {keeper.worker} computes on {mine.describe()}, the run's other workers on"
                            f" {task.facts.describe()}: a run's chunks must all come from one kind of worker")
    with client_folder(task.cwd):
        return _extract(keeper, task, started)


def _extract(keeper: ModelHolder, task: GroupTask, started: float) -> GroupDone:
    m = task.manifest
    lm = keeper.get(m.model)
    points = resolve_points(lm, task.request, ())
    stop = stop_ids(lm)
    scored = correct = 0
    try:
        with _intervention(lm, m), ChunkWriter(task.site, task.info, list(task.arrays.values()), task.stimuli) as cw:
            handles = {key: cw.handle(info.zarr_path) for key, info in task.arrays.items()}
            for at in range(0, len(task.samples), m.batch_size):
                batch = task.samples[at : at + m.batch_size]
                for offset, group in by_modality(batch):
                    done = run_batch(lm, group, points, m, stop, task.capture_via, start=task.start + at + offset)
                    done.write(cw, handles, task.specs)
                    scored += sum(g.correct is not None for g in done.gens)
                    correct += sum(bool(g.correct) for g in done.gens)
            written = cw.close()
    except Exception as err:
        over = overflow_in(err)  # the chain does not cross processes: the overflow itself does
        if over is not None:
            raise over from None
        raise
    return GroupDone(task.info.run, task.rows, written, keeper.worker, time.perf_counter() - started, scored, correct)
