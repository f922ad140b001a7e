"""What every stimulus family produces, and the validation helpers they share.

A family is a module with a ``Config`` dataclass and a ``generate(config, n, seed, split)``
iterator of :class:`Stimulus`. ``Config`` fields become command-line options automatically
(see :mod:`extract.stimuli.cli`): each field's ``metadata["help"]`` is its help text, so a
family never writes argparse code of its own.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image


class StimulusError(ValueError):
    """A stimulus parameter is invalid. The message names the parameter, the value and the fix."""


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


@dataclass(frozen=True)
class Family:
    """A registered stimulus family: its name, its config class and its generator.

    ``task_inputs(truth, task)`` says what a task shows besides its question (default: the
    image, no strings); families with text-only tasks or strings to read override it.
    """

    name: str
    description: str
    config: type
    generate: Callable[..., Iterator[Stimulus]]
    task_inputs: Callable[[Mapping[str, Any], str], TaskInputs] = lambda truth, task: TaskInputs()

    def make_config(self, **overrides: Any) -> Any:
        return self.config(**overrides)


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
