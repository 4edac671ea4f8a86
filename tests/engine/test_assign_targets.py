"""The engine's assign targets (``Target(..., assign=True)``) and switch watchers, on throwaway
modules: no torch, no transformers.

An assign target sees every value assigned to an attribute on instances of a class while its patch
is on, never a read; several patches' parts run in one layer in ``after=`` order, come out in any
order, the layer comes off leaving the class as it was, and is found again by a second registry. A watcher is told when a
patch's switch goes off and on."""

import importlib
import logging

import pytest
import wrapt

import shim
from shim import APPLIED, SKIPPED, Patch, PatchError, Registry, Target, settings

pytestmark = pytest.mark.any_version

TARGET = """
class Layer:
    default = "class default"

    def __getattr__(self, name):
        raise AttributeError(f"'Layer' object has no attribute {name!r}")
"""


def doubling(seen):
    def assigned(instance, value):
        seen.append(value)
        return value * 2

    return assigned


def make_patch(pkg, assigned, name="demo", attribute="slot", check=None, after=()):
    """A patch whose part on ``Layer.<attribute>`` is ``assigned(instance, value)``, whatever it is handed."""
    target = Target(f"{pkg}.target:Layer.{attribute}", lambda name, switch: assigned, assign=True, check=check)
    return Patch(name=name, summary="demo", distribution=pkg, requires=">=1.0", targets=(target,), after=after)


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())
    for variable in ("SHIM_DISABLE", "SHIM_FORCE", "SHIM_STRICT"):
        monkeypatch.delenv(variable, raising=False)


def test_every_assignment_passes_the_patch_and_no_read_does(fake_modules):
    pkg = fake_modules(target=TARGET)
    seen = []
    registry = Registry([make_patch(pkg, doubling(seen))])
    registry.activate()
    layer_class = importlib.import_module(f"{pkg}.target").Layer
    layer = layer_class()
    assert not hasattr(layer, "slot")
    with pytest.raises(AttributeError, match="'Layer' object has no attribute 'slot'"):
        layer.slot  # noqa: B018  (as without the layer: the class's own __getattr__ answers)
    layer.slot = 3
    assert layer.slot == 6 and vars(layer) == {"slot": 6} and seen == [3]
    for _ in range(3):
        assert layer.slot == 6
    assert seen == [3], "a read never runs the patch"
    del layer.slot
    assert not hasattr(layer, "slot")


def test_off_stores_as_upstream_and_deactivate_leaves_the_class_as_it_was(fake_modules):
    pkg = fake_modules(target=TARGET)
    seen = []
    registry = Registry([make_patch(pkg, doubling(seen))])
    layer_class = importlib.import_module(f"{pkg}.target").Layer
    before = dict(vars(layer_class))
    registry.activate()
    layer = layer_class()
    with registry.disabled():
        layer.slot = 3
    assert layer.slot == 3 and seen == []
    registry.deactivate()
    assert dict(vars(layer_class)) == before
    layer.slot = 4
    assert layer.slot == 4 and seen == []
    registry.activate()
    layer.slot = 5
    assert layer.slot == 10


def test_a_class_default_stays_readable_beneath_the_layer(fake_modules):
    pkg = fake_modules(target=TARGET)
    registry = Registry([make_patch(pkg, lambda instance, value: value.upper(), attribute="default")])
    registry.activate()
    layer = importlib.import_module(f"{pkg}.target").Layer()
    assert layer.default == "class default"
    layer.default = "mine"
    assert layer.default == "MINE"


def test_parts_run_in_after_order_in_one_layer_and_come_out_in_any_order(fake_modules):
    pkg = fake_modules(target=TARGET)

    def tag(name):
        return lambda instance, value: [*value, name]

    inner = make_patch(pkg, tag("inner"), name="inner")
    outer = make_patch(pkg, tag("outer"), name="outer", after=("inner",))
    registry = Registry([inner, outer])
    registry.activate()
    layer_class = importlib.import_module(f"{pkg}.target").Layer
    layer = layer_class()
    layer.slot = []
    assert layer.slot == ["outer", "inner"], "the outer part sees the value first"
    handles = [entry for entry in wrapt.wrapper_chain(vars(layer_class)["slot"]) if entry is not wrapt.MISSING]
    assert len(handles) == 1, "one layer, whatever the number of patches on the target"
    registry.disable("inner")
    layer.slot = []
    assert layer.slot == ["outer"]
    registry.enable("inner")
    registry._entries["inner"].deactivate()  # its part comes out, the outer one stays
    layer.slot = []
    assert layer.slot == ["outer"]
    registry.deactivate()
    assert "slot" not in vars(layer_class)


def test_a_second_registry_adopts_the_layer_instead_of_adding_one(fake_modules):
    pkg = fake_modules(target=TARGET)
    seen = []
    patch = make_patch(pkg, doubling(seen))
    first, second = Registry([patch]), Registry([patch])
    first.activate()
    second.activate()
    layer_class = importlib.import_module(f"{pkg}.target").Layer
    chain = list(wrapt.wrapper_chain(vars(layer_class)["slot"]))
    assert len(chain) == 2, "one layer and MISSING beneath it"
    layer = layer_class()
    layer.slot = 1
    assert layer.slot == 2


def test_the_shape_check_is_given_the_class_and_a_missing_class_skips(fake_modules):
    pkg = fake_modules(target=TARGET)
    given = []
    registry = Registry([make_patch(pkg, doubling([]), check=lambda owner: given.append(owner))])
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    assert given == [module.Layer]
    assert registry.status()[0].state == APPLIED

    pkg = fake_modules(target="class Other:\n    pass\n")
    registry = Registry([make_patch(pkg, doubling([]))])
    registry.activate()
    importlib.import_module(f"{pkg}.target")
    status = registry.status()[0]
    assert status.state == SKIPPED and "does not exist" in status.reason


def test_strict_mode_raises_on_a_shape_check_that_finds_the_shape_changed(fake_modules, monkeypatch):
    pkg = fake_modules(target=TARGET)
    monkeypatch.setenv("SHIM_STRICT", "1")
    registry = Registry([make_patch(pkg, doubling([]), check=lambda owner: "the call shape changed")])
    registry.activate()
    with pytest.raises(PatchError, match="the call shape changed"):
        importlib.import_module(f"{pkg}.target")


def test_an_assign_targets_part_is_made_with_its_patchs_name_and_switch(fake_modules):
    """The engine hands an assign target's part the name and switch of the patch whose targets hold
    it, as it joins the layer: the switch the engine runs the part by, the one ``switch_of`` gives."""
    pkg = fake_modules(target=TARGET)
    made = []

    def make(name, switch):
        made.append((name, switch))
        return lambda instance, value: (name, switch.on, value)

    target = Target(f"{pkg}.target:Layer.slot", make, assign=True)
    registry = Registry([Patch(name="demo", summary="demo", distribution=pkg, requires=">=1.0", targets=(target,))])
    registry.activate()
    layer = importlib.import_module(f"{pkg}.target").Layer()
    assert made == [("demo", registry.switch_of("demo"))]
    layer.slot = 1
    assert layer.slot == ("demo", True, 1)


def test_an_assign_target_needs_a_class_and_an_attribute():
    with pytest.raises(ValueError, match="Class.attribute"):
        Target("m:f", lambda instance, value: value, assign=True)


# -- switch watchers -------------------------------------------------------------------------------


def test_a_watcher_is_told_each_time_the_switch_goes_off_and_on(fake_modules):
    pkg = fake_modules(target=TARGET)
    registry = Registry([make_patch(pkg, doubling([]))])
    told = []
    registry.switch_of("demo").watch(told.append)
    registry.activate()
    importlib.import_module(f"{pkg}.target")
    assert told == [True], "on when applied"
    registry.disable()
    registry.enable()
    with registry.disabled():
        with registry.disabled("demo"):
            pass
    registry.deactivate()
    registry.activate()
    assert told == [True, False, True, False, True, False, True], "only changes, once each"


def test_a_failing_watcher_is_logged_and_the_switch_still_switches(fake_modules, caplog):
    pkg = fake_modules(target=TARGET)
    registry = Registry([make_patch(pkg, doubling([]))])

    def broken(on):
        raise RuntimeError("watcher broke")

    registry.switch_of("demo").watch(broken)
    registry.activate()
    importlib.import_module(f"{pkg}.target")
    with caplog.at_level(logging.ERROR, logger="shim"):
        registry.disable()
    assert not registry.switch_of("demo").on and "watcher" in caplog.text


def test_shim_exposes_the_watch_through_switch_of():
    assert callable(shim.switch_of("replaced-forward-keeps-checkpointing").watch)


class Boxed:
    """What a part makes of a value (weak references can be made to it, as to a checkpoint function)."""

    def __init__(self, value):
        self.value = value


def test_one_value_given_to_many_instances_of_a_class_passes_the_parts_once(fake_modules):
    """An enable gives every layer one function: the parts run for the first layer and the others
    get what it got. Another value, another class or a flipped switch runs them again; a value the
    layer cannot refer to weakly runs them each time."""
    pkg = fake_modules(target=TARGET + "\n\nclass Other(Layer):\n    pass\n")
    seen = []

    def boxing(instance, value):
        seen.append(type(instance).__name__)
        return Boxed(value)

    registry = Registry([make_patch(pkg, boxing)])
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    function = lambda: None  # noqa: E731  (a checkpoint function, as an enable hands every layer one)
    layers = [module.Layer() for _ in range(3)]
    for layer in layers:
        layer.slot = function
    assert seen == ["Layer"] and len({id(layer.slot) for layer in layers}) == 1
    assert layers[0].slot.value is function
    module.Other().slot = function
    layers[0].slot = function
    assert seen == ["Layer", "Other", "Layer"], "another class in between: the parts run again"
    other = lambda: None  # noqa: E731
    layers[1].slot = other
    assert seen[-1] == "Layer" and layers[1].slot.value is other
    with registry.disabled():
        layers[2].slot = other
    registry.disable()
    registry.enable()
    layers[2].slot = other
    assert len(seen) == 5 and layers[2].slot.value is other, "another set of active parts: they run again"
    count = len(seen)
    for layer in layers:
        layer.slot = 7  # an int: no weak reference
    assert len(seen) == count + 3
    registry.deactivate()


def test_a_module_function_given_again_after_another_value_passes_the_parts_once(fake_modules):
    """trl's cycle: every disable gives the layers torch's ``checkpoint`` again between two enables'
    new partials. A function its module holds by its name is remembered beside the last value, so the
    parts run for it once; what they made is shared by the instances and holds none of them."""
    pkg = fake_modules(target=TARGET + "\n\ndef checkpoint():\n    pass\n")
    seen = []

    def boxing(instance, value):
        seen.append(value)
        return Boxed(value)

    registry = Registry([make_patch(pkg, boxing)])
    registry.activate()
    module = importlib.import_module(f"{pkg}.target")
    layer = module.Layer()
    layer.slot = module.checkpoint
    made = layer.slot
    for _cycle in range(3):
        layer.slot = lambda: None  # an enable's new partial
        layer.slot = module.checkpoint  # a disable
    assert seen.count(module.checkpoint) == 1 and layer.slot is made
    assert len(seen) == 4, "each enable's new function still passes the parts"
    layers = [module.Layer() for _ in range(2)]
    for other in layers:
        other.slot = module.checkpoint
    assert all(other.slot is made for other in layers) and seen.count(module.checkpoint) == 1
    registry.disable()
    registry.enable()
    layer.slot = module.checkpoint
    assert seen.count(module.checkpoint) == 2, "another set of active parts: they run again"
    registry.deactivate()
