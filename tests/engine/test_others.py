"""Other patchers on the shim's targets, on throwaway modules (``shim.others``): a target replaced by
hand, a known fix of the same bug, and when the engine looks. The stand-ins of real patchers
(unsloth, axolotl) and the shim's answer to each are in ``tests/coexistence/``."""

import importlib
import logging
import sys

import pytest

from shim import Patch, Registry, Target
from tests.engine.fakes import TARGET, make_patch, tagging


def test_a_target_replaced_by_hand_is_reported_and_activate_wraps_it_again(fake_modules):
    from shim import FAILED, Registry
    from tests.engine.fakes import TARGET

    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg)])
    registry.activate()
    module.f = lambda x: x  # someone else's assignment replaces our layer
    record = next(s for s in registry.status() if s.name == "demo")
    assert record.state == FAILED
    assert record.reason.startswith(f"{pkg}.target:f was replaced by tests.engine.test_others:test_a_target_")
    assert "the fix does not run there" in record.reason  # who replaced it, where: another patcher
    assert [(o["relation"], o["file"]) for o in record.others] == [("bypassed", __file__)]
    registry.activate()
    assert module.f(1) == ("demo", 1)


WRAPPER = """
class Wrapper:
    pass
"""


def test_a_known_fix_of_the_same_bug_is_named_only_while_its_mark_and_code_are_there(fake_modules):
    from shim import Registry, SameFix
    from tests.engine.fakes import TARGET

    pkg = fake_modules(target=TARGET + WRAPPER, elsewhere=WRAPPER)
    module = importlib.import_module(f"{pkg}.target")
    same = SameFix(f"{pkg}.target:Wrapper.__setattr__", mark="_fixed_here", covers="Wrapper alone")
    never_imported = SameFix(f"{pkg}.elsewhere:Wrapper.__setattr__", mark="_fixed_here", covers="-")
    registry = Registry([make_patch(pkg, same_fix=(same, never_imported))])
    registry.activate()

    def others():
        return next(s for s in registry.status() if s.name == "demo").others

    def fixed_setattr(self, name, value):
        object.__setattr__(self, name, value)

    module.Wrapper._fixed_here = True
    assert others() == ()  # the mark, but upstream's own __setattr__ (object's)
    del module.Wrapper._fixed_here
    module.Wrapper.__setattr__ = fixed_setattr
    assert others() == ()  # another patcher's code, but nothing says it is that fix
    module.Wrapper._fixed_here = True
    [other] = others()
    where = f"{__name__}:{test_a_known_fix_of_the_same_bug_is_named_only_while_its_mark_and_code_are_there.__name__}"
    assert (other["target"], other["relation"], other["by"]) == (
        same.spec,
        "same fix",
        f"{where}.<locals>.fixed_setattr",
    )
    assert other["text"].endswith("which fixes the same bug for Wrapper alone: both can be on")
    assert f"{pkg}.elsewhere" not in sys.modules  # a status imports nothing to look for it
    registry.deactivate()
    assert others() == ()  # said while the patch is on only


def test_a_same_fix_is_declared_on_a_class_attribute():
    from shim import SameFix

    with pytest.raises(ValueError, match="'package.module:Class.attribute'"):
        SameFix("json:dumps", mark="_fixed", covers="-")  # the mark lives on a class: it needs one
    with pytest.raises(TypeError, match="same_fix= must be a tuple of shim.SameFix"):
        make_patch("demo_pkg", same_fix=("json:JSONEncoder.default",))


def calls_into_others(action):
    """How many calls of code in ``shim/others.py`` ``action()`` makes."""
    import os

    import shim.others

    counted = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == os.path.abspath(shim.others.__file__):
            counted.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return counted


def test_other_patchers_are_named_when_asked_never_while_patches_apply(fake_modules, monkeypatch, caplog):
    """Applying a patch, switching it and calling its targets never look for other patchers; a
    status does, and an apply does while the ``shim`` logger shows DEBUG (``SHIM_LOG_LEVEL=DEBUG``)."""
    from shim import others

    pkg = fake_modules(target=TARGET, more=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    watched = Patch(
        name="watched",
        summary="demo",
        distribution=pkg,
        requires=">=1.0",
        targets=(Target(f"{pkg}.target:f", tagging("watched")), Target(f"{pkg}.more:f", tagging("watched"))),
    )
    registry = Registry([watched])

    def replaced_by_hand(wrapped):  # another patcher wraps the shim's layer by hand, after it applied
        def f(x):
            return wrapped(x)

        return f

    def run():
        registry.activate()
        module.f = replaced_by_hand(module.f)
        assert module.f(1) == ("watched", 1)
        with registry.disabled("watched"):
            assert module.f(1) == 1

    monkeypatch.setattr(others, "_seen", set())
    with caplog.at_level(logging.INFO, logger="shim"):
        assert calls_into_others(run) == []
        assert calls_into_others(lambda: importlib.import_module(f"{pkg}.more")) == []  # applied there too
        assert not [r for r in caplog.records if "is wrapped again by" in r.getMessage()]
        [record] = [s for s in registry.status() if s.name == "watched"]
    assert [o["relation"] for o in record.others] == ["above"]
    said = [r.getMessage() for r in caplog.records if "is wrapped again by" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"watched: {pkg}.target:f is wrapped again by ")
    registry.deactivate()

    monkeypatch.setattr(others, "_seen", set())
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="shim"):
        registry.activate()  # wraps f again, under the hand-written wrapper: said at once, as asked
    said = [r.getMessage() for r in caplog.records if "replaced_by_hand" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    registry.deactivate()


APPLYING = """
import json, os, sys
calls = []
def profile(frame, event, arg):  # calls of its functions (CO_OPTIMIZED), not its import's bodies
    code = frame.f_code
    if event == "call" and code.co_flags & 1 and os.path.basename(code.co_filename) == "others.py":
        calls.append(code.co_name)
sys.setprofile(profile)
import shim
import transformers.modeling_utils, transformers.trainer, trl.models.utils
from tests.tinymodels import tiny_llama

model = tiny_llama(2)
model.train()
model.activation_checkpointing_enable({"use_reentrant": True})
model.activation_checkpointing_disable()
model.activation_checkpointing_enable()
sys.setprofile(None)
import wrapt
from shim.wrapping import object_at, patch_names_of

layers = {}
for name in shim.registry.names:
    for target in shim.registry.patch(name).targets:
        module = sys.modules.get(target.module)
        try:
            current = object_at(module, target.path) if module else None
        except Exception:
            continue
        found = sum(1 for entry in wrapt.wrapper_chain(current) if patch_names_of(entry))
        if found:
            layers[target.spec] = found
print(json.dumps({"calls": calls, "layers": layers, "applied": [s.name for s in shim.status() if s.state == "applied"]}))
"""


def test_the_real_stack_applies_its_patches_one_layer_a_target_and_names_no_patcher_unasked():
    """On the installed transformers and trl: every target the patches wrap holds one shim layer,
    however many patches have a part there, and applying them and a model's enable, disable and
    re-enable never call into the other-patcher room."""
    import json

    from tests.conftest import run_python

    out = json.loads(run_python(APPLYING, torch_first=True).stdout.splitlines()[-1])
    assert len(out["applied"]) >= 10, out
    assert out["layers"] and set(out["layers"].values()) == {1}, out["layers"]
    assert out["calls"] == []


HELD = """
import functools

def f(x):
    return x
"""
KEEPERS = """
import functools
from {pkg}.target import f as original

class Patcher:
    kept = functools.partial(original)

    def __init__(self):
        self.original = original

    def call(self, x):  # a bound method of a patcher object, set on the module
        return self.original(x)

    def __call__(self, x):  # an object called in its place
        return self.original(x)

    @staticmethod
    def static(x):
        return Patcher.kept(x)

def through_the_class(x):
    return Patcher.static(x)

def through_a_module_global(x):
    return original(x)

def through_nothing_of_the_shim(x):
    return x
"""


def test_the_fix_runs_where_a_replacement_reaches_the_layer_through_what_it_keeps(fake_modules):
    """A replacement that keeps the shim's layer (an instance's attribute, a partial in a class
    attribute behind a static method, a module global) calls the fix: the status says it sits above;
    one that keeps nothing of it bypasses it. Each call is checked, not only the status."""
    pkg = fake_modules(target=HELD)
    target = importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg)])
    registry.activate()
    keepers = importlib.import_module(f"{fake_modules(keepers=KEEPERS.format(pkg=pkg))}.keepers")  # takes the layer
    patcher = keepers.Patcher()
    cases = {
        "a bound method": (patcher.call, "above"),
        "an object called": (patcher, "above"),
        "a partial in a class attribute": (keepers.through_the_class, "above"),
        "a module global": (keepers.through_a_module_global, "above"),
        "nothing of the shim": (keepers.through_nothing_of_the_shim, "bypassed"),
    }
    for case, (replacement, relation) in cases.items():
        target.f = replacement
        record = next(s for s in registry.status() if s.name == "demo")
        runs_the_fix = target.f(1) == ("demo", 1)
        assert runs_the_fix == (relation == "above"), case
        assert [o["relation"] for o in record.others] == [relation], (case, record.others)
        assert record.state == ("applied" if runs_the_fix else "failed"), (case, record.reason)
