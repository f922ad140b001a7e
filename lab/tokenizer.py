"""The toy VLM's word-level tokenizer (counting-bottleneck, semproj ``tokenizer.py``).

One token per whitespace-separated word and one per digit, so a count is spelled digit by digit
("4 7") and strings are written one letter per token ("c a b ..."). The vocabulary is closed:
special tokens, a-z, 0-9, True/False and the words of the four Go-board questions. The G2M toy
(``lab.g2m``) appends the pieces of the G2M prompt (``g2m_words``); the counter's ids never move.
"""

from __future__ import annotations

import string

from stimuli.goboard import QUESTIONS

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
USER_START, USER_END = "<|user_start|>", "<|user_end|>"
ASSISTANT_START, ASSISTANT_END = "<|assistant_start|>", "<|assistant_end|>"
IMAGE, IMAGE_START, IMAGE_END = "<|image|>", "<|image_start|>", "<|image_end|>"
QUESTION_START, QUESTION_END = "<|question_start|>", "<|question_end|>"
STR_START, STR_END = "<|str_start|>", "<|str_end|>"

SPECIALS = (
    PAD, BOS, EOS, UNK, USER_START, USER_END, ASSISTANT_START, ASSISTANT_END,
    IMAGE, IMAGE_START, IMAGE_END, QUESTION_START, QUESTION_END, STR_START, STR_END,
)


def question_words() -> list[str]:
    """Words of the study's questions that are not single letters or digits, in first-seen order."""
    seen: list[str] = []
    for question in QUESTIONS.values():
        for word in question.split():
            if len(word) > 1 and word not in seen:
                seen.append(word)
    return seen


def pre_tokenize(text: str) -> list[str]:
    """The pieces the tokenizer's pre-tokenizer cuts ``text`` into (whitespace, then single digits)."""
    return [piece for piece, _ in _pre_tokenizer().pre_tokenize_str(text)]


def _pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )


def g2m_words() -> list[str]:
    """Pieces of the G2M study prompt (``stimuli.g2m.prompt``) for every C, first-seen order.

    Added after the counting vocabulary (``build_tokenizer(extra_words=g2m_words())``), so the toy
    reads the study's own prompt word by word; grid sizes and colour indices are digits already.
    """
    from stimuli import g2m

    seen: list[str] = []
    for colors in range(g2m.MIN_COLORS, g2m.MAX_COLORS + 1):
        for piece in pre_tokenize(g2m.prompt(3, 3, colors)):
            if piece not in seen:
                seen.append(piece)
    return seen


def vocabulary(extra_words: tuple[str, ...] | list[str] = ()) -> dict[str, int]:
    """Token -> id. Order is fixed so that ids never move between releases of the same vocab.

    ``extra_words`` (e.g. :func:`g2m_words`) come after the counting vocabulary, so the counting
    tokens keep their ids in every vocabulary.
    """
    words = [*SPECIALS, *string.ascii_lowercase, *string.digits, "True", "False", "?"]
    words += [w for w in question_words() if w not in words]
    seen = set(words)
    for w in extra_words:
        if w not in seen:
            words.append(w)
            seen.add(w)
    return {w: i for i, w in enumerate(words)}


def build_tokenizer(extra_words: tuple[str, ...] | list[str] = ()):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocabulary(extra_words), unk_token=UNK))
    core.pre_tokenizer = _pre_tokenizer()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        extra_special_tokens={"image_token": IMAGE},
        model_max_length=4096,
    )
    tok.add_special_tokens(
        {"additional_special_tokens": [t for t in SPECIALS if t not in (BOS, EOS, PAD, UNK, IMAGE)]},
        replace_extra_special_tokens=False,
    )
    return tok
