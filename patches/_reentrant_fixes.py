"""The two reentrant fixes the shim's checkpoint function (``_checkpoint_function.py``) applies to a
checkpointed call: lifting grad-requiring keyword tensors into checkpoint inputs
(``reentrant-keyword-grads``), and anchoring a call none of whose inputs requires grad
(``reentrant-frozen-input-grads``). The recomputation each hands the checkpoint carries the layer
both ways, so a checkpoint function that finds its layer (``func.args[0]`` or ``func.func.__self__``)
keeps finding it.
"""

from __future__ import annotations

from shim import record_effect

from ._checkpointing import handed

KEYWORDS = "reentrant-keyword-grads"
FROZEN = "reentrant-frozen-input-grads"
_torch = None


def bind_torch():
    """torch, imported on first use (the patch modules are imported before torch may be)."""
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


def any_grad(values) -> bool:
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


def wants_grad(value) -> bool:
    """Whether ``value`` holds a tensor that requires grad, in tuples, lists and dicts."""
    if isinstance(value, _torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(wants_grad(item) for item in value)
    if type(value) is dict:
        return any(wants_grad(item) for item in value.values())
    return False


def _recomputation(layer, recompute):
    """``recompute`` handed to the checkpoint function with the layer both ways (``func.args[0]``
    and ``func.func.__self__``), so a function that finds its layer finds it."""
    return handed(recompute, layer)


# -- reentrant-keyword-grads -----------------------------------------------------------------------


def lift(checkpoint, layer, function, args, options):
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

    def recompute(_layer, *inputs):
        keywords = {key: _fill(value, inputs[count:]) for key, value in template.items()}
        return run(*bound, *inputs[:count], **keywords)

    return checkpoint.run(_recomputation(layer, recompute), *args, *lifted, **options)


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


def anchor(checkpoint, layer, device, function, args, options):
    """Run ``function`` with one more checkpoint input, a zero-size tensor that requires grad, which
    the recomputation drops: the checkpointed output gets a ``grad_fn``."""
    record_effect(
        FROZEN,
        "gave the trainable parameters of %s their gradients under reentrant checkpointing although none "
        "of its inputs requires grad (upstream's checkpointed output has no grad_fn, so they get none)",
        type(layer).__name__,
    )

    def recompute(_layer, *inputs):
        output = function(*inputs[:-1])  # the anchor is the last input; the layer never sees it
        if _torch.is_grad_enabled() and not wants_grad(output):
            # The trainable parameters went unused in this call (a conditional adapter, an idle
            # expert): tie the output to the anchor so torch's backward has something to run,
            # where upstream never reached this layer at all. Its value is unchanged (+ 0.0).
            output = _tied(output, inputs[-1])
        return output

    anchor = _torch.empty(0, device=device, requires_grad=True)
    return checkpoint.run(_recomputation(layer, recompute), *args, anchor, **options)


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
