"""The surface every probe kind shares, and the registry that finds kinds by name.

A kind is a small class: ``fit(X, y)``, ``predict(X)``, ``score(X, y)``, ``save(path)``,
``load(path)``, with its hyper-parameters as a pydantic model (unknown keys are refused, so a
typo in a plan fails before any training). ``X`` is the array the store returns for one
(run, tap, layer, site, tokens): ``[n, T, d]`` (or :class:`store.Ragged` where a kind says so);
``y`` has the shape of the target (see ``probes.targets``).

The farm calls the classmethod :meth:`Probe.evaluate` with every job of one kind that shares
the same features; the default fits them one by one, and kinds that can batch (linear,
pooled, hidden_number) override it. Register a kind with ``@register_kind("name")``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import numpy as np

from probes import artifacts
from probes.errors import ProbeError, did_you_mean
from probes.splits import Fold, control_permutation
from probes.targets import Shape, TargetValues
from stimuli.registry import Registry
from store.config import StrictModel, validate


class ProbeParams(StrictModel):
    """Hyper-parameters of a kind; subclasses add fields with defaults."""


@dataclass(frozen=True)
class Job:
    """One probe to train and score on a group's features (rows = the group's selection)."""

    key: str
    target: TargetValues
    fold: Fold
    params: dict[str, Any] = field(default_factory=dict)
    control: bool = True
    grid: tuple[int, int] | None = None


@dataclass
class Outcome:
    """What one probe scored; ``probe`` is the fitted model (saved by the farm)."""

    metric: str
    score: float
    control_score: float | None
    n_train: int
    n_test: int
    metrics: dict[str, Any] = field(default_factory=dict)
    probe: Probe | None = None
    flops: float = 0.0
    # Per test sample (the farm stores them by array row in probe_predictions): a PerSample, or
    # (positions among the job's rows, predicted value) from kinds written before PerSample.
    predictions: PerSample | tuple[Any, Any] | None = None


@dataclass
class PerSample:
    """A probe's test samples: positions among the job's rows and, per sample, its one-number
    prediction, the target's number and the per-sample score (each None where it has none); the
    shuffled-label control's prediction and score on the same samples beside them, so a query can
    set the probe against its control per group of samples, not only over all of them."""

    positions: np.ndarray
    prediction: np.ndarray | None = None
    truth: np.ndarray | None = None
    score: np.ndarray | None = None
    control_prediction: np.ndarray | None = None
    control_score: np.ndarray | None = None


#: Probe kinds by name (stimuli/registry.py, as stimulus families and model adapters are found).
KINDS: Registry[type[Probe]] = Registry("probe kind", error=ProbeError, hint="a new kind: docs/new-probe.md")
P = TypeVar("P", bound="type[Probe]")


def register_kind(name: str) -> Callable[[P], P]:
    """Class decorator: make a :class:`Probe` subclass available to plans as ``name``.

    Parameters
    ----------
    name
        The kind's name in plans and in the probes table.

    Returns
    -------
    Callable
        The decorator; it sets the class's ``name`` and registers it in :data:`KINDS`.

    Raises
    ------
    TypeError
        On anything but a Probe subclass, or one that declares no target shapes (``accepts``).
    ProbeError
        When another class is registered under ``name`` already.
    """

    def deco(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, Probe)):
            raise TypeError(f"@register_kind({name!r}) decorates a Probe subclass, got {cls!r}")
        if not cls.accepts:
            raise TypeError(f"kind {name!r}: set accepts = ('token' | 'sample' | 'grid' | 'boxes', ...)")
        cls.name = name
        if not _reimported(name, cls):
            KINDS.add(name, cls)
        return cls

    return deco


def _reimported(name: str, cls: type[Probe]) -> bool:
    """Whether ``name`` holds this very class from an earlier import of its module (a plugin module
    imported under two names, or again on a worker): that is no second kind, so no error."""
    if name not in KINDS:
        return False
    known = KINDS.get(name)
    return known is not cls and (known.__module__, known.__qualname__) == (cls.__module__, cls.__qualname__)


def get_kind(name: str) -> type[Probe]:
    """The kind registered as ``name``.

    Parameters
    ----------
    name
        As a plan or a saved probe names it.

    Returns
    -------
    type[Probe]
        The kind's class.

    Raises
    ------
    ProbeError
        An unknown name, with the closest known one (or every known one).
    """
    if name not in KINDS:
        raise ProbeError(f"unknown probe kind {name!r}{did_you_mean(name, KINDS)}")
    return KINDS.get(name)


def take(X: Any, index: np.ndarray) -> Any:
    """Rows ``index`` (bool mask or ints) of a dense array or a Ragged."""
    from store import Ragged

    if isinstance(X, Ragged):
        idx = np.flatnonzero(index) if index.dtype == bool else index
        pieces = [X[int(i)] for i in idx]
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        values = np.concatenate(pieces) if pieces else X.values[:0]
        return Ragged(values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return X[index]


class Probe:
    """Base class of probe kinds (see the module docstring)."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[ProbeParams]] = ProbeParams
    #: target shapes the kind can learn
    accepts: ClassVar[tuple[Shape, ...]] = ()
    metric: ClassVar[str] = "accuracy"
    #: the farm passes the image-token grid (h, w) as the ``grid`` parameter when it is unset
    uses_grid: ClassVar[bool] = False
    #: reads store.Ragged arrays (variable tokens per sample), not only dense [n, T, d]
    accepts_ragged: ClassVar[bool] = False
    #: the farm's trainers that may train the kind, in order of preference (probes/trainers/):
    #: "in_memory" (features read whole, :meth:`evaluate`), "streamed" (statistics streamed chunk by
    #: chunk), "iterative" (out of core on a capped subsample, taken when in memory does not fit)
    trains: ClassVar[tuple[str, ...]] = ("in_memory",)
    #: what fixes a group of this kind over the worker memory limit, where the kind knows better
    #: than its trainer (said before raising the limit); None: the trainer's own advice
    memory_fix: ClassVar[str | None] = None

    def __init__(self, *, random_state: int = 0, **params: Any) -> None:
        self.params = self.check_params(params)
        self.random_state = int(random_state)
        self.state_: dict[str, np.ndarray] = {}
        self.meta_: dict[str, Any] = {}

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> Any:
        return validate(cls.Params, params, f"kind {cls.name or cls.__name__} parameters", ProbeError,
                        key_word="parameter", inline=True)

    def __repr__(self) -> str:
        given = {k: v for k, v in self.params.model_dump().items() if v != self.Params.model_fields[k].default}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in given.items())})"

    # ------------------------------------------------------------------ the sklearn-like surface

    def fit(self, X: Any, y: Any) -> Probe:
        raise NotImplementedError

    def predict(self, X: Any) -> Any:
        raise NotImplementedError

    def score(self, X: Any, y: Any) -> float:
        raise NotImplementedError

    def metrics(self, X: Any, y: Any) -> dict[str, Any]:
        """Extra numbers beside the score (recorded in the probe's params)."""
        return {}

    def sample_scores(self, X: Any, y: Any) -> np.ndarray | None:
        """One number per sample worth comparing with the model's own answer per sample (e.g. a
        grid probe's cell accuracy); the farm stores them by array row. None: not per sample."""
        return None

    def sample_predictions(self, X: Any, y: Any) -> tuple[Any, Any, Any]:
        """(prediction, truth, score) per sample of X. The default: a one-number target gets the
        prediction, the truth and 1/0 correct; others their sample_scores."""
        y = np.asarray(y) if not isinstance(y, list) else y
        if isinstance(y, np.ndarray) and y.ndim == 1 and y.dtype.kind in "iuf":
            pred = np.asarray(self.predict(X), dtype=np.float64).reshape(len(y))
            return pred, y.astype(np.float64), (pred == y).astype(np.float64)
        return None, None, self.sample_scores(X, y)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, np.ndarray]:
        return dict(self.state_)

    def load_state(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.state_ = dict(tensors)
        self.meta_ = dict(meta)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        return artifacts.write(path, self.dumps(extra))

    def dumps(self, extra: dict[str, Any] | None = None) -> bytes:
        """The probe as safetensors bytes (what :meth:`save` writes)."""
        meta = {"kind": self.name, "params": self.params.model_dump(mode="json"), "random_state": self.random_state,
                "meta": self.meta_, **(extra or {})}
        return artifacts.dumps(self.state_dict(), meta)

    @classmethod
    def load(cls, path: str | Path) -> Probe:
        """Rebuild a saved probe (the kind comes from the file; import plugin kinds first)."""
        tensors, meta = artifacts.load(path)
        kind = get_kind(meta["kind"]) if cls is Probe else cls
        if cls is not Probe and meta.get("kind") != cls.name:
            raise ProbeError(f"{path} holds a {meta.get('kind')!r} probe, not {cls.name!r}: load it with Probe.load")
        probe = kind(random_state=meta.get("random_state", 0), **meta.get("params", {}))
        probe.load_state(tensors, meta.get("meta", {}))
        return probe

    # ------------------------------------------------------------------ the farm's entry point

    @classmethod
    def build(cls, job: Job, seed: int) -> Self:
        params = dict(job.params)
        if cls.uses_grid and params.get("grid") is None and job.grid is not None:
            params["grid"] = tuple(job.grid)
        return cls(random_state=seed, **params)

    @classmethod
    def evaluate(cls, Xs: list[Any], jobs: list[Job]) -> list[list[Outcome]]:
        """Outcomes [feature set][job]: fit each job on its fold's train rows, score on its test
        rows; the control is the same probe on labels shuffled across samples."""
        out: list[list[Outcome]] = []
        for X in Xs:
            row: list[Outcome] = []
            for job in jobs:
                row.append(cls.evaluate_one(X, job))
            out.append(row)
        return out

    @classmethod
    def evaluate_one(cls, X: Any, job: Job) -> Outcome:
        fold = job.fold
        y = wide_codes(job.target.values)
        train = fold.train & job.target.labelled()
        test = fold.test & job.target.labelled()
        probe = cls.build(job, fold.seed).fit(take(X, train), y[train])
        score = float(probe.score(take(X, test), y[test]))
        metrics = probe.metrics(take(X, test), y[test])
        control = None
        pred, truth, per_sample = probe.sample_predictions(take(X, test), _rows(y, test))
        predictions = PerSample(np.flatnonzero(test), pred, truth, per_sample)
        if job.control:
            yc = job.target.permuted(control_permutation(len(y), fold.seed))
            ctr, cte = fold.train & yc.labelled(), fold.test & yc.labelled()
            ctrl = cls.build(job, fold.seed).fit(take(X, ctr), wide_codes(yc.values)[ctr])
            control = float(ctrl.score(take(X, cte), wide_codes(yc.values)[cte]))
            # Per sample: the control on the probe's test samples, scored against their real target.
            predictions.control_prediction, _, predictions.control_score = ctrl.sample_predictions(
                take(X, test), _rows(y, test))
        return Outcome(cls.metric, score, control, int(train.sum()), int(test.sum()), metrics, probe,
                       predictions=predictions)


def _rows(y: Any, index: np.ndarray) -> Any:
    return [y[i] for i in np.flatnonzero(index)] if isinstance(y, list) else y[index]


def wide_codes(y: np.ndarray) -> np.ndarray:
    """Labels as a kind's fit/score take them: int8/int16 codes (as labels travel) widened to int64.

    Parameters
    ----------
    y
        A target's values.

    Returns
    -------
    numpy.ndarray
        ``y`` as int64 when it holds integers, else ``y`` itself.
    """
    return y.astype(np.int64) if y.dtype.kind == "i" else y


def params_json(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)
