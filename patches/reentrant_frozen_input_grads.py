"""``reentrant-frozen-input-grads``: reentrant checkpointing gives trainable parameters their gradients
when none of the layer's inputs requires grad.

Symptom (silent): with ``use_reentrant=True``, a checkpointed layer whose inputs are all frozen
(frozen embeddings or first layers, ``inputs_embeds`` from a frozen tower, a vision model) gives its
trainable parameters no gradient, nor does any checkpointed layer after it: the reentrant
checkpoint's output joins the graph only through inputs that require grad.

Fix: ``GradientCheckpointingLayer.__call__`` is wrapped, stacked with ``reentrant-keyword-grads``
(shared decision in ``_reentrant.py``; never both for one call). A reentrant, training, checkpointing
call with no grad-requiring input, on a layer with a trainable parameter, gets one extra checkpoint
input: a zero-size tensor that requires grad (an anchor), dropped before the layer runs. Gradients
then equal a run without checkpointing; the layer sees upstream's inputs.

Limits: parameters must be registered on the layer (FSDP1 flat parameters are left to upstream);
the same one-call swap of the checkpoint function as ``reentrant-keyword-grads``; a custom
reentrant checkpoint function must accept a zero-size input.

Full story, versions measured and references: docs/bugs.md#reentrant-frozen-input-grads
"""

from __future__ import annotations

from shim import Patch, Target, record_effect

from . import _reentrant
from ._checkpointing import first_trainable
from ._reentrant import StandIn, divert, reentrant_function, torch_module, wants_grad

NAME = "reentrant-frozen-input-grads"


class _Anchoring(StandIn):
    """Stands in for a layer's checkpoint function during one diverted call: one more input, a
    zero-size tensor that requires grad, gives the checkpointed output a ``grad_fn``."""

    __slots__ = ("device",)

    def __init__(self, original, layer: str, device) -> None:
        super().__init__(original, layer)
        self.device = device

    def __call__(self, function, *args, **options):
        anchor = _reentrant._torch.empty(0, device=self.device, requires_grad=True)
        record_effect(
            NAME,
            "gave the trainable parameters of %s their gradients under reentrant checkpointing although none "
            "of its inputs requires grad (upstream's checkpointed output has no grad_fn, so they get none)",
            self.layer,
        )

        def recompute(*inputs):
            return function(*inputs[:-1])  # the anchor is the last input; the layer never sees it

        return self.original(recompute, *args, anchor, **options)


def _any_wants_grad(args, kwargs) -> bool:
    for value in args:
        if wants_grad(value):
            return True
    for value in kwargs.values():
        if wants_grad(value):
            return True
    return False


def _call(wrapped, instance, args, kwargs):
    if instance.gradient_checkpointing and instance.training:
        torch = _reentrant._torch or torch_module()
        if torch.is_grad_enabled() and not _any_wants_grad(args, kwargs):
            function = reentrant_function(instance)
            if function is not None:
                trainable = first_trainable(instance)
                if trainable is not None:
                    stand_in = _Anchoring(function, type(instance).__name__, trainable.device)
                    return divert(wrapped, instance, stand_in, args, kwargs)
    return wrapped(*args, **kwargs)


# -- self-check (python -m shim doctor) ------------------------------------------------------------


def _self_check() -> bool:
    """True when a reentrant Llama with frozen inputs to its layers gets wrong parameter gradients."""
    from shim.tinymodels import frozen_input_llama, reentrant_changes_grads, trainable_grads

    model, loss_of = frozen_input_llama()
    return reentrant_changes_grads(model, lambda m: trainable_grads(m, loss_of))


PATCH = Patch(
    name=NAME,
    summary="Reentrant checkpointing gives trainable parameters their gradients when a layer's inputs are frozen.",
    distribution="transformers",
    requires=">=4.57",
    targets=(
        Target(
            "transformers.modeling_layers:GradientCheckpointingLayer.__call__",
            _call,
            probe=lambda original: _reentrant.probe(),
        ),
    ),
    references=(
        "docs/bugs.md#reentrant-frozen-input-grads",
        "huggingface/transformers#21381",
        "huggingface/transformers#23170",
    ),
    self_check=_self_check,
    after=("reentrant-keyword-grads",),
)
