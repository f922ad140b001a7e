"""SAE plans: which SAEs (or transcoders) to train over which stored arrays, and which truth to
score their features against. Checked with pydantic before anything trains, like probe plans.

```yaml
name: demo-sae
saes:
  - runs: all                     # or [run-a]
    taps: [vision, llm]
    layers: all                   # as in probe plans: 3, [0, -1], '2-7'
    site: resid_post
    out_site: null                # a transcoder: the site it predicts (same tap, layer, tokens)
    tokens: image                 # the token array; rows: tokens (each token a row) or pooled
    rows: tokens
    where: "family = 'counting'"  # SQL over v_samples; train_where narrows the training rows only
    architecture: topk            # topk | standard (ReLU + L1) | transcoder (ReLU + L1)
    expansion: 4                  # d_sae = expansion x d_in, unless d_sae is given
    k: 8
    epochs: 4
    targets: [counting.count]     # probe targets (probes/targets.py) the features are scored against
```
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from probes.errors import PlanError
from probes.plan import Layers, resolve_layers
from probes.targets import get_target
from store import Workspace
from store.config import StrictModel, check_mapping, read_yaml, validate

#: Part of every SAE key: bump when a change makes old SAEs incomparable.
SAE_KEY_VERSION = 1


class SaeEntry(StrictModel):
    runs: list[str] | Literal["all"] = "all"
    taps: list[str] = ["vision"]
    layers: Layers = "all"
    site: str = "resid_post"
    out_site: str | None = None
    tokens: str = "image"
    rows: Literal["tokens", "pooled"] = "tokens"
    where: str | None = None
    train_where: str | None = None
    architecture: Literal["topk", "standard", "transcoder"] = "topk"
    d_sae: int | None = Field(None, ge=1)
    expansion: float = Field(4.0, gt=0)
    k: int = Field(16, ge=1)
    l1: float = Field(1e-3, ge=0)
    lr: float = Field(1e-3, gt=0)
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(1024, ge=1)
    buffer_rows: int = Field(65536, ge=1)
    checkpoint_every: int = Field(200, ge=0)
    seeds: list[int] = [0]
    test_fraction: float = Field(0.2, gt=0, lt=1)
    targets: list[str] = []
    shuffles: int = Field(1, ge=1, le=100)   # shuffled-truth controls per score (their mean is stored)

    @model_validator(mode="after")
    def _transcoder_needs_out_site(self) -> SaeEntry:
        if (self.architecture == "transcoder") != (self.out_site is not None):
            raise ValueError("a transcoder needs out_site (the site it predicts), and only a transcoder takes one")
        return self


class SaePlan(StrictModel):
    name: str = Field("sae", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    memory_limit: str | int | None = None
    saes: list[SaeEntry] = Field(min_length=1)


def parse_sae_plan(data: Any, source: str = "plan") -> SaePlan:
    """An SAE plan from its parsed YAML, checked (keys, values, targets).

    Parameters
    ----------
    data : Any
        The plan as a mapping (``name``, ``saes``).
    source : str
        What to call it in error messages.

    Returns
    -------
    SaePlan
        The validated plan.
    """
    check_mapping(data, source, PlanError, "name, saes")
    plan = validate(SaePlan, data, f"{source} is not a valid SAE plan", PlanError)
    for i, e in enumerate(plan.saes):
        for t in e.targets:
            try:
                get_target(t)
            except Exception as err:
                raise PlanError(f"{source}: saes[{i}].targets: {err}") from None
    return plan


def load_sae_plan(path: str | Path) -> SaePlan:
    """Read and check the SAE plan at ``path`` (YAML).

    Parameters
    ----------
    path : str or Path
        The plan's file, e.g. ``manifests/sae-demo.yaml``.

    Returns
    -------
    SaePlan
        The validated plan.
    """
    data = read_yaml(path, PlanError, "SAE plan", "manifests/sae-demo.yaml", "name, saes")
    return parse_sae_plan(data, str(path))


@dataclass(frozen=True)
class SaeTask:
    """One SAE of a plan, resolved against the workspace; ``key`` identifies it across runs."""

    plan: str
    run: str
    tap: str
    layer: int
    site: str
    out_site: str | None
    tokens: str
    d_in: int
    d_sae: int
    entry: dict[str, Any] = field(compare=False)
    seed: int = 0

    def identity(self) -> dict[str, Any]:
        e = {k: v for k, v in self.entry.items() if k not in ("runs", "taps", "layers", "seeds", "checkpoint_every")}
        return {"v": SAE_KEY_VERSION, "run": self.run, "tap": self.tap, "layer": self.layer, "site": self.site,
                "out_site": self.out_site, "tokens": self.tokens, "d_sae": self.d_sae, "seed": self.seed, **e}

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True, default=str).encode()).hexdigest()[:24]


def expand_sae_plan(plan: SaePlan, ws: Workspace) -> list[SaeTask]:
    """Every SAE the plan asks for, against the arrays ``ws`` holds (errors name what is stored).

    Parameters
    ----------
    plan : SaePlan
        A checked plan.
    ws : Workspace
        The workspace the SAEs read.

    Returns
    -------
    list of SaeTask
        In plan order.
    """
    runs_all = [r["run"] for r in ws.runs()]
    tasks: list[SaeTask] = []
    for i, e in enumerate(plan.saes):
        runs = runs_all if e.runs == "all" else e.runs
        for run in runs:
            if run not in runs_all:
                raise PlanError(f"saes[{i}].runs: run {run!r} is not in the workspace (runs: {runs_all})")
            arrays = [a for a in ws.arrays(run) if a.site == e.site and a.tokens == e.tokens and a.layout == "dense"]
            for tap in e.taps:
                layers = sorted({a.layer for a in arrays if a.tap == tap})
                if not layers:
                    if e.runs == "all":
                        continue
                    raise PlanError(f"saes[{i}]: run {run} stores no dense {tap} array of site {e.site}, tokens {e.tokens}")
                for layer in resolve_layers(e.layers, layers, f"run {run} tap {tap}"):
                    info = next(a for a in arrays if a.tap == tap and a.layer == layer)
                    if e.out_site and ws.array_info_or_none(run, tap, layer, e.out_site, e.tokens) is None:
                        raise PlanError(f"saes[{i}]: transcoder output {tap}:{layer}:{e.out_site}:{e.tokens} is not stored"
                                        f" in run {run}")
                    d_in = int(info.item_shape[-1])
                    d_sae = e.d_sae or max(1, round(e.expansion * d_in))
                    if e.architecture == "topk" and e.k > d_sae:
                        raise PlanError(f"saes[{i}]: k={e.k} exceeds d_sae={d_sae}; lower k or raise expansion")
                    for seed in e.seeds:
                        tasks.append(SaeTask(plan.name, run, tap, layer, e.site, e.out_site, e.tokens, d_in, d_sae,
                                             e.model_dump(mode="json"), seed))
    if not tasks:
        raise PlanError(f"plan {plan.name}: no stored array matches any entry (runs {runs_all})")
    return tasks
