"""The toy's vocabulary is frozen in toyvlm/tokenizer.py; these tests catch a prompt drifting out of it.

The checkpoints in lab/checkpoints were trained on these ids, so the lists must never follow a
prompt edit. Instead, a prompt the toys read that gains a word outside the lists fails here, by name.
"""

from __future__ import annotations

import json

import pytest

import lab
from lab.g2m import G2M_CHECKPOINT
from stimuli import g2m, goboard
from toyvlm import tokenizer as T

DRIFT = ("is outside the toy's frozen vocabulary (toyvlm/tokenizer.py): the committed checkpoints would read it as"
         " <|unk|>. Revert the prompt edit, or add the word to the frozen list and retrain the toys (make toy-model)")


def _drift_message(where: str, missing: list[str]) -> str:
    return f"{where}: {', '.join(map(repr, missing))} {DRIFT}"


@pytest.mark.parametrize("task", sorted(goboard.QUESTIONS))
def test_goboard_prompts_are_covered(task: str) -> None:
    missing = T.unknown_words(goboard.QUESTIONS[task])
    assert not missing, _drift_message(f"goboard prompt {task!r}", missing)


@pytest.mark.parametrize("colors", range(g2m.MIN_COLORS, g2m.MAX_COLORS + 1))
def test_g2m_prompts_are_covered(colors: int) -> None:
    for n in (3, 6, 10, 17):
        missing = T.unknown_words(g2m.prompt(n, n, colors), T.G2M_WORDS)
        assert not missing, _drift_message(f"g2m prompt for a {n}x{n} grid of {colors} colours", missing)


def test_a_drifted_prompt_is_named() -> None:
    # What an edit would look like: one new word, reported once, in order, with the fix.
    edited = goboard.QUESTIONS["multimodal_num"].replace("black stones", "dark stones stones")
    missing = T.unknown_words(edited)
    assert missing == ["dark"]
    assert "'dark' is outside the toy's frozen vocabulary" in _drift_message("goboard prompt", missing)
    assert T.unknown_words(g2m.prompt(3, 3, 3)) != []  # the counter's vocabulary alone cannot read G2M


@pytest.mark.parametrize("folder, extra", [
    (lab.DEFAULT_CHECKPOINT, ()),
    (lab.DEFAULT_CHECKPOINT.parent / "toy-counter-mas", ()),
    (G2M_CHECKPOINT, T.G2M_WORDS),
])
def test_frozen_vocabulary_is_the_checkpoints_vocabulary(folder, extra) -> None:
    # Every id the committed checkpoints were trained on, in the saved tokenizer.json.
    saved = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert saved == T.vocabulary(extra)
