"""The toy VLM's word-level tokenizer (seed 001, semproj ``tokenizer.py``).

One token per whitespace-separated word and one per digit, so a count is spelled digit by digit
("4 7") and strings are written one letter per token ("c a b ..."). The vocabulary is closed:
special tokens, a-z, 0-9, True/False and the words of the four Go-board questions.
"""

from __future__ import annotations

import string

from extract.stimuli.goboard import QUESTIONS

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


def vocabulary() -> dict[str, int]:
    """Token -> id. Order is fixed so that ids never move between releases of the same vocab."""
    words = [*SPECIALS, *string.ascii_lowercase, *string.digits, "True", "False", "?"]
    words += [w for w in question_words() if w not in words]
    return {w: i for i, w in enumerate(words)}


def build_tokenizer():  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
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
