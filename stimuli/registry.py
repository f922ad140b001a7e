"""One registry style for everything a user adds by name: stimulus families, model adapters, probe kinds.

Each is a :class:`Registry`. An entry is registered where it is defined — ``@REGISTRY.register("name")``
on a class, or ``REGISTRY.add("name", value)`` — and the modules holding the repository's own entries
are named once, beside the registry, to be imported on the first lookup — either a module whose import
registers its entries, or an entry point, ``"package.module:ATTRIBUTE"``, as Python packaging's entry
points and xarray's backends name theirs. So importing a stage never pays for every entry, and a
user's own entry is one line in their own module (docs/design.md, "Registries").

This module sits in the first stage so that every later stage can use it; it imports nothing of the
project's.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
V = TypeVar("V")


class Registry(Generic[T]):
    """Names -> entries of one kind (``what``: "stimulus family", "probe kind", ...).

    Parameters
    ----------
    what
        What an entry is, for error messages.
    error
        The exception type raised for an unknown or doubly registered name.
    hint
        Appended to the unknown-name message: how to add one.
    check
        Called as ``check(name, entry)`` on every entry point loaded; raises ``error`` when the
        attribute is not a valid entry.
    """

    def __init__(self, what: str, *, error: type[Exception] = LookupError, hint: str = "",
                 check: Callable[[str, T], None] | None = None) -> None:
        self.what = what
        self.error = error
        self.hint = hint
        self.check = check
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}  # name -> "module" whose import registers it, or "module:ATTRIBUTE"
        self._on_lookup: list[str] = []  # modules that register entries of unknown names when imported

    # -- adding ---------------------------------------------------------------------------------
    def register(self, *names: str) -> Callable[[V], V]:
        """Decorator: register the decorated object under each of ``names``."""
        if not names:
            raise TypeError(f"register a {self.what} under at least one name")

        def deco(obj: V) -> V:
            for name in names:
                self.add(name, obj)  # type: ignore[arg-type]
            return obj

        return deco

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name``; a second, different entry under one name is refused."""
        if name in self._entries and self._entries[name] is not entry:
            raise self.error(f"{self.what} {name!r} is already registered ({_label(self._entries[name])}):"
                             " pick another name")
        self._entries[name] = entry
        return entry

    def add_lazy(self, name: str, target: str) -> None:
        """Register ``name`` by reference, loaded on its first lookup: ``target`` is an entry point,
        ``"module:ATTRIBUTE"``, or a module whose import registers ``name`` itself."""
        known = self._lazy.get(name)
        if known is not None and known != target:
            raise self.error(f"{self.what} {name!r} is already registered to {known}: pick another name")
        self._lazy[name] = target

    def import_on_lookup(self, *modules: str) -> None:
        """Modules that register entries whose names are known only once imported (all at first lookup)."""
        self._on_lookup.extend(m for m in modules if m not in self._on_lookup)

    def copy(self) -> Registry[T]:
        """An independent registry with the same entries (a test registers into it and drops it)."""
        other: Registry[T] = Registry(self.what, error=self.error, hint=self.hint, check=self.check)
        other._entries, other._lazy, other._on_lookup = dict(self._entries), dict(self._lazy), list(self._on_lookup)
        return other

    # -- looking up -----------------------------------------------------------------------------
    def target(self, name: str) -> str:
        """Where ``name`` is registered lazily ("module" or "module:ATTRIBUTE"); "" if it is not."""
        return self._lazy.get(name, "")

    def get(self, name: str) -> T:
        """The entry registered as ``name``; an unknown name raises ``error`` listing the known ones."""
        if name not in self._entries:
            self._load(name)
        if name not in self._entries:
            if name in self._lazy:  # a module (no ":ATTRIBUTE") that should have registered itself
                raise self.error(f"{self.what} {name!r}: importing {self._lazy[name]} did not register it;"
                                 f" that module must register {name!r}")
            raise self.error(f"unknown {self.what} {name!r}{_did_you_mean(name, self.names())}"
                             + (f". {self.hint}" if self.hint else ""))
        return self._entries[name]

    def names(self) -> list[str]:
        """Every registered name, in registration order (lazily registered ones included, unimported)."""
        self._load(None)
        return list(dict.fromkeys([*self._lazy, *self._entries]))

    def items(self) -> list[tuple[str, T]]:
        """Every (name, entry), importing what is registered lazily."""
        return [(name, self.get(name)) for name in self.names()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def _load(self, name: str | None) -> None:
        while self._on_lookup:
            importlib.import_module(self._on_lookup[0])
            self._on_lookup.pop(0)  # after the import: a module that failed to import is tried again
        if name is None or name not in self._lazy or name in self._entries:
            return
        module, _, attribute = self._lazy[name].partition(":")
        imported = importlib.import_module(module)
        if attribute:
            entry = getattr(imported, attribute, None)
            if self.check is not None:
                self.check(name, entry)  # type: ignore[arg-type]
            elif entry is None:
                raise self.error(f"{self.what} {name!r}: {module} has no attribute {attribute!r}")
            self.add(name, entry)  # type: ignore[arg-type]


def _label(entry: object) -> str:
    return getattr(entry, "__qualname__", None) or type(entry).__name__


def _did_you_mean(word: str, known: Iterable[str]) -> str:
    known = list(known)
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f": choose one of {', '.join(known)}"
