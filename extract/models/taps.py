"""The tap vocabulary: one naming scheme for hook points across every architecture.

A hook point is named ``{tap}.{layer}.{site}`` (TransformerLens style), e.g. ``vision.3.resid_post``,
``projector.0.out``, ``llm.-1.resid_post``, ``attn.5.probs``. ``tap`` says which part of the model,
``layer`` the block index (0-based; negative values count from the end, so ``-1`` is the last
block), ``site`` what is read at that block. Adapters (``extract.models.adapters``) map a name to
a module path of one architecture; nothing else in the code base knows module paths.

Captured values are addressed by a :class:`CaptureKey`, the resolved tap plus the token kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .errors import TapError

# tap -> its sites, default first.
SITES: dict[str, tuple[str, ...]] = {
    # Output of a vision-encoder block; ``pre_merger`` is the merger input after the merger's own
    # pre-norm, raster-ordered (Qwen family only, last block only): G2M's vision tap.
    "vision": ("resid_post", "pre_merger"),
    # The connector between vision tower and LLM: what goes in, what comes out.
    "projector": ("out", "in"),
    # Output of an LLM decoder block (the residual stream after the block).
    "llm": ("resid_post",),
    # Attention probabilities of an LLM self-attention module, only for chosen query rows.
    "attn": ("probs",),
    # The LM head's output.
    "logits": ("out",),
}
TAPS: tuple[str, ...] = tuple(SITES)
# Sites that exist only where a family's adapter declares them (Adapter.extra_sites).
FAMILY_SITES = frozenset({"pre_merger"})

# Token kinds: which positions of a sample are kept.
#   image  - the image tokens (vision/projector taps: every vision token of the image)
#   last   - the last prompt token (the one whose output predicts the first answer token)
#   answer - the answer tokens (teacher-forced answers, or tokens fed back during generation)
TOKEN_KINDS: tuple[str, ...] = ("image", "last", "answer")
# Vision-side taps are computed before the image meets the prompt, so they only have image tokens.
IMAGE_ONLY_TAPS = frozenset({"vision", "projector"})


@dataclass(frozen=True)
class TapSpec:
    """One requested hook point. ``site=None`` means the tap's default site."""

    tap: str
    layer: int = -1
    site: str | None = None

    def __post_init__(self) -> None:
        if self.tap not in SITES:
            raise TapError(
                f"unknown tap {self.tap!r}: expected one of {', '.join(TAPS)}"
                " (e.g. TapSpec('llm', 3) or TapSpec.parse('llm.3.resid_post'))"
            )
        if not isinstance(self.layer, int) or isinstance(self.layer, bool):
            raise TapError(f"tap {self.tap}: layer must be an int, got {self.layer!r}")
        site = SITES[self.tap][0] if self.site is None else self.site
        if site not in SITES[self.tap]:
            raise TapError(
                f"tap {self.tap!r} has no site {site!r}: expected one of {', '.join(SITES[self.tap])}"
            )
        object.__setattr__(self, "site", site)

    @property
    def name(self) -> str:
        return f"{self.tap}.{self.layer}.{self.site}"

    @property
    def site_name(self) -> str:
        """The site, resolved by ``__post_init__`` (``None`` became the tap's default)."""
        if self.site is None:
            raise TapError(f"tap {self.tap}.{self.layer} has no resolved site")
        return self.site

    def key(self, kind: str) -> CaptureKey:
        """The address of this tap's ``kind`` tokens."""
        return CaptureKey(self.tap, self.layer, self.site_name, kind)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> TapSpec:
        """``"llm.3"``, ``"llm.-1.resid_post"``, ``"projector.0.in"`` or ``"logits"`` -> TapSpec."""
        parts = name.strip().split(".")
        if not parts[0] or len(parts) > 3:
            raise TapError(f"cannot parse tap name {name!r}: expected 'tap[.layer[.site]]', e.g. 'llm.3.resid_post'")
        layer = -1
        if len(parts) >= 2:
            try:
                layer = int(parts[1])
            except ValueError:
                raise TapError(f"cannot parse tap name {name!r}: layer {parts[1]!r} is not an integer") from None
        return cls(parts[0], layer, parts[2] if len(parts) == 3 else None)

    @classmethod
    def coerce(cls, tap: TapSpec | str | tuple) -> TapSpec:
        """Accept a TapSpec, a name, or a (tap, layer[, site]) tuple."""
        if isinstance(tap, TapSpec):
            return tap
        if isinstance(tap, str):
            return cls.parse(tap)
        return cls(*tap)


class CaptureKey(NamedTuple):
    """Address of one captured array: the resolved tap (layer >= 0) and the token kind."""

    tap: str
    layer: int
    site: str
    kind: str

    @property
    def name(self) -> str:
        return f"{self.tap}.{self.layer}.{self.site}/{self.kind}"


def check_kinds(kinds: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    bad = [k for k in kinds if k not in TOKEN_KINDS]
    if bad:
        raise TapError(f"unknown token kind(s) {bad}: expected some of {', '.join(TOKEN_KINDS)}")
    if not kinds:
        raise TapError(f"no token kinds requested: pass some of {', '.join(TOKEN_KINDS)}")
    return tuple(dict.fromkeys(kinds))


def kinds_for(tap: str, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The token kinds a tap yields for a request: vision-side taps only have image tokens."""
    return ("image",) if tap in IMAGE_ONLY_TAPS else kinds
