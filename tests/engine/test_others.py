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


def test_a_lookout_target_looks_at_its_first_call_per_instance_while_its_patch_is_on(fake_modules, monkeypatch, caplog):
    from shim import others

    pkg = fake_modules(target=TARGET + "\n\nclass Model:\n    def enable(self):\n        return 'enabled'\n")
    module = importlib.import_module(f"{pkg}.target")
    watched = Patch(
        name="watched",
        summary="demo",
        distribution=pkg,
        requires=">=1.0",
        targets=(Target(f"{pkg}.target:f", tagging("watched")),),
    )
    looking = Patch(
        name="looking",
        summary="demo",
        distribution=pkg,
        requires=">=1.0",
        targets=(Target(f"{pkg}.target:Model.enable", tagging("looking"), lookout=True),),
    )
    registry = Registry([watched, looking])
    registry.activate()

    def replaced_by_hand(wrapped):  # another patcher wraps the shim's layer by hand, after it applied
        def f(x):
            return wrapped(x)

        return f

    module.f = replaced_by_hand(module.f)  # calls the layer: "above", said at INFO
    monkeypatch.setattr(others, "_seen", set())

    def said():
        return [r.getMessage() for r in caplog.records if "is wrapped again by" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="shim"):
        with registry.disabled("looking"):
            module.Model().enable()  # the lookout's patch is off: nothing looks
        assert said() == []
        model = module.Model()
        assert model.enable() == ("looking", "enabled")
        assert len(said()) == 1 and said()[0].startswith(f"watched: {pkg}.target:f is wrapped again by ")
        monkeypatch.setattr(others, "_seen", set())
        model.enable()  # the same instance: looked already
        assert said() == [said()[0]]
        module.Model().enable()  # a new instance: looks again (each new patcher is said once)
        assert len(said()) == 2
    registry.deactivate()
