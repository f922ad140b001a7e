"""The probe farm: thousands of cheap probes trained from the activation store on CPU workers.

::

    from probes import load_plan, run_plan
    report = run_plan(load_plan("manifests/probes-demo.yaml"), data="data")   # small plan: in this process
    ws.query("SELECT * FROM v_best_probe")                                    # results

Probe kinds (``linear``, ``pooled``, ``conv_spatial``, ``detect``, ``hidden_number``) share a
small surface (fit / predict / score / save / load) and are found by name; targets (labels
from the stimuli's truth) likewise. A new kind is one decorated class: docs/new-probe.md.
This package imports ``store`` (and ``stimuli.progress`` for its bar) only: never a model, never ``transformers``.
"""

from typing import Any

from probes.errors import PlanError, ProbeError

# The rest loads on first use (PEP 562): a Dask worker that unpickles a task of
# probes.stream imports this package, and must not pay for torch and every kind
# (~200 MB of resident memory) to run numpy statistics.
_LAZY = {
    "FarmReport": "probes.farm", "load_probe": "probes.farm", "run_plan": "probes.farm",
    "KINDS": "probes.kinds", "Job": "probes.kinds", "Outcome": "probes.kinds", "Probe": "probes.kinds",
    "ProbeParams": "probes.kinds", "get_kind": "probes.kinds", "register_kind": "probes.kinds",
    "Plan": "probes.plan", "ProbeTask": "probes.plan", "load_plan": "probes.plan", "parse_plan": "probes.plan",
    "TARGETS": "probes.targets", "SampleInfo": "probes.targets", "TargetValues": "probes.targets",
    "get_target": "probes.targets", "register_target": "probes.targets",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'probes' has no attribute {name!r}")


__all__ = [
    "KINDS", "TARGETS", "FarmReport", "Job", "Outcome", "Plan", "PlanError", "Probe", "ProbeError", "ProbeParams",
    "ProbeTask", "SampleInfo", "TargetValues", "get_kind", "get_target", "load_plan", "load_probe", "parse_plan",
    "register_kind", "register_target", "run_plan",
]
