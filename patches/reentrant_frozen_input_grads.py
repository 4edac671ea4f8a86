"""``reentrant-frozen-input-grads``: reentrant checkpointing gives trainable parameters their gradients
when none of the layer's inputs requires grad.

Symptom (silent): with ``use_reentrant=True``, a checkpointed layer whose inputs are all frozen
(frozen embeddings or first layers, ``inputs_embeds`` from a frozen tower, a vision model) gives its
trainable parameters no gradient, nor does any checkpointed layer after it: the reentrant
checkpoint's output joins the graph only through inputs that require grad.

Fix: the same checkpoint function as ``reentrant-keyword-grads`` (``_checkpoint_function.py``; the two never
act on one call), given to layers on the same path (``_checkpoint_path.py``). A reentrant call in grad mode with no grad-requiring input, on a layer with a
trainable parameter, gets one extra checkpoint input: a zero-size tensor that requires grad (an
anchor), dropped before the layer runs. Gradients then equal a run without checkpointing; the layer
sees upstream's inputs. A call that leaves the trainable parameters unused still backpropagates.

Limits: parameters must be registered on the layer (FSDP1 flat parameters are left to upstream);
a custom reentrant checkpoint function must accept a zero-size input; a model enabled before
``import shim`` gets the step when its layers are next given a function.

Full story, versions measured and references: docs/bugs.md#reentrant-frozen-input-grads
"""

from __future__ import annotations

from shim import Patch

from . import _checkpoint_path
from ._reentrant_fixes import FROZEN as NAME

# -- self-check (python -m shim doctor) ------------------------------------------------------------


def _self_check() -> bool:
    """True when a reentrant Llama with frozen inputs to its layers gets wrong parameter gradients."""
    from shim.selfcheck.models import frozen_input_llama
    from shim.selfcheck.steps import reentrant_changes_grads, trainable_grads

    model, loss_of = frozen_input_llama()
    return reentrant_changes_grads(model, lambda m: trainable_grads(m, loss_of))


PATCH = Patch(
    name=NAME,
    summary="Reentrant checkpointing gives trainable parameters their gradients when a layer's inputs are frozen.",
    distribution="transformers",
    requires=">=4.57",
    targets=_checkpoint_path.targets(_checkpoint_path.step(NAME), probe=_checkpoint_path.probe),
    references=(
        "docs/bugs.md#reentrant-frozen-input-grads",
        "huggingface/transformers#21381",
        "huggingface/transformers#23170",
    ),
    self_check=_self_check,
    after=("reentrant-keyword-grads",),
)
