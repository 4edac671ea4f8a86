"""What a layer calls when it checkpoints with the shim: :class:`LayerCheckpoint`.

A ``GradientCheckpointingLayer`` calls its checkpoint function as ``function(partial(fn, **kwargs),
*args)`` (``fn`` is ``super().__call__`` up to transformers 5.22, the layer's own ``forward`` with
the layer bound first from 5.23). Where a checkpointing patch's step applies to the function a
layer is given (decided once, when it is given: ``_checkpoint_path.py``), the layer holds a
``LayerCheckpoint``: upstream's ``functools.partial``, same ``func``, ``args`` and ``keywords``, with
the steps marked on it. Per checkpointed call, each marked step acts only while its patch is
applied and switched on, in this order:

1. ``checkpoint-function-finds-layer``: a function of the user's own gets the layer both ways,
   ``func.args[0]`` (as upstream hands it from 5.23) and ``func.func.__self__`` (as up to 5.22);
2. ``reentrant-keyword-grads`` (grad mode): keyword tensors that require grad become checkpoint
   inputs, put back in their places on recomputation;
3. ``reentrant-frozen-input-grads`` (grad mode, no input requires grad, the layer has a
   trainable parameter): one more input, a zero-size tensor that requires grad (an anchor).

Steps 2 and 3 never both act on one call. The recomputation they hand over carries the layer both
ways too, so a function that finds its layer keeps finding it. Any other shape of call goes to the
original function unchanged.
"""

from __future__ import annotations

import copy
import functools
import sys

from shim import record_effect, switch_of

from ._checkpointing import first_trainable, handed
from ._reentrant_fixes import FROZEN, KEYWORDS, anchor, any_grad, bind_torch, lift

FINDS_LAYER = "checkpoint-function-finds-layer"
_partial = functools.partial
_torch = None
_switches = None  # (keywords, frozen, finds-layer) switches, looked up on first use


def _bind():
    global _switches, _torch
    _torch = bind_torch()
    if _switches is None:
        _switches = (switch_of(KEYWORDS), switch_of(FROZEN), switch_of(FINDS_LAYER))
    return _switches


class LayerCheckpoint(_partial):
    """A layer's checkpoint function, as upstream's partial, with the steps marked on it.

    ``keywords_step``, ``frozen_step`` and ``finds_layer_step`` say which steps apply (set when the
    function is given to a layer, never cleared). It pickles as upstream's plain partial (a model
    saved with the shim loads without it) and copies as itself.
    """

    keywords_step = frozen_step = finds_layer_step = False

    def __call__(self, function, *args, **options):
        switches = _switches or _bind()
        if type(function) is _partial:
            if self.finds_layer_step and switches[2].on:
                function = both_ways(function)
            if (self.keywords_step or self.frozen_step) and _torch.is_grad_enabled():
                keywords = function.keywords
                if self.keywords_step and switches[0].on and keywords and any_grad(keywords.values()):
                    layer = layer_of(function)
                    if layer is not None:
                        return lift(self, layer, function, args, options)
                elif self.frozen_step and switches[1].on and not any_grad(args):
                    layer = layer_of(function)
                    trainable = first_trainable(layer) if layer is not None else None
                    if trainable is not None and not any_grad(keywords.values()):
                        return anchor(self, layer, trainable.device, function, args, options)
        if options:
            return self.func(*self.args, function, *args, **{**self.keywords, **options})
        return self.func(*self.args, function, *args, **self.keywords)

    def run(self, *args, **options):
        """The original function: ``func(*partial args, *args, **partial keywords, **options)``."""
        return self.func(*self.args, *args, **{**self.keywords, **options})

    def marked(self, other: LayerCheckpoint) -> LayerCheckpoint:
        """``self`` with ``other``'s steps marked as well."""
        self.keywords_step |= other.keywords_step
        self.frozen_step |= other.frozen_step
        self.finds_layer_step |= other.finds_layer_step
        return self

    def __reduce__(self):
        return _partial, (self.func,), (self.func, self.args, self.keywords or None, None)

    def __copy__(self):
        return LayerCheckpoint(self.func, *self.args, **self.keywords).marked(self)

    def __deepcopy__(self, memo: dict):
        func, args, keywords = copy.deepcopy((self.func, self.args, self.keywords), memo)
        return LayerCheckpoint(func, *args, **keywords).marked(self)


def layer_of(function):
    """The ``GradientCheckpointingLayer`` a layer's call handed over: the ``__self__`` of the
    partial's function (``partial(super().__call__)``, :class:`LayerMethod`) or bound first in it
    (``partial(forward, layer, ...)``)."""
    layers = sys.modules.get("transformers.modeling_layers")
    if layers is None:
        return None
    owner = getattr(function.func, "__self__", None)
    if owner is None and function.args:
        owner = function.args[0]
    return owner if isinstance(owner, layers.GradientCheckpointingLayer) else None


def both_ways(function):
    """``partial(forward, layer, **kwargs)`` (transformers >= 5.23) as :func:`handed`: the layer is
    ``func.args[0]`` as upstream hands it and ``func.func.__self__`` as up to 5.22."""
    if not function.args or hasattr(function.func, "__self__"):
        return function
    layer = layer_of(function)
    if layer is None:
        return function
    record_effect(
        FINDS_LAYER,
        "handed %s's checkpoint function the layer as func.func.__self__ (as up to transformers 5.22) "
        "besides func.args[0]",
        type(layer).__name__,
    )
    return handed(function.func, layer, *function.args[1:], **function.keywords)
