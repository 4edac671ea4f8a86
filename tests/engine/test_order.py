"""The one order of the parts on a target (``shim.order``): declared with ``Patch.after`` and
``Patch.place``, checked where it is declared (the built-ins' index, a registration), never
inside a user's call; a pack whose order cannot hold is left out with one warning."""

import importlib
import sys
import warnings

import pytest

import shim
from shim import Patch, Registry, Target, order, packs
from shim.order import OrderError
from shim.tools.index import stacking_order
from tests.engine.fakes import TARGET, tagging
from tests.engine.test_packs import write_pack

pytestmark = pytest.mark.any_version


def declared(name, *after, place=""):
    return Patch(name, "s", "demo", ">=1", (Target("m:f", lambda *a: None),), after=after, place=place)


def on_target(pkg, name, *after, place=""):
    """Patch ``name`` on ``{pkg}.target:f``, tagging what f returns with its name."""
    targets = (Target(f"{pkg}.target:f", tagging(name)),)
    return Patch(
        name=name, summary="demo", distribution=pkg, requires=">=1.0", targets=targets, after=after, place=place
    )


def test_the_built_ins_order_puts_the_places_first_then_after_then_names():
    ordered = stacking_order(
        [
            declared("c"),
            declared("a", "c"),
            declared("z", place="innermost"),
            declared("b"),
            declared("y", place="outermost"),
        ]
    )
    assert [p.name for p in ordered] == ["z", "b", "c", "a", "y"]


@pytest.mark.parametrize(
    ("patches", "message"),
    [
        ([declared("a", "b"), declared("b", "a")], "cycle: a -> b -> a"),
        ([declared("a", "missing")], "which is no built-in patch"),
        ([declared("a", "b", place="innermost"), declared("b")], "drop one of the two declarations"),
    ],
    ids=["cycle", "unknown name", "after against a place"],
)
def test_an_order_that_cannot_hold_is_refused_where_the_index_is_generated(patches, message):
    with pytest.raises(OrderError, match=message):
        stacking_order(patches)


def test_one_function_computes_the_order_and_what_it_refuses_for_every_caller():
    """``shim.order.settle`` is the one order: the index, the packs at ``import shim`` and
    ``register()`` all read it; what a refusal means is theirs to say."""
    patches = [
        declared("late", "early"),  # given first, declared after "early"
        declared("early"),
        declared("inner", "outer", place="innermost"),  # its after= sits outside it
        declared("gone", "nobody"),
        declared("a", "b"),
        declared("b", "a"),
    ]
    settled = order.settle(patches, {"outer": "outermost"})
    assert [p.name for p in settled.ordered] == ["early", "late"]
    assert {name: (r.cause, r.named) for name, r in settled.refused.items()} == {
        "inner": (order.OUTSIDE, "outer"),
        "gone": (order.MISSING, "nobody"),
        "a": (order.CYCLE, "b"),
        "b": (order.CYCLE, "a"),
    }
    assert settled.refused["a"].cycle == ("a", "b", "a") and settled.dropped == {}
    lenient = order.settle(patches, {"outer": "outermost"}, drop_missing=True)
    assert [p.name for p in lenient.ordered] == ["early", "late", "gone"] and lenient.dropped == {"gone": ["nobody"]}


def test_a_refusal_that_follows_from_another_drops_the_constraint_and_is_found_after_it():
    patches = [declared("follower", "refused"), declared("refused", "outer")]
    lenient = order.settle(patches, {"outer": "outermost"}, drop_missing=True)
    assert [p.name for p in lenient.ordered] == ["follower"] and lenient.dropped == {"follower": ["refused"]}
    strict = order.settle(patches, {"outer": "outermost"})
    assert list(strict.refused) == ["refused", "follower"], "the cause first"
    with pytest.raises(OrderError, match="'refused' .* is declared after 'outer'"):
        Registry([*patches, declared("outer", place="outermost")])  # the cause is what register() raises


def test_a_patch_declared_after_itself_is_refused_by_every_caller():
    with pytest.raises(OrderError, match="cycle: a -> a"):
        stacking_order([declared("a", "a")])
    with pytest.raises(OrderError, match="'a', which is not registered before it"):
        Registry([declared("a", "a")])
    assert order.settle([declared("a", "a")], drop_missing=True).refused["a"].cycle == ("a", "a")


def test_a_place_must_be_one_of_the_three():
    with pytest.raises(ValueError, match="place= must be one of"):
        declared("a", place="first")


def test_a_registry_orders_the_parts_on_a_target_outermost_first(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    patches = [
        on_target(pkg, "late", "middle"),  # given first, but declared after "middle": registered after it
        on_target(pkg, "middle"),
        on_target(pkg, "last", place="innermost"),
        on_target(pkg, "first", place="outermost"),
    ]
    registry = Registry(patches)
    registry.activate()
    assert [name for name, _layer in shim.wrappers(module.f)] == ["first", "late", "middle", "last"]
    assert module.f(1) == ("first", ("late", ("middle", ("last", 1))))
    registry.deactivate()


def test_a_patch_of_your_own_sits_outside_the_ones_registered_before_it_in_its_place(fake_modules):
    pkg = fake_modules(target=TARGET)
    module = importlib.import_module(f"{pkg}.target")
    registry = Registry([on_target(pkg, "builtin-like"), on_target(pkg, "inner", place="innermost")])
    registry.activate()
    registry.register(on_target(pkg, "yours"))
    assert [name for name, _layer in shim.wrappers(module.f)] == ["yours", "builtin-like", "inner"]
    registry.deactivate()


@pytest.mark.parametrize(
    ("after", "place", "message"),
    [
        (("nobody",), "", "'nobody', which is not registered before it"),
        (("outer",), "", "sits outside it: drop one of the two declarations"),
    ],
    ids=["unknown name", "after a patch of an outer place"],
)
def test_register_refuses_an_order_that_cannot_hold_and_changes_nothing(fake_modules, after, place, message):
    pkg = fake_modules(target=TARGET)
    registry = Registry([on_target(pkg, "outer", place="outermost")])
    with pytest.raises(OrderError, match=message):
        registry.register(on_target(pkg, "mine", *after, place=place))
    assert registry.names == ("outer",)


def test_a_packs_after_naming_a_patch_not_installed_is_dropped_at_import_shim_not_the_pack(tmp_path, monkeypatch):
    source = """
from shim import Patch, Target

PATCH = Patch(name=NAME, summary="s", distribution=DIST, requires=">=1.0",
              targets=(Target(TARGET + ":one", lambda w, i, a, k: w(*a, **k)),), after=("no-such-patch",))
"""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_pack(
        tmp_path, {"orderly-one": "{n}.fixes:PATCH"}, source=source, order=["orderly-one.after.no-such-patch"]
    )
    registry = Registry()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packs.load(registry, paths=[str(tmp_path)])  # decided here, its module not imported
        assert f"{name}.fixes" not in sys.modules
        registry.activate()
        __import__(f"{name}.target")
        (status,) = registry.status()
    assert [str(w.message) for w in caught if issubclass(w.category, shim.ShimWarning)] == []
    assert status.state == "applied"
    assert "declared after 'no-such-patch', which is not installed: that constraint is dropped" in status.reason
    registry.deactivate()
