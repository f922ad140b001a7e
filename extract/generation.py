"""Where a greedy answer ends: the stop ids ``generate`` honours, the answer's length, why it stopped.

Shared by the extraction run, the variant runs (extract/variants.py) and the toy lab's evaluation
(lab/evaluate.py), so that a stored answer and an evaluated one are cut at the same token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from extract.models.loading import LoadedModel


def eos_ids(model: Any) -> set[int]:
    """The ids ``generate`` stops a row on: the generation config's EOS ids, nothing else. The pad
    id is not one: a model may generate it mid-answer, and ``generate`` carries on past it."""
    v = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set(v if isinstance(v, (list, tuple)) else [v] if v is not None else [])


def stop_ids(lm: LoadedModel) -> set[int]:
    """:func:`eos_ids` of a loaded model."""
    return eos_ids(lm.model)


def answer_length(generated: torch.Tensor, stop: set[int], n_fed: int) -> tuple[int, int]:
    """(answer tokens kept as activations, answer tokens in the text) for one row of ids."""
    ids = generated.tolist()
    end = next((i for i, t in enumerate(ids) if t in stop), len(ids))
    return min(end, n_fed), end


def stop_reason(generated: torch.Tensor, n_text: int) -> str:
    """'eos' when the row ended on a stop id at ``n_text`` (what :func:`answer_length` found),
    'cap' when it ran to the last generated step without one."""
    return "eos" if n_text < len(generated) else "cap"
