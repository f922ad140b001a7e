"""The one strict-config helper every stage's config goes through (store/config.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Annotated, Literal

import pytest
from pydantic import Field

from store.config import StrictModel, did_you_mean, load_yaml, validate


class Inner(StrictModel):
    dtype: Literal["float32", "float16"] = "float32"
    depth: int = 1


class Poly(StrictModel):
    kind: Literal["poly"]
    alpha: float = 1.0


class Sig(StrictModel):
    kind: Literal["sigmoid"]
    slope: float = 1.0


class Outer(StrictModel):
    name: str
    inner: Inner = Inner()
    items: list[Inner] = []
    shape: Annotated[Poly | Sig, Field(discriminator="kind")] | None = None


@dataclass(frozen=True)
class Options:
    board_size: int = 5
    colours: tuple[str, ...] = ("red",)


class ConfigError(ValueError):
    pass


def problem(data: dict, root: type = Outer, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        validate(root, data, "c.yaml is not valid", ConfigError, **kw)
    return str(err.value)


def test_unknown_key_with_a_close_match_names_it():
    text = problem({"name": "x", "inner": {"dtyp": "float16"}})
    assert text == "c.yaml is not valid:\n  inner.dtyp: unknown key 'dtyp' — did you mean 'dtype'?"


def test_unknown_key_with_no_close_match_lists_the_keys_of_that_level():
    text = problem({"name": "x", "inner": {"zzz": 1}})
    assert "inner.zzz: unknown key 'zzz'; known keys: depth, dtype" in text
    assert "name" not in text.split("known keys:")[1]  # the nested level's keys, not the top level's


def test_wrong_type_names_the_nested_path_the_expectation_and_the_value():
    text = problem({"name": "x", "items": [{}, {"depth": "deep"}]})
    assert "items.1.depth: Input should be a valid integer" in text
    assert "(got 'deep')" in text


def test_missing_key_and_every_problem_reported_at_once():
    text = problem({"inner": {"dtype": "int8"}, "extra": 1})
    lines = text.splitlines()[1:]
    assert "  name: required key is missing" in lines
    assert any(line.startswith("  inner.dtype: Input should be 'float32' or 'float16'") for line in lines)
    assert any(line.startswith("  extra: unknown key 'extra'") for line in lines)


def test_a_discriminated_union_suggests_the_keys_of_the_tagged_member():
    text = problem({"name": "x", "shape": {"kind": "sigmoid", "slop": 2}})
    assert "shape.sigmoid.slop: unknown key 'slop' — did you mean 'slope'?" in text


def test_a_plain_dataclass_refuses_unknown_keys_and_wrong_types_the_same_way():
    text = problem({"boardsize": 3}, Options, key_word="option", inline=True)
    assert text == "c.yaml is not valid: boardsize: unknown option 'boardsize' — did you mean 'board_size'?"
    assert "board_size: Input should be a valid integer" in problem({"board_size": "big"}, Options)
    assert validate(Options, {"board_size": "7", "colours": ["a"]}, "w", ConfigError) == Options(7, ("a",))


def test_did_you_mean_is_case_insensitive_and_lists_choices_when_nothing_is_close():
    assert did_you_mean("c", ["C", "alpha"]) == " — did you mean 'C'?"
    assert did_you_mean("zzz", ["b", "a"]) == "; known: a, b"


def test_load_yaml_reads_validates_and_refuses_in_one_line(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("name: x\ninner: {depth: 3}\n")
    assert load_yaml(good, Outer, ConfigError, "thing", "x.yaml").inner.depth == 3
    for text, expected in [("name: [x\n", "is not valid YAML"), ("- 1\n", "expected a YAML mapping at the top level"),
                           ("name: x\nnam: y\n", "bad.yaml is not a valid thing:\n  nam: unknown key 'nam'")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=expected):
            load_yaml(bad, Outer, ConfigError, "thing", "x.yaml")
    with pytest.raises(ConfigError, match="thing .*missing.yaml does not exist: pass a YAML file, e.g. x.yaml"):
        load_yaml(tmp_path / "missing.yaml", Outer, ConfigError, "thing", "x.yaml")


def test_stimulus_family_options_validate_like_every_config():
    from stimuli import StimulusError, get_family

    go = get_family("go")
    with pytest.raises(StimulusError, match="board_sise: unknown option 'board_sise' — did you mean 'board_size'"):
        go.make_config(board_sise=5)
    with pytest.raises(StimulusError, match="board_size: Input should be a valid integer"):
        go.make_config(board_size="big")
    assert go.make_config(board_size=9).board_size == 9


@pytest.mark.slow  # a stimulus process
def test_stimuli_cli_unknown_option_is_one_line_with_did_you_mean_and_exit_2(tmp_path):
    got = subprocess.run([sys.executable, "-m", "stimuli", "go", "--out", str(tmp_path / "s"), "--boardsize", "5"],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert got.stderr.strip() == "error: python -m stimuli go: unknown option '--boardsize' — did you mean '--board-size'?"
    assert not (tmp_path / "s").exists()
