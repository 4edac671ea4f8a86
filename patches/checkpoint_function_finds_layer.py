"""``checkpoint-function-finds-layer``: a checkpoint function of your own finds its layer, as it did up to 5.22.

Symptom: checkpoint functions that find the layer they checkpoint through the partial they are
handed (``func.func.__self__``; LlamaFactory's, which checkpoints only layers with trainable
parameters, and other training frameworks' offload or selective wrappers) fail in the first forward
once transformers checkpoints inside the layer's ``forward``: ``AttributeError: 'function' object
has no attribute '__self__'``. The layer now hands over ``partial(forward, layer, **kwargs)``.

Fix: a step of the checkpointing path (``shim.checkpointing``), the innermost, so it acts last: a function that is not
torch's or transformers' own, however a layer is given it, is handed the layer both ways:
``partial(<forward bound to the layer>, layer, **kwargs)``, so ``func.func.__self__`` and
``func.args[0]`` are the layer, and ``func(*args)`` as well as ``func.func(*args, **func.keywords)``
run the same ``forward``. So is the recomputation a reentrant step hands over.

Limits: ``func.func`` is a bound-method look-alike (``__func__``, ``__self__``, ``__name__``:
``shim.checkpointing.LayerMethod``), not a ``types.MethodType``, so ``inspect.ismethod`` and
``inspect.isfunction`` are false for it; a model enabled before ``import shim`` gets the step when
its layers are next given a function.

Full story, versions measured and references: docs/bugs.md#checkpoint-function-finds-layer
"""

from __future__ import annotations

import functools

from shim import Patch, record_effect
from shim.checkpointing import LayerMethod, Step, bind_torch, eager, in_effect, probe, targets

NAME = "checkpoint-function-finds-layer"


def _is_own(function) -> bool:
    """A step's ``applies``: whether ``function`` is not torch's checkpoint nor transformers'
    offload closure around it (under any partials): a function of the user's own, which may look
    for its layer."""
    checkpoint = bind_torch().utils.checkpoint.checkpoint
    while isinstance(function, functools.partial):  # the usual case: transformers' partial of torch's
        function = function.func
    if function is checkpoint:
        return False
    return not (
        getattr(function, "__module__", None) == "transformers.modeling_utils"
        and getattr(function, "__name__", None) == "checkpoint_func"
    )


@eager
def _both_ways(layer, function, args):
    """A step's ``act``: ``partial(forward, layer, **kwargs)`` (transformers >= 5.23) handed as
    ``partial(<forward bound to the layer>, layer, **kwargs)``."""
    if not function.args or hasattr(function.func, "__self__"):
        return None
    record_effect(
        NAME,
        "handed %s's checkpoint function the layer as func.func.__self__ (as up to transformers 5.22) "
        "besides func.args[0]",
        type(layer).__name__,
    )
    return functools.partial(LayerMethod(function.func, layer), *function.args, **function.keywords), args


STEP = Step(NAME, applies=_is_own, act=_both_ways)

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
    targets=targets(STEP, probe=probe),
    references=("docs/bugs.md#checkpoint-function-finds-layer",),
    self_check=_self_check,
    in_effect=in_effect(NAME, "hands your checkpoint function its layer both ways"),
    # Innermost: its step acts last, so what any other step hands the checkpoint carries the layer both ways.
    place="innermost",
)
