"""What every stimulus family produces, and the validation helpers they share.

A family is one module exposing ``FAMILY`` (a :class:`Family`): a ``Config`` dataclass, a
``generate(config, n, seed, split)`` iterator of :class:`Stimulus`, the :class:`Truth` schema
its truth follows, its ``score(task, text, answer, truth)`` and the size of its small set.
``Config`` fields become command-line options automatically (see :mod:`stimuli.cli`):
each field's ``metadata["help"]`` is its help text, so a family never writes argparse code of
its own. docs/stimuli/new-family.md walks through adding one.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import numpy as np
from PIL import Image


class StimulusError(ValueError):
    """A stimulus parameter is invalid. The message names the parameter, the value and the fix."""


class TruthError(StimulusError, KeyError):
    """A stimulus' truth lacks a key its family's :class:`Truth` schema declares, or holds a value
    of the wrong type. A ``KeyError`` too, since a missing key is what it reports."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


T = TypeVar("T", bound="Truth")


@dataclass(frozen=True)
class Truth:
    """A family's truth schema: the keys of ``Stimulus.truth`` that other stages read (scoring,
    probe targets), with their types. Subclass it as a frozen dataclass, one field per key.

    The generator may write more keys (descriptive ones, read by ``truth:<path>`` probe targets);
    a declared key that is missing or renamed fails loudly in :meth:`from_truth`, never reads as
    None.
    """

    @classmethod
    def from_truth(cls: type[T], truth: Mapping[str, Any], *, family: str = "", stimulus: str = "") -> T:
        """The typed truth of one stimulus; :class:`TruthError` naming the key and the fix otherwise."""
        where = f"the truth of {family + ' ' if family else ''}stimulus {stimulus or '?'}"
        if not isinstance(truth, Mapping):
            raise TruthError(f"{where} is a {type(truth).__name__}, not a mapping of keys to values")
        values = {}
        for name, kinds in _schema(cls):
            if name not in truth:
                raise TruthError(
                    f"{where} has no key {name!r} (it has {sorted(truth)[:12]}), which {cls.__name__} declares:"
                    f" regenerate the set with `python -m stimuli`, or rename the key back"
                )
            value = truth[name]
            if not _is_instance(value, kinds):
                raise TruthError(
                    f"{where}: key {name!r} holds {type(value).__name__} {str(value)[:40]}, not"
                    f" {' or '.join(k.__name__ for k in kinds)} as {cls.__name__} declares"
                )
            values[name] = value
        return cls(**values)


_SCHEMAS: dict[type, tuple[tuple[str, tuple[type, ...]], ...]] = {}


def _schema(cls: type) -> tuple[tuple[str, tuple[type, ...]], ...]:
    """(field, accepted runtime types) per field of a Truth dataclass, resolved once per class."""
    if cls not in _SCHEMAS:
        _SCHEMAS[cls] = _resolve(cls)
    return _SCHEMAS[cls]


def _resolve(cls: type) -> tuple[tuple[str, tuple[type, ...]], ...]:
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        parts = get_args(kind) if get_origin(kind) in (Union, types.UnionType) else (kind,)
        accepted = tuple(type(None) if p is None else get_origin(p) or p for p in parts)
        out.append((f.name, (object,) if Any in accepted else accepted))
    return tuple(out)


def _is_instance(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in kinds:
        return False  # True is an int to Python, never a count to a schema
    if float in kinds and isinstance(value, int):
        return True
    return isinstance(value, kinds)


@dataclass(frozen=True)
class Score:
    """One answer parsed and scored: what the model answered (None: nothing parsable), whether
    that parse worked, whether it is right, a score in [0, 1] and extra numbers as JSON."""

    prediction: Any
    parse_ok: bool
    correct: bool
    score: float
    metrics: dict[str, Any] | None = None


def compare(parsed: Any, expected: Any) -> Score:
    """Right when the parse worked and equals ``expected``; a failed parse is wrong."""
    ok = parsed is not None
    correct = ok and parsed == expected
    return Score(prediction=parsed, parse_ok=ok, correct=correct, score=float(correct))


def exact_match(task: str, text: str, answer: str, truth: Truth) -> Score:
    """The default scorer: the stripped text equals the stripped reference answer."""
    return compare(text.strip() or None, answer.strip())


@dataclass(frozen=True)
class Stimulus:
    """One sample: an image, the prompts asked about it, their answers and the exact truth.

    ``prompts`` and ``answers`` are keyed by task name; both hold the same keys, and the
    first key is the family's default task. ``truth`` and ``params`` hold plain Python values
    (ints, floats, strings, lists, dicts) so they land as typed Parquet columns; every sample
    of one set has the same keys with the same types.
    """

    id: str
    family: str
    split: str
    seed: int
    image: Image.Image | None
    prompts: dict[str, str]
    answers: dict[str, str]
    truth: dict[str, Any]
    params: dict[str, Any]
    # Extra images keyed by name (e.g. an object-index mask), written beside the main image.
    extra_images: dict[str, Image.Image] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if list(self.prompts) != list(self.answers):
            raise ValueError(
                f"stimulus {self.id}: prompts and answers must have the same task keys in the same"
                f" order, got {list(self.prompts)} vs {list(self.answers)}"
            )
        if self.image is not None and self.image.mode != "RGB":
            raise ValueError(f"stimulus {self.id}: image must be RGB, got mode {self.image.mode}")

    @property
    def prompt(self) -> str:
        """The default task's prompt."""
        return next(iter(self.prompts.values()))

    @property
    def answer(self) -> str:
        """The default task's reference answer."""
        return next(iter(self.answers.values()))


@dataclass(frozen=True)
class TaskInputs:
    """What a task shows the model besides its question: the image or not, and text strings
    (a Go board's text twin, say), in order."""

    image: bool = True
    strings: tuple[str, ...] = ()


def _image_only(truth: Mapping[str, Any], task: str) -> TaskInputs:
    return TaskInputs()


@dataclass(frozen=True)
class Family:
    """A registered stimulus family: everything the other stages need to know about it.

    - ``config``, ``generate``: the parameters and the generator.
    - ``truth``: the :class:`Truth` schema scoring and probe targets read the truth through.
    - ``score(task, text, answer, truth)``: parse and score one answer (``truth`` typed); it must
      return on any text (the caller records a raising scorer as unparsable, and warns). Default:
      :func:`exact_match`.
    - ``small_set_n``: the ``--n`` of its small set (``python -m stimuli all``); ``n``
      counts per sweep cell where the family sweeps, so each family picks its own.
    - ``task_inputs(truth, task)``: what a task shows besides its question (default: the image,
      no strings); families with text-only tasks or strings to read override it.
    - ``cells(config)``: how many sweep cells ``config`` spans (1 where the family does not sweep);
      :meth:`set_size` is ``n`` per cell, the total of the progress bar. None (the default): the
      family does not say, and the bar counts without an end.
    """

    name: str
    description: str
    config: type
    generate: Callable[..., Iterator[Stimulus]]
    truth: type[Truth] = Truth
    score: Callable[[str, str, str, Any], Score] = exact_match
    small_set_n: int = 16
    task_inputs: Callable[[Mapping[str, Any], str], TaskInputs] = _image_only
    cells: Callable[[Any], int] | None = None

    def make_config(self, **overrides: Any) -> Any:
        """The family's ``Config`` with these options, checked the way every agnosia config is:
        an unknown option names the closest known one, a wrong type says what was expected."""
        from store.config import validate  # the error plumbing only: reading a set needs no store

        return validate(self.config, overrides, f"stimulus family {self.name} options", StimulusError,
                        key_word="option", inline=True)

    def set_size(self, config: Any, n: int) -> int:
        """How many stimuli ``generate(config, n, ...)`` yields: ``n`` per sweep cell."""
        if self.cells is None:
            raise StimulusError(f"stimulus family {self.name} does not say how many cells a config spans"
                                " (Family(cells=...)), so its set size is known only once generated")
        return self.cells(config) * n

    def read_truth(self, truth: Mapping[str, Any], stimulus: str = "") -> Truth:
        """``truth`` through this family's schema: a typed object, or a :class:`TruthError`."""
        return self.truth.from_truth(truth, family=self.name, stimulus=stimulus)


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A ``Config`` field that is also a command-line option with this help text."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for sequence defaults so configs stay immutable")
    return field(default=default, metadata={"help": help, **metadata})


def check_int_range(name: str, value: int, lo: int, hi: int | None = None, hint: str = "") -> None:
    """Raise a :class:`StimulusError` unless ``lo <= value <= hi`` (``hi=None``: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise StimulusError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise StimulusError(f"{name}={value} is out of range: expected {bound}.{' ' + hint if hint else ''}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise StimulusError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def parse_int_ranges(spec: str | Sequence[int] | int) -> tuple[int, ...]:
    """``"0-49,60,100-120"`` (or an int, or a sequence of ints) -> sorted unique ints."""
    if isinstance(spec, int):
        return (spec,)
    if not isinstance(spec, str):
        return tuple(sorted({int(v) for v in spec}))
    values: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        span = re.fullmatch(r"(\d+)-(\d+)", part)
        if span:
            lo, hi = int(span[1]), int(span[2])
            if hi < lo:
                raise StimulusError(f"range {part!r} runs backwards: write it as {hi}-{lo}")
            values.update(range(lo, hi + 1))
        elif re.fullmatch(r"-?\d+", part):
            values.add(int(part))
        else:
            raise StimulusError(
                f"cannot read {spec!r} as integers: use a comma list of values and ranges, e.g. 0-49,60"
            )
    return tuple(sorted(values))


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts: stable across runs, platforms and numpy versions."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def config_dict(config: Any) -> dict[str, Any]:
    """A config as plain JSON-able values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
