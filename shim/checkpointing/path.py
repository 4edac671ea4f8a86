"""The checkpointing path: the one way a layer gets its checkpoint function, and the steps that
act there. It names no patch: a patch with a part in it, built-in or a pack's, declares a
:class:`Step` in its own module and takes the path's two targets with :func:`targets`; the
engine's one layer on each target runs the parts of every such patch in the catalogue's one order
(``shim.order``), as on any target. A step has no name of its own: the engine hands its part the
name and switch of the patch whose targets hold it, as the part joins the slot's layer.

However a ``GradientCheckpointingLayer`` is given its function, it ends up assigned to
``layer._gradient_checkpointing_func`` (``_set_gradient_checkpointing`` at every enable and disable,
``checkpointing-restore`` putting a configuration back, a training script writing it directly) or
arrives with the layer (unpickled, ``torch.load``-ed, copied). Two targets see all of it:

- the assignment of that attribute (:data:`SLOT`, an assign target): the function passes through
  each step's part, outermost first; a part whose step applies to the function adds its step to a
  ``LayerCheckpoint`` of it (``shim.checkpointing.function``), so the layer holds one object whose
  steps act on each call in the parts' order; where no step applies it holds the function itself,
  and a read returns what is stored, as without the shim. A step that asks to be told
  (``Step.given``) is told when a layer is given a function.
- ``GradientCheckpointingLayer.__setstate__`` (:data:`SETSTATE`): a layer unpickled or copied is
  given its function again, so a model saved before (which holds only upstream's objects) gets its
  steps too.

What the parts make of a function is decided by the first layer given it; the next layers of its
class given it in a row get the same object, from the engine's layer on the slot
(``shim.assigning``), as upstream's share one partial. A step acts only while its patch's switch
(the one the engine runs its part by) is on; one switched on after a layer was given its function
acts once the layer is given one again. A step that raises never reaches the user's code: it is
one ``ShimWarning`` naming its patch (a ``shim.PatchError`` under ``SHIM_STRICT=1``), and the layer
keeps the function it was given.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shim.patch import Assigned, Target  # shim.Target itself, which the front door imports lazily

from .function import Act, LayerCheckpoint, layer_checkpoint, layer_of, step_failed

if TYPE_CHECKING:
    from shim.runtime import Switch

ATTRIBUTE = "_gradient_checkpointing_func"
SLOT = f"transformers.modeling_layers:GradientCheckpointingLayer.{ATTRIBUTE}"
SETSTATE = "transformers.modeling_layers:GradientCheckpointingLayer.__setstate__"
_MISSING = object()


@dataclass(frozen=True, init=False)
class Step:
    """One patch's part in the checkpointing path, declared in the patch's own module and given to
    its ``Patch`` with :func:`targets`. It has no name: it acts for the patch whose targets hold it,
    by that patch's switch, at that patch's place in the catalogue's order (``Patch.after``,
    ``Patch.place``): on a call, the steps act outermost first.

    ``applies(function)``: whether the step acts on the calls of a layer given ``function``.
    ``act(layer, function, args)``: per checkpointed call of such a layer (``function`` the
    partial the layer hands over, ``args`` the checkpoint's inputs), ``None`` to leave the call
    as it is, or the ``(function, args)`` to hand the checkpoint instead; the next step sees them.
    ``given(layer, function)``: told when a layer is given a callable; returns what the layer is to
    hold (``function`` itself to leave it). A step has an ``act`` (with its ``applies``), a
    ``given``, or both; anything else is refused here, when the patch's module is imported.
    """

    applies: Callable[[Any], bool] | None
    act: Act | None
    given: Callable[[Any, Any], Any] | None

    def __init__(
        self,
        *name: object,
        applies: Callable[[Any], bool] | None = None,
        act: Act | None = None,
        given: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        if name:  # the name a step once repeated, which could name another patch than its own
            raise TypeError(
                f"Step({name[0]!r}, ...): a step takes no name; it acts for the patch whose targets hold it "
                "(Patch(name=..., targets=targets(STEP))): write Step(applies=..., act=..., given=...)"
            )
        for what, value in (("applies", applies), ("act", act), ("given", given)):
            if value is not None and not callable(value):
                raise TypeError(f"Step: {what} must be a callable or None, not {type(value).__name__}")
            object.__setattr__(self, what, value)
        if act is None and given is None:
            raise TypeError("Step: a step has an act, a given, or both")
        if act is not None and applies is None:
            raise TypeError("Step: a step with an act needs applies(function)")


def targets(
    step: Step, check: Callable[[Any], str | None] | None = None, *, probe: Callable[[Any], str | None] | None = None
) -> tuple[Target, Target]:
    """The path's two targets with ``step``'s parts, for its patch's ``targets``; ``check``: the slot's
    shape check (``probe=``, its old name, still taken)."""
    if not isinstance(step, Step):
        raise TypeError(f"targets() takes a shim.checkpointing.Step, not {type(step).__name__}")
    slot = Target(SLOT, functools.partial(_part, step), check=check, assign=True, probe=probe)
    return slot, Target(SETSTATE, _given_again)


def _part(step: Step, name: str, switch: Switch) -> Assigned:
    """``step``'s part on the slot, made by the engine as patch ``name``'s part joins the slot's
    layer, with the switch that part answers to: what a layer holds when it is given ``value``."""
    told, act, applies = step.given, step.act, step.applies

    def given(layer: Any, value: Any) -> Any:
        try:
            held = value if told is None else told(layer, value)
            if act is None or applies is None:
                return held
            return _decide(name, applies, act, switch, held)
        except Exception as error:  # a step's fault never reaches the user's enable
            step_failed(name, "as a layer was given its checkpoint function", error)
            return value

    return given


def _decide(name: str, applies: Callable[[Any], bool], act: Act, switch: Switch, value: Any) -> Any:
    """``value`` with the step of patch ``name``: a ``LayerCheckpoint`` of the function it is (or
    stands for) whose steps end with ``act``, or ``value`` itself where the step does not apply or
    holds it already (a layer given what another layer holds)."""
    if type(value) is LayerCheckpoint:
        function, steps, names = value.given, value.steps, value.names
        applies_here = all(acts is not act for _switch, acts in steps) and applies(function)
    else:
        function, steps, names = value, (), ()
        applies_here = callable(value) and not _is_mock(value) and applies(function)
    return layer_checkpoint(function, (*steps, (switch, act)), (*names, name)) if applies_here else value


def in_effect(step: Step, what: str) -> Callable[[Any], list[str]]:
    """``Patch.in_effect`` of the patch with ``step``: on how many of a model's layers, and which
    kinds, the step acts (``what`` it does), counting those whose checkpointing is on."""
    act = step.act
    if act is None:
        raise TypeError("in_effect(step, ...) counts where a step acts: this step has no act")

    def acts_on(layer: Any) -> bool:
        held = layer.__dict__.get(ATTRIBUTE)
        return type(held) is LayerCheckpoint and any(acts is act for _switch, acts in held.steps)

    def on(model: Any) -> list[str]:
        layers = [m for m in model.modules() if acts_on(m)]
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


_checked: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()  # class -> what check() found


def check(layer_class: Any) -> str | None:
    """The slot's shape check: a layer must call ``_gradient_checkpointing_func(partial(fn, **kwargs),
    *args)`` with itself findable by :func:`shim.checkpointing.layer_of`. The patches with a step share
    the answer (one check per class, not one per patch)."""
    if layer_class not in _checked:
        _checked[layer_class] = _call_shape_problem(layer_class)
    return _checked[layer_class]


probe = check  # its old name, for packs written before the shape check was named apart from the bug probe


def _call_shape_problem(layer_class: Any) -> str | None:
    """Runs on CPU float32 with grad on, whatever the import happened in (a ``torch.device("meta")``
    block, a default dtype, no_grad, inference mode)."""
    import torch

    class _CheckedLayer(layer_class):  # type: ignore[misc]  # a GradientCheckpointingLayer, which mypy does not follow
        def forward(self, first: Any, second: Any = None) -> Any:
            return first + second

    seen: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def record(function: Any, *args: Any, **options: Any) -> Any:
        seen.append((function, args, options))
        return function(*args)

    with torch.device("cpu"), torch.inference_mode(False), torch.enable_grad():
        layer = _CheckedLayer()
        layer.train()
        layer.gradient_checkpointing = True
        layer.__dict__[ATTRIBUTE] = record  # past the slot: no step may act on the check
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
