"""Whether a patch applies, on throwaway modules: version gates and their rule for dev builds,
``SHIM_FORCE``, each target's own requirement, shape checks, and which problems strict mode raises."""

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import types

import pytest

from shim import (
    APPLIED,
    FAILED,
    SKIPPED,
    Patch,
    PatchError,
    Registry,
    Target,
    gating,
)
from tests.engine.fakes import TARGET, make_patch, state, tagging

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


def test_target_level_requirements_leave_unneeded_targets_alone(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setitem(sys.modules, "otherdist", types.SimpleNamespace(__version__="0.9"))
    module = importlib.import_module(f"{pkg}.target")
    patch = Patch(
        name="demo",
        summary="demo",
        distribution=pkg,
        requires=">=1.0",
        targets=(
            Target(f"{pkg}.target:f", tagging("demo"), requires="otherdist>=1.0"),
            Target(f"{pkg}.target:g", tagging("demo"), requires=f"{pkg}>=1.0"),
        ),
    )
    registry = Registry([patch])
    registry.activate()
    assert (module.f(1), module.g(1)) == (1, ("demo", -1))
    assert "left alone: f (needs otherdist>=1.0)" in state(registry)[1]

    only_unneeded = Registry([Patch("demo", "demo", pkg, ">=1.0", (patch.targets[0],))])
    only_unneeded.activate()
    assert state(only_unneeded) == (SKIPPED, "left alone: f (needs otherdist>=1.0)")


def test_version_gate_force_and_dev_builds(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg, requires=">=2.0")])
    registry.activate()
    assert state(registry) == (SKIPPED, f"{pkg} 1.2.0 is outside >=2.0")
    assert module.f(1) == 1

    monkeypatch.setenv("SHIM_FORCE", "demo")
    forced = Registry([make_patch(pkg, requires=">=2.0")])
    forced.activate()
    assert module.f(1) == ("demo", 1)
    assert "applied anyway because of SHIM_FORCE" in state(forced)[1]


def test_outside_the_gate_is_skipped_before_import_even_if_the_target_module_does_not_exist(fake_modules, monkeypatch):
    # Like transformers 4.57, which has no core_model_loading module: the patch must not stay pending.
    pkg = fake_modules(target=TARGET)
    importlib.import_module(pkg)  # the distribution is installed; its target modules are not imported
    registry = Registry(
        [make_patch(pkg, "nowhere:f", requires=">=2.0", name="gone"), make_patch(pkg, requires=">=2.0")]
    )
    registry.activate()
    assert state(registry, "gone") == (SKIPPED, f"{pkg} 1.2.0 is outside >=2.0")
    assert state(registry) == (SKIPPED, f"{pkg} 1.2.0 is outside >=2.0")
    # The import hooks stay: SHIM_FORCE set after activation still applies on the first import.
    monkeypatch.setenv("SHIM_FORCE", "demo")
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == ("demo", 1) and state(registry)[0] == APPLIED


@pytest.mark.parametrize(
    "installed, gated_as, admitted",
    [("5.25.0.dev0", "5.25.0", False), ("5.0.0rc1", "5.0.0", True), ("5.24.0+local", "5.24.0", True)],
)
def test_pre_dev_and_local_builds_are_gated_as_their_release(monkeypatch, installed, gated_as, admitted):
    monkeypatch.setitem(sys.modules, "gatedist", types.SimpleNamespace(__version__=installed))
    decision = gating.check_versions("gatedist", make_patch("x", requires=">=5.0,<5.25").specifier)
    assert (decision.gated_as, decision.admitted) == (gated_as, admitted)
    assert f"{installed} (gated as {gated_as})" in decision.reason


def test_strict_mode_raises_on_apply_failures_only(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET, later=TARGET)
    importlib.import_module(f"{pkg}.target")
    monkeypatch.setenv("SHIM_STRICT", "1")
    with pytest.raises(PatchError, match="'demo' did not apply: target .*:missing does not exist"):
        Registry([make_patch(pkg, "target:missing")]).activate()
    # Lazily: the error surfaces in the import that triggers the patch, as the user asked.
    Registry([make_patch(pkg, "later:missing")]).activate()
    with pytest.raises(PatchError):
        importlib.import_module(f"{pkg}.later")
    # Outside its version gate a patch is not needed: that is never an error.
    Registry([make_patch(pkg, requires=">=9")]).activate()


def test_a_failing_shape_check_or_hook_never_breaks_the_import(fake_modules, monkeypatch, caplog):
    pkg = fake_modules(target=TARGET, other=TARGET)

    def exploding_check(original):
        raise RuntimeError("boom")

    registry = Registry([make_patch(pkg, check=exploding_check)])
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == 1
    current, reason = state(registry)
    assert current == FAILED and reason.startswith(f"the shape check of {pkg}.target:f raised RuntimeError('boom')")
    assert "not a sign that upstream changed" in reason and "shim.enable('demo') tries again" in reason

    broken = Registry([make_patch(pkg, "other:f")])
    broken.activate()
    monkeypatch.setattr(gating, "check_versions", lambda *a: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="shim"):
        other = importlib.import_module(f"{pkg}.other")
    assert other.f(1) == 1
    assert "unexpected error in the post-import hook" in caplog.text


def test_the_shape_checks_reason_is_shown(fake_modules):
    pkg = fake_modules(target=TARGET)
    registry = Registry([make_patch(pkg, check=lambda original: "signature changed: f(y)")])
    registry.activate()
    importlib.import_module(f"{pkg}.target")
    assert state(registry) == (SKIPPED, f"signature changed: f(y) ({pkg} 1.2.0 is inside >=1.0)")


# -- newer than measured ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "installed, newest, said",
    [
        ("99.0.0", "5.25.0", "newdist 99.0.0 is newer than the newest release measured (5.25.0)"),
        ("5.26.0.dev0", "5.25.0", "newdist 5.26.0.dev0 is newer than the newest release measured (5.25.0)"),
        ("5.25.0", "5.25.0", None),
        ("5.25.0.dev0", "5.25.0", None),  # gated as 5.25.0, as the gates read it
        ("5.25.0+local", "5.25.0", None),
        ("4.57.6", "5.25.0", None),
    ],
)
def test_a_release_newer_than_the_newest_measured_is_said(measured, monkeypatch, installed, newest, said):
    monkeypatch.setitem(sys.modules, "newdist", types.SimpleNamespace(__version__=installed))
    measured({"newdist": newest})
    assert gating.newer_than_measured("newdist") == said


def test_nothing_is_said_without_a_measurement_or_an_installed_release(measured, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "newdist", types.SimpleNamespace(__version__="99.0"))
    measured({"otherdist": "1.0"})
    assert gating.newer_than_measured("newdist") is None  # never measured: nothing to compare with
    measured({"newdist": "1.0"})
    monkeypatch.setitem(sys.modules, "newdist", None)  # not installed
    assert gating.newer_than_measured("newdist") is None
    monkeypatch.setattr(gating, "MEASURED", str(tmp_path / "missing.json"))
    gating.newest_measured.cache_clear()
    assert gating.newest_measured() == {}


def test_a_status_reason_says_when_the_release_is_newer_than_measured(fake_modules, measured, monkeypatch):
    """Every state, the note after the reason; never an error, not even in strict mode."""
    pkg = fake_modules(target=TARGET)
    importlib.import_module(f"{pkg}.target")
    monkeypatch.setenv("SHIM_STRICT", "1")
    measured({pkg: "1.0.0"})
    registry = Registry([make_patch(pkg, name="inside"), make_patch(pkg, name="outside", requires="<1.0")])
    registry.activate()
    note = f"{pkg} 1.2.0 is newer than the newest release measured (1.0.0): run `python -m shim doctor`"
    assert state(registry, "inside") == (APPLIED, f"{pkg} 1.2.0 is inside >=1.0; {note}")
    assert state(registry, "outside") == (SKIPPED, f"{pkg} 1.2.0 is outside <1.0; {note}")
    measured({pkg: "1.2.0"})
    assert state(registry, "inside") == (APPLIED, f"{pkg} 1.2.0 is inside >=1.0")
