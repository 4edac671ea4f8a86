"""The one path by which a layer gets its checkpoint function, and where the checkpointing steps
are decided.

However a ``GradientCheckpointingLayer`` is given its function, it ends up assigned to
``layer._gradient_checkpointing_func``: by ``_set_gradient_checkpointing`` (every enable and disable),
by ``checkpointing-restore`` putting a configuration back, by a training script that writes it
directly. Each patch with a step (``_checkpoint_function.py``) declares the same two targets:

- the assignment of that attribute (``SLOT``, an assign target): when a function is assigned and the
  step applies to it, the layer receives it as a ``LayerCheckpoint`` with the step marked; a read
  returns what is stored, as without the shim;
- ``GradientCheckpointingLayer.__setstate__`` (``SETSTATE``): a layer unpickled, ``torch.load``-ed or
  copied hands its function to the slot again, so a model saved before gets every step too.

The layers of the patches stack on the slot in their declared order (``Patch.after``); each adds
its step once. Per call, ``LayerCheckpoint`` runs the marked steps in one fixed order.
"""

from __future__ import annotations

import functools
import weakref

from shim import Target

from ._checkpoint_function import LayerCheckpoint, layer_of
from ._checkpointing import MISSING, is_reentrant
from ._reentrant_fixes import bind_torch

NAME = "_gradient_checkpointing_func"
SLOT = f"transformers.modeling_layers:GradientCheckpointingLayer.{NAME}"
SETSTATE = "transformers.modeling_layers:GradientCheckpointingLayer.__setstate__"
STEPS = ("checkpoint-function-finds-layer", "reentrant-keyword-grads", "reentrant-frozen-input-grads")
_partial = functools.partial
_marks = {  # step -> the LayerCheckpoint attribute that marks it
    "checkpoint-function-finds-layer": "finds_layer_step",
    "reentrant-keyword-grads": "keywords_step",
    "reentrant-frozen-input-grads": "frozen_step",
}


def targets(assigned, probe=None) -> tuple[Target, Target]:
    """The two targets of a patch acting on layers' checkpoint functions: ``assigned(layer,
    function)`` is given each function assigned to a layer and returns the one the layer gets."""
    return (Target(SLOT, assigned, probe=probe, assign=True), Target(SETSTATE, given_again))


def given_again(wrapped, instance, args, kwargs):
    """``__setstate__`` wrapper: the function the layer comes with goes through the slot again."""
    result = wrapped(*args, **kwargs)
    function = instance.__dict__.get(NAME, MISSING) if instance is not None else MISSING
    if function is not MISSING:
        setattr(instance, NAME, function)
    return result


def step(name: str):
    """The slot wrapper of patch ``name``: marks its step on the function a layer is given, where
    the step can act on it."""
    mark = _marks[name]
    applies = _is_own if name == "checkpoint-function-finds-layer" else is_reentrant

    def assigned(layer, function):
        if type(function) is LayerCheckpoint:
            if not getattr(function, mark) and applies(function):
                setattr(function, mark, True)
        elif callable(function) and applies(function):
            function = _as_layer_checkpoint(function)
            setattr(function, mark, True)
        return function

    return assigned


# The last function made a LayerCheckpoint, and the one made of it: an enable hands one function
# to every layer, so they all get the same object, as upstream's layers share one partial. Weak, so
# that it keeps no model alive (a context_fn bound to a model).
_last: tuple = (lambda: None, lambda: None)


def _as_layer_checkpoint(function):
    global _last
    if isinstance(function, LayerCheckpoint):
        return function
    given, made = _last[0](), _last[1]()
    if given is function and made is not None:
        return made
    if type(function) is _partial:
        made = LayerCheckpoint(function.func, *function.args, **function.keywords)
    else:
        made = LayerCheckpoint(function)
    try:
        _last = (weakref.ref(function), weakref.ref(made))
    except TypeError:  # a function without weak references: not shared
        pass
    return made


def _is_own(function) -> bool:
    """Whether ``function`` is not torch's checkpoint nor transformers' offload closure around it
    (under any partials): a function of the user's own, which may look for its layer."""
    checkpoint = bind_torch().utils.checkpoint.checkpoint
    while isinstance(function, _partial):  # the usual case: transformers' partial of torch's checkpoint
        function = function.func
    if function is checkpoint:
        return False
    return not (
        getattr(function, "__module__", None) == "transformers.modeling_utils"
        and getattr(function, "__name__", None) == "checkpoint_func"
    )


# -- the call shape the steps need, checked when transformers.modeling_layers is imported -----------


_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> what probe() found


def probe(layer_class) -> str | None:
    """A layer must call ``_gradient_checkpointing_func(partial(fn, **kwargs), *args)`` with itself
    findable by ``_checkpoint_function.layer_of``. The patches that share the path share the
    answer (one probe per class, not one per patch)."""
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
        layer.__dict__[NAME] = record  # past the slot: no step of ours may act on the probe
        first = torch.zeros(1, dtype=torch.float32, device="cpu")
        second = torch.ones(1, dtype=torch.float32, device="cpu")
        result = layer(first, second=second)
    if len(seen) != 1:
        return f"GradientCheckpointingLayer called _gradient_checkpointing_func {len(seen)} times, not once"
    function, args, options = seen[0]
    if type(function) is not _partial or function.keywords.get("second") is not second:
        return "GradientCheckpointingLayer no longer hands keyword arguments over in a functools.partial"
    if len(args) != 1 or args[0] is not first or options:
        return "GradientCheckpointingLayer no longer hands positional arguments over as *args"
    if layer_of(function) is not layer:
        return "GradientCheckpointingLayer no longer hands itself over in the partial"
    if not torch.equal(result, first + second):
        return "GradientCheckpointingLayer's checkpoint function result is not the layer's output"
    return None
