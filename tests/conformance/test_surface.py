"""The surface gate: everything a user can call, pass, register, do to the model or do on one rank
(enumerated from the code by _matrix_surface) is an axis value of the conformance matrix or an
exclusion with its reason and covering test (_matrix_declared). A new public method, constructor
option, optimizer class or flag of the installed torch, hook, module method or engine option
fails here until it is declared, and is then crossed with every other value for free."""

from __future__ import annotations

from pathlib import Path

import pytest
from _matrix_axes import MULTI_AXES, SINGLE_AXES
from _matrix_declared import HOOKS, MEMBERS, MODEL, OPTIMIZERS, OPTIONS, PACKAGE
from _matrix_declared_ranks import ENGINE, RANKS
from _matrix_surface import Axis, Excluded, surface

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"package": PACKAGE, "member": MEMBERS, "option": OPTIONS, "optimizer": OPTIMIZERS,
          "hook": HOOKS,
          "model": MODEL, "engine": ENGINE, "ranks": RANKS}
# our own surface: a declared item that the code no longer has is stale (torch's surface varies
# with the installed release: an item of another release may stay declared)
OWN = ("package", "member", "option", "ranks")


def lookup(table: dict, item: str):
    if item in table:
        return table[item]
    if "." in item:
        head, _, tail = item.rpartition(".")
        return table.get("*." + item.split(".", 1)[1]) or table.get(head + ".*")
    return None


def _axis_values() -> dict[str, set[str]]:
    out = {"single": set(), "multi": set()}
    for part, axes in (("single", SINGLE_AXES), ("multi", MULTI_AXES)):
        for a in axes:
            out[part] |= {f"{a.name}={v}" for v in a.values}
    return out


@pytest.mark.parametrize("kind", list(TABLES))
def test_every_item_is_declared(kind):
    """Every enumerated item is an axis value or an exclusion with its reason."""
    missing = sorted(i for i in surface()[kind] if lookup(TABLES[kind], i) is None)
    assert not missing, (f"undeclared {kind} items: {missing}: add each to "
                         f"tests/conformance/_matrix_declared*.py as an axis value (ax) of the "
                         f"matrix or an exclusion (ex) with its reason")


@pytest.mark.parametrize("kind", OWN)
def test_no_stale_declaration(kind):
    stale = sorted(k for k in set(TABLES[kind]) - surface()[kind] if not k.endswith(".*"))
    assert not stale, f"declared {kind} items the code does not have: {stale}"



@pytest.mark.parametrize("kind", list(TABLES))
def test_declarations_are_real(kind):
    """An axis value exists in the matrix's axes; an exclusion's reason says something and the
    test file it names exists and mentions what it covers."""
    values, bad = _axis_values(), []
    for item, decl in TABLES[kind].items():
        if isinstance(decl, Axis):
            for v in decl.values:
                part, _, av = v.partition(".")
                if part not in values or (av and av not in values[part]):
                    bad.append(f"{item}: {v} is not a value of the matrix's axes")
        elif isinstance(decl, Excluded):
            if len(decl.reason.split()) < 5:
                bad.append(f"{item}: the reason {decl.reason!r} says too little")
            if decl.where is not None:
                path = ROOT / decl.where
                needle = decl.needle or item.split(".")[-1]
                if not path.is_file():
                    bad.append(f"{item}: {decl.where} does not exist")
                elif needle not in path.read_text():
                    bad.append(f"{item}: {decl.where} does not mention {needle!r}")
        else:
            bad.append(f"{item}: {decl!r} is neither ax(...) nor ex(...)")
    assert not bad, "\n".join(bad)


def test_every_new_axis_value_is_declared_somewhere():
    """The other way round: each value of the axes this gate added is what some surface item
    declares (an axis value nothing points at is surface the gate does not know about)."""
    used = {v for t in TABLES.values() for d in t.values() if isinstance(d, Axis)
            for v in d.values}
    new_axes = {("single", "loop"), ("single", "hooks"), ("single", "construct"),
                ("multi", "engine"), ("multi", "ranks")}
    unused = [f"{part}.{a.name}={v}" for part, axes in (("single", SINGLE_AXES),
                                                         ("multi", MULTI_AXES))
              for a in axes if (part, a.name) in new_axes for v in a.values
              if f"{part}.{a.name}={v}" not in used and v not in ("none", "default")]
    assert not unused, f"axis values no surface item declares: {unused}"
