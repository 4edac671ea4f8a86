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

from shim import BugProbe, Evidence, Patch, record_effect
from shim.checkpointing import LayerMethod, Step, bind_torch, check, eager, in_effect, targets
from shim.selfcheck import bare

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


STEP = Step(applies=_is_own, act=_both_ways)

# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """One layer checkpointing with a function that finds its layer as ``func.func.__self__``: the bug
    is there when that raises ``AttributeError`` or finds something else."""
    import functools

    torch = bare.torch_module()
    found = []

    def finding_the_layer(func, *args, **kwargs):
        owner = func.func if isinstance(func, functools.partial) else func
        found.append(owner.__self__)
        return func(*args, **kwargs)

    layer = bare.checkpointing_layer(finding_the_layer)
    try:
        layer(torch.ones(1, 2))
    except AttributeError as exc:
        return Evidence(True, f"a checkpoint function reading func.func.__self__ fails: AttributeError: {exc}")
    if found != [layer]:
        return Evidence(True, f"a checkpoint function reading func.func.__self__ finds {found!r}, not the layer")
    return Evidence(False, "a checkpoint function finds its layer as func.func.__self__")


PATCH = Patch(
    name=NAME,
    summary="A checkpoint function of your own finds its layer through the partial (func.func.__self__).",
    distribution="transformers",
    requires=">=5.23",
    targets=targets(STEP, check=check),
    references=("docs/bugs.md#checkpoint-function-finds-layer",),
    bug_probe=BugProbe(_bug_probe),
    in_effect=in_effect(STEP, "hands your checkpoint function its layer both ways"),
    # Innermost: its step acts last, so what any other step hands the checkpoint carries the layer both ways.
    place="innermost",
)
