"""``reentrant-frozen-input-grads``: reentrant checkpointing gives trainable parameters their gradients
when none of the layer's inputs requires grad.

Upstream bug (every release measured, transformers 4.57.6 – 5.24.0; docs/bugs.md#reentrant-frozen-input-grads):
with reentrant checkpointing (``use_reentrant=True``) the layer runs inside a ``torch.autograd.Function``
whose output has a ``grad_fn`` only if one of its tensor *inputs* requires grad; the layer's own
parameters do not count. When the layer's inputs are frozen (frozen embeddings, a frozen first
layer, ``inputs_embeds`` computed by a frozen tower, a vision model whose ``main_input_name`` is
not ``input_ids`` so transformers adds no input-require-grads hook), the checkpointed output is
cut off from the graph, and that layer's trainable parameters, and every layer's after it, get no
gradient at all. Nothing raises; the only trace is torch's ``UserWarning: None of the inputs have
requires_grad=True``. Measured on 5.24: a ViT with frozen embeddings and layer 0 loses 32 of 36
trainable parameters' gradients; a 3-layer Llama called with ``inputs_embeds`` and layer 0 frozen,
18 of 20. Non-reentrant checkpointing is correct.

The fix shares its target, ``GradientCheckpointingLayer.__call__``, and its divert decision with
``reentrant-keyword-grads`` (``patches/_reentrant.py``); the two layers stack and each can be
switched off. A call is diverted only when the layer is checkpointing and training, grad mode is
on, no input (positional or keyword, also nested in tuples, lists and dicts) requires grad, the
layer's checkpoint function is reentrant, and the layer has a trainable parameter. Then, for that
call only, the checkpoint function receives one more input: a zero-size tensor that requires grad
on the device of the layer's first trainable parameter (an *anchor*), which the recomputation
drops before calling the layer. The checkpointed output gets a ``grad_fn``; in backward, torch's
reentrant checkpoint recomputes the layer with grad on and accumulates the parameters' gradients
as a run without checkpointing does. The layer sees exactly the inputs upstream passes. A layer
with no trainable parameter is left alone (its output correctly needs no gradient, and an anchor
would make torch's backward raise "none of output has requires_grad=True").

Limits: the parameters must be registered on the layer (FSDP1 without ``use_orig_params`` moves
them into flat parameters outside it: such layers are left as upstream runs them). The swap has
the same thread limit as ``reentrant-keyword-grads``. The anchor is a checkpoint input like any
other, so a reentrant checkpoint function other than torch's must accept a zero-size tensor.
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
