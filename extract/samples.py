"""The run's rows: one :class:`Sample` per stimulus of the manifest's sets, in order.

Both runners read them (extract/run.py for activations, extract/variants.py for head ablation and
token compression): collected from the sets, grouped by modality for the processor, and counted
off by one progress bar.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extract.manifest import Manifest, ManifestError
from stimuli import get_family
from stimuli.io import read_set
from stimuli.progress import progress_bar
from store.errors import StoreError
from store.records import check_name


@dataclass(frozen=True)
class Sample:
    """One row of the run: which stimulus, which prompt, where its image is (None: the task is
    text-only) and the strings the task shows before its question."""

    key: str
    family: str
    task: str
    prompt: str
    answer: str
    truth: dict[str, Any]
    params: dict[str, Any]
    image: Path | None
    strings: tuple[str, ...] = ()


def collect_samples(manifest: Manifest) -> tuple[list[tuple[Path, str]], list[Sample]]:
    """(set folder, dataset name) per stimulus set, and the run's rows in order."""
    sets: list[tuple[Path, str]] = []
    samples: list[Sample] = []
    seen: dict[str, Path] = {}
    for i, spec in enumerate(manifest.stimuli):
        stim_set = read_set(spec.set)
        dataset = stim_set.path.name
        if dataset in seen and seen[dataset] != stim_set.path.resolve():
            raise ManifestError(
                f"stimuli.{i}: two sets are both named {dataset!r} ({seen[dataset]} and {stim_set.path});"
                " stimulus keys are '<set folder name>/<id>', so rename one folder"
            )
        seen[dataset] = stim_set.path.resolve()
        check_dataset_name(f"stimuli.{i}", spec.set, dataset)
        rows = stim_set.rows()[: spec.limit]
        tasks = list(rows[0]["prompts"]) if rows else []
        task = spec.task or tasks[0]
        if task not in tasks:
            raise ManifestError(f"stimuli.{i}.task: {task!r} is not a task of {spec.set}; its tasks are {tasks}")
        sets.append((stim_set.path, dataset))
        for row in rows:
            family = get_family(row["family"])
            family.read_truth(row["truth"], row["id"])  # a renamed truth key stops here, before the model loads
            shown = family.task_inputs(row["truth"], task)
            samples.append(Sample(
                key=f"{dataset}/{row['id']}", family=row["family"], task=task, prompt=row["prompts"][task],
                answer=row["answers"][task], truth=row["truth"], params=row["params"],
                image=stim_set.path / row["image"] if shown.image else None, strings=tuple(shown.strings),
            ))
    return sets, samples


def check_dataset_name(where: str, set_path: Any, dataset: str) -> None:
    """The set folder's name is the dataset's in every stimulus key: one the store would refuse is
    refused here, before the workspace is touched (the store refused it only after the run's row
    was written, leaving a failed run behind). The set's ids are checked when it is read."""
    try:
        check_name("dataset", dataset)
    except StoreError as err:
        raise ManifestError(f"{where}: the set folder {set_path} names the dataset: {err}; rename the folder") from None


def by_modality(batch: list[Sample]) -> list[tuple[int, list[Sample]]]:
    """(offset, samples) runs of one modality: a processor call takes images for all or none."""
    groups: list[tuple[int, list[Sample]]] = []
    for i, s in enumerate(batch):
        if groups and (groups[-1][1][0].image is None) == (s.image is None):
            groups[-1][1].append(s)
        else:
            groups.append((i, [s]))
    return groups


def run_progress(total: int, run: str, enabled: bool) -> Any:
    """The run's progress bar over ``total`` samples (a silent one unless ``enabled``)."""
    return progress_bar(total, desc=f"extract {run}", unit="sample", enabled=enabled)
