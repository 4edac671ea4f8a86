"""``reentrant-keyword-grads``: reentrant checkpointing keeps the gradients of keyword tensor inputs.

Symptom (silent): with ``use_reentrant=True``, a ``GradientCheckpointingLayer`` called as
``layer(hidden_states=h, ...)`` gives ``h`` (and, when no positional input requires grad, the
layer's own weights and everything before it) no gradient: only positional arguments become inputs
of ``torch.utils.checkpoint``; keywords ride hidden in a ``partial``. The only trace is torch's
``UserWarning: None of the inputs have requires_grad=True``.

Fix: ``GradientCheckpointingLayer.__call__`` is wrapped. A call that is checkpointing, training, in
grad mode, with a reentrant checkpoint function (the rule in ``_checkpointing.is_reentrant``) and a
grad-requiring tensor in its keywords (also nested in tuples, lists, dicts) gets those tensors passed
as extra checkpoint inputs, put back into their keyword places on every run of the layer. Every other
call goes straight through.

Limits: tensors in other containers (dataclasses, ``ModelOutput``) are not lifted; a layer's
``forward`` called directly is not covered; the checkpoint function is swapped on the instance for
one call, so two threads running the same layer object may see each other's swap.

Full story, versions measured and references: docs/bugs.md#reentrant-keyword-grads
"""

from __future__ import annotations

import functools

from shim import Patch, Target, record_effect

from . import _reentrant
from ._reentrant import StandIn, divert, reentrant_function, torch_module
from ._reentrant import probe as _probe
from ._reentrant import wants_grad as _wants_grad

NAME = "reentrant-keyword-grads"
_partial = functools.partial


# -- finding and putting back the tensors ------------------------------------------------------


def _lift(value, lifted: list):
    """A template of ``value``: grad-requiring tensors appended to ``lifted``, their places marked."""
    if isinstance(value, _reentrant._torch.Tensor):
        if value.requires_grad:
            lifted.append(value)
            return _Slot(len(lifted) - 1)
        return value
    kind = type(value)
    if isinstance(value, (tuple, list)):
        items = [_lift(item, lifted) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return _Rebuild(kind, items)
    if kind is dict:
        items = {key: _lift(item, lifted) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        return _Rebuild(dict, items)
    return value


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Rebuild:
    __slots__ = ("kind", "items")

    def __init__(self, kind, items) -> None:
        self.kind = kind
        self.items = items


def _fill(template, tensors):
    kind = type(template)
    if kind is _Slot:
        return tensors[template.index]
    if kind is not _Rebuild:
        return template
    items = template.items
    if template.kind is dict:
        return {key: _fill(item, tensors) for key, item in items.items()}
    filled = [_fill(item, tensors) for item in items]
    if template.kind is list:
        return filled
    if template.kind is tuple:
        return tuple(filled)
    if hasattr(template.kind, "_make"):  # a named tuple
        return template.kind._make(filled)
    return template.kind(filled)


# -- deciding ----------------------------------------------------------------------------------


class _Lifting(StandIn):
    """Stands in for a layer's checkpoint function during one diverted call: grad-requiring
    keyword tensors become checkpoint inputs."""

    __slots__ = ()

    def __call__(self, function, *args, **options):
        original = self.original
        if not isinstance(function, _partial) or not function.keywords:
            return original(function, *args, **options)
        lifted: list = []
        template = {key: _lift(value, lifted) for key, value in function.keywords.items()}
        if not lifted:
            return original(function, *args, **options)
        run, bound, count = function.func, function.args, len(args)
        record_effect(
            NAME,
            "passed %d grad-requiring keyword tensor(s) (%s) of %s to reentrant checkpointing as inputs, "
            "which upstream leaves inside the partial, without gradients",
            len(lifted), ", ".join(key for key, value in template.items() if value is not function.keywords[key]),
            self.layer,
        )  # fmt: skip

        def recompute(*inputs):
            keywords = {key: _fill(value, inputs[count:]) for key, value in template.items()}
            return run(*bound, *inputs[:count], **keywords)

        return original(recompute, *args, *lifted, **options)


def _call(wrapped, instance, args, kwargs):
    if kwargs and instance.gradient_checkpointing and instance.training:
        torch = _reentrant._torch or torch_module()
        if any(_wants_grad(value) for value in kwargs.values()) and torch.is_grad_enabled():
            function = reentrant_function(instance)
            if function is not None:
                return _diverted(wrapped, instance, function, args, kwargs)
    return wrapped(*args, **kwargs)


def _diverted(wrapped, instance, function, args, kwargs):
    """Run the layer's call with its checkpoint function swapped for a lifting one."""
    return divert(wrapped, instance, _Lifting(function, type(instance).__name__), args, kwargs)


# -- self-check (python -m shim doctor) ------------------------------------------------------------


def _self_check() -> bool:
    """True when a reentrant, keyword-driven 3-layer Llama gets wrong parameter gradients."""
    from shim.tinymodels import keyword_driven_grads, reentrant_changes_grads, tiny_llama

    torch = torch_module()
    torch.manual_seed(0)
    model = tiny_llama(3)
    model.train()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8))
    return reentrant_changes_grads(model, lambda m: keyword_driven_grads(m, input_ids))


PATCH = Patch(
    name=NAME,
    summary="Reentrant checkpointing keeps the gradients of tensors passed to a layer by keyword.",
    distribution="transformers",
    requires=">=4.57",
    targets=(
        Target(
            "transformers.modeling_layers:GradientCheckpointingLayer.__call__",
            _call,
            probe=lambda original: _probe(),
        ),
    ),
    references=("docs/bugs.md#reentrant-keyword-grads", "huggingface/transformers#41818"),
    self_check=_self_check,
)
