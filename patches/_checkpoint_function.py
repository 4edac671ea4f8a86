"""The checkpoint function the shim hands to layers, and what it does on each checkpointed call.

Three patches act where their bugs are, on the function transformers gives a
``GradientCheckpointingLayer`` when checkpointing is enabled, never on the layer's call. Each wraps
``PreTrainedModel._set_gradient_checkpointing`` with :func:`install`: a function that one of them
may need to act on (reentrant: ``_checkpointing.is_reentrant``; or not torch's and transformers'
own) reaches the layers as a :class:`LayerCheckpoint`. That is a ``functools.partial`` with the
same ``func``, ``args`` and ``keywords``, so code that reads or compares the function sees
upstream's; any other function, and every layer call that does not checkpoint, runs no code here.

A layer calls it as ``function(partial(fn, **kwargs), *args)`` (``fn`` is ``super().__call__`` up
to transformers 5.22, the layer's own ``forward`` with the layer bound first from 5.23). Per call,
each patch only while it is applied and switched on:

- ``checkpoint-function-finds-layer``: a function of the user's own gets ``fn`` as a method bound
  to the layer again (``func.func.__self__``), as up to 5.22;
- ``reentrant-keyword-grads`` (grad mode, reentrant): keyword tensors that require grad become
  checkpoint inputs, put back in their places on recomputation;
- ``reentrant-frozen-input-grads`` (grad mode, reentrant, no input requires grad, the layer has a
  trainable parameter): one more input, a zero-size tensor that requires grad (an anchor), gives
  the output a ``grad_fn``.

The recomputation these hand over is a method bound to the layer too, so a function that finds its
layer keeps finding it. Any other shape of call goes to the original function unchanged.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import types

from shim import record_effect, switch_of

from ._arguments import argument
from ._checkpointing import first_trainable, is_reentrant
from ._reentrant_fixes import FROZEN, KEYWORDS, anchor, any_grad, lift
from ._reentrant_fixes import bind_torch as _reentrant_fixes_bind

FINDS_LAYER = "checkpoint-function-finds-layer"
_partial = functools.partial
_torch = None
_switches = None  # the three patches' switches, looked up on first use


def _bind():
    global _switches
    _bind_torch()
    _reentrant_fixes_bind()
    if _switches is None:
        _switches = (switch_of(KEYWORDS), switch_of(FROZEN), switch_of(FINDS_LAYER))
    return _switches


def _bind_torch():
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


class LayerCheckpoint(_partial):
    """A layer's checkpoint function, as upstream's partial, with the patches' steps per call.

    ``reentrant`` and ``own`` (a function that is not torch's or transformers') say which steps can
    apply. It pickles as upstream's plain partial (a model saved with the shim loads without it)
    and copies as itself.
    """

    def __call__(self, function, *args, **options):
        switches = _switches or _bind()
        if type(function) is _partial:
            if self.own and switches[2].on:
                function = bound_to_layer(function)
            if self.reentrant and (switches[0].on or switches[1].on) and _torch.is_grad_enabled():
                keywords = function.keywords
                if switches[0].on and keywords and any_grad(keywords.values()):
                    layer = layer_of(function)
                    if layer is not None:
                        return lift(self, layer, function, args, options)
                elif switches[1].on and not any_grad(args):
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

    def __reduce__(self):
        return _partial, (self.func,), (self.func, self.args, self.keywords or None, None)

    def __copy__(self):
        return of(_partial(self.func, *self.args, **self.keywords), self.reentrant, self.own)

    def __deepcopy__(self, memo: dict):
        func, args, keywords = copy.deepcopy((self.func, self.args, self.keywords), memo)
        return of(_partial(func, *args, **keywords), self.reentrant, self.own)


def of(function, reentrant: bool, own: bool) -> LayerCheckpoint:
    """``function`` as a :class:`LayerCheckpoint` with the same ``func``, ``args`` and ``keywords``."""
    if type(function) is _partial:
        checkpoint = LayerCheckpoint(function.func, *function.args, **function.keywords)
    else:
        checkpoint = LayerCheckpoint(function)
    checkpoint.reentrant, checkpoint.own = reentrant, own
    return checkpoint


def install(wrapped, instance, args, kwargs):
    """``_set_gradient_checkpointing`` wrapper: a function a patch may act on is handed on as :func:`of` it."""
    if not argument(args, kwargs, 0, "enable", True) or not _shape_fits():
        return wrapped(*args, **kwargs)
    given = len(args) > 1
    function = args[1] if given else kwargs.get("gradient_checkpointing_func", _default())
    if not isinstance(function, LayerCheckpoint):
        switches = _switches or _bind()
        reentrant = (switches[0].on or switches[1].on) and is_reentrant(function)
        own = switches[2].on and not _stock(function)
        if reentrant or own:
            function = of(function, reentrant, own)
            if given:
                args = (args[0], function, *args[2:])
            else:
                kwargs = {**kwargs, "gradient_checkpointing_func": function}
    return wrapped(*args, **kwargs)


def _default():
    """What ``_set_gradient_checkpointing`` checkpoints with when it is given no function."""
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint


def _stock(function) -> bool:
    """Whether ``function`` is torch's checkpoint or transformers' offload closure around it (under
    any partials): functions that never look for their layer."""
    while isinstance(function, _partial):
        function = function.func
    if function is _default():
        return True
    return getattr(function, "__module__", None) == "transformers.modeling_utils" and (
        getattr(function, "__name__", None) == "checkpoint_func"
    )


def layer_of(function):
    """The ``GradientCheckpointingLayer`` a layer's call handed over: bound first in the partial
    (``partial(forward, layer, ...)``) or the ``__self__`` of its method (``partial(super().__call__)``)."""
    layers = sys.modules.get("transformers.modeling_layers")
    if layers is None:
        return None
    owner = getattr(function.func, "__self__", None)
    if owner is None and function.args:
        owner = function.args[0]
    return owner if isinstance(owner, layers.GradientCheckpointingLayer) else None


def bound_to_layer(function):
    """``partial(forward, layer, **kwargs)`` as ``partial(<forward bound to layer>, **kwargs)``: the
    shape up to transformers 5.22, where ``func.func.__self__`` is the layer."""
    if not function.args or hasattr(function.func, "__self__"):
        return function
    layer = layer_of(function)
    if layer is None:
        return function
    record_effect(
        FINDS_LAYER,
        "handed %s's checkpoint function its forward bound to the layer (func.func.__self__), which "
        "transformers passes unbound from 5.23",
        type(layer).__name__,
    )
    return _partial(types.MethodType(function.func, layer), *function.args[1:], **function.keywords)


# -- the call shape, checked once ------------------------------------------------------------------

_shape_problem: list = []  # [None] once the layers' call shape is checked and fine, [reason] if not


def _shape_fits() -> bool:
    """Whether the layers call their checkpoint function the way :class:`LayerCheckpoint` expects,
    checked at the first enable (the import-time probe may have come too early)."""
    if not _shape_problem:
        try:
            _shape_problem.append(probe())
        except Exception as exc:  # a probe that cannot run here is no reason to touch the run
            _shape_problem.append(f"the probe raised {exc!r}")
        if _shape_problem[0]:
            logging.getLogger("shim").warning(
                "%s, %s, %s: %s; checkpointing runs as upstream's", KEYWORDS, FROZEN, FINDS_LAYER, _shape_problem[0]
            )
    return _shape_problem[0] is None


def probe() -> str | None:
    """A layer must call ``_gradient_checkpointing_func(partial(fn, **kwargs), *args)`` with itself
    findable by :func:`layer_of`. Checked when ``transformers.modeling_layers`` has finished
    importing; before that (it imports ``modeling_utils`` on its way) the per-call checks leave any
    other shape of call to upstream's function, unchanged."""
    layers = sys.modules.get("transformers.modeling_layers")
    if layers is None or getattr(getattr(layers, "__spec__", None), "_initializing", False):
        return None
    torch = _bind_torch()

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
    if type(function) is not _partial or function.keywords.get("second") is not second:
        return "GradientCheckpointingLayer no longer hands keyword arguments over in a functools.partial"
    if len(args) != 1 or args[0] is not first or options:
        return "GradientCheckpointingLayer no longer hands positional arguments over as *args"
    if layer_of(function) is not layer:
        return "GradientCheckpointingLayer no longer hands itself over in the partial"
    if not torch.equal(result, first + second):
        return "GradientCheckpointingLayer's checkpoint function result is not the layer's output"
    return None
