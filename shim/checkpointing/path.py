"""The checkpointing path: the one way a layer gets its checkpoint function, and the steps that
act there. It names no patch: a patch with a part in it, built-in or a pack's, declares a
:class:`Step` in its own module and takes the path's two targets with :func:`targets`; the
engine's one layer on each target runs the parts of every such patch in the catalogue's one order
(``shim.order``), as on any target.

However a ``GradientCheckpointingLayer`` is given its function, it ends up assigned to
``layer._gradient_checkpointing_func`` (``_set_gradient_checkpointing`` at every enable and disable,
``checkpointing-restore`` putting a configuration back, a training script writing it directly) or
arrives with the layer (unpickled, ``torch.load``-ed, copied). Two targets see all of it:

- the assignment of that attribute (:data:`SLOT`, an assign target): the function passes through
  each step's part, outermost first; a part whose step applies to the function adds its step to a
  ``LayerCheckpoint`` of it (``shim.checkpointing.function``), so the layer holds one object whose
  steps act on each call in the parts' order; where no step applies it holds the function itself,
  and a read returns what is stored, as without the shim. A step that asks to be told
  (``Step.given``) is told each time a layer is given a function. A mock (``unittest.mock``) is
  stored as it is: a test that patches the attribute sees its own object.
- ``GradientCheckpointingLayer.__setstate__`` (:data:`SETSTATE`): a layer unpickled or copied is
  given its function again, so a model saved before (which holds only upstream's objects) gets its
  steps too.

Whether a step applies to a function is decided once per function object, for every layer given
it: an enable hands one function to every layer, and they all get the same ``LayerCheckpoint``, as
upstream's share one partial. A step acts only while its patch is on; one switched on after a layer
was given its function acts once the layer is given one again.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shim import switch_of
from shim.patch import Assigned, Target  # shim.Target itself, which the front door imports lazily

from .function import Act, LayerCheckpoint, layer_checkpoint, layer_of

if TYPE_CHECKING:
    from shim.runtime import Switch

ATTRIBUTE = "_gradient_checkpointing_func"
_DECIDED = 64  # a part's remembered decisions, before the dead ones are dropped
SLOT = f"transformers.modeling_layers:GradientCheckpointingLayer.{ATTRIBUTE}"
SETSTATE = "transformers.modeling_layers:GradientCheckpointingLayer.__setstate__"
_MISSING = object()

#: id(value) -> (a weak reference to it, to what it becomes, or None: itself)
_Decided = dict[int, tuple[weakref.ref[Any], Any]]


@dataclass(frozen=True)
class Step:
    """One patch's part in the checkpointing path, declared in the patch's own module.

    ``name``: the patch, whose switch says whether the step acts and whose place in the catalogue's
    order (``Patch.after``, ``Patch.place``) says when: on a call, the steps act outermost first.
    ``applies(function)``: whether the step acts on the calls of a layer given ``function``.
    ``act(layer, function, args)``: per checkpointed call of such a layer (``function`` the
    partial the layer hands over, ``args`` the checkpoint's inputs), ``None`` to leave the call
    as it is, or the ``(function, args)`` to hand the checkpoint instead; the next step sees them.
    ``given(layer, function)``: told each time a layer is given a callable; returns it. A step that
    has no ``act`` is its ``given`` on the slot (one call per layer and assignment, nothing more).
    A step has an ``act`` (with its ``applies``), a ``given``, or both.
    """

    name: str
    applies: Callable[[Any], bool] | None = None
    act: Act | None = None
    given: Callable[[Any, Any], Any] | None = None


def targets(step: Step, probe: Callable[[Any], str | None] | None = None) -> tuple[Target, Target]:
    """The path's two targets with ``step``'s parts, for its patch's ``targets``."""
    return Target(SLOT, _part(step), probe=probe, assign=True), Target(SETSTATE, _given_again)


def _part(step: Step) -> Assigned:
    """``step``'s part on the slot: what a layer holds when it is given ``value``. It runs for every
    layer at every enable and disable, so the usual case (the function the first layer was given)
    is one lookup: what ``value`` becomes with the step is decided once per object, remembered
    while it lives."""
    told, act, applies = step.given, step.act, step.applies
    if act is None:
        if told is None:
            raise TypeError(f"step {step.name!r}: a Step has an act, a given, or both")
        return told
    if applies is None:
        raise TypeError(f"step {step.name!r}: a Step with an act needs applies(function)")
    # id(value) -> (a weak reference to it, to what it becomes, or None: itself); an entry whose value
    # is gone is dropped later, and never matches another object at that address
    decided: _Decided = {}
    # the patch's switch, found at the first decision (a part is made before its patch registers)
    switch: list[Switch] = []

    def given(layer: Any, value: Any) -> Any:
        if told is not None:
            told(layer, value)
        found = decided.get(id(value))
        if found is not None and found[0]() is value:
            if found[1] is None:
                return value
            made = found[1]()
            if made is not None:
                return made
        if not switch:
            switch.append(switch_of(step.name))
        return _decide(step.name, applies, act, switch[0], value, decided)

    return given


def _decide(name: str, applies: Callable[[Any], bool], act: Act, switch: Switch, value: Any, decided: _Decided) -> Any:
    """``value`` with the step of patch ``name``: a ``LayerCheckpoint`` of the function it is (or
    stands for) whose steps end with ``act``, or ``value`` itself where the step does not apply or
    holds it already (a layer given what another layer holds); remembered in ``decided`` while
    ``value`` lives."""
    if type(value) is LayerCheckpoint:
        function, steps, names = value.given, value.steps, value.names
        applies_here = all(acts is not act for _switch, acts in steps) and applies(function)
    else:
        function, steps, names = value, (), ()
        applies_here = callable(value) and not _is_mock(value) and applies(function)
    made = layer_checkpoint(function, (*steps, (switch, act)), (*names, name), value) if applies_here else value
    try:
        reference = weakref.ref(value)
    except TypeError:  # an object without weak references is decided again at each assignment
        return made
    if len(decided) >= _DECIDED:  # each enable hands the layers a new function: forget the dead ones
        for key in [key for key, (ref, _made) in decided.items() if ref() is None]:
            del decided[key]
    key = id(value)
    if not applies_here:
        decided[key] = (reference, None)
    elif type(function) is not functools.partial and _module_level(function):
        # A module's own function (torch's checkpoint, which every disable hands the layers) holds no
        # model: what it becomes is kept, not made again at every disable.
        decided[key] = (reference, lambda: made)
    else:
        decided[key] = (reference, weakref.ref(made))
    return made


def _module_level(function: Any) -> bool:
    """Whether ``function`` is what its module holds under its name (it lives as long as the module)."""
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    return module is not None and getattr(module, getattr(function, "__name__", ""), None) is function


def in_effect(name: str, what: str) -> Callable[[Any], list[str]]:
    """``Patch.in_effect`` of patch ``name``'s step: on how many of a model's layers, and which
    kinds, it acts (``what`` it does), counting those whose checkpointing is on."""

    def on(model: Any) -> list[str]:
        layers = [m for m in model.modules() if name in getattr(m.__dict__.get(ATTRIBUTE), "names", ())]
        if not layers:
            return []
        kinds = ", ".join(sorted({type(layer).__name__ for layer in layers}))
        on = sum(1 for layer in layers if getattr(layer, "gradient_checkpointing", False))
        return [f"acts on the calls of {len(layers)} {kinds} layer(s), {on} checkpointing now: {what}"]

    return on


def _is_mock(value: Any) -> bool:
    mock = sys.modules.get("unittest.mock")
    return mock is not None and isinstance(value, mock.NonCallableMock)


def _given_again(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``__setstate__`` wrapper: the function the layer comes with goes through the slot again."""
    result = wrapped(*args, **kwargs)
    function = instance.__dict__.get(ATTRIBUTE, _MISSING) if instance is not None else _MISSING
    if function is not _MISSING:
        setattr(instance, ATTRIBUTE, function)
    return result


# -- the call shape the steps need, checked when transformers.modeling_layers is imported -----------


_probed: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()  # class -> what probe() found


def probe(layer_class: Any) -> str | None:
    """A layer must call ``_gradient_checkpointing_func(partial(fn, **kwargs), *args)`` with itself
    findable by :func:`shim.checkpointing.layer_of`. The patches with a step share the answer (one
    probe per class, not one per patch)."""
    if layer_class not in _probed:
        _probed[layer_class] = _call_shape_problem(layer_class)
    return _probed[layer_class]


def _call_shape_problem(layer_class: Any) -> str | None:
    """Runs on CPU float32 with grad on, whatever the import happened in (a ``torch.device("meta")``
    block, a default dtype, no_grad, inference mode)."""
    import torch

    class _ProbeLayer(layer_class):  # type: ignore[misc]  # a GradientCheckpointingLayer, which mypy does not follow
        def forward(self, first: Any, second: Any = None) -> Any:
            return first + second

    seen: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def record(function: Any, *args: Any, **options: Any) -> Any:
        seen.append((function, args, options))
        return function(*args)

    with torch.device("cpu"), torch.inference_mode(False), torch.enable_grad():
        layer = _ProbeLayer()
        layer.train()
        layer.gradient_checkpointing = True
        layer.__dict__[ATTRIBUTE] = record  # past the slot: no step may act on the probe
        first = torch.zeros(1, dtype=torch.float32, device="cpu")
        second = torch.ones(1, dtype=torch.float32, device="cpu")
        result = layer(first, second=second)
    if len(seen) != 1:
        return f"GradientCheckpointingLayer called _gradient_checkpointing_func {len(seen)} times, not once"
    function, args, options = seen[0]
    if type(function) is not functools.partial or function.keywords.get("second") is not second:
        return "GradientCheckpointingLayer no longer hands keyword arguments over in a functools.partial"
    if len(args) != 1 or args[0] is not first or options:
        return "GradientCheckpointingLayer no longer hands positional arguments over as *args"
    if layer_of(function) is not layer:
        return "GradientCheckpointingLayer no longer hands itself over in the partial"
    if not torch.equal(result, first + second):
        return "GradientCheckpointingLayer's checkpoint function result is not the layer's output"
    return None
