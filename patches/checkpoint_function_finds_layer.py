"""``checkpoint-function-finds-layer``: a checkpoint function of your own finds its layer, as it did up to 5.22.

Symptom: checkpoint functions that find the layer they checkpoint through the partial they are
handed (``func.func.__self__``; LlamaFactory's, which checkpoints only layers with trainable
parameters, and other training frameworks' offload or selective wrappers) fail in the first forward
once transformers checkpoints inside the layer's ``forward``: ``AttributeError: 'function' object
has no attribute '__self__'``. The layer now hands over ``partial(forward, layer, **kwargs)``.

Fix: where checkpointing is enabled with a function that is not torch's or transformers' own, the
layers receive it as ``_checkpoint_function.LayerCheckpoint``, which hands the function
``partial(<forward bound to the layer>, **kwargs)``: ``func.func.__self__`` is the layer and
``func.keywords`` the keyword arguments, and calling it runs the same ``forward``. Torch's and
transformers' functions are left as they are.

Limits: a function assigned to a layer's ``_gradient_checkpointing_func`` without
``_set_gradient_checkpointing`` is not covered; a function that needs the partial's exact type or
``func.args`` sees the older shape.

Full story, versions measured and references: docs/bugs.md#checkpoint-function-finds-layer
"""

from __future__ import annotations

from shim import Patch, Target

from . import _checkpoint_function
from .reentrant_keyword_grads import _probe

NAME = _checkpoint_function.FINDS_LAYER


# -- self-check (python -m shim doctor) ------------------------------------------------------------


def _self_check() -> bool:
    """True when a checkpoint function that finds its layer through ``func.func.__self__`` fails."""
    import torch

    from shim.tinymodels import tiny_llama
    from shim.tinysteps import layer_finding_checkpoint

    torch.manual_seed(0)
    model = tiny_llama(2)
    model.train()
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=layer_finding_checkpoint())
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    try:
        model(ids, labels=ids).loss.backward()
    except AttributeError as exc:
        return "__self__" in str(exc)
    return False


PATCH = Patch(
    name=NAME,
    summary="A checkpoint function of your own finds its layer through the partial (func.func.__self__).",
    distribution="transformers",
    requires=">=5.23",
    targets=(
        Target(
            "transformers.modeling_utils:PreTrainedModel._set_gradient_checkpointing",
            _checkpoint_function.install,
            probe=_probe,
        ),
    ),
    references=("docs/bugs.md#checkpoint-function-finds-layer",),
    self_check=_self_check,
    after=("replaced-forward-keeps-checkpointing",),
)
