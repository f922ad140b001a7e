"""The probe farm: thousands of cheap probes trained from the activation store on CPU workers.

::

    from probes import load_plan, run_plan
    report = run_plan(load_plan("manifests/probes-demo.yaml"), data="data")   # LocalCluster
    ws.query("SELECT * FROM v_best_probe")                                    # results

Probe kinds (``linear``, ``pooled``, ``conv_spatial``, ``detect``, ``hidden_number``) share a
small surface (fit / predict / score / save / load) and are found by name; targets (labels
from the stimuli's truth) likewise. A new kind is one decorated class: docs/new-probe.md.
This package imports ``store`` only: never a model, never ``transformers``.
"""

from probes.errors import PlanError, ProbeError
from probes.farm import FarmReport, load_probe, run_plan
from probes.kinds import KINDS, Job, Outcome, Probe, ProbeParams, get_kind, register_kind
from probes.plan import Plan, ProbeTask, load_plan, parse_plan
from probes.targets import TARGETS, SampleInfo, TargetValues, get_target, register_target

__all__ = [
    "KINDS", "TARGETS", "FarmReport", "Job", "Outcome", "Plan", "PlanError", "Probe", "ProbeError", "ProbeParams",
    "ProbeTask", "SampleInfo", "TargetValues", "get_kind", "get_target", "load_plan", "load_probe", "parse_plan",
    "register_kind", "register_target", "run_plan",
]
