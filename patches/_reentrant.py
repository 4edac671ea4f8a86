"""What the reentrant-checkpointing patches share on ``GradientCheckpointingLayer.__call__``.

``reentrant-keyword-grads`` and ``reentrant-frozen-input-grads`` wrap the same method and stack
there, each with its own switch. Each asks one question of a call (does a keyword tensor require
grad? does no input at all?), and the two never both say yes to the same call. The rest is decided
here, once, for both:

- :func:`reentrant_function`: the layer's checkpoint function, if the layer is set up to
  checkpoint it reentrantly (the rule of :func:`._checkpointing.is_reentrant`);
- :func:`divert`: run the layer's own call with that function swapped, for this call only, for a
  :class:`StandIn` that changes what reaches ``torch.utils.checkpoint``;
- :func:`probe`: the shape both rely on, ``_gradient_checkpointing_func(partial(fn, **kwargs), *args)``.

Nothing here imports torch at import time: :func:`torch_module` binds it on first use.
"""

from __future__ import annotations

import functools
import sys

from ._checkpointing import is_reentrant

ATTRIBUTE = "_gradient_checkpointing_func"
_torch = None


def torch_module():
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


def wants_grad(value) -> bool:
    """Whether ``value`` holds a tensor that requires grad, in tuples, lists and dicts."""
    if isinstance(value, _torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(wants_grad(item) for item in value)
    if type(value) is dict:
        return any(wants_grad(item) for item in value.values())
    return False


class StandIn:
    """A layer's checkpoint function for the length of one diverted call.

    ``original`` is the layer's own function; ``layer`` its class name, for the effects ledger.
    """

    __slots__ = ("original", "layer")

    def __init__(self, original, layer: str) -> None:
        self.original = original
        self.layer = layer


def reentrant_function(instance):
    """The layer's checkpoint function if it is reentrant, else ``None`` (also when it has none:
    upstream then raises its own error)."""
    function = instance.__dict__.get(ATTRIBUTE, None)
    if function is None:
        function = getattr(instance, ATTRIBUTE, None)
    if isinstance(function, StandIn):  # another thread's diverted call on this very layer
        function = function.original
    if function is None or not is_reentrant(function):
        return None
    return function


def divert(wrapped, instance, stand_in: StandIn, args, kwargs):
    """Run the layer's call with its checkpoint function swapped for ``stand_in``."""
    state = instance.__dict__
    own = ATTRIBUTE in state
    state[ATTRIBUTE] = stand_in
    try:
        return wrapped(*args, **kwargs)
    finally:
        if state.get(ATTRIBUTE) is stand_in:  # undone by identity: only our own swap
            if own:
                state[ATTRIBUTE] = stand_in.original
            else:
                del state[ATTRIBUTE]


def probe():
    """The layer must call ``_gradient_checkpointing_func(partial(fn, **kwargs), *args)``."""
    torch = torch_module()
    layers = sys.modules["transformers.modeling_layers"]

    class _ProbeLayer(layers.GradientCheckpointingLayer):
        def forward(self, first, second=None):
            return first + second

    seen = []

    def record(function, *args, **options):
        seen.append((function, args, options))
        return function(*args)

    # Whatever the import happened in (a ``torch.device("meta")`` block for big-model init, a
    # changed default dtype, no_grad or inference mode), the probe runs on CPU float32 with grad on.
    with torch.device("cpu"), torch.inference_mode(False), torch.enable_grad():
        layer = _ProbeLayer()
        layer.train()
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = record
        first = torch.zeros(1, dtype=torch.float32, device="cpu")
        second = torch.ones(1, dtype=torch.float32, device="cpu")
        result = layer(first, second=second)
    if len(seen) != 1:
        return f"GradientCheckpointingLayer called _gradient_checkpointing_func {len(seen)} times, not once"
    function, args, options = seen[0]
    if not isinstance(function, functools.partial) or function.keywords.get("second") is not second:
        return "GradientCheckpointingLayer no longer hands keyword arguments over in a functools.partial"
    if len(args) != 1 or args[0] is not first or options:
        return "GradientCheckpointingLayer no longer hands positional arguments over as *args"
    if not torch.equal(result, first + second):
        return "GradientCheckpointingLayer's checkpoint function result is not the layer's output"
    return None
