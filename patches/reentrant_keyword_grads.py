"""``reentrant-keyword-grads``: reentrant checkpointing keeps the gradients of keyword tensor inputs.

Symptom (silent): with ``use_reentrant=True``, a ``GradientCheckpointingLayer`` called as
``layer(hidden_states=h, ...)`` gives ``h`` (and, when no positional input requires grad, the
layer's own weights and everything before it) no gradient: only positional arguments become inputs
of ``torch.utils.checkpoint``; keywords ride hidden in a ``partial``. The only trace is torch's
``UserWarning: None of the inputs have requires_grad=True``.

Fix: whenever a layer is given a reentrant checkpoint function (an enable, a restore, a direct
assignment, an unpickled model: ``_checkpoint_path.py``), it receives it as
``_checkpoint_function.LayerCheckpoint``, upstream's partial with one more step per call:
grad-requiring tensors in the keywords (also nested in tuples, lists, dicts) become extra checkpoint
inputs, put back into their keyword places on every run of the layer. Layer calls that do not
checkpoint, and non-reentrant checkpointing, run no code of this patch.

Limits: tensors in other containers (dataclasses, ``ModelOutput``) are not lifted; a layer's
``forward`` called directly is not covered; a model enabled before ``import shim`` gets the step
when its layers are next given a function.

Full story, versions measured and references: docs/bugs.md#reentrant-keyword-grads
"""

from __future__ import annotations

from shim import Patch

from . import _checkpoint_path
from ._reentrant_fixes import KEYWORDS as NAME

# -- self-check (python -m shim doctor) ------------------------------------------------------------


def _self_check() -> bool:
    """True when a reentrant, keyword-driven 3-layer Llama gets wrong parameter gradients."""
    import torch

    from shim.selfcheck.models import tiny_llama
    from shim.selfcheck.steps import keyword_driven_grads, reentrant_changes_grads

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
    targets=_checkpoint_path.targets(_checkpoint_path.step(NAME), probe=_checkpoint_path.probe),
    references=("docs/bugs.md#reentrant-keyword-grads", "huggingface/transformers#41818"),
    self_check=_self_check,
    after=("checkpointing-restore",),
)
