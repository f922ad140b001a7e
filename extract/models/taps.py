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

from store.errors import StoreError
from store.vocab import FAMILY_SITES, IMAGE_ONLY_TAPS, SITES, TAPS, TOKEN_KINDS, check_tap, kinds_for

from .errors import TapError

# The words live in the store's one table (store/vocab.py): every stage addresses arrays by them.
__all__ = ["FAMILY_SITES", "IMAGE_ONLY_TAPS", "SITES", "TAPS", "TOKEN_KINDS", "CaptureKey", "TapSpec",
           "check_kinds", "kinds_for"]


@dataclass(frozen=True)
class TapSpec:
    """One requested hook point. ``site=None`` means the tap's default site."""

    tap: str
    layer: int = -1
    site: str | None = None

    def __post_init__(self) -> None:
        try:
            site = check_tap(self.tap, self.site)
        except StoreError as err:
            raise TapError(f"{err} (e.g. TapSpec('llm', 3) or TapSpec.parse('llm.3.resid_post'))") from None
        if not isinstance(self.layer, int) or isinstance(self.layer, bool):
            raise TapError(f"tap {self.tap}: layer must be an int, got {self.layer!r}")
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

