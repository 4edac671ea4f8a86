"""The checkpointing path: the one way a layer gets its checkpoint function, and the steps that
act there. It names no patch: a patch with a part in it declares a :class:`Step` in its own module
and takes the path's two targets with :func:`targets`.

However a ``GradientCheckpointingLayer`` is given its function, it ends up assigned to
``layer._gradient_checkpointing_func`` (``_set_gradient_checkpointing`` at every enable and disable,
``checkpointing-restore`` putting a configuration back, a training script writing it directly) or
arrives with the layer (unpickled, ``torch.load``-ed, copied). Two targets see all of it, each one
layer shared by every patch with a step (``Target(..., shared=True)``):

- the assignment of that attribute (:data:`SLOT`, an assign target): the layer holds a
  ``LayerCheckpoint`` (``_checkpoint_function.py``) of the function where a step applies to it,
  else the function itself; a read returns what is stored, as without the shim. A step that asks
  to be told (``Step.given``) is told each time a layer is given a function. A mock
  (``unittest.mock``) is stored as it is: a test that patches the attribute sees its own object.
- ``GradientCheckpointingLayer.__setstate__`` (:data:`SETSTATE`): a layer unpickled or copied is
  given its function again, so a model saved before (which holds only upstream's objects) gets its
  steps too.

Which steps apply to a function is decided once per function object and state of the path (the
steps declared, their switches), for every layer given it: an enable hands one function to every
layer, and they all get the same ``LayerCheckpoint``, as upstream's share one partial. A step acts
only while its patch is on; one switched on after a layer was given its function acts once the
layer is given one again.
"""

from __future__ import annotations

import functools
import graphlib
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


@dataclass(frozen=True)
class Step:
    """One patch's part in the checkpointing path, declared in the patch's own module.

    ``name``: the patch, whose switch says whether the step acts.
    ``applies(function)``: whether the step acts on the calls of a layer given ``function``.
    ``act(layer, function, args)``: per checkpointed call of such a layer (``function`` the
    partial the layer hands over, ``args`` the checkpoint's inputs), ``None`` to leave the call
    as it is, or the ``(function, args)`` to hand the checkpoint instead; the next step sees them.
    ``given(layer, function)``: told each time a layer is given a callable.
    ``after``: the steps this one runs after, where both act on a call (by patch name).
    """

    name: str
    applies: Callable[[Any], bool] | None = None
    act: Callable[[Any, Any, tuple], tuple | None] | None = None
    given: Callable[[Any, Any], None] | None = None
    after: tuple[str, ...] = ()


class _Path:
    """The declared steps, in order, with their switches; ``generation`` changes whenever what a
    decision depends on does (a step declared, a switch flipped)."""

    def __init__(self) -> None:
        self.steps: dict[str, Step] = {}
        self.generation = 0
        self._ordered: list[tuple[Step, Any]] | None = None
        self._told: list[tuple[Callable[[Any, Any], None], Any]] = []  # (given, switch), in order

    def declare(self, step: Step) -> None:
        self.steps[step.name] = step  # a module imported again declares its step again
        self._ordered = None
        self.generation += 1

    def ordered(self) -> list[tuple[Step, Any]]:
        """``(step, switch)`` in declared order (``after``, else the order of declaration)."""
        if self._ordered is None:
            names = list(self.steps)
            sorter = graphlib.TopologicalSorter(
                {name: [n for n in self.steps[name].after if n in self.steps] for name in names}
            )
            sorter.prepare()
            order: list[str] = []
            while sorter.is_active():
                ready = sorted(sorter.get_ready(), key=names.index)
                order += ready
                sorter.done(*ready)
            ordered = []
            for name in order:
                try:
                    switch = switch_of(name)
                except KeyError:  # a step whose patch is in no registry never acts
                    continue
                switch.watch(self._flipped)
                ordered.append((self.steps[name], switch))
            self._told = [(step.given, switch) for step, switch in ordered if step.given is not None]
            self._ordered = ordered
        return self._ordered

    def told(self) -> list[tuple[Callable[[Any, Any], None], Any]]:
        """``(given, switch)`` of the steps that are told of every function a layer is given."""
        if self._ordered is None:
            self.ordered()
        return self._told

    def _flipped(self, _on: bool) -> None:
        self.generation += 1


_path = _Path()
# id(function) -> a weak reference to the LayerCheckpoint made of it, which a layer holding it keeps
# alive; the entry goes with it. Checked against the function it was made of before it is used.
_made: dict[int, weakref.ref] = {}


def targets(step: Step, probe=None) -> tuple[Target, Target]:
    """Declare ``step`` and return the path's two targets, for its patch's ``targets``."""
    _path.declare(step)
    return (
        Target(SLOT, _given, probe=probe, assign=True, shared=True),
        Target(SETSTATE, _given_again, shared=True),
    )


def _given(layer, function):
    """The slot's wrapper: what ``layer`` holds when it is given ``function``."""
    for given, switch in _path.told():
        if switch.on:
            given(layer, function)
    return checkpoint_for(function)


def checkpoint_for(function):
    """A ``LayerCheckpoint`` of ``function`` with the steps that apply to it, or ``function``
    itself where none does (decided once per function object and generation)."""
    generation = _path.generation
    if type(function) is LayerCheckpoint:
        if function.generation == generation:
            return function
        function = function.given
    key = id(function)
    reference = _made.get(key)
    made = reference() if reference is not None else None
    if made is not None and made.given is function and made.generation == generation:
        return made  # the usual case: the function an enable hands every layer, after the first
    if not callable(function) or _is_mock(function):
        return function
    steps = tuple(
        (switch, step.act)
        for step, switch in _path.ordered()
        if step.act is not None and switch.on and step.applies is not None and step.applies(function)
    )
    if not steps:
        return function
    made = layer_checkpoint(function, steps, generation)
    _made[key] = weakref.ref(made, functools.partial(_forget, key))
    return made


def _forget(key: int, reference: weakref.ref) -> None:
    if _made.get(key) is reference:  # not a newer object made for a function now at that address
        del _made[key]


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
