"""``replaced-forward-keeps-checkpointing``: a layer class whose ``forward`` was replaced still checkpoints.

Symptom (silent): transformers checkpoints a layer inside a wrapper it puts on each layer class's
``forward`` when the class is created, and only while ``type(layer).forward`` is that wrapper. Code
that replaces ``LayerClass.forward`` afterwards (kernel libraries, tracers, a user's own patch, a
wrapt wrapper) turns checkpointing off for every layer of that class: no error, no warning, the
memory saving gone.

Fix: when checkpointing is enabled (``_set_gradient_checkpointing``), each checkpointing layer
class whose ``forward`` is no longer transformers' wrapper gets transformers' own wrapper again
(``GradientCheckpointingLayer.__init_subclass__``), around its current ``forward``: the replacement
still runs, inside the checkpoint. An effect names the class. Classes that define their own
``forward`` are wrapped by transformers itself and left alone.

Limits: a ``forward`` replaced after the enable stops checkpointing again until the next enable.

Full story, versions measured and references: docs/bugs.md#replaced-forward-keeps-checkpointing
"""

from __future__ import annotations

import sys
import types

from shim import Patch, Target, record_effect

from ._arguments import argument, leading_parameters
from ._checkpointing import checkpointing_modules

NAME = "replaced-forward-keeps-checkpointing"
_wrapper_code: list = []  # the code object of transformers' checkpointing wrapper, found once


def _checkpointing_wrapper_code(layers):
    """The code of the ``forward`` wrapper ``GradientCheckpointingLayer.__init_subclass__`` puts on
    every layer class (the same code object for all of them, a new function each)."""
    if not _wrapper_code:

        class _Probe(layers.GradientCheckpointingLayer):
            def forward(self):
                return None

        _wrapper_code.append(getattr(_Probe.forward, "__code__", None))
    return _wrapper_code[0]


def checkpoints(cls, layers) -> bool:
    """Whether instances of ``cls`` checkpoint when enabled: ``cls.forward``, looked up as transformers
    looks it up, is transformers' own wrapper (a plain function with its code)."""
    forward = cls.forward
    return type(forward) is types.FunctionType and forward.__code__ is _checkpointing_wrapper_code(layers)


def _set_gradient_checkpointing(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if instance is None or not argument(args, kwargs, 0, "enable", True):
        return result
    layers = sys.modules.get("transformers.modeling_layers")
    if layers is None:
        return result
    classes = {type(m) for m in checkpointing_modules(instance) if isinstance(m, layers.GradientCheckpointingLayer)}
    for cls in classes:
        if not checkpoints(cls, layers):
            # transformers' own mechanism, run again for this class: it wraps the current forward.
            layers.GradientCheckpointingLayer.__dict__["__init_subclass__"].__func__(cls)
            record_effect(
                NAME,
                "%s.forward was replaced after transformers wrapped it for checkpointing, which turned "
                "checkpointing off for its layers; the shim wrapped the replacement again",
                cls.__name__,
            )
    return result


def _probe(original) -> str | None:
    problem = leading_parameters(original, ("self", "enable"))
    if problem:
        return problem
    layers = sys.modules.get("transformers.modeling_layers")
    if layers is None or getattr(getattr(layers, "__spec__", None), "_initializing", False):
        return None  # checked by the self-check; the enable path finds the module imported
    init_subclass = layers.GradientCheckpointingLayer.__dict__.get("__init_subclass__")
    if not isinstance(init_subclass, classmethod) or _checkpointing_wrapper_code(layers) is None:
        return "GradientCheckpointingLayer no longer wraps each layer class's forward in __init_subclass__"
    return None


# -- self-check (python -m shim doctor) ------------------------------------------------------------


def _self_check() -> bool:
    """True when a 3-layer Llama whose decoder-layer class had its forward replaced checkpoints no layer."""
    import torch

    from shim.tinymodels import replaced_forward_llama
    from shim.tinysteps import checkpointed_layer_calls

    with replaced_forward_llama() as model:
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        return checkpointed_layer_calls(model, lambda: model(ids, labels=ids).loss.backward()) == 0


PATCH = Patch(
    name=NAME,
    summary="A layer class whose forward was replaced after import still checkpoints when checkpointing is on.",
    distribution="transformers",
    requires=">=5.23",
    targets=(
        Target(
            "transformers.modeling_utils:PreTrainedModel._set_gradient_checkpointing",
            _set_gradient_checkpointing,
            probe=_probe,
        ),
    ),
    references=("docs/bugs.md#replaced-forward-keeps-checkpointing",),
    self_check=_self_check,
    after=("reentrant-frozen-input-grads",),
)
