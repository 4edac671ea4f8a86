"""The shim's post-import hooks on throwaway modules: after execution, once, the real loader kept."""

import importlib
import threading

import pytest

from shim import importhooks

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
    assert importhooks.wait(10)
    assert seen == [3]
