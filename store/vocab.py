"""The tap vocabulary: the words an activation array is addressed by, and the layout each one gets.

An array is addressed by ``(tap, layer, site, tokens)``. ``tap`` says which part of the model,
``site`` what is read at that block, ``tokens`` which positions of a sample are kept. This module is
the one table of those words: extraction validates manifests and names hook points with it, the
dry run sizes arrays with it, and readers (probes, queries) may rely on it. It lives in the store,
the lowest stage every other stage imports, so no stage keeps its own copy.

:func:`array_layout` is the one rule that decides whether an array is dense (``[samples, ...]``,
every sample the same shape) or ragged (rows of variable count per sample).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from store.errors import StoreError


@dataclass(frozen=True)
class Tap:
    """One tap word: its sites (the default first) and what its arrays hold."""

    sites: tuple[str, ...]
    #: Computed before the image meets the prompt, so only image tokens exist.
    image_only: bool = False
    #: What one stored row is as wide as: the hidden size ("dim") or the attention heads ("head").
    row: str = "dim"
    #: Whether a manifest's ``taps:`` list may name it (attention has its own block; logits are
    #: read through the stored unembedding, not captured per sample).
    listed: bool = True
    #: The block stack its ``layer`` indexes ("vision" or "llm" blocks); None: one module, layer 0.
    stack: str | None = None


TAP_TABLE: dict[str, Tap] = {
    # Output of a vision-encoder block; ``pre_merger`` is the merger input after the merger's own
    # pre-norm, raster-ordered (Qwen family only, last block only): G2M's vision tap.
    "vision": Tap(("resid_post", "pre_merger"), image_only=True, stack="vision"),
    # The connector between vision tower and LLM: what goes in, what comes out.
    "projector": Tap(("out", "in"), image_only=True),
    # Output of an LLM decoder block (the residual stream after the block).
    "llm": Tap(("resid_post",), stack="llm"),
    # Attention probabilities of an LLM self-attention module, only for chosen query rows.
    "attn": Tap(("probs",), row="head", listed=False, stack="llm"),
    # The LM head's output.
    "logits": Tap(("out",), listed=False),
}
TAPS: tuple[str, ...] = tuple(TAP_TABLE)
#: tap -> its sites, default first.
SITES: dict[str, tuple[str, ...]] = {name: tap.sites for name, tap in TAP_TABLE.items()}
#: Sites that exist only where a family's adapter declares them (Adapter.extra_sites).
FAMILY_SITES = frozenset({"pre_merger"})
IMAGE_ONLY_TAPS = frozenset(name for name, tap in TAP_TABLE.items() if tap.image_only)
#: The taps a manifest's ``taps:`` list may name.
LISTED_TAPS: tuple[str, ...] = tuple(name for name, tap in TAP_TABLE.items() if tap.listed)
#: Taps whose rows are one [heads] vector per key (attention probabilities), not hidden states: no
#: probe reads them as features, and a dense one is laid out [head, query, key].
HEAD_TAPS = frozenset(name for name, tap in TAP_TABLE.items() if tap.row == "head")
#: The block stacks a layer index counts in, data-path order (the keys of a run's layer counts).
STACKS: tuple[str, ...] = tuple(dict.fromkeys(tap.stack for tap in TAP_TABLE.values() if tap.stack))

#: Token kinds: which positions of a sample are kept.
#:   image  - the image tokens (vision/projector taps: every vision token of the image)
#:   last   - the last prompt token (the one whose output predicts the first answer token)
#:   answer - the answer tokens (teacher-forced answers, or tokens fed back during generation)
TOKEN_KINDS: tuple[str, ...] = ("image", "last", "answer")
#: The query rows an attention array keeps (its ``tokens``).
QUERY_KINDS: tuple[str, ...] = ("last", "answer")


def did_you_mean(word: str, words: Iterable[str]) -> str:
    """`` — did you mean 'x'?`` for a close word, else the list of known words."""
    words = list(words)
    hint = difflib.get_close_matches(str(word), words, n=1)
    return f" — did you mean {hint[0]!r}?" if hint else f"; expected one of {', '.join(words)}"


def check_tap(tap: str, site: str | None = None, *, listed: bool = False) -> str:
    """The tap's site (its default when ``site`` is None); an unknown word raises with a did-you-mean.
    ``listed=True`` accepts only the taps a manifest's ``taps:`` list may name."""
    known = LISTED_TAPS if listed else TAPS
    if tap not in known:
        raise StoreError(f"unknown tap {tap!r}{did_you_mean(tap, known)}")
    sites = SITES[tap]
    if site is None:
        return sites[0]
    if site not in sites:
        raise StoreError(f"tap {tap!r} has no site {site!r}{did_you_mean(site, sites)}")
    return site


def stack_of(tap: str) -> str | None:
    """The block stack ``tap``'s layer indexes (see :data:`STACKS`); None for a one-module tap or
    a word outside the vocabulary."""
    known = TAP_TABLE.get(tap)
    return known.stack if known else None


def kinds_for(tap: str, kinds: Iterable[str]) -> tuple[str, ...]:
    """The token kinds a tap yields for a request: vision-side taps only have image tokens."""
    return ("image",) if tap in IMAGE_ONLY_TAPS else tuple(kinds)


@dataclass(frozen=True)
class ArrayLayout:
    """How one array is stored: dense ``[samples, *shape]`` or ragged rows, and what a row is."""

    ragged: bool
    #: Names of the per-sample dims of a dense array (None: ragged, one row per token or key).
    dims: tuple[str, ...] | None
    #: What one row (ragged) or one sample (dense) holds, in words.
    row: str


def array_layout(tap: str, kind: str, *, same_size_images: bool) -> ArrayLayout:
    """The dense-vs-ragged rule, for the runner, the dry run and manifest validation alike.

    ``same_size_images``: every sample of the run has an image and all have one size, so every
    sample has the same number of image tokens. ``last`` is one token per sample: dense. Answers
    vary in length, and an attention row is one per key (or answer query x key): ragged.
    """
    if tap not in TAP_TABLE:
        raise StoreError(f"unknown tap {tap!r}{did_you_mean(tap, TAPS)}")
    known = QUERY_KINDS if TAP_TABLE[tap].row == "head" else TOKEN_KINDS
    if kind not in known:
        raise StoreError(f"tap {tap!r} has no token kind {kind!r}{did_you_mean(kind, known)}")
    if TAP_TABLE[tap].row == "head":
        return ArrayLayout(True, None, "one [heads] row per key of the prompt, or per (answer query, key)")
    if kind not in kinds_for(tap, (kind,)):
        raise StoreError(f"tap {tap!r} keeps image tokens only (it runs before the image meets the prompt),"
                         f" not {kind!r}: use tokens [image]")
    if kind == "image" and same_size_images:
        return ArrayLayout(False, ("token", "dim"), "[image tokens, dim] per sample")
    if kind == "last":
        return ArrayLayout(False, ("token", "dim"), "[1, dim] per sample")
    return ArrayLayout(True, None, "one [dim] row per token")
