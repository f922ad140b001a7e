"""Interventions: the same stimuli, the model made to run differently, stored as a variant run.

A manifest's ``intervention:`` block names one; the run records it in ``runs.intervention`` so the
offline stages compare variants with plain SQL (``SELECT run, intervention FROM v_runs``).

- ``rope_scaling`` (:mod:`.rope`): the vision tower's rotary frequencies scaled, then a normal
  extraction (activations, attention, generations) under the scaled model;
- ``head_ablation`` (:mod:`.heads`): one attention head zeroed at a time, teacher-forced on the
  reference answer; each (stimulus, layer, head) lands in ``head_ablations``;
- ``token_compression`` (:mod:`.compression`): image tokens merged by run-length of their top-1
  vocabulary token at prefill; generations carry the retained ratio.

MAS fine-tuning changes the weights rather than the forward: ``python -m lab.mas`` writes a
normal model folder (with ``agnosia_intervention.json``) that a plain manifest extracts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

INTERVENTION_FILE = "agnosia_intervention.json"  # written beside a model made by an intervention


def describe(spec: BaseModel | None) -> dict[str, Any] | None:
    """The ``runs.intervention`` value of a manifest's intervention (None for a plain run)."""
    return None if spec is None else spec.model_dump()
