"""The toy VLM's word-level tokenizer (counting-bottleneck, semproj ``tokenizer.py``).

One token per whitespace-separated word and one per digit, so a count is spelled digit by digit
("4 7") and strings are written one letter per token ("c a b ..."). The vocabulary is closed:
special tokens, a-z, 0-9, True/False and the words of the four Go-board questions. The G2M toy
(``lab.g2m``) appends the pieces of the G2M prompt (``G2M_WORDS``); the counter's ids never move.

The word lists are frozen literals, not read from the stimulus families' prompts: a token's id is
part of every trained checkpoint, so editing a prompt must never renumber a model's vocabulary.
``tests/lab/test_vocabulary.py`` fails when a prompt the toys read drifts outside these lists.
"""

from __future__ import annotations

import string

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


# The words of the Go-board questions (``stimuli.goboard.QUESTIONS``) that are not single letters
# or digits, in first-seen order, as the toy-counter checkpoints were trained on them.
QUESTION_WORDS = (
    "How", "many", "black", "stones", "are", "there", "on", "the", "chessboard", "letters", "in",
    "given", "string", "Is", "number", "of", "same", "as", "Are", "both", "input", "strings",
)

# The pieces of the G2M study prompt (``stimuli.g2m.prompt``) for every colour count, in first-seen
# order, as the toy-g2m checkpoint was trained on them; appended after the counting vocabulary.
G2M_WORDS = (
    "You", "are", "a", "precise", "grid", "serialization", "engine.", "Task:", "Transcribe", "the", "3",
    "x", "pixel", "from", "image", "into", "numerical", "matrix.", "Color", "Mapping:", "{White:", "0",
    ",", "Red:", "1", "Blue:", "2", "}.", "Instructions:", ".", "Scan", "row", "by", "row,", "top", "to",
    "bottom.", "For", "each", "map", "every", "cell", "using", "color", "mapping.", "Ensure", "output",
    "has", "exactly", "rows", "and", "columns.", "Output", "Format:", "Return", "ONLY", "Python", "list",
    "of", "lists", "(e.g.,", "[[", "],", "[", "]]).", "Do", "not", "use", "markdown,", "code", "blocks,",
    "or", "explanations.", "Green:", "Orange:", "4", "Purple:", "5", "Yellow:", "6", "Cyan:", "7",
    "Pink:", "8", "Brown:", "9",
)


def pre_tokenize(text: str) -> list[str]:
    """The pieces the tokenizer's pre-tokenizer cuts ``text`` into (whitespace, then single digits)."""
    return [piece for piece, _ in _pre_tokenizer().pre_tokenize_str(text)]


def _pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )


def unknown_words(text: str, extra_words: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Pieces of ``text`` outside ``vocabulary(extra_words)``, first-seen order: each would read as UNK."""
    vocab = vocabulary(extra_words)
    missing: list[str] = []
    for piece in pre_tokenize(text):
        if piece not in vocab and piece not in missing:
            missing.append(piece)
    return missing


def vocabulary(extra_words: tuple[str, ...] | list[str] = ()) -> dict[str, int]:
    """Token -> id. Order is fixed so that ids never move between releases of the same vocab.

    ``extra_words`` (e.g. :data:`G2M_WORDS`) come after the counting vocabulary, so the counting
    tokens keep their ids in every vocabulary.
    """
    words = [*SPECIALS, *string.ascii_lowercase, *string.digits, "True", "False", "?"]
    words += [w for w in QUESTION_WORDS if w not in words]
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
