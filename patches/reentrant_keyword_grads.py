"""``reentrant-keyword-grads``: reentrant checkpointing keeps the gradients of keyword tensor inputs.

Symptom (silent): with ``use_reentrant=True``, a ``GradientCheckpointingLayer`` called as
``layer(hidden_states=h, ...)`` gives ``h`` (and, when no positional input requires grad, the
layer's own weights and everything before it) no gradient: only positional arguments become inputs
of ``torch.utils.checkpoint``; keywords ride hidden in a ``partial``. The only trace is torch's
``UserWarning: None of the inputs have requires_grad=True``.

Fix: where checkpointing is enabled (``_set_gradient_checkpointing``), a reentrant checkpoint
function is handed to the layers as ``_checkpoint_function.LayerCheckpoint``, upstream's partial with one
more step per call: grad-requiring tensors in the keywords (also nested in tuples, lists, dicts)
become extra checkpoint inputs, put back into their keyword places on every run of the layer. Layer
calls that do not checkpoint, and non-reentrant checkpointing, run no shim code at all.

Limits: tensors in other containers (dataclasses, ``ModelOutput``) are not lifted; a function
assigned to a layer's ``_gradient_checkpointing_func`` without ``_set_gradient_checkpointing`` runs
as upstream's; a layer's ``forward`` called directly is not covered.

Full story, versions measured and references: docs/bugs.md#reentrant-keyword-grads
"""

from __future__ import annotations

from shim import Patch, Target

from . import _checkpoint_function
from ._arguments import leading_parameters

NAME = _checkpoint_function.KEYWORDS


def _probe(original) -> str | None:
    return (
        leading_parameters(original, ("self", "enable", "gradient_checkpointing_func")) or _checkpoint_function.probe()
    )


# -- self-check (python -m shim doctor) ------------------------------------------------------------


def _self_check() -> bool:
    """True when a reentrant, keyword-driven 3-layer Llama gets wrong parameter gradients."""
    import torch

    from shim.tinymodels import tiny_llama
    from shim.tinysteps import keyword_driven_grads, reentrant_changes_grads

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
            "transformers.modeling_utils:PreTrainedModel._set_gradient_checkpointing",
            _checkpoint_function.install,
            probe=_probe,
        ),
    ),
    references=("docs/bugs.md#reentrant-keyword-grads", "huggingface/transformers#41818"),
    self_check=_self_check,
    after=("checkpointing-restore",),
)
