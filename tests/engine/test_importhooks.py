"""The shim's post-import hooks on throwaway modules: after execution, once, the real loader kept."""

import importlib
import importlib.machinery
import sys
import threading
import time
import types

import pytest

from shim import importhooks
from tests.conftest import FrontLoader
from tests.engine_state import watchers_done

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


def test_a_hook_fires_once_after_the_module_has_executed(fake_modules):
    pkg = fake_modules(target="VALUE = 1\n")
    seen = []
    importhooks.when_imported(
        f"{pkg}.target", lambda module: seen.append((module.VALUE, importhooks.executing(module)))
    )
    assert seen == []
    module = importlib.import_module(f"{pkg}.target")
    # Fired inside the import, after the body ran (importlib clears _initializing only afterwards).
    assert seen == [(1, True)]
    importlib.reload(module)
    assert len(seen) == 1
    assert type(module.__loader__).__name__ == "SourceFileLoader" and module.__spec__.loader is module.__loader__


def test_a_module_already_imported_fires_at_once(fake_modules):
    pkg = fake_modules(target="VALUE = 2\n")
    module = importlib.import_module(f"{pkg}.target")
    seen = []
    importhooks.when_imported(f"{pkg}.target", seen.append)
    assert seen == [module]


def test_a_module_another_thread_is_still_executing_fires_when_it_is_done(fake_modules, monkeypatch):
    # The module's body waits until the test has registered its hook: the hook must not fire on
    # the half-executed module, but once the other thread's import has finished.
    import builtins

    gate = {"started": threading.Event(), "go": threading.Event()}
    monkeypatch.setattr(builtins, "_shim_test_gate", gate, raising=False)
    pkg = fake_modules(
        slow="import builtins\ngate = builtins._shim_test_gate\ngate['started'].set()\nassert gate['go'].wait(10)\nVALUE = 3\n"
    )
    thread = threading.Thread(target=importlib.import_module, args=(f"{pkg}.slow",), daemon=True)
    thread.start()
    assert gate["started"].wait(10)
    seen = []
    importhooks.when_imported(f"{pkg}.slow", lambda module: seen.append(getattr(module, "VALUE", None)))
    assert seen == [], "still executing: not yet"
    gate["go"].set()
    thread.join(10)
    assert not thread.is_alive()
    assert watchers_done(10)
    assert seen == [3]


# -- a finder in front of the shim's, and imports already under way ---------------------------------


def test_a_module_imported_past_the_finder_fires_late_and_says_so(fake_modules, finder_in_front):
    pkg = fake_modules(target="VALUE = 4\n")
    seen = []
    importhooks.when_imported(f"{pkg}.target", lambda module: seen.append((module.VALUE, importhooks.late_note())))
    finder_in_front(f"{pkg}.target")
    module = importlib.import_module(f"{pkg}.target")
    assert type(module.__loader__) is FrontLoader and seen == [], "the shim's finder was not asked"

    importhooks.sweep("the test's sweep")

    assert seen == [
        (
            4,
            f"late: {pkg}.target was imported without passing the shim's import hook "
            f"(loader tests.conftest.FrontLoader), so this applied only at the test's sweep",
        )
    ]
    importhooks.sweep("again")
    assert len(seen) == 1, "once"


def test_the_next_import_through_the_finder_catches_up_even_with_a_module_still_executing(
    fake_modules, finder_in_front
):
    # outer is imported past the shim's finder and imports inner (through it) on its way: inner's
    # import notices outer, which is still executing, and fires its hooks once it is done.
    pkg = fake_modules(outer="from . import inner\nVALUE = 5\n", inner="VALUE = 6\n")
    seen = []
    for name in ("outer", "inner"):
        importhooks.when_imported(f"{pkg}.{name}", lambda module: seen.append((module.VALUE, importhooks.late_note())))
    finder_in_front(f"{pkg}.outer")
    importlib.import_module(f"{pkg}.outer")
    assert watchers_done(10)
    assert seen == [
        (6, None),
        (
            5,
            f"late: {pkg}.outer was imported without passing the shim's import hook (loader "
            f"tests.conftest.FrontLoader), so this applied only at the end of its import (noticed at the "
            f"import of {pkg}.inner)",
        ),
    ]


def test_a_watched_module_that_leaves_sys_modules_for_a_moment_still_fires():
    # importlib ends every import by taking the module out of sys.modules and putting it back
    # (_load_unlocked); a watcher that looked in that instant used to take the import for failed
    # and give up, and the hooks never fired. Here the instant is held open for a while.
    name = "shim_test_vanishing_module"
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__spec__._initializing = True
    sys.modules[name] = module
    seen = []
    try:
        importhooks.when_imported(name, seen.append)
        del sys.modules[name]
        time.sleep(0.3)  # the watcher looks several times while the module is out
        sys.modules[name] = module
        module.__spec__._initializing = False
        assert watchers_done(10)
    finally:
        sys.modules.pop(name, None)
    assert seen == [module]


def test_every_hook_runs_and_a_failed_import_fires_them_all_again(fake_modules):
    # A hook that raises (strict mode's PatchError) fails the import, so importlib discards the
    # module: the other hooks must still run, and every hook must fire again on the next import.
    pkg = fake_modules(target="VALUE = 7\n")
    seen, failing = [], [True]

    def broken(module):
        seen.append("broken")
        if failing[0]:
            raise RuntimeError("a hook that fails")

    for hook in (lambda module: seen.append("before"), broken, lambda module: seen.append("after")):
        importhooks.when_imported(f"{pkg}.target", hook)
    for _attempt in range(2):
        with pytest.raises(RuntimeError, match="a hook that fails"):
            importlib.import_module(f"{pkg}.target")
        assert f"{pkg}.target" not in sys.modules
        assert seen == ["before", "broken", "after"]
        seen.clear()
    failing[0] = False
    importlib.import_module(f"{pkg}.target")
    assert seen == ["before", "broken", "after"]
