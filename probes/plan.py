"""Probe plans: one YAML file says which probes to train over which stored activations.

```yaml
name: go-counting                    # recorded with every probe (params.plan)
plugins: [my_lab.probes]             # modules to import first (they register kinds / targets)
layers_per_task: 1                   # layers packed into one Dask task (one batched solve)
derive: auto                         # or never: store pooled features once (docs/probes.md, derived arrays)
defaults:                            # apply to every entry unless it says otherwise
  seeds: [0]
  test_fraction: 0.2                 # hash split by stimulus key (probes/splits.py)
  split: hash                        # or kfold (folds: k probes per seed, each sample tested once),
                                     # or column: the stimuli's split column (train / test)
  folds: 5                           # split kfold only
  control: shuffle                   # or none
  sites: [resid_post]
  tokens: [image]
probes:
  - runs: all                        # or [run-a, run-b]
    taps: [vision, llm]              # or all (every tap except attn)
    layers: all                      # or 3, [0, 5, -1], '2-7' (inclusive)
    where: "family = 'go'"           # SQL over v_samples: which samples
    train_where: "(truth->>'count')::INT <= 49"   # optional: restricts training rows only
    targets: [go.intersection]
    kinds: {linear: {}, hidden_number: {per_board: 2}}   # or [linear, pooled]
    params: {}                       # given to every kind of this entry
    seeds: [0, 1]
    tag: null                        # recorded as target#tag: tells apart entries that differ only in where/params
```

Validation happens in two steps, both before any training: the file itself (unknown keys,
kinds, targets, kind parameters, kind/target shapes) and then against the workspace (runs,
taps, layers, token arrays that exist, SQL that runs). Messages name the key, what was
expected and what was found.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from probes.errors import PlanError, ProbeError, did_you_mean
from probes.kinds import get_kind
from probes.targets import get_target
from store.config import StrictModel, check_mapping, read_yaml, validate
from store.vocab import HEAD_TAPS

#: Part of every probe key: bump when a change to the farm makes old results incomparable.
KEY_VERSION = 1


_Strict = StrictModel


Layers = Literal["all"] | int | list[int] | str


def _listify(v: Any) -> Any:
    return [v] if isinstance(v, (str, int)) and v != "all" else v


Split = Literal["hash", "kfold", "column"]


class Defaults(_Strict):
    seeds: list[int] = [0]
    test_fraction: float = Field(0.2, gt=0, lt=1)
    split: Split = "hash"
    folds: int = Field(5, ge=2, le=100)
    control: Literal["shuffle", "none"] = "shuffle"
    sites: list[str] = ["resid_post"]
    tokens: list[str] = ["image"]

    _lists = field_validator("seeds", "sites", "tokens", mode="before")(_listify)


class Entry(_Strict):
    runs: Literal["all"] | list[str] = "all"
    taps: Literal["all"] | list[str] = "all"
    layers: Layers = "all"
    sites: Literal["all"] | list[str] | None = None
    tokens: list[str] | None = None
    where: str | None = None
    train_where: str | None = None
    targets: list[str]
    kinds: dict[str, dict[str, Any]]
    params: dict[str, Any] = {}
    seeds: list[int] | None = None
    test_fraction: float | None = Field(None, gt=0, lt=1)
    split: Split | None = None
    folds: int | None = Field(None, ge=2, le=100)
    control: Literal["shuffle", "none"] | None = None
    tag: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")

    _lists = field_validator("runs", "taps", "sites", "tokens", "targets", "seeds", mode="before")(_listify)

    @field_validator("kinds", mode="before")
    @classmethod
    def _kinds(cls, v: Any) -> Any:
        if isinstance(v, str):
            return {v: {}}
        if isinstance(v, list):
            if not all(isinstance(k, str) for k in v):
                raise ValueError("kinds is a list of names or a mapping name -> parameters")
            return {k: {} for k in v}
        if isinstance(v, dict):
            return {k: (p or {}) for k, p in v.items()}
        return v

    @model_validator(mode="after")
    def _nonempty(self) -> Entry:
        if not self.targets:
            raise ValueError("targets is empty: name at least one (e.g. go.intersection, truth:count)")
        if not self.kinds:
            raise ValueError("kinds is empty: name at least one (e.g. linear, pooled)")
        return self


class Plan(_Strict):
    name: str = Field("probes", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    plugins: list[str] = []
    layers_per_task: int = Field(1, ge=1, le=1024)
    # Worker memory (Dask's memory_limit, e.g. "384MiB"; None: Dask's default share of the
    # machine) and samples per read block of streamed kinds (None: ~32 MiB of float32 per block).
    memory_limit: str | int | None = None
    block_rows: int | None = Field(None, ge=1)
    # Iterative kinds (linear, pooled classification, conv_spatial, detect) out of core: auto when
    # their in-memory features exceed memory_limit; trained on at most max_train_rows labelled
    # training units (conv_spatial, detect: samples) per probe batch (None: as many as the limit
    # holds), see probes/trainers/iterative.py.
    out_of_core: Literal["auto", "always", "never"] = "auto"
    max_train_rows: int | None = Field(None, ge=1)
    # Pooled features stored once (probes/derived.py): auto derives, on the client before any group
    # is dispatched, every array a pooling group selects that has no fresh derived array of its pool;
    # never leaves the store as it is (fresh derived arrays are still read).
    derive: Literal["auto", "never"] = "auto"
    defaults: Defaults = Defaults()
    probes: list[Entry] = Field(min_length=1)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Plan:
        return load_plan(path)


# ----------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class ProbeTask:
    """One probe of a plan, fully resolved; ``key`` identifies it across runs of the farm."""

    run: str
    tap: str
    layer: int
    site: str
    tokens: str
    target: str
    kind: str
    seed: int
    params: dict[str, Any] = field(hash=False, compare=False)
    where: str | None = None
    train_where: str | None = None
    split: str = "hash"
    test_fraction: float = 0.2
    control: str = "shuffle"
    tag: str | None = None
    folds: int | None = None          # split kfold: k, and ``fold`` the one this probe tests
    fold: int | None = None
    key: str = field(default="", compare=False)

    def identity(self) -> dict[str, Any]:
        ident = {
            "v": KEY_VERSION, "run": self.run, "tap": self.tap, "layer": self.layer, "site": self.site,
            "tokens": self.tokens, "target": self.target, "kind": self.kind, "seed": self.seed, "params": self.params,
            "where": self.where, "train_where": self.train_where, "split": self.split,
            "test_fraction": self.test_fraction if self.split == "hash" else None, "control": self.control,
            "tag": self.tag,
        }
        if self.split == "kfold":  # only here: the keys of hash and column probes stay what they were
            ident |= {"folds": self.folds, "fold": self.fold}
        return ident

    @property
    def record_target(self) -> str:
        return self.target if self.tag is None else f"{self.target}#{self.tag}"

    @property
    def fold_id(self) -> str:
        frac = self.test_fraction if self.split == "hash" else None
        kfold = f"|{self.fold}/{self.folds}" if self.split == "kfold" else ""
        return f"{self.split}|{self.seed}|{frac}|{self.train_where or ''}{kfold}"


def task_key(identity: dict[str, Any]) -> str:
    """Deterministic probe key: sha256 of the canonical JSON identity (24 hex digits)."""
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _make_task(**kw: Any) -> ProbeTask:
    t = ProbeTask(**kw)
    return ProbeTask(**{**kw, "key": task_key(t.identity())})


@dataclass
class Group:
    """Tasks that share features (run, tap, site, tokens, rows) over a few layers: one Dask task."""

    run: str
    tap: str
    site: str
    tokens: str
    where: str | None
    layers: list[int]
    tasks: list[ProbeTask]

    @property
    def key(self) -> str:
        return task_key({"g": [self.run, self.tap, self.site, self.tokens, self.where, self.layers],
                         "t": sorted(t.key for t in self.tasks)})[:16]


# ----------------------------------------------------------------------------- loading


def parse_plan(data: Any, source: str = "plan") -> Plan:
    """A probe plan from its parsed YAML, checked: keys, kinds and their parameters, targets.

    Parameters
    ----------
    data
        The plan as a mapping (``name``, ``defaults``, ``probes``, ...).
    source
        What to call it in error messages (its file name).

    Returns
    -------
    Plan
        The validated plan; its ``plugins`` are imported, so the kinds and targets they register exist.

    Raises
    ------
    PlanError
        Every problem found, each with the key it is at.
    """
    check_mapping(data, source, PlanError, "name, defaults, probes")
    plan = validate(Plan, data, f"{source} is not a valid probe plan", PlanError)
    import_plugins(plan.plugins)
    check_static(plan, source)
    return plan


def load_plan(path: str | Path) -> Plan:
    """Read and check the probe plan at ``path`` (YAML), as :func:`parse_plan` does.

    Parameters
    ----------
    path
        The plan's file, e.g. ``manifests/probes-demo.yaml``.

    Returns
    -------
    Plan
        The validated plan.

    Raises
    ------
    PlanError
        A missing or unreadable file, bad YAML, or an invalid plan.
    """
    data = read_yaml(path, PlanError, "probe plan", "manifests/probes-demo.yaml", "name, defaults, probes")
    return parse_plan(data, str(path))


def import_plugins(modules: Sequence[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise PlanError(f"plugin {name!r} cannot be imported ({err}): it must be a module on PYTHONPATH that registers"
                            " kinds/targets") from None


def kind_params(entry: Entry, kind: str) -> dict[str, Any]:
    """The kind's full parameter set (defaults filled in), validated."""
    cls = get_kind(kind)
    merged = {**entry.params, **entry.kinds[kind]}
    return cls.check_params(merged).model_dump(mode="json")


def check_static(plan: Plan, source: str = "plan") -> None:
    problems: list[str] = []
    for i, entry in enumerate(plan.probes):
        where = f"probes.{i}"
        for kind in entry.kinds:
            try:
                cls = get_kind(kind)
                kind_params(entry, kind)
            except ProbeError as err:
                problems.append(f"  {where}.kinds.{kind}: {err}")
                continue
            for target in entry.targets:
                try:
                    spec = get_target(target)
                except ProbeError as err:
                    problems.append(f"  {where}.targets: {err}")
                    continue
                if spec.shape not in cls.accepts:
                    fits = sorted(k for k, c in _kinds() if spec.shape in c.accepts)
                    problems.append(
                        f"  {where}: kind {kind} learns {'/'.join(cls.accepts)} targets; {target} is a {spec.shape} target."
                        f" Kinds for {spec.shape} targets: {', '.join(fits)}"
                    )
    if problems:
        raise PlanError(f"{source} is not a valid probe plan:\n" + "\n".join(dict.fromkeys(problems)))


def _kinds() -> list[tuple[str, Any]]:
    from probes.kinds import KINDS

    return KINDS.items()


# ----------------------------------------------------------------------------- expansion


@dataclass(frozen=True)
class ArrayRow:
    run: str
    tap: str
    layer: int
    site: str
    tokens: str
    layout: str


def resolve_layers(spec: Layers, available: list[int], what: str) -> list[int]:
    """'all' | int | [ints] | 'a-b' against the layers a tap stored; negatives count from the end."""
    if spec == "all":
        return list(available)
    if isinstance(spec, str):
        m = re.fullmatch(r"\s*(-?\d+)\s*-\s*(-?\d+)\s*", spec)
        if not m:
            raise PlanError(f"layers {spec!r}: expected 'all', an integer, a list, or an inclusive range like '2-7'")
        lo, hi = int(m[1]), int(m[2])
        wanted = [layer for layer in available if lo <= layer <= hi]
        if not wanted:
            raise PlanError(f"layers {spec!r}: {what} stored layers {available}, none in that range")
        return wanted
    values = [spec] if isinstance(spec, int) else list(spec)
    out = []
    for v in values:
        layer = available[v] if v < 0 and -len(available) <= v else v
        if layer not in available:
            raise PlanError(f"layer {v} of {what} is not stored; stored layers: {available}")
        out.append(layer)
    return sorted(set(out))


@dataclass(frozen=True)
class Features:
    """One stored feature array an entry selects: (run, tap, layer, site, tokens)."""

    run: str
    tap: str
    layer: int
    site: str
    tokens: str


def expand(plan: Plan, arrays: Sequence[ArrayRow]) -> list[ProbeTask]:
    """Every probe the plan asks for, in plan order, against the arrays a workspace holds.

    Per entry, three passes: validation (runs, taps, layers and token arrays that exist, kinds
    that can read them) resolves the feature arrays; the probes are their product with targets,
    kinds and seeds; de-duplication keeps the first of probes that share a probes-table key.
    """
    by_run: dict[str, list[ArrayRow]] = defaultdict(list)
    for a in arrays:
        by_run[a.run].append(a)
    tasks: list[ProbeTask] = []
    seen: dict[tuple[Any, ...], ProbeTask] = {}
    for i, entry in enumerate(plan.probes):
        where = f"probes.{i}"
        features = select_features(entry, plan.defaults, by_run, where)
        added = dedupe(entry_tasks(entry, plan.defaults, features), seen, where)
        if not added:
            listing = sorted({f"{a.run}:{a.tap}/{a.site}/{a.tokens}" for a in arrays})
            raise PlanError(
                f"{where} adds no probe: every probe it selects is already asked for by an earlier entry, or its seeds"
                " list is empty; remove the entry, or give it a tag: to train it again. The workspace has: "
                + ", ".join(listing[:12]) + (" ..." if len(listing) > 12 else "")
            )
        tasks.extend(added)
    return tasks


def select_features(entry: Entry, defaults: Defaults, by_run: dict[str, list[ArrayRow]],
                    where: str) -> list[Features]:
    """The validation pass: the feature arrays an entry selects, in plan order, or a PlanError."""
    runs = sorted(by_run) if entry.runs == "all" else entry.runs
    for run in runs:
        if run not in by_run:
            raise PlanError(f"{where}.runs: run {run!r} has no arrays in this workspace{did_you_mean(run, by_run)}")
    sites = defaults.sites if entry.sites is None else entry.sites
    features: list[Features] = []
    missing: list[str] = []
    for run in runs:
        have = by_run[run]
        taps = sorted({a.tap for a in have if a.tap not in HEAD_TAPS}) if entry.taps == "all" else entry.taps
        for tap in taps:
            site_list = sorted({a.site for a in have if a.tap == tap}) if sites == "all" else sites
            for site, tok in itertools.product(site_list, entry.tokens or defaults.tokens):
                rows = [a for a in have if (a.tap, a.site, a.tokens) == (tap, site, tok)]
                if not rows:
                    missing.append(f"{run}:{tap}/{site}/{tok}")
                    continue
                what = f"{run} {tap}/{site}/{tok}"
                layers = resolve_layers(entry.layers, sorted(a.layer for a in rows), what)
                _check_layout(entry, rows[0].layout, tok, what, where)
                features.extend(Features(run, tap, layer, site, tok) for layer in layers)
    if not features:
        listing = sorted({f"{a.run}:{a.tap}/{a.site}/{a.tokens}" for rows in by_run.values() for a in rows})
        raise PlanError(
            f"{where} selects no stored array ({', '.join(missing[:6]) or 'nothing matched'}); the workspace has: "
            + ", ".join(listing[:12]) + (" ..." if len(listing) > 12 else "")
        )
    return features


def _check_layout(entry: Entry, layout: str, tokens: str, what: str, where: str) -> None:
    for kind in entry.kinds:
        # Image tokens vary with image size: a selection of one size reads as a dense [n, T, d]
        # array (checked per group by the farm).
        if layout == "ragged" and not get_kind(kind).accepts_ragged and tokens != "image":
            raise PlanError(
                f"{where}: {what} is ragged (a variable number of tokens per sample); kind {kind}"
                " needs fixed token arrays. Use kind pooled for ragged tokens"
            )


def entry_tasks(entry: Entry, defaults: Defaults, features: Sequence[Features]) -> Iterator[ProbeTask]:
    """The product pass: every (feature array, target, kind, seed) of an entry, in that nesting order."""
    params = {k: kind_params(entry, k) for k in entry.kinds}
    seeds = entry.seeds if entry.seeds is not None else defaults.seeds
    split = entry.split or defaults.split
    k = (entry.folds or defaults.folds) if split == "kfold" else None
    folds: list[int | None] = list(range(k)) if k else [None]
    for f, target, kind, seed, fold in itertools.product(features, entry.targets, entry.kinds, seeds, folds):
        yield _make_task(
            run=f.run, tap=f.tap, layer=f.layer, site=f.site, tokens=f.tokens, target=target, kind=kind, seed=seed,
            params=params[kind], where=entry.where, train_where=entry.train_where, split=split,
            test_fraction=1.0 / k if k else entry.test_fraction or defaults.test_fraction,
            control=entry.control or defaults.control, tag=entry.tag, folds=k, fold=fold,
        )


def dedupe(candidates: Iterable[ProbeTask], seen: dict[tuple[Any, ...], ProbeTask], where: str) -> list[ProbeTask]:
    """The de-duplication pass: candidates whose probes-table key is not in ``seen`` yet (first one
    wins, order kept; ``seen`` grows). Two probes with one table key but different identities
    (where/params/split) cannot both be stored: a PlanError."""
    added = []
    for task in candidates:
        pk = (task.run, task.tap, task.layer, task.site, task.tokens, task.record_target, task.kind, task.seed,
              task.fold)
        other = seen.get(pk)
        if other is None:
            seen[pk] = task
            added.append(task)
        elif other.key != task.key:
            raise PlanError(
                f"{where}: two probes share the probes-table key {pk} but differ in"
                " where/params/split; give one entry a tag: (recorded as target#tag)"
            )
    return added


def group_tasks(tasks: Sequence[ProbeTask], layers_per_task: int = 1) -> list[Group]:
    """Tasks sharing (run, tap, site, tokens, where) and a block of layers -> one Group."""
    by_feat: dict[tuple[Any, ...], dict[int, list[ProbeTask]]] = defaultdict(lambda: defaultdict(list))
    for t in tasks:
        by_feat[(t.run, t.tap, t.site, t.tokens, t.where)][t.layer].append(t)
    groups: list[Group] = []
    for (run, tap, site, tok, where), per_layer in by_feat.items():
        layers = sorted(per_layer)
        for s in range(0, len(layers), layers_per_task):
            block = layers[s : s + layers_per_task]
            groups.append(Group(run, tap, site, tok, where, block, [t for layer in block for t in per_layer[layer]]))
    return groups
