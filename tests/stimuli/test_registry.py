"""The one registry style (stimuli/registry.py): decorator, entry points, lazy modules, clear errors."""

from __future__ import annotations

import sys
import textwrap

import pytest

from stimuli.registry import Registry


class Unknown(Exception):
    pass


def test_the_decorator_registers_under_every_name_and_lookup_names_the_choices():
    reg: Registry[type] = Registry("widget", error=Unknown, hint="add one with @WIDGETS.register")

    @reg.register("cog", "gear")
    class Cog:
        pass

    assert reg.get("cog") is Cog and reg.get("gear") is Cog
    assert reg.names() == ["cog", "gear"] and "cog" in reg and len(reg) == 2
    with pytest.raises(Unknown, match=r"unknown widget 'cgo' \(did you mean 'cog'\?\)\. add one with"):
        reg.get("cgo")
    with pytest.raises(Unknown, match=r"unknown widget 'zzz': choose one of cog, gear"):
        reg.get("zzz")


def test_a_second_entry_under_one_name_is_refused_and_the_first_kept():
    reg: Registry[int] = Registry("number", error=Unknown)
    reg.add("one", 1)
    reg.add("one", 1)  # the same entry again is harmless
    big = 10**6
    with pytest.raises(Unknown, match="number 'one' is already registered"):
        reg.add("one", big)
    assert reg.get("one") == 1


def test_entry_points_and_modules_load_on_first_lookup_only(tmp_path, monkeypatch):
    (tmp_path / "reg_points.py").write_text("VALUE = 42\n")
    (tmp_path / "reg_self.py").write_text(textwrap.dedent("""
        from reg_holder import REG
        REG.add("self", "registered on import")
    """))
    (tmp_path / "reg_holder.py").write_text("from stimuli.registry import Registry\nREG = Registry('thing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("reg_points", "reg_self", "reg_holder"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import reg_holder

    reg = reg_holder.REG
    reg.add_lazy("answer", "reg_points:VALUE")
    reg.add_lazy("self", "reg_self")
    assert reg.names() == ["answer", "self"]
    assert "reg_points" not in sys.modules and "reg_self" not in sys.modules  # naming costs no import
    assert reg.get("answer") == 42 and reg.get("self") == "registered on import"
    with pytest.raises(LookupError, match="already registered to reg_points:VALUE"):
        reg.add_lazy("answer", "elsewhere:VALUE")


def test_a_module_that_does_not_register_its_name_is_named(tmp_path, monkeypatch):
    (tmp_path / "reg_silent.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[int] = Registry("thing", error=Unknown)
    reg.add_lazy("quiet", "reg_silent")
    with pytest.raises(Unknown, match="importing reg_silent did not register it"):
        reg.get("quiet")


def test_modules_imported_on_lookup_register_names_not_known_before(tmp_path, monkeypatch):
    (tmp_path / "reg_many.py").write_text(textwrap.dedent("""
        from reg_many_holder import REG
        @REG.register("a", "b")
        class AB: pass
    """))
    (tmp_path / "reg_many_holder.py").write_text("from stimuli.registry import Registry\nREG = Registry('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("reg_many", "reg_many_holder"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import reg_many_holder

    reg = reg_many_holder.REG
    reg.import_on_lookup("reg_many")
    assert reg.names() == ["a", "b"] and reg.get("a") is reg.get("b")


def test_a_copy_is_independent():
    reg: Registry[int] = Registry("n")
    reg.add("one", 1)
    other = reg.copy()
    other.add("two", 2)
    assert "two" not in reg and other.get("one") == 1
