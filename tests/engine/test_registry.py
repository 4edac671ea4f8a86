"""A patch's life in the registry, on throwaway modules (no torch, no transformers): lazy
activation, module by module, rollback, one layer from many threads, registering, what the log
says, targets imported past the shim's finder, strict retries, imports already under way."""

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading

import pytest

import shim
from shim import (
    APPLIED,
    FAILED,
    PENDING,
    SKIPPED,
    PatchError,
    Registry,
    Target,
)
from tests.engine.fakes import TARGET, make_patch, shim_layers, state, tagging
from tests.engine_state import watchers_done

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


def test_activation_is_lazy_and_applies_on_first_import(fake_modules):
    pkg = fake_modules(target=TARGET)
    registry = Registry([make_patch(pkg)])
    registry.activate()
    assert f"{pkg}.target" not in sys.modules, "activation must never import a target"
    assert state(registry)[0] == PENDING
    assert f"{pkg}.target is imported" in state(registry)[1]

    module = importlib.import_module(f"{pkg}.target")

    assert module.f(2) == ("demo", 2)
    assert state(registry) == (APPLIED, f"{pkg} 1.2.0 is inside >=1.0")


def test_applies_at_once_when_target_already_imported(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg)])
    assert module.f(2) == 2
    registry.activate()
    assert module.f(2) == ("demo", 2)


def test_targets_apply_module_by_module(fake_modules):
    pkg = fake_modules(a=TARGET, b=TARGET)
    registry = Registry([make_patch(pkg, "a:f", "b:f")])
    registry.activate()
    a = importlib.import_module(f"{pkg}.a")
    assert a.f(1) == ("demo", 1)
    assert state(registry) == (APPLIED, f"{pkg} 1.2.0 is inside >=1.0; the rest applies when {pkg}.b is imported")
    b = importlib.import_module(f"{pkg}.b")
    assert b.f(1) == ("demo", 1)
    assert state(registry) == (APPLIED, f"{pkg} 1.2.0 is inside >=1.0")


def test_a_target_module_still_executing_is_waited_for(fake_modules):
    # a imports b at the top, as transformers.modeling_utils imports core_model_loading: when b's
    # hook fires, a is in sys.modules but half executed, and a.f does not exist yet.
    pkg = fake_modules(a="from . import b\n\ndef f(x):\n    return x\n", b=TARGET)
    registry = Registry([make_patch(pkg, "b:f", "a:f")])
    registry.activate()
    a = importlib.import_module(f"{pkg}.a")
    assert (a.f(1), a.b.f(1)) == (("demo", 1), ("demo", 1))
    assert state(registry) == (APPLIED, f"{pkg} 1.2.0 is inside >=1.0")


def test_a_later_module_that_fails_rolls_back_the_earlier_ones(fake_modules):
    pkg = fake_modules(a=TARGET, b=TARGET)
    registry = Registry([make_patch(pkg, "a:f", "b:missing")])
    registry.activate()
    a = importlib.import_module(f"{pkg}.a")
    assert a.f(1) == ("demo", 1)
    importlib.import_module(f"{pkg}.b")
    assert a.f(1) == 1 and shim_layers(a.f) == []
    assert state(registry) == (SKIPPED, f"target {pkg}.b:missing does not exist in 1.2.0")


def test_missing_second_target_wraps_nothing(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg, "target:f", "target:missing")])
    registry.activate()
    assert module.f(1) == 1
    assert state(registry) == (SKIPPED, f"target {pkg}.target:missing does not exist in 1.2.0")


def test_failure_on_second_target_rolls_back_the_first(fake_modules):
    pkg = fake_modules(
        target=TARGET
        + """
class ReadOnly:
    def __init__(self):
        object.__setattr__(self, "h", lambda: 1)
    def __setattr__(self, name, value):
        raise AttributeError("read-only holder")

holder = ReadOnly()
"""
    )
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg, "target:f", "target:holder.h")])
    registry.activate()
    assert module.f(1) == 1 and shim_layers(module.f) == []
    current, reason = state(registry)
    assert current == FAILED and "read-only holder" in reason and "rolled back" in reason


def test_eight_threads_importing_a_target_at_once_add_one_layer(fake_modules):
    pkg = fake_modules(target="import time\ntime.sleep(0.05)\n" + TARGET)
    registry = Registry([make_patch(pkg)])
    registry.activate()
    barrier = threading.Barrier(8)
    errors = []

    def worker():
        try:
            barrier.wait()
            importlib.import_module(f"{pkg}.target")
            registry.activate()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    module = sys.modules[f"{pkg}.target"]
    assert len(shim_layers(module.f)) == 1 and module.f(1) == ("demo", 1)


def test_register_rejects_a_different_patch_under_a_known_name(fake_modules):
    pkg = fake_modules(target=TARGET)
    registry = Registry([make_patch(pkg)])
    registry.register(registry.patch("demo"))  # the same patch again is fine
    with pytest.raises(ValueError, match="already registered"):
        registry.register(make_patch(pkg, "target:g"))


def test_patch_declarations_are_validated():
    with pytest.raises(ValueError, match="kebab-case"):
        make_patch("pkg", name="Not_Kebab")
    with pytest.raises(ValueError, match="PEP 440"):
        make_patch("pkg", requires="five or later")
    with pytest.raises(ValueError, match="not of the form"):
        Target("no-colon", tagging("x"))


def test_a_targets_shape_check_is_still_taken_by_its_old_name_probe():
    """``Target(..., check=...)`` was ``probe=`` before the shape check was named apart from the bug
    probe: a pack written then declares as it did."""

    def check(original):
        return None

    wrapper = tagging("x")
    assert Target("json:dumps", wrapper, probe=check) == Target("json:dumps", wrapper, check=check)
    assert Target("json:dumps", wrapper, probe=check).check is check
    with pytest.raises(TypeError, match="not both"):
        Target("json:dumps", wrapper, check=check, probe=check)


def test_register_takes_ordered_and_its_old_name_settled(fake_modules):
    """``ordered=True`` (``settled=True`` before): the order was decided with its peers' already, so
    ``register`` does not check it again."""
    pkg = fake_modules(target=TARGET)
    for keyword in ("ordered", "settled"):
        registry = Registry()
        registry.register(make_patch(pkg, after=("not-registered",)), **{keyword: True})
        assert registry.names == ("demo",)


def test_shim_register_puts_a_users_patch_in_the_process_registry(fake_modules):

    pkg = fake_modules(target=TARGET)
    shim.register(make_patch(pkg, name=f"user-{pkg.replace('_', '-')}"))
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1)[1] == 1
    assert any(s.name.startswith("user-") and s.state == APPLIED for s in shim.status())


# -- the log says what the status says ------------------------------------------------------------


def test_pending_reasons_name_the_modules_in_english(fake_modules):
    pkg = fake_modules(a=TARGET, b=TARGET, c=TARGET)
    registry = Registry([make_patch(pkg, "a:f", "b:f"), make_patch(pkg, "a:f", "b:f", "c:f", name="three")])
    registry.activate()
    assert state(registry)[1].startswith(f"applies when {pkg}.a and {pkg}.b are imported;")
    assert state(registry, "three")[1].startswith(f"applies when {pkg}.a, {pkg}.b and {pkg}.c are imported;")


def test_applied_is_logged_at_info_once_and_each_later_module_at_debug(fake_modules, caplog):
    # load-keeps-requires-grad applies in two modules: INFO said "applied" twice.
    pkg = fake_modules(a=TARGET, b=TARGET)
    registry = Registry([make_patch(pkg, "a:f", "b:f")])
    with caplog.at_level(logging.DEBUG, logger="shim"):
        registry.activate()
        importlib.import_module(f"{pkg}.a")
        importlib.import_module(f"{pkg}.b")
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("demo:")]
    assert lines == [
        ("DEBUG", f"demo: pending (applies when {pkg}.a and {pkg}.b are imported; {pkg} 1.2.0 is inside >=1.0)"),
        ("INFO", f"demo: applied ({pkg} 1.2.0 is inside >=1.0; the rest applies when {pkg}.b is imported)"),
        ("DEBUG", f"demo: applied to {pkg}.b as well ({pkg} 1.2.0 is inside >=1.0)"),
    ]


def test_the_log_says_skipped_where_the_status_does(fake_modules, caplog):
    pkg = fake_modules(target=TARGET)
    importlib.import_module(pkg)
    registry = Registry([make_patch(pkg, requires=">=9"), make_patch("not_installed_here", name="absent")])
    with caplog.at_level(logging.DEBUG, logger="shim"):
        registry.activate()
    logged = {r.getMessage().split(":")[0]: r.getMessage() for r in caplog.records if r.name == "shim"}
    assert logged["demo"] == f"demo: skipped ({pkg} 1.2.0 is outside >=9)"
    assert state(registry) == (SKIPPED, f"{pkg} 1.2.0 is outside >=9")
    assert logged["absent"] == "absent: skipped (not_installed_here is not installed)"


# -- a target imported past the shim's finder; strict retries; reloads ------------------------------


def late_reason(pkg, when):
    return (
        f"{pkg} 1.2.0 is inside >=1.0; late: {pkg}.target was imported without passing the shim's "
        f"import hook (loader tests.conftest.FrontLoader), so this applied only at {when}"
    )


@pytest.mark.parametrize("noticed_by", ["shim.status()", "shim.activate()", "shim.enable()", "the import of"])
def test_a_target_imported_past_the_shims_finder_applies_late_and_says_so(
    fake_modules, finder_in_front, caplog, noticed_by
):
    # typeguard's and jaxtyping's import hooks, installed after ``import shim``, sit in front of the
    # shim's finder: the patch used to stay pending for good, saying its module was not imported.
    pkg = fake_modules(target=TARGET, other=TARGET)
    registry = Registry([make_patch(pkg), make_patch(pkg, "other:f", name="other")])
    registry.activate()
    finder_in_front(f"{pkg}.target")
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == 1, "nothing fired yet"
    with caplog.at_level(logging.INFO, logger="shim"):
        if noticed_by == "shim.activate()":
            registry.activate()
        elif noticed_by == "shim.enable()":
            registry.enable("other")
        elif noticed_by == "the import of":
            importlib.import_module(f"{pkg}.other")  # the next target import that passes the shim's finder
            noticed_by = f"the import of {pkg}.other"
        current, reason = state(registry)
    assert module.f(1) == ("demo", 1)
    assert (current, reason) == (APPLIED, late_reason(pkg, noticed_by))
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("demo:")] == [
        ("WARNING", f"demo: applied ({reason})")
    ]


def test_strict_mode_a_retried_import_raises_again_and_the_other_patches_apply(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_STRICT", "1")
    registry = Registry([make_patch(pkg, "target:missing", name="broken"), make_patch(pkg, "target:g", name="healthy")])
    registry.activate()
    for _attempt in range(2):  # the second import used to succeed, unpatched
        with pytest.raises(PatchError, match="'broken' did not apply: target .*:missing does not exist"):
            importlib.import_module(f"{pkg}.target")
        assert state(registry, "healthy") == (
            PENDING,
            f"{pkg} 1.2.0 is inside >=1.0; the import of {pkg}.target failed: it applies again when {pkg}.target "
            "is imported",
        )
    monkeypatch.delenv("SHIM_STRICT")
    module = importlib.import_module(f"{pkg}.target")
    assert (module.f(1), module.g(1)) == (1, ("healthy", -1))
    assert state(registry, "healthy") == (APPLIED, f"{pkg} 1.2.0 is inside >=1.0")
    assert state(registry, "broken") == (SKIPPED, f"target {pkg}.target:missing does not exist in 1.2.0")


class HeldLoader(importlib.abc.Loader):
    """Builds its module only when ``go`` is set: an import that is already past the finders (and
    so past the shim's) but not yet in ``sys.modules``."""

    def __init__(self, started, go):
        self.started, self.go = started, go

    def create_module(self, spec):
        self.started.set()
        assert self.go.wait(10)
        return None

    def exec_module(self, module):
        exec(TARGET, vars(module))


@pytest.mark.parametrize("lock_table", ["importlib's", "none"])
def test_an_import_already_under_way_when_the_hook_is_registered_is_applied(fake_modules, monkeypatch, lock_table):
    # import shim in one thread while another imports transformers: a target module whose import
    # had passed the finders when the shim hooked it used to leave its patch pending for good. The
    # shim sees the import in importlib's table of module locks and waits for it; without that
    # (private) table, the next status() notices the module.
    from shim import importhooks

    if lock_table == "none":
        monkeypatch.setattr(importhooks, "_importing", lambda name: False)
    pkg = fake_modules()
    name = f"{pkg}.held"
    started, go = threading.Event(), threading.Event()
    loader = HeldLoader(started, go)

    class Finder:
        def find_spec(self, fullname, path=None, target=None):
            return importlib.util.spec_from_loader(fullname, loader) if fullname == name else None

    sys.meta_path.append(Finder())
    try:
        thread = threading.Thread(target=importlib.import_module, args=(name,), daemon=True)
        thread.start()
        assert started.wait(10)
        registry = Registry([make_patch(pkg, "held:f")])
        registry.activate()  # the module is not in sys.modules yet: the hook waits for an import
        go.set()
        thread.join(10)
        assert watchers_done(10) and not thread.is_alive()
        assert sys.modules[name].f(1) == (1 if lock_table == "none" else ("demo", 1)), "before any status()"
        current, reason = state(registry)
    finally:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, Finder)]
    assert current == APPLIED and sys.modules[name].f(1) == ("demo", 1)
    if lock_table == "none":
        assert reason.endswith(
            f"late: {name} was imported without passing the shim's import hook (loader "
            "tests.engine.test_registry.HeldLoader), so this applied only at shim.status()"
        )
    else:
        assert reason == f"{pkg} 1.2.0 is inside >=1.0"
