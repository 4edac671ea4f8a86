"""The shim's layers on throwaway modules: one per patch however often applied, stacked in order,
taken off from under other libraries' wrappers, listed by ``shim.wrappers``, consumers rebound."""

import functools
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import types

import pytest
import wrapt

import shim
from shim import (
    APPLIED,
    DISABLED,
    Registry,
)
from tests.engine.fakes import TARGET, make_patch, shim_layers, state, tagging

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


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


# -- several patches on one target: one layer, their parts in one order ---------------------------------


def patches_on_one_target(pkg, wrappers, assign=False):
    """A patch per ``name: wrapper`` of ``wrappers``, each with a target on the same attribute."""
    path = f"{pkg}.target:Layer.slot" if assign else f"{pkg}.target:f"
    return [
        shim.Patch(
            name=name,
            summary="demo",
            distribution=pkg,
            requires=">=1.0",
            targets=(shim.Target(path, w, assign=assign),),
        )
        for name, w in wrappers.items()
    ]


ONE_TARGET = (
    TARGET
    + """
class Layer:
    pass
"""
)


@pytest.mark.parametrize("assign", [False, True], ids=["function", "assign"])
def test_patches_on_one_target_share_one_layer_each_part_on_while_its_patch_is(fake_modules, assign):
    pkg = fake_modules(target=ONE_TARGET)
    module = importlib.import_module(f"{pkg}.target")

    def part(name):
        if assign:  # made for its patch as it joins the layer
            return lambda patch, switch: lambda instance, value: [*value, name]
        return tagging(name)

    def call():
        if assign:
            layer = module.Layer()
            layer.slot = []
            return layer.slot
        return module.f(3)

    registry = Registry(patches_on_one_target(pkg, {"first": part("first"), "second": part("second")}, assign))
    registry.activate()
    target = f"{pkg}.target:Layer.slot" if assign else f"{pkg}.target:f"
    layers = shim.wrappers(target)
    assert [name for name, _layer in layers] == ["second", "first"], registry.status()  # registered later: outside
    assert layers[0][1] is layers[1][1], "one layer for both"
    both = ["second", "first"] if assign else ("second", ("first", 3))
    assert call() == both
    registry.disable("first")
    assert call() == (["second"] if assign else ("second", 3)), "each part follows its own patch's switch"
    registry.disable("second")
    assert call() == ([] if assign else 3)
    registry.enable("first")
    assert call() == (["first"] if assign else ("first", 3))
    registry.deactivate()
    assert shim.wrappers(target) == [] and call() == ([] if assign else 3)
    registry.activate()  # "second" stays off: shim.disable() outlives a deactivation
    assert call() == (["first"] if assign else ("first", 3))
    assert [name for name, _layer in shim.wrappers(target)] == ["first"]


def test_one_layer_stays_while_one_of_its_patches_is_applied(fake_modules):
    pkg = fake_modules(target=ONE_TARGET)
    module = importlib.import_module(f"{pkg}.target")
    patches = patches_on_one_target(pkg, {"first": tagging("first"), "second": tagging("second")})
    first, second = Registry(patches[:1]), Registry(patches[1:])
    first.activate()
    second.activate()
    (layer,) = {id(layer) for _name, layer in shim.wrappers(module.f)}
    assert sorted(name for name, _layer in shim.wrappers(module.f)) == ["first", "second"]
    first.deactivate()
    assert [name for name, _layer in shim.wrappers(module.f)] == ["second"]
    assert module.f(3) == ("second", 3)
    second.deactivate()
    assert shim.wrappers(module.f) == [] and module.f(3) == 3


def test_a_switch_that_flips_changes_the_parts_a_call_runs_once_not_per_call(fake_modules):
    """The layer keeps the wrappers of the parts that act now; flipping a switch recomputes them.
    A call reads that list and runs it: no switch is read per call."""
    from shim.wrapping import parts_of

    pkg = fake_modules(target=ONE_TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry(patches_on_one_target(pkg, {"first": tagging("first"), "second": tagging("second")}))
    registry.activate()
    parts = parts_of(shim.wrappers(module.f)[0][1])
    assert len(parts.active) == 2
    with registry.disabled("second"):
        assert len(parts.active) == 1
        assert module.f(3) == ("first", 3)
    assert len(parts.active) == 2
    registry.deactivate()
