"""When a patch's bug probe is asked and what its answer decides (``shim.probing``), on throwaway
modules: the releases it is asked on, ``SHIM_PROBE``, stepping aside, a probe that fails or waits for
a module, per library, ``SHIM_FORCE`` and strict mode, and what a probe may not leave behind."""

import functools
import importlib
import json
import logging
import random
import types
import warnings

import pytest

import shim
from shim import (
    APPLIED,
    PENDING,
    SKIPPED,
    BugProbe,
    Evidence,
    Patch,
    PatchError,
    Registry,
    ShimWarning,
    Target,
    probing,
    runtime,
)
from tests.conftest import run_python
from tests.engine.fakes import TARGET, finds, make_patch, tagging

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


def counting(present, detail="f is fixed"):
    """A bug probe answering ``present`` that counts its calls (``.calls``)."""

    def ask():
        ask.calls += 1
        return Evidence(present, detail)

    ask.calls = 0
    return ask


def built(fake_modules, monkeypatch, version="1.2.0", **modules):
    """A throwaway package whose installed version reads ``version``."""
    pkg = fake_modules(target=TARGET, **modules)
    monkeypatch.setattr(importlib.import_module(pkg), "__version__", version)
    return pkg


def record(registry, name="demo"):
    return next(s for s in registry.status() if s.name == name)


def wrapped(pkg):
    return importlib.import_module(f"{pkg}.target").f(1) == ("demo", 1)


# -- where it is asked --------------------------------------------------------------------------------


def test_on_a_release_the_gate_decides_and_no_probe_is_asked(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch)
    probe = counting(False)
    registry = Registry([make_patch(pkg, bug_probe=probe)])
    registry.activate()
    assert wrapped(pkg) and probe.calls == 0
    status = record(registry)
    assert (status.decided_by, status.probe) == ("release", None)


@pytest.mark.parametrize("version", ["1.2.1.dev0", "1.2.0+6a8f0e2", "1.2.0rc1", "1.2.0.post1"])
def test_a_build_between_releases_that_carries_the_fix_steps_aside(fake_modules, monkeypatch, version):
    pkg = built(fake_modules, monkeypatch, version)
    monkeypatch.setenv("SHIM_STRICT", "1")  # a fix found upstream is no problem, not even in strict mode
    registry = Registry([make_patch(pkg, bug_probe=finds(False, "f keeps its frozen parameter"))])
    registry.activate()
    assert not wrapped(pkg), "no layer is installed"
    assert shim.wrappers(importlib.import_module(f"{pkg}.target").f) == []
    status = record(registry)
    assert status.state == SKIPPED
    assert f"steps aside: {pkg} {version} carries the fix: f keeps its frozen parameter" in status.reason
    assert f"{pkg} {version} is a build between releases" in status.reason
    assert status.decided_by == "probe"
    (answer,) = status.probe
    assert (answer["library"], answer["present"], answer["error"]) == (pkg, False, "")


def test_a_build_between_releases_that_has_the_bug_gets_the_patch(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    registry = Registry([make_patch(pkg, bug_probe=finds(True, "f drops the flag"))])
    registry.activate()
    assert wrapped(pkg)
    status = record(registry)
    assert (status.state, status.decided_by) == (APPLIED, "probe")
    assert f"{pkg} 1.2.1.dev0 has the bug: f drops the flag" in status.reason


@pytest.mark.parametrize("present, applies", [(True, True), (False, False)])
def test_outside_the_gate_a_build_between_releases_is_decided_by_its_probe(fake_modules, monkeypatch, present, applies):
    """A git build labelled as the first fixed release, from before the fix merged, lacks it."""
    pkg = built(fake_modules, monkeypatch, "2.0.0+6a8f0e2")
    registry = Registry([make_patch(pkg, requires="<2.0", bug_probe=finds(present, "f"))])
    registry.activate()
    assert wrapped(pkg) is applies
    status = record(registry)
    assert "is outside <2.0" in status.reason
    assert (status.state, status.decided_by) == ((APPLIED, "probe") if applies else (SKIPPED, "release"))
    assert ("but" in status.reason) is applies


def test_a_release_newer_than_measured_is_probed(fake_modules, monkeypatch, measured):
    pkg = built(fake_modules, monkeypatch)
    measured({pkg: "1.0.0"})
    registry = Registry([make_patch(pkg, bug_probe=finds(False, "f"))])
    registry.activate()
    assert not wrapped(pkg)
    assert f"(asked because {pkg} 1.2.0 is newer than the newest release measured (1.0.0))" in record(registry).reason


@pytest.mark.parametrize(
    "direct_url, said",
    [
        ({"url": "file:///src", "dir_info": {"editable": True}}, "is an editable install"),
        (
            {"url": "https://example.org/x.git", "vcs_info": {"vcs": "git"}},
            "is installed from git (https://example.org/x.git)",
        ),
    ],
)
def test_an_editable_or_version_control_install_is_probed(fake_modules, monkeypatch, tmp_path, direct_url, said):
    pkg = built(fake_modules, monkeypatch)
    (tmp_path / f"{pkg}-1.2.0.dist-info" / "direct_url.json").write_text(json.dumps(direct_url))
    assert probing.why_asked(pkg, "auto") == f"{pkg} {said}"
    registry = Registry([make_patch(pkg, bug_probe=finds(False, "f"))])
    registry.activate()
    assert not wrapped(pkg)


@pytest.mark.parametrize("mode, version, asked", [("always", "1.2.0", True), ("never", "1.2.1.dev0", False)])
def test_shim_probe_asks_always_or_never(fake_modules, monkeypatch, mode, version, asked):
    pkg = built(fake_modules, monkeypatch, version)
    monkeypatch.setenv("SHIM_PROBE", mode)
    probe = counting(True)
    registry = Registry([make_patch(pkg, bug_probe=probe)])
    registry.activate()
    assert wrapped(pkg) and probe.calls == int(asked)
    assert record(registry).decided_by == ("probe" if asked else "release")


def test_a_bad_shim_probe_warns_with_the_values_it_takes_and_asks_as_auto(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    monkeypatch.setenv("SHIM_PROBE", "sometimes")
    registry = Registry([make_patch(pkg, bug_probe=finds(False, "f"))])
    with pytest.warns(
        ShimWarning, match="SHIM_PROBE='sometimes' is not valid; use one of auto, always, never; using auto"
    ):
        registry.activate()
        importlib.import_module(f"{pkg}.target")
    assert not wrapped(pkg)


# -- what its answer decides ----------------------------------------------------------------------------


def test_a_probe_that_raises_leaves_the_release_to_decide_and_says_so(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    registry = Registry([make_patch(pkg, bug_probe=lambda: 1 / 0)])
    registry.activate()
    assert wrapped(pkg)
    status = record(registry)
    assert (status.state, status.decided_by) == (APPLIED, "release")
    assert f"the bug probe for {pkg} 1.2.1.dev0 failed (ZeroDivisionError: division by zero)" in status.reason
    assert status.probe[0]["present"] is None and "ZeroDivisionError" in status.probe[0]["error"]


def test_a_probe_that_answers_something_else_than_evidence_has_failed(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    registry = Registry([make_patch(pkg, bug_probe=lambda: True)])
    registry.activate()
    assert wrapped(pkg)
    assert "returns shim.Evidence(present, detail), not True" in record(registry).reason


def test_strict_mode_raises_where_a_probe_fails(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    monkeypatch.setenv("SHIM_STRICT", "1")
    registry = Registry([make_patch(pkg, bug_probe=lambda: 1 / 0)])
    registry.activate()
    with pytest.raises(PatchError, match="bug probe .* failed .*ZeroDivisionError"):
        importlib.import_module(f"{pkg}.target")


def test_shim_force_applies_a_patch_whose_probe_found_no_bug(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    monkeypatch.setenv("SHIM_FORCE", "demo")
    registry = Registry([make_patch(pkg, bug_probe=finds(False, "f"))])
    registry.activate()
    assert wrapped(pkg)
    assert "carries the fix: f (asked because" in record(registry).reason
    assert "applied anyway because of SHIM_FORCE" in record(registry).reason


def test_a_probe_is_asked_once_per_process(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    probe = counting(True)
    registry = Registry([make_patch(pkg, bug_probe=probe)])
    registry.activate()
    assert wrapped(pkg)
    registry.deactivate()
    registry.activate()
    registry.enable("demo")
    assert wrapped(pkg) and probe.calls == 1


def test_each_library_is_decided_by_its_own_probe(fake_modules, monkeypatch):
    """A fix in one library (here: the second) does not silence the patch in the other."""
    first = built(fake_modules, monkeypatch, "1.2.1.dev0")
    second = built(fake_modules, monkeypatch, "3.0.0.dev0")
    patch = Patch(
        name="demo",
        summary="demo",
        distribution=first,
        requires=">=1.0",
        targets=(
            Target(f"{first}.target:f", tagging("demo")),
            Target(f"{second}.target:f", tagging("demo"), requires=f"{second}>=1"),
        ),
        bug_probe=(BugProbe(finds(True, "first"), library=first), BugProbe(finds(False, "second"), library=second)),
    )
    assert patch.libraries == (first, second)
    registry = Registry([patch])
    registry.activate()
    assert wrapped(first) and not wrapped(second)
    status = record(registry)
    assert status.state == APPLIED
    assert f"steps aside: {second} 3.0.0.dev0 carries the fix: second" in status.reason
    assert f"{first} 1.2.1.dev0 has the bug: first" in status.reason


# -- a probe that waits for a module it needs ------------------------------------------------------------


def test_inside_the_gate_the_release_decides_until_the_module_a_probe_needs_is_imported(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0", later="")
    seen = []

    def ask():
        seen.append(importlib.import_module(f"{pkg}.target").f(1))  # with the patch's own parts off
        return Evidence(False, "f is fixed")

    registry = Registry([make_patch(pkg, bug_probe=BugProbe(ask, needs=(f"{pkg}.later",)))])
    registry.activate()
    assert wrapped(pkg), "meanwhile the release decides"
    status = record(registry)
    assert status.state == APPLIED and f"asked once {pkg}.later finishes importing" in status.reason
    importlib.import_module(f"{pkg}.later")
    assert seen == [1] and not wrapped(pkg)
    status = record(registry)
    assert status.state == SKIPPED and "steps aside" in status.reason


def test_outside_the_gate_the_targets_wait_with_the_probe(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "2.0.0+6a8f0e2", later="")
    registry = Registry(
        [make_patch(pkg, requires="<2.0", bug_probe=BugProbe(finds(True, "f"), needs=(f"{pkg}.later",)))]
    )
    registry.activate()
    assert not wrapped(pkg)
    assert record(registry).state == PENDING
    importlib.import_module(f"{pkg}.later")
    assert wrapped(pkg) and record(registry).state == APPLIED


def test_a_module_a_probe_needs_that_this_release_lacks_does_not_hold_it(fake_modules, monkeypatch):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    registry = Registry([make_patch(pkg, bug_probe=BugProbe(finds(False, "f"), needs=(f"{pkg}.absent",)))])
    registry.activate()
    assert not wrapped(pkg) and record(registry).state == SKIPPED


# -- what a probe needs follows from the builders it calls ---------------------------------------------

builders = types.ModuleType("builders")  # stands for shim.selfcheck.bare, whose builders say what they take


def build():
    """A builder: what it takes from ``sys.modules`` is given to each test (``needs``)."""
    return "built"


builders.build = build


def asking_through_a_helper():
    return helping()


def helping():
    builders.build()  # a helper of the probe's own module, called from the probe: read too
    return Evidence(False, "f is fixed")


def test_a_probe_needs_what_the_builders_it_calls_take_without_declaring_it(fake_modules, monkeypatch):
    """A probe that calls a builder but declares nothing waits for what the builder takes: forgetting
    its ``needs`` cannot make it answer "could not tell" where it should decide."""
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0", later="")
    monkeypatch.setattr(build, "needs", (f"{pkg}.later",), raising=False)
    probe = BugProbe(asking_through_a_helper, needs=(f"{pkg}.target",))
    assert probe.needs == (f"{pkg}.target", f"{pkg}.later")
    registry = Registry([make_patch(pkg, bug_probe=probe)])
    registry.activate()
    assert wrapped(pkg), "meanwhile the release decides"
    assert f"asked once {pkg}.later finishes importing" in record(registry).reason
    importlib.import_module(f"{pkg}.later")
    status = record(registry)
    assert status.state == SKIPPED and "steps aside" in status.reason


class Loud:
    def __getattr__(self, name):
        raise AssertionError("an attribute of an object is never looked up: it could run code")


stand_in = Loud()


def test_reading_what_a_probe_needs_runs_nothing_and_follows_only_names_it_looks_up(monkeypatch):
    monkeypatch.setattr(build, "needs", ("a.module",), raising=False)

    def nested():
        def inner():
            return builders.build()

        class Layer:
            made = builders.build

        return inner, Layer

    assert BugProbe(nested).needs == ("a.module",), "nested functions and classes are read"
    assert BugProbe(lambda: stand_in.assemble()).needs == ()
    assert BugProbe(lambda: stand_in.build()).needs == ("a.module",), "a name like a builder's: more, never less"
    assert BugProbe(lambda: Evidence(True, "no builder")).needs == ()
    assert BugProbe(functools.partial(asking_through_a_helper)).needs == (), "no code of its own: declare needs"


# -- a probe leaves no trace ---------------------------------------------------------------------------------


def test_a_probe_sees_the_cpu_with_gradients_on_and_leaves_the_random_states_as_they_were():
    import numpy
    import torch

    seen = {}

    def ask():
        seen.update(
            grad=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            device=torch.empty(1).device.type,
        )
        torch.manual_seed(123), random.seed(123), numpy.random.seed(123)
        torch.rand(3), random.random(), numpy.random.rand()
        warnings.warn("a probe's own warning", stacklevel=1)
        runtime.record("another-patch", "acted inside a probe")
        return Evidence(True, "seen")

    before = (torch.random.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy())
    effects = runtime.count("another-patch")
    with warnings.catch_warnings(record=True) as shown, torch.inference_mode(), torch.device("meta"):
        warnings.simplefilter("always")
        answer = probing.ask(BugProbe(ask), "demo", "a test")
    assert answer.evidence == Evidence(True, "seen")
    assert seen == {"grad": True, "inference": False, "device": "cpu"}
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert (numpy.random.get_state()[1] == before[2]).all()
    assert shown == [] and runtime.count("another-patch") == effects


def test_a_probe_builds_in_float32_without_deterministic_algorithms_or_anomaly_mode_and_leaves_them_as_set():
    """A script that sets a bf16 default dtype, deterministic algorithms or anomaly detection before its
    imports: the probe sees none of them (a tensor it builds is float32, as the bare models' weights
    are), and the script has them back after it."""
    import torch

    seen = {}

    def ask():
        seen.update(
            dtype=torch.ones(1).dtype,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            anomaly=torch.is_anomaly_enabled(),
        )
        torch.set_default_dtype(torch.float64)  # a probe's own change does not outlive it either
        return Evidence(True, "seen")

    def ambient():
        return (
            torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(),
        )

    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with torch.autograd.set_detect_anomaly(True, check_nan=False):
            before = ambient()
            answer = probing.ask(BugProbe(ask), "demo", "a test")
            after = ambient()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_default_dtype(default_dtype)
    assert answer.evidence == Evidence(True, "seen")
    assert seen == {"dtype": torch.float32, "deterministic": False, "anomaly": False}
    assert after == before == (torch.bfloat16, True, True, True, False)


SHOWN_ONCE = """
import warnings
import torch  # imported first: a library's import may change the filters itself
from shim import probing
from shim.patch import BugProbe, Evidence

shown = []
warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))


def here():
    warnings.warn("the user's", FutureWarning)


def ask():
    warnings.warn("the probe's", UserWarning)
    here()
    return Evidence(False, "seen")


here()
probing.ask(BugProbe(ask), "demo", "a test")
here()  # shown once at this place already: not again
print(shown)
"""


def test_a_probe_neither_shows_its_warnings_nor_shows_the_users_again():
    """``warnings.catch_warnings()`` would mark every place's record of what was shown as stale: the
    user's warning, shown once at its place, would show again after the probe."""
    assert run_python(SHOWN_ONCE).stdout.strip() == '["the user\'s"]'


# -- what a patch declares ----------------------------------------------------------------------------


def test_a_patch_declares_one_probe_per_library_of_its_targets(fake_modules):
    pkg = fake_modules(target=TARGET)
    with pytest.raises(ValueError, match="a bug probe for 'elsewhere', which none of its targets lives in"):
        make_patch(pkg, bug_probe=BugProbe(finds(True), library="elsewhere"))
    with pytest.raises(ValueError, match="one bug probe per library"):
        make_patch(pkg, bug_probe=(BugProbe(finds(True)), BugProbe(finds(False), library=pkg)))
    with pytest.raises(TypeError, match="ask must be a callable"):
        BugProbe("yes")
    with pytest.raises(TypeError, match="bug_probe= must be a shim.BugProbe or a callable"):
        make_patch(pkg, bug_probe="yes")
    assert make_patch(pkg, bug_probe=finds(True)).probe_for(pkg).library == ""


def test_a_probe_answer_is_logged(fake_modules, monkeypatch, caplog):
    pkg = built(fake_modules, monkeypatch, "1.2.1.dev0")
    registry = Registry([make_patch(pkg, bug_probe=finds(False, "f is fixed"))])
    with caplog.at_level(logging.INFO, logger="shim"):
        registry.activate()
        importlib.import_module(f"{pkg}.target")
    assert f"demo: {pkg} 1.2.1.dev0 carries the fix: f is fixed" in caplog.text
