"""The checkpointing path: the one way a layer gets its checkpoint function, and the steps that
act there. It names no patch: a patch with a part in it declares a :class:`Step` in its own module
and takes the path's two targets with :func:`targets`; the engine's one layer on each target runs
the parts of every such patch in the catalogue's one order (``shim.order``), as on any target.

However a ``GradientCheckpointingLayer`` is given its function, it ends up assigned to
``layer._gradient_checkpointing_func`` (``_set_gradient_checkpointing`` at every enable and disable,
``checkpointing-restore`` putting a configuration back, a training script writing it directly) or
arrives with the layer (unpickled, ``torch.load``-ed, copied). Two targets see all of it:

- the assignment of that attribute (:data:`SLOT`, an assign target): the function passes through
  each step's part, outermost first; a part whose step applies to the function adds its step to a
  ``LayerCheckpoint`` of it (``_checkpoint_function.py``), so the layer holds one object whose steps
  act on each call in the parts' order; where no step applies it holds the function itself, and a
  read returns what is stored, as without the shim. A step that asks to be told (``Step.given``) is
  told each time a layer is given a function. A mock (``unittest.mock``) is stored as it is: a test
  that patches the attribute sees its own object.
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
from typing import Any

from shim import Target, switch_of

from ._checkpoint_function import LayerCheckpoint, layer_checkpoint, layer_of

ATTRIBUTE = "_gradient_checkpointing_func"
SLOT = f"transformers.modeling_layers:GradientCheckpointingLayer.{ATTRIBUTE}"
SETSTATE = "transformers.modeling_layers:GradientCheckpointingLayer.__setstate__"
_MISSING = object()
_APPLIES_NOT = object()  # a decision: the step does not apply to that function


@dataclass(frozen=True)
class Step:
    """One patch's part in the checkpointing path, declared in the patch's own module.

    ``name``: the patch, whose switch says whether the step acts and whose place in the catalogue's
    order (``Patch.after``, ``Patch.place``) says when: on a call, the steps act outermost first.
    ``applies(function)``: whether the step acts on the calls of a layer given ``function``.
    ``act(layer, function, args)``: per checkpointed call of such a layer (``function`` the
    partial the layer hands over, ``args`` the checkpoint's inputs), ``None`` to leave the call
    as it is, or the ``(function, args)`` to hand the checkpoint instead; the next step sees them.
    ``given(layer, function)``: told each time a layer is given a callable.
    """

    name: str
    applies: Callable[[Any], bool] | None = None
    act: Callable[[Any, Any, tuple], tuple | None] | None = None
    given: Callable[[Any, Any], None] | None = None


def targets(step: Step, probe=None) -> tuple[Target, Target]:
    """The path's two targets with ``step``'s parts, for its patch's ``targets``."""
    return Target(SLOT, _part(step), probe=probe, assign=True), Target(SETSTATE, _given_again)


def _part(step: Step):
    """``step``'s part on the slot: what a layer holds when it is given ``value``."""
    switch = []  # the patch's switch, found at the first assignment (the part exists before its patch is registered)

    def given(layer, value):
        if step.given is not None:
            step.given(layer, value)
        if step.act is None:
            return value
        if not switch:
            switch.append(switch_of(step.name))
        return with_step(value, step, switch[0])

    given.__qualname__ = given.__name__ = f"given_{step.name.replace('-', '_')}"
    return given


# (id(value), step name) -> (a weak reference to value, a weak reference to what value becomes with the
# step, or _APPLIES_NOT): found again only for the same object; an entry goes with its value.
_decided: dict[tuple[int, str], tuple[weakref.ref, Any]] = {}


def with_step(value, step: Step, switch):
    """``value`` with ``step``: a ``LayerCheckpoint`` of the function it is (or it stands for) whose
    steps end with ``step``, or ``value`` itself where the step does not apply or is there already."""
    if type(value) is LayerCheckpoint:
        if any(act is step.act for _switch, act in value.steps):
            return value  # a layer given what another layer holds, or given its function again
        function, steps = value.given, value.steps
    elif callable(value) and not _is_mock(value):
        function, steps = value, ()
    else:
        return value
    key = (id(value), step.name)
    found = _decided.get(key)
    if found is not None and found[0]() is value:
        if found[1] is _APPLIES_NOT:
            return value
        made = found[1]()
        if made is not None:
            return made  # the usual case: the function an enable hands every layer, after the first
    applies = step.applies(function)
    made = layer_checkpoint(function, (*steps, (switch, step.act)), value) if applies else value
    try:
        reference = weakref.ref(value, functools.partial(_forget, key))
    except TypeError:  # an object without weak references is decided again at each assignment
        return made
    _decided[key] = (reference, weakref.ref(made) if applies else _APPLIES_NOT)
    return made


def _forget(key, reference: weakref.ref) -> None:
    found = _decided.get(key)
    if found is not None and found[0] is reference:  # not a newer entry for an object now at that address
        del _decided[key]


def _is_mock(value) -> bool:
    mock = sys.modules.get("unittest.mock")
    return mock is not None and isinstance(value, mock.NonCallableMock)


def _given_again(wrapped, instance, args, kwargs):
    """``__setstate__`` wrapper: the function the layer comes with goes through the slot again."""
    result = wrapped(*args, **kwargs)
    function = instance.__dict__.get(ATTRIBUTE, _MISSING) if instance is not None else _MISSING
    if function is not _MISSING:
        setattr(instance, ATTRIBUTE, function)
    return result


# -- the call shape the steps need, checked when transformers.modeling_layers is imported -----------


_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> what probe() found


def probe(layer_class) -> str | None:
    """A layer must call ``_gradient_checkpointing_func(partial(fn, **kwargs), *args)`` with itself
    findable by ``_checkpoint_function.layer_of``. The patches with a step share the answer (one
    probe per class, not one per patch)."""
    if layer_class not in _probed:
        _probed[layer_class] = _call_shape_problem(layer_class)
    return _probed[layer_class]


def _call_shape_problem(layer_class) -> str | None:
    """Runs on CPU float32 with grad on, whatever the import happened in (a ``torch.device("meta")``
    block, a default dtype, no_grad, inference mode)."""
    import torch

    class _ProbeLayer(layer_class):
        def forward(self, first, second=None):
            return first + second

    seen = []

    def record(function, *args, **options):
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
