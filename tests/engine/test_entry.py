"""One patch's life (``shim.entry.Entry``): the transition table, each row driven on a real entry
over throwaway modules. docs/how-it-works.md draws the same table ("A patch's states")."""

import importlib
import logging
import sys

import pytest

from shim.entry import APPLIED, DISABLED, FAILED, PENDING, SKIPPED, Entry, State
from shim.settings import Settings
from tests.engine.fakes import TARGET, make_patch

QUIET = Settings(disable_all=False, disabled=frozenset(), forced=frozenset(), strict=False)
OPTED_OUT = Settings(disable_all=True, disabled=frozenset(), forced=frozenset(), strict=False)


def imported(module: str) -> bool:
    return module in sys.modules


def advance(entry, settings=QUIET):
    return entry.advance(imported, settings)


def start(pkg, state, **patch):
    """An entry of a patch on ``{pkg}.target:f`` brought to ``state`` the way a run gets there."""
    entry = Entry(make_patch(pkg, **patch), active=True)
    if state in (APPLIED, "bypassed", "import failed"):
        importlib.import_module(f"{pkg}.target")
        advance(entry)
    elif state is SKIPPED:
        importlib.import_module(f"{pkg}.target")
        entry = Entry(make_patch(pkg, requires=">=9"), active=True)
        advance(entry)
    elif state is FAILED:
        importlib.import_module(f"{pkg}.target")
        entry = Entry(make_patch(pkg, check=lambda original: 1 / 0), active=True)
        advance(entry)
    elif state is DISABLED:
        entry.disable()
        advance(entry)
    if state == "bypassed":  # another patcher replaces the wrapped function
        sys.modules[f"{pkg}.target"].f = lambda x: x
    if state == "import failed":  # the import the patch was applied in failed after it
        del sys.modules[f"{pkg}.target"]
    return entry


# (where it starts, what happens, the state it ends in, whether that is final)
TRANSITIONS = [
    (PENDING, "advance: target module not imported", PENDING, False),
    (PENDING, "advance: target module imported", APPLIED, False),
    (PENDING, "advance: outside its gate", SKIPPED, True),
    (PENDING, "advance: the shape check raises", FAILED, True),
    (PENDING, "advance: SHIM_DISABLE=all", DISABLED, False),
    (PENDING, "disable()", DISABLED, False),
    (PENDING, "refresh: outside its gate", SKIPPED, False),
    (PENDING, "refresh: inside its gate", PENDING, False),
    (APPLIED, "disable()", DISABLED, False),
    (APPLIED, "deactivate()", DISABLED, False),
    (APPLIED, "suspend", APPLIED, False),
    (APPLIED, "refresh: layers in place", APPLIED, False),
    ("bypassed", "refresh: layer replaced", FAILED, False),
    ("bypassed", "activate(), then advance", APPLIED, False),
    ("import failed", "refresh: module gone", PENDING, False),
    (SKIPPED, "advance: target module imported", SKIPPED, True),
    (SKIPPED, "enable()", SKIPPED, True),
    (FAILED, "enable()", PENDING, False),
    (DISABLED, "enable(), then advance", APPLIED, False),
    (DISABLED, "deactivate()", DISABLED, False),
]


def happen(entry, pkg, event):
    if event == "advance: target module not imported":
        advance(entry)
    elif event == "advance: target module imported":
        importlib.import_module(f"{pkg}.target")
        advance(entry)
    elif event == "advance: outside its gate":
        importlib.import_module(f"{pkg}.target")
        entry = Entry(make_patch(pkg, requires=">=9"), active=True)
        advance(entry)
    elif event == "advance: the shape check raises":
        importlib.import_module(f"{pkg}.target")
        entry = Entry(make_patch(pkg, check=lambda original: 1 / 0), active=True)
        advance(entry)
    elif event == "advance: SHIM_DISABLE=all":
        advance(entry, OPTED_OUT)
    elif event == "refresh: outside its gate":
        entry = Entry(make_patch(pkg, requires=">=9"), active=True)
        advance(entry)
        entry.refresh(forced=False)
    elif event.startswith("refresh"):
        entry.refresh(forced=False)
    elif event == "suspend":
        entry.suspend(+1)
    elif event == "activate(), then advance":
        entry.activate()
        advance(entry)
    elif event == "enable(), then advance":
        entry.enable()
        importlib.import_module(f"{pkg}.target")
        advance(entry)
    else:
        getattr(entry, event.rstrip("()"))()
    return entry


@pytest.mark.parametrize(("start_in", "event", "end_in", "final"), TRANSITIONS, ids=lambda v: str(v))
def test_transition(fake_modules, start_in, event, end_in, final):
    pkg = fake_modules(target=TARGET)
    entry = happen(start(pkg, start_in), pkg, event)
    assert (entry.state, entry.final) == (end_in, final), entry.reason
    assert type(entry.state) is State


def test_every_state_is_reached_and_left():
    starts = {row[0] for row in TRANSITIONS} - {"bypassed", "import failed"}
    ends = {row[2] for row in TRANSITIONS}
    assert starts == ends == set(State)


def test_docs_draw_every_transition_of_the_table():
    """docs/how-it-works.md's state diagram has an arrow for each row (a replaced layer and a failed
    import start from APPLIED)."""
    import re

    from tests.conftest import ROOT

    text = (ROOT / "docs" / "how-it-works.md").read_text()
    drawing = text.split("### A patch's states", 1)[1].split("```mermaid", 1)[1].split("```", 1)[0]
    drawn = set(re.findall(r"^\s*(\w+) --> (\w+):", drawing, re.MULTILINE))
    starts = {"bypassed": APPLIED, "import failed": APPLIED}
    rows = {(starts.get(start, start).name, end.name) for start, _event, end, _final in TRANSITIONS}
    assert rows - drawn == set()


def test_a_suspended_patch_keeps_its_state_with_its_switch_off(fake_modules):
    pkg = fake_modules(target=TARGET)
    entry = start(pkg, APPLIED)
    entry.suspend(+1)
    entry.refresh(forced=False)
    assert (entry.state, entry.switch.on, entry.is_on) == (APPLIED, False, False)
    entry.suspend(-1)
    assert (entry.state, entry.switch.on, entry.is_on) == (APPLIED, True, True)


def test_a_refresh_records_a_replaced_layer_once_and_quietly(fake_modules, caplog):
    pkg = fake_modules(target=TARGET)
    entry = start(pkg, "bypassed")
    with caplog.at_level(logging.DEBUG, logger="shim"):
        entry.refresh(forced=False)
        entry.refresh(forced=False)
    said = [r for r in caplog.records if r.getMessage().startswith("demo: failed")]
    assert [r.levelname for r in said] == ["DEBUG"], [r.getMessage() for r in said]  # a change, said once
    assert "was replaced by" in entry.reason and "shim.activate() wraps it again" in entry.reason


def test_a_skip_seen_by_a_refresh_is_not_final_so_shim_force_later_still_applies(fake_modules):
    pkg = fake_modules(target=TARGET)
    entry = Entry(make_patch(pkg, requires=">=9"), active=True)
    advance(entry)
    entry.refresh(forced=False)
    assert (entry.state, entry.final) == (SKIPPED, False)
    importlib.import_module(f"{pkg}.target")
    forced = Settings(disable_all=False, disabled=frozenset(), forced=frozenset({"demo"}), strict=False)
    advance(entry, forced)
    assert entry.state is APPLIED and "applied anyway because of SHIM_FORCE" in entry.reason
