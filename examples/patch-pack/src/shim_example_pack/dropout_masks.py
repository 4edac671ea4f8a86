"""``example-checkpoint-keeps-dropout-masks``: checkpointing with ``preserve_rng_state=False`` recomputes a
layer's dropout with new masks, so its gradients are taken for another sample than the loss.

Symptom: none you can see. ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=
{"preserve_rng_state": False})`` (set for speed: torch then skips saving the random state before each
checkpointed layer) on a model whose layers drop out (``attention_dropout`` or ``hidden_dropout`` above
0, an ``nn.Dropout`` with ``p > 0``) trains on gradients that do not belong to the loss it reports:
backward re-runs each layer's forward, which draws fresh dropout masks. Turning checkpointing off
moves the loss (allenai/OLMo-core#828 measured 2.49 against 2.19 after 150 steps).

Fix: a step on the checkpointing path (``shim.checkpointing``). When a layer that drops out is given
``partial(torch.utils.checkpoint.checkpoint, ..., preserve_rng_state=False)``, it is given the same
partial with ``preserve_rng_state=True`` instead, and the effect is counted. A layer without dropout
keeps ``False`` (nothing random to replay: the saving stands), and every other function is left as it
is. The layer holds a plain ``functools.partial`` of torch's function, as without the shim: a model
pickled with it loads where the shim is not installed.

Limits: dropout is found by its modules and by the ``*_dropout`` numbers transformers' attention
and MLP modules keep; dropout drawn another way (a functional call with a hard-coded ``p``) is not
seen. A checkpoint function of your own is left alone.

This docstring is what ``python -m shim explain example-checkpoint-keeps-dropout-masks`` prints.
"""

import functools

from shim import BugProbe, Evidence, Patch, record_effect
from shim.checkpointing import Step, check, targets
from shim.selfcheck import bare

NAME = "example-checkpoint-keeps-dropout-masks"


def _drops_out(layer) -> bool:
    """Whether ``layer`` draws dropout masks in training: an ``nn.Dropout`` with ``p > 0``, or a
    submodule's ``attention_dropout`` / ``hidden_dropout`` / ``dropout`` number above 0."""
    for module in layer.modules():
        probability = getattr(module, "p", None) if "Dropout" in type(module).__name__ else None
        numbers = [probability, *(getattr(module, a, None) for a in ("attention_dropout", "hidden_dropout", "dropout"))]
        if any(isinstance(n, float) and n > 0 for n in numbers):
            return True
    return False


def _keeps_masks(layer, function):
    """The step: what ``layer`` holds when it is given ``function``."""
    if (
        type(function) is functools.partial
        and getattr(function.func, "__module__", None) == "torch.utils.checkpoint"
        and getattr(function.func, "__name__", None) == "checkpoint"
        and function.keywords.get("preserve_rng_state") is False
        and _drops_out(layer)
    ):
        record_effect(NAME, "%s: preserve_rng_state=False turned True (the layer drops out)", type(layer).__name__)
        return functools.partial(function.func, *function.args, **{**function.keywords, "preserve_rng_state": True})
    return function


def _bug_probe() -> Evidence:
    """The bug probe (``python -m shim doctor`` asks it with the patch off, then on; the shim asks it on
    a transformers build it was not measured on): one layer that drops out, checkpointing with
    ``preserve_rng_state=False``. The bug is there when its gradient differs from the same layer's
    without checkpointing. It builds a bare layer from what is imported (``shim.selfcheck.bare``, named
    at the top of the module: ``BugProbe`` reads the modules its builders need from the probe's code):
    no model, no config, nothing imported or written."""
    import torch

    class DroppingLayer(bare.layer_class()):
        def __init__(self) -> None:
            super().__init__()
            self.dropout = torch.nn.Dropout(0.5)

        def forward(self, hidden_states=None, **kwargs):
            return self.dropout(self.linear(hidden_states))

    rows = torch.arange(1.0, 17.0).unsqueeze(1)  # each row of the output weighs differently in the loss

    def gradient(layer):
        layer.zero_grad()
        bare.seed(2)  # the same masks in the forward, with and without checkpointing
        (layer(torch.ones(16, 2, requires_grad=True)) * rows).sum().backward()
        return layer.linear.weight.grad.clone()

    layer = DroppingLayer().train()
    reference = gradient(layer)
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(
        torch.utils.checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=False
    )
    if not torch.allclose(gradient(layer), reference):
        return Evidence(
            True, "a layer that drops out, checkpointed with preserve_rng_state=False, gets other gradients"
        )
    return Evidence(False, "a layer that drops out gets the same gradients checkpointed with preserve_rng_state=False")


STEP = Step(given=_keeps_masks)

PATCH = Patch(
    name=NAME,
    summary="Checkpointing with preserve_rng_state=False replays a layer's dropout masks where the layer drops out.",
    distribution="transformers",
    requires=">=4.57,<6",
    # The path's two targets (the layer's checkpoint-function slot and its __setstate__): the step is
    # ordered with the built-ins' steps by the one order; registered after them, it sits outside.
    targets=targets(STEP, check=check),
    bug_probe=BugProbe(_bug_probe),
    references=("allenai/OLMo-core#828",),
)
