"""What the two reentrant-checkpointing patches share: the checkpoint function they put in place.

``reentrant-keyword-grads`` and ``reentrant-frozen-input-grads`` act where the bug is, on the
checkpoint function transformers hands a ``GradientCheckpointingLayer`` when checkpointing is
enabled, never on the layer's call. Both wrap ``PreTrainedModel._set_gradient_checkpointing``
with :func:`install`: when it is given a function that checkpoints reentrantly (the rule of
``_checkpointing.is_reentrant``), every layer gets a :class:`ReentrantCheckpoint` of it instead.
That is a ``functools.partial`` with the same ``func``, ``args`` and ``keywords``, so code that
reads or compares the function sees upstream's; non-reentrant checkpointing, evaluation, and every
layer that is not checkpointing never run any of this.

A layer calls it as ``function(partial(fn, **kwargs), *args)`` (``fn`` is ``super().__call__`` up
to transformers 5.22, the layer's own ``forward`` with the layer bound first from 5.23). Per call,
with grad mode on, one of the two patches may change what reaches the checkpoint (each only while
switched on; the two never both apply to one call):

- keyword tensors that require grad are passed as checkpoint inputs and put back in their places on
  recomputation (``reentrant-keyword-grads``);
- when no input requires grad but the layer has a trainable parameter, one more input, a zero-size
  tensor that requires grad (an anchor), gives the output a ``grad_fn`` (``reentrant-frozen-input-grads``).

Any other shape of call goes to the original function unchanged.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys

from shim import record_effect, switch_of

from ._arguments import argument
from ._checkpointing import first_trainable, is_reentrant

KEYWORDS = "reentrant-keyword-grads"
FROZEN = "reentrant-frozen-input-grads"
_partial = functools.partial
_torch = None
_switches = None  # (keyword switch, frozen switch), looked up on first use


def _bind():
    global _switches
    _bind_torch()
    if _switches is None:
        _switches = (switch_of(KEYWORDS), switch_of(FROZEN))
    return _switches


def _bind_torch():
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


def _any_grad(values) -> bool:
    """Whether any of ``values`` holds a tensor that requires grad (one frame for the usual case of
    plain tensors and flags; containers go through :func:`wants_grad`)."""
    tensor = _torch.Tensor
    for value in values:
        if isinstance(value, tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (tuple, list, dict)) and wants_grad(value):
            return True
    return False


class ReentrantCheckpoint(_partial):
    """A layer's reentrant checkpoint function, as upstream's partial, with the two fixes per call.

    Pickles as upstream's plain partial (an unpickled model needs no shim), copies as itself.
    """

    def __call__(self, function, *args, **options):
        switches = _switches or _bind()
        keywords_on, frozen_on = switches[0].on, switches[1].on  # attributes: no frame per call
        if (keywords_on or frozen_on) and type(function) is _partial and _torch.is_grad_enabled():
            keywords = function.keywords
            if keywords_on and keywords and _any_grad(keywords.values()):
                layer = layer_of(function)
                if layer is not None:
                    return lift(self, layer, function, args, options)
            elif frozen_on and not _any_grad(args):
                layer = layer_of(function)
                trainable = first_trainable(layer) if layer is not None else None
                if trainable is not None and not _any_grad(keywords.values()):
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
        return ReentrantCheckpoint(self.func, *self.args, **self.keywords)

    def __deepcopy__(self, memo: dict):
        state = copy.deepcopy((self.func, self.args, self.keywords), memo)
        return ReentrantCheckpoint(state[0], *state[1], **state[2])


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


def of(function) -> ReentrantCheckpoint:
    """``function`` as a :class:`ReentrantCheckpoint` with the same ``func``, ``args`` and ``keywords``."""
    if type(function) is _partial:
        return ReentrantCheckpoint(function.func, *function.args, **function.keywords)
    return ReentrantCheckpoint(function)


_shape_problem: list = []  # [None] once the layers' call shape is checked and fine, [reason] if not


def install(wrapped, instance, args, kwargs):
    """``_set_gradient_checkpointing`` wrapper: a reentrant function is handed on as :func:`of` it."""
    if not argument(args, kwargs, 0, "enable", True) or not _shape_fits():
        return wrapped(*args, **kwargs)
    if len(args) > 1:
        function = args[1]
        if is_reentrant(function) and not isinstance(function, ReentrantCheckpoint):
            args = (args[0], of(function), *args[2:])
    else:
        function = kwargs.get("gradient_checkpointing_func", _default())
        if is_reentrant(function) and not isinstance(function, ReentrantCheckpoint):
            kwargs = {**kwargs, "gradient_checkpointing_func": of(function)}
    return wrapped(*args, **kwargs)


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


def _shape_fits() -> bool:
    """Whether the layers call their checkpoint function the way :class:`ReentrantCheckpoint`
    expects, checked at the first enable (the import-time probe may have come too early)."""
    if not _shape_problem:
        try:
            _shape_problem.append(probe())
        except Exception as exc:  # a probe that cannot run here is no reason to touch the run
            _shape_problem.append(f"the probe raised {exc!r}")
        if _shape_problem[0]:
            logging.getLogger("shim").warning(
                "%s, %s: %s; reentrant checkpointing runs as upstream's", KEYWORDS, FROZEN, _shape_problem[0]
            )
    return _shape_problem[0] is None


def _default():
    """What ``_set_gradient_checkpointing`` checkpoints with when it is given no function."""
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint


# -- reentrant-keyword-grads -----------------------------------------------------------------------


def lift(checkpoint: ReentrantCheckpoint, layer, function, args, options):
    """Run ``function`` with its grad-requiring keyword tensors as checkpoint inputs."""
    lifted: list = []
    template = {key: _lift(value, lifted) for key, value in function.keywords.items()}
    run, bound, count = function.func, function.args, len(args)
    record_effect(
        KEYWORDS,
        "passed %d grad-requiring keyword tensor(s) (%s) of %s to reentrant checkpointing as inputs, "
        "which upstream leaves inside the partial, without gradients",
        len(lifted), ", ".join(key for key, value in template.items() if value is not function.keywords[key]),
        type(layer).__name__,
    )  # fmt: skip

    def recompute(*inputs):
        keywords = {key: _fill(value, inputs[count:]) for key, value in template.items()}
        return run(*bound, *inputs[:count], **keywords)

    return checkpoint.run(recompute, *args, *lifted, **options)


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Rebuild:
    __slots__ = ("kind", "items")

    def __init__(self, kind, items) -> None:
        self.kind = kind
        self.items = items


def _lift(value, lifted: list):
    """A template of ``value``: grad-requiring tensors appended to ``lifted``, their places marked."""
    if isinstance(value, _torch.Tensor):
        if value.requires_grad:
            lifted.append(value)
            return _Slot(len(lifted) - 1)
        return value
    if isinstance(value, (tuple, list)):
        items = [_lift(item, lifted) for item in value]
        return value if all(new is old for new, old in zip(items, value)) else _Rebuild(type(value), items)
    if type(value) is dict:
        items = {key: _lift(item, lifted) for key, item in value.items()}
        return value if all(items[key] is item for key, item in value.items()) else _Rebuild(dict, items)
    return value


def _fill(template, tensors):
    kind = type(template)
    if kind is _Slot:
        return tensors[template.index]
    if kind is not _Rebuild:
        return template
    if template.kind is dict:
        return {key: _fill(item, tensors) for key, item in template.items.items()}
    filled = [_fill(item, tensors) for item in template.items]
    if template.kind in (list, tuple):
        return template.kind(filled)
    if hasattr(template.kind, "_make"):  # a named tuple
        return template.kind._make(filled)
    return template.kind(filled)


# -- reentrant-frozen-input-grads ------------------------------------------------------------------


def anchor(checkpoint: ReentrantCheckpoint, layer, device, function, args, options):
    """Run ``function`` with one more checkpoint input, a zero-size tensor that requires grad, which
    the recomputation drops: the checkpointed output gets a ``grad_fn``."""
    record_effect(
        FROZEN,
        "gave the trainable parameters of %s their gradients under reentrant checkpointing although none "
        "of its inputs requires grad (upstream's checkpointed output has no grad_fn, so they get none)",
        type(layer).__name__,
    )

    def recompute(*inputs):
        output = function(*inputs[:-1])  # the anchor is the last input; the layer never sees it
        if _torch.is_grad_enabled() and not wants_grad(output):
            # The trainable parameters went unused in this call (a conditional adapter, an idle
            # expert): tie the output to the anchor so torch's backward has something to run,
            # where upstream never reached this layer at all. Its value is unchanged (+ 0.0).
            output = _tied(output, inputs[-1])
        return output

    return checkpoint.run(recompute, *args, _torch.empty(0, device=device, requires_grad=True), **options)


def _tied(output, anchor):
    if isinstance(output, _torch.Tensor):
        return output + anchor.sum() if output.is_floating_point() else output
    if isinstance(output, (tuple, list)):
        for index, item in enumerate(output):
            if isinstance(item, _torch.Tensor) and item.is_floating_point():
                items = list(output)
                items[index] = item + anchor.sum()
                return type(output)(items) if type(output) in (tuple, list) else type(output)(*items)
    return output
