"""``checkpoint-function-finds-layer``: a checkpoint function of your own finds its layer, as it did up to 5.22.

Symptom: checkpoint functions that find the layer they checkpoint through the partial they are
handed (``func.func.__self__``; LlamaFactory's, which checkpoints only layers with trainable
parameters, and other training frameworks' offload or selective wrappers) fail in the first forward
once transformers checkpoints inside the layer's ``forward``: ``AttributeError: 'function' object
has no attribute '__self__'``. The layer now hands over ``partial(forward, layer, **kwargs)``.

Fix: a function that is not torch's or transformers' own, however a layer is given it
(``_checkpoint_path.py``), reaches the layer as ``_checkpoint_function.LayerCheckpoint``, which
hands it the layer both ways: ``partial(<forward bound to the layer>, layer, **kwargs)``, so
``func.func.__self__`` and ``func.args[0]`` are the layer, and ``func(*args)`` as well as
``func.func(*args, **func.keywords)`` run the same ``forward``.

Limits: ``func.func`` is a bound-method look-alike, not a ``types.MethodType``; a model enabled
before ``import shim`` gets the step when its layers are next given a function.

Full story, versions measured and references: docs/bugs.md#checkpoint-function-finds-layer
"""

from __future__ import annotations

from shim import Patch

from . import _checkpoint_path
from ._checkpoint_function import FINDS_LAYER as NAME

# -- self-check (python -m shim doctor) ------------------------------------------------------------


def _self_check() -> bool:
    """True when a checkpoint function that finds its layer through ``func.func.__self__`` fails."""
    import torch

    from shim.selfcheck.models import tiny_llama
    from shim.selfcheck.steps import layer_finding_checkpoint

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
    targets=_checkpoint_path.targets(_checkpoint_path.step(NAME), probe=_checkpoint_path.probe),
    references=("docs/bugs.md#checkpoint-function-finds-layer",),
    self_check=_self_check,
    after=("replaced-forward-keeps-checkpointing",),
)
