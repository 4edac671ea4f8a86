"""The registry engine on throwaway modules: no torch, no transformers."""

import functools
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading
import types

import pytest
import wrapt

import shim
from shim import (
    APPLIED,
    DISABLED,
    FAILED,
    PENDING,
    SKIPPED,
    Patch,
    PatchError,
    Registry,
    ShimWarning,
    Target,
    gating,
    settings,
)

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version

TARGET = """
def f(x):
    return x

def g(x):
    return -x
"""


def tagging(tag):
    def wrapper(wrapped, instance, args, kwargs):
        return (tag, wrapped(*args, **kwargs))

    return wrapper


def make_patch(pkg, *paths, name="demo", requires=">=1.0", probe=None, **extra):
    paths = paths or ("target:f",)
    targets = tuple(Target(f"{pkg}.{path}", tagging(name), probe=probe) for path in paths)
    return Patch(name=name, summary="demo", distribution=pkg, requires=requires, targets=targets, **extra)


def shim_layers(obj):
    return [layer for _name, layer in shim.wrappers(obj)]


def state(registry, name="demo"):
    return next((s.state, s.reason) for s in registry.status() if s.name == name)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    for variable in ("SHIM_DISABLE", "SHIM_FORCE", "SHIM_STRICT"):
        monkeypatch.delenv(variable, raising=False)


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


def test_one_layer_however_often_and_by_whomever_activated(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    first, second = Registry([make_patch(pkg)]), Registry([make_patch(pkg)])
    first.activate()
    first.activate()
    second.activate()
    second.enable()
    assert len(shim_layers(module.f)) == 1
    assert module.f(3) == ("demo", 3)
    # The second registry adopted the layer, so its switch reaches it.
    second.disable("demo")
    assert module.f(3) == 3
    second.deactivate()
    assert shim_layers(module.f) == [] and module.f(3) == 3


INHERITED = """
class Base:
    def __call__(self, x):
        return x

class Layer(Base):
    pass
"""


@pytest.mark.parametrize("order", ["inner first", "outer first"])
def test_two_patches_stacked_on_an_inherited_method_leave_it_inherited_when_removed(fake_modules, order):
    # Two patches on one inherited method (as reentrant-keyword-grads and reentrant-frozen-input-grads
    # on GradientCheckpointingLayer.__call__, which is nn.Module's from transformers 5.23).
    pkg = fake_modules(target=INHERITED)
    module = importlib.import_module(f"{pkg}.target")
    inner, outer = (make_patch(pkg, "target:Layer.__call__", name=n) for n in ("inner", "outer"))
    registry = Registry([inner, outer])
    registry.activate()
    assert "__call__" in vars(module.Layer) and module.Layer()(1) == ("outer", ("inner", 1))
    assert module.Base()(1) == 1

    for name in ("inner", "outer") if order == "inner first" else ("outer", "inner"):
        registry.disable(name)
        registry._entries[name].deactivate()  # what registry.deactivate() does, one patch at a time
    assert "__call__" not in vars(module.Layer), "the class inherits the method again"
    assert module.Layer()(1) == 1

    registry.deactivate()
    registry.enable()
    assert module.Layer()(1) == ("outer", ("inner", 1))
    registry.deactivate()
    assert "__call__" not in vars(module.Layer)


def test_deactivate_removes_only_our_layer_under_a_third_party_wrapper(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg)])
    registry.activate()
    wrapt.wrap_function_wrapper(module, "f", tagging("theirs"))
    assert module.f(1) == ("theirs", ("demo", 1))

    registry.deactivate()

    assert module.f(1) == ("theirs", 1)
    assert shim_layers(module.f) == []
    assert state(registry)[0] == DISABLED


def test_wrappers_lists_the_shim_layers_on_a_target_outermost_first_past_foreign_ones(fake_modules):
    pkg = fake_modules(target=TARGET)
    spec = f"{pkg}.target:f"
    assert shim.wrappers(spec) == []  # not imported: nothing is imported to answer
    assert f"{pkg}.target" not in sys.modules
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg), make_patch(pkg, name="second", after=("demo",))])
    registry.activate()
    wrapt.wrap_function_wrapper(module, "f", tagging("theirs"))  # another patcher on top

    listed = shim.wrappers(spec)
    assert [name for name, _layer in listed] == ["second", "demo"]
    assert listed == shim.wrappers(module.f)
    assert not hasattr(listed[1][1].__wrapped__, "__wrapped__")  # demo's layer wraps the function itself
    assert shim.wrappers(f"{pkg}.target:missing") == [] and shim.wrappers(len) == []
    registry.deactivate()
    assert shim.wrappers(spec) == []


def test_deactivate_under_a_plain_closure_leaves_our_layer_inert(fake_modules, caplog):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg)])
    registry.activate()
    inner = module.f

    @functools.wraps(inner)
    def closure(x):
        return ("closure", inner(x))

    module.f = closure
    with caplog.at_level(logging.WARNING, logger="shim"):
        registry.deactivate()
    assert module.f(1) == ("closure", 1)
    assert "left in place switched off" in caplog.text
    registry.activate()  # adopts the stranded layer instead of stacking a second one
    assert module.f(1) == ("closure", ("demo", 1))
    assert len(shim_layers(module.f)) == 1


def test_runtime_switch_acts_at_once_under_a_third_party_wrapper(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg), make_patch(pkg, "target:g", name="other")])
    registry.activate()
    wrapt.wrap_function_wrapper(module, "f", tagging("theirs"))

    registry.disable("demo")
    assert module.f(1) == ("theirs", 1)
    assert state(registry)[0] == DISABLED and not registry.is_on("demo")
    registry.enable("demo")
    assert module.f(1) == ("theirs", ("demo", 1))
    assert state(registry)[0] == APPLIED and len(shim_layers(module.f)) == 1

    with registry.disabled("demo"):
        assert module.f(1) == ("theirs", 1)
        assert module.g(1) == ("other", -1)
        with registry.disabled():
            assert module.g(1) == -1
        assert module.f(1) == ("theirs", 1)
    assert module.f(1) == ("theirs", ("demo", 1))
    with pytest.raises(KeyError, match="no patch named 'nope'"):
        registry.disable("nope")


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


def test_doctor_measures_the_bug_when_a_target_module_does_not_exist(fake_modules):
    from shim.tools import doctor

    pkg = fake_modules(target=TARGET)
    importlib.import_module(pkg)
    registry = Registry(
        [
            make_patch(pkg, "nowhere:f", requires=">=2.0", name="absent", self_check=lambda: False),
            make_patch(pkg, "nowhere:f", requires=">=1.0", name="present", self_check=lambda: True),
            make_patch("not_a_distribution_here", "nowhere:f", name="uninstalled", self_check=lambda: True),
        ]
    )
    registry.activate()
    findings = {f.name: f for f in doctor.run(registry)}
    assert (findings["absent"].state, findings["absent"].verdict) == (SKIPPED, doctor.NOT_AFFECTED)
    assert findings["present"].verdict == doctor.NOT_FIXED, "the bug shows and the patch cannot apply"
    assert f"{pkg}.nowhere cannot be imported" in findings["present"].detail
    assert findings["uninstalled"].verdict == doctor.NOT_INSTALLED


@pytest.mark.parametrize(
    "installed, gated_as, admitted",
    [("5.25.0.dev0", "5.25.0", False), ("5.0.0rc1", "5.0.0", True), ("5.24.0+local", "5.24.0", True)],
)
def test_pre_dev_and_local_builds_are_gated_as_their_release(monkeypatch, installed, gated_as, admitted):
    monkeypatch.setitem(sys.modules, "gatedist", types.SimpleNamespace(__version__=installed))
    decision = gating.decide("gatedist", make_patch("x", requires=">=5.0,<5.25").specifier)
    assert (decision.gated_as, decision.admitted) == (gated_as, admitted)
    assert f"{installed} (gated as {gated_as})" in decision.reason


@pytest.mark.parametrize("value", ["all", "1", "true", "*", "ALL"])
def test_shim_disable_all(fake_modules, monkeypatch, value):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", value)
    registry = Registry([make_patch(pkg)])
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == 1
    assert state(registry) == (DISABLED, "opted out with SHIM_DISABLE=all")


def test_shim_disable_list_and_explicit_enable(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", " demo , other")
    registry = Registry(
        [make_patch(pkg), make_patch(pkg, "target:g", name="other"), make_patch(pkg, "target:g", name="third")]
    )
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == 1
    assert module.g(1) == ("third", -1)
    assert state(registry) == (DISABLED, "opted out with SHIM_DISABLE=demo")
    registry.enable("demo")  # the API is explicit and wins over the environment
    assert module.f(1) == ("demo", 1)


def test_unknown_patch_name_warns_once_with_the_closest_names(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_DISABLE", "dmeo")
    registry = Registry([make_patch(pkg)])
    with pytest.warns(ShimWarning, match="unknown patch 'dmeo', ignored; did you mean demo"):
        registry.activate()
    importlib.import_module(f"{pkg}.target")  # read again on apply: no second warning
    assert len(settings._warned) == 1


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        (
            "SHIM_DISABLE",
            "demo;rm -rf",
            "'demo;rm -rf' is not a patch name, ignored; SHIM_DISABLE takes 'all' or a comma",
        ),
        ("SHIM_STRICT", "maybe", "use one of"),
        ("SHIM_LOG_LEVEL", "LOUD", "use one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ],
)
def test_invalid_values_warn_list_the_valid_ones_and_use_the_default(
    fake_modules, monkeypatch, variable, value, expected
):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv(variable, value)
    registry = Registry([make_patch(pkg)])
    with pytest.warns(ShimWarning, match=expected):
        settings.configure_logging()
        registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == ("demo", 1)  # the default: applied, not strict


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


def test_a_failing_probe_or_hook_never_breaks_the_import(fake_modules, monkeypatch, caplog):
    pkg = fake_modules(target=TARGET, other=TARGET)

    def exploding_probe(original):
        raise RuntimeError("boom")

    registry = Registry([make_patch(pkg, probe=exploding_probe)])
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert module.f(1) == 1
    current, reason = state(registry)
    assert current == FAILED and reason.startswith(f"the shape probe of {pkg}.target:f raised RuntimeError('boom')")
    assert "not a sign that upstream changed" in reason and "shim.enable('demo') tries again" in reason

    broken = Registry([make_patch(pkg, "other:f")])
    broken.activate()
    monkeypatch.setattr(gating, "decide", lambda *a: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="shim"):
        other = importlib.import_module(f"{pkg}.other")
    assert other.f(1) == 1
    assert "unexpected error in the post-import hook" in caplog.text


def test_probe_reason_is_shown(fake_modules):
    pkg = fake_modules(target=TARGET)
    registry = Registry([make_patch(pkg, probe=lambda original: "signature changed: f(y)")])
    registry.activate()
    importlib.import_module(f"{pkg}.target")
    assert state(registry) == (SKIPPED, f"signature changed: f(y) ({pkg} 1.2.0 is inside >=1.0)")


def test_consumers_bound_before_the_patch_are_rebound_and_restored(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET, consumer="from .target import f as imported_f\n")
    target = importlib.import_module(f"{pkg}.target")
    consumer = importlib.import_module(f"{pkg}.consumer")
    original = target.f

    class Stubborn(types.ModuleType):
        def __setattr__(self, name, value):
            raise AttributeError("frozen module")

    stubborn = Stubborn(f"{pkg}.stubborn")
    object.__setattr__(stubborn, "f", original)
    monkeypatch.setitem(sys.modules, f"{pkg}.stubborn", stubborn)

    registry = Registry([make_patch(pkg, consumers=(f"{pkg}.consumer", f"{pkg}.stub*"))])
    registry.activate()
    assert consumer.imported_f(1) == ("demo", 1)
    assert f"could not rebind {pkg}.stubborn.f" in state(registry)[1]

    registry.deactivate()
    assert consumer.imported_f is original


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


def test_shim_register_puts_a_users_patch_in_the_process_registry(fake_modules):
    import shim

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


CLASS_TARGET = """
class Model:
    def f(self, x):
        return x
"""


def test_deactivate_takes_the_layer_off_the_class_a_reload_left_behind(fake_modules):
    pkg = fake_modules(target=CLASS_TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg, "target:Model.f")])
    registry.activate()
    old = module.Model
    importlib.reload(module)
    assert module.Model is not old
    # While applied, both work: models built before the reload keep the old class.
    assert (old().f(1), module.Model().f(1)) == (("demo", 1), ("demo", 1))
    assert state(registry)[0] == APPLIED

    registry.deactivate()

    assert shim_layers(vars(old)["f"]) == [] and old().f(1) == 1, "the old class keeps no layer, not even inert"
    assert shim_layers(vars(module.Model)["f"]) == [] and module.Model().f(1) == 1


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
        assert importhooks.wait(10) and not thread.is_alive()
        assert sys.modules[name].f(1) == (1 if lock_table == "none" else ("demo", 1)), "before any status()"
        current, reason = state(registry)
    finally:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, Finder)]
    assert current == APPLIED and sys.modules[name].f(1) == ("demo", 1)
    if lock_table == "none":
        assert reason.endswith(
            f"late: {name} was imported without passing the shim's import hook (loader "
            "tests.test_engine.HeldLoader), so this applied only at shim.status()"
        )
    else:
        assert reason == f"{pkg} 1.2.0 is inside >=1.0"
