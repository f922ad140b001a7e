"""From a plan's groups to the jobs the trainers take: each group's rows, labels, splits and
arrays, read from the manifest on the client (a worker never opens it).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from probes import derived
from probes.errors import ProbeError
from probes.kinds import get_kind
from probes.plan import Group, Plan, ProbeTask, group_tasks
from probes.splits import Fold, column_fold, hash_fold, kfold_fold
from probes.targets import SampleInfo, TargetValues, get_target, token_grid
from probes.trainers.group import GroupJob
from store import Workspace
from store.errors import StoreError


class JobBuilder:
    """Builds a plan's :class:`GroupJob` s from the manifest; caches what layers of the same rows
    share (samples, labels, splits), so building every group of a plan reads each once.

    Parameters
    ----------
    ws
        The workspace (read only: every manifest read of a farm run happens here, on the client).
    plan
        The plan whose groups are built.
    """

    def __init__(self, ws: Workspace, plan: Plan) -> None:
        self.ws, self.plan = ws, plan
        self._samples: dict[tuple[str, str | None], tuple[np.ndarray, list[SampleInfo]]] = {}
        self._targets: dict[tuple[Any, ...], TargetValues] = {}
        self._folds: dict[tuple[Any, ...], Fold] = {}
        self._masks: dict[tuple[Any, ...], np.ndarray] = {}
        self._committed: dict[str, dict[str, set[int]]] = {}
        self._arrays: dict[str, dict[tuple[str, int, str, str], Any]] = {}
        self.notes: list[str] = []  # said in the log once the jobs are built (e.g. a stale derived array)
        self.prospective = False    # a dry run of derive: auto: missing derived arrays count as to be derived
        self.derived: dict[str, derived.GroupDerived] = {}  # group key -> what it reads (derived.group_status)

    def samples(self, run: str, where: str | None) -> tuple[np.ndarray, list[SampleInfo]]:
        """The selected rows of ``run`` (array rows, ascending) and what each sample is."""
        key = (run, where)
        if key not in self._samples:
            sql = ("SELECT array_row, stimulus, family, split, truth, params, grid_h, grid_w FROM v_samples"
                   " WHERE run = ?" + (f" AND ({where})" if where else "") + " ORDER BY array_row")
            try:
                got = self.ws.rows(sql, [run])
            except Exception as err:
                raise ProbeError(f"where {where!r} is not valid SQL over v_samples ({err}); columns: family, split,"
                                 " truth, params (JSON: truth->>'count'), grid_h, correct, ...") from None
            rows = np.array([g[0] for g in got], dtype=np.int64)
            infos = [SampleInfo(g[1], g[2], g[3], json.loads(g[4]) if g[4] else {}, json.loads(g[5]) if g[5] else {},
                                g[6], g[7]) for g in got]
            self._samples[key] = (rows, infos)
        return self._samples[key]

    def target(self, run: str, where: str | None, name: str, n_tokens: int | None) -> TargetValues:
        """The labels of target ``name`` for those rows."""
        key = (run, where, name, n_tokens)
        if key not in self._targets:
            _, infos = self.samples(run, where)
            self._targets[key] = get_target(name)(infos, n_tokens)
        return self._targets[key]

    def fold(self, run: str, where: str | None, task: ProbeTask) -> Fold:
        """The task's split of those rows (``train_where`` applied)."""
        key = (run, where, task.fold_id)
        if key not in self._folds:
            rows, infos = self.samples(run, where)
            if task.split == "hash":
                fold = hash_fold([i.stimulus for i in infos], task.seed, task.test_fraction)
            elif task.split == "kfold":
                assert task.folds is not None and task.fold is not None, "a kfold task names its fold"
                fold = kfold_fold([i.stimulus for i in infos], task.seed, task.folds, task.fold)
            else:
                fold = column_fold([i.split for i in infos], task.seed)
            if task.train_where:
                fold = fold.restrict_train(self.train_mask(run, where, task.train_where))
                if not fold.train.any():
                    raise ProbeError(f"run {run}: train_where {task.train_where!r} leaves no training rows")
            self._folds[key] = fold
        return self._folds[key]

    def train_mask(self, run: str, where: str | None, train_where: str) -> np.ndarray:
        """Which of those rows ``train_where`` keeps for training."""
        key = (run, where, train_where)
        if key not in self._masks:
            rows, _ = self.samples(run, where)
            combined = f"({where}) AND ({train_where})" if where else train_where
            try:
                keep = self.ws.select(run, combined).rows
            except StoreError as err:
                raise ProbeError(f"train_where {train_where!r}: {err}") from None
            self._masks[key] = np.isin(rows, keep)
        return self._masks[key]

    def committed(self, run: str) -> dict[str, set[int]]:
        """The committed chunks of ``run``'s arrays, by Zarr path."""
        if run not in self._committed:
            got: dict[str, set[int]] = {}
            for path, chunk in self.ws.rows("SELECT zarr_path, chunk FROM chunks WHERE run = ?", [run]):
                got.setdefault(path, set()).add(int(chunk))
            self._committed[run] = got
        return self._committed[run]

    def array(self, run: str, tap: str, layer: int, site: str, tokens: str) -> Any:
        """The stored array (run, tap, layer, site, tokens); a StoreError listing what exists if none."""
        if run not in self._arrays:  # one manifest read per run, not one per layer
            self._arrays[run] = {(a.tap, a.layer, a.site, a.tokens): a for a in self.ws.arrays(run)}
        got = self._arrays[run].get((tap, layer, site, tokens))
        return got if got is not None else self.ws.array_info(run, tap, layer, site, tokens)  # raises, listing what exists

    def job(self, group: Group) -> GroupJob:
        """The group's job: rows, labels, folds and arrays, every one of its chunks committed."""
        rows, infos = self.samples(group.run, group.where)
        arrays = [self.array(group.run, group.tap, layer, group.site, group.tokens) for layer in group.layers]
        for info in arrays:
            need = set(np.unique(rows // info.chunk_samples).tolist())
            missing = need - self.committed(group.run).get(info.zarr_path, set())
            if missing:
                raise ProbeError(
                    f"{info.key()}: {len(missing)} chunk(s) holding selected rows are not committed"
                    f" (first {sorted(missing)[:3]});"
                    " the extraction is still running or was interrupted: finish it, or narrow where:"
                )
        first = arrays[0]
        kinds = {t.kind: get_kind(t.kind) for t in group.tasks}
        n_tokens = first.shape[1] if first.layout == "dense" and len(first.shape) >= 3 else None
        dense_tokens = None
        if first.layout == "ragged" and not all(k.accepts_ragged for k in kinds.values()):
            dense_tokens = n_tokens = self._uniform_image_tokens(group, infos)
        targets = {t.target: self.target(group.run, group.where, t.target, n_tokens) for t in group.tasks}
        folds = {t.fold_id: self.fold(group.run, group.where, t) for t in group.tasks}
        grid = None
        if n_tokens and any(k.uses_grid for k in kinds.values()):
            grids = {token_grid(i, n_tokens) for i in {(i.grid_h, i.grid_w): i for i in infos}.values()}
            grid = grids.pop() if len(grids) == 1 else None
        pooled = derived.group_status(self.ws, arrays, group.tasks, self.prospective)  # stored pooled features
        if pooled.note:
            self.notes.append(pooled.note)
        self.derived[group.key] = pooled
        return GroupJob(workspace=str(self.ws.path), root=self.ws.root, group=group.key, arrays=pooled.arrays or arrays,
                        rows=rows,
                        tasks=group.tasks,
                        kinds=kinds, targets=targets, folds=folds, grid=grid, plan=self.plan.name,
                        dense_tokens=dense_tokens)

    @staticmethod
    def _uniform_image_tokens(group: Group, infos: list[SampleInfo]) -> int:
        """Image tokens per sample when every selected sample has the same number (then a ragged
        image array reads as dense [n, T, d]); else a ProbeError that says how to select one size."""
        counts = sorted({(i.grid_h or 0) * (i.grid_w or 0) for i in infos})
        if len(counts) != 1 or not counts[0]:
            kinds = sorted({t.kind for t in group.tasks})
            raise ProbeError(
                f"{group.run} {group.tap}/{group.site}/{group.tokens}: kind {', '.join(kinds)} needs the same number of"
                f" image tokens in every selected sample, but the selection ({group.where or 'every sample'}) has"
                f" {counts[:6]}: select one image size per plan entry, e.g. where: \"(params->>'grid_size')::INT = 6\","
                " or use kind pooled"
            )
        return counts[0]


def group_jobs(plan: Plan, ws: Workspace, tasks: list[Any]) -> list[GroupJob]:
    """Every group of ``tasks`` (the plan's, grouped by its ``layers_per_task``) as a job.

    Parameters
    ----------
    plan
        The plan (its name, layers_per_task and derived arrays' settings).
    ws
        Its workspace.
    tasks
        The probes to group, e.g. ``probes.farm.plan_tasks(plan, ws)``.

    Returns
    -------
    list[GroupJob]
        One per group, in the plan's order; groups whose selection is empty are left out.
    """
    builder = JobBuilder(ws, plan)
    return [builder.job(g) for g in group_tasks(tasks, plan.layers_per_task) if len(builder.samples(g.run, g.where)[0])]
