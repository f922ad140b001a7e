"""Strict configuration files: one way to validate user YAML/keyword input and to say what is wrong.

Every stage reads a hand-written config (an extraction manifest, a probe plan, a probe kind's
parameters, a stimulus family's options). Each is a pydantic model (or a dataclass) that refuses
unknown keys, and each reports a refusal the same way: one line per problem, naming the path of
the key, what was expected and what was found, with a "did you mean" for a typo::

    manifests/demo.yaml is not a valid extraction manifest:
      model.dtyp: unknown key 'dtyp' — did you mean 'dtype'?
      stimuli: required key is missing

This module imports only pydantic and yaml, so any stage may use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

T = TypeVar("T")


class StrictModel(BaseModel):
    """A config section: unknown keys are errors (a typo must not be silently ignored), and a
    parsed config is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def did_you_mean(word: str, known: Iterable[str], known_label: str = "known") -> str:
    """`` — did you mean 'x'?`` for the closest of ``known`` (case-insensitive: 'c' finds 'C'),
    else ``; known: a, b`` so the reader still sees the choices."""
    known = sorted(known)
    lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(word.lower(), list(lower), n=1)
    return f" — did you mean {lower[close[0]]!r}?" if close else f"; {known_label}: {', '.join(known) or 'none'}"


def _field_names(cls: Any) -> list[str]:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return list(cls.model_fields)
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return []


def _field_type(cls: Any, name: str) -> Any:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return cls.model_fields[name].annotation
    return typing.get_type_hints(cls)[name]


def _configs_in(annotation: Any) -> list[Any]:
    """The models and dataclasses inside an annotation (through Optional, unions, lists, Annotated)."""
    if _field_names(annotation):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _configs_in(arg)]


def _tag_of(cls: Any, part: str) -> bool:
    # A discriminated union puts the tag in the path (intervention.rope_scaling.alpha): the
    # member whose ``kind`` literal is that tag is the one the path continues in.
    names = _field_names(cls)
    return "kind" in names and part in typing.get_args(_field_type(cls, "kind"))


def fields_at(root: Any, loc: Sequence[Any]) -> list[str]:
    """The keys a config accepts at path ``loc`` below ``root`` (empty where the path leaves the
    models, e.g. inside a free-form mapping)."""
    candidates = [root]
    for part in loc:
        if isinstance(part, int):
            continue
        tagged = [m for m in candidates if _tag_of(m, part)]
        if tagged:
            candidates = tagged
            continue
        owners = [m for m in candidates if part in _field_names(m)]
        if not owners:
            return []
        candidates = _configs_in(_field_type(owners[0], part))
        if not candidates:
            return []
    if len(candidates) == 1:
        return _field_names(candidates[0])
    return sorted({f for m in candidates for f in _field_names(m)})


def _user_loc(loc: Sequence[Any]) -> list[Any]:
    # pydantic adds union members and validator names to the path (`list[int]`,
    # `function-after[...]`): the user wrote neither, so they are not part of the key path.
    return [p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]


def error_lines(err: ValidationError, root: Any, key_word: str = "key") -> list[str]:
    """One line per problem in ``err`` (raised validating ``root``), each starting with the key's path."""
    lines = []
    for e in err.errors():
        loc = _user_loc(e["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            key = str(loc[-1])
            lines.append(f"{where}: unknown {key_word} {key!r}"
                         + did_you_mean(key, fields_at(root, loc[:-1]), f"known {key_word}s"))
        elif e["type"] == "missing":
            lines.append(f"{where}: required {key_word} is missing")
        else:
            lines.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return list(dict.fromkeys(lines))  # a union reports one mistake once per member


def friendly_errors(err: ValidationError, root: Any, where: str, error_cls: type[Exception] = ValueError,
                    *, key_word: str = "key", inline: bool = False) -> Exception:
    """``err`` as one ``error_cls`` whose message starts with ``where`` and lists every problem,
    one per line (``inline``: joined with '; ' on one line, for messages nested in another)."""
    lines = error_lines(err, root, key_word)
    if inline:
        return error_cls(f"{where}: " + "; ".join(lines))
    return error_cls(f"{where}:\n" + "\n".join(f"  {line}" for line in lines))


def validate(root: type[T], data: Mapping[str, Any], where: str, error_cls: type[Exception] = ValueError,
             *, key_word: str = "key", inline: bool = False) -> T:
    """``data`` as a ``root`` (a pydantic model or a dataclass), or one ``error_cls`` naming every problem.

    A plain dataclass accepts no unknown keys either: they are refused here, before its own
    checks run, with the same message a :class:`StrictModel` gives."""
    try:
        if isinstance(root, type) and issubclass(root, BaseModel):
            return root.model_validate(data)
        unknown = [k for k in data if k not in _field_names(root)]
        if unknown:
            lines = [f"{k}: unknown {key_word} {k!r}" + did_you_mean(k, _field_names(root), f"known {key_word}s")
                     for k in unknown]
            sep, lead = ("; ", f"{where}: ") if inline else ("\n  ", f"{where}:\n  ")
            raise error_cls(lead + sep.join(lines))
        return TypeAdapter(root).validate_python(dict(data))
    except ValidationError as err:
        raise friendly_errors(err, root, where, error_cls, key_word=key_word, inline=inline) from None


def read_yaml(path: str | Path, error_cls: type[Exception], what: str, example: str,
              top_keys: str = "") -> dict[str, Any]:
    """The mapping a YAML config file holds, or one ``error_cls`` line: the file is missing, is not
    YAML, or does not hold a mapping (``top_keys``: the keys the reader expects, as a hint)."""
    path = Path(path)
    if not path.is_file():
        raise error_cls(f"{what} {path} does not exist: pass a YAML file, e.g. {example}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise error_cls(f"{path} is not valid YAML: {err}") from None
    check_mapping(data, str(path), error_cls, top_keys)
    return data


def check_mapping(data: Any, source: str, error_cls: type[Exception], top_keys: str = "") -> None:
    if not isinstance(data, dict):
        hint = f" ({top_keys})" if top_keys else ""
        raise error_cls(f"{source}: expected a YAML mapping at the top level{hint}, got {type(data).__name__}")


def load_yaml(path: str | Path, root: type[T], error_cls: type[Exception], what: str, example: str) -> T:
    """Read and validate a YAML config file in one call: the file's mapping as a ``root``."""
    data = read_yaml(path, error_cls, what, example)
    return validate(root, data, f"{path} is not a valid {what}", error_cls)
