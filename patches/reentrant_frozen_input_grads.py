"""``reentrant-frozen-input-grads``: reentrant checkpointing gives trainable parameters their gradients
when none of the layer's inputs requires grad.

Symptom (silent): with ``use_reentrant=True``, a checkpointed layer whose inputs are all frozen
(frozen embeddings or first layers, ``inputs_embeds`` from a frozen tower, a vision model) gives its
trainable parameters no gradient, nor does any checkpointed layer after it: the reentrant
checkpoint's output joins the graph only through inputs that require grad.

Fix: a step of the checkpointing path (``shim.checkpointing``), beside ``reentrant-keyword-grads``
(the two never act on one call). A reentrant call in grad mode with no grad-requiring input, on a
layer with a trainable parameter, gets one extra checkpoint input: a zero-size tensor that requires
grad (an anchor), dropped before the layer runs. Gradients then equal a run without checkpointing; the layer
sees upstream's inputs. A call that leaves the trainable parameters unused still backpropagates.

Limits: parameters must be registered on the layer (FSDP1 flat parameters are left to upstream);
a custom reentrant checkpoint function must accept a zero-size input; a model enabled before
``import shim`` gets the step when its layers are next given a function.

Full story, versions measured and references: docs/bugs.md#reentrant-frozen-input-grads
"""

from __future__ import annotations

from shim import BugProbe, Evidence, Patch, record_effect
from shim.checkpointing import (
    Step,
    any_grad,
    bind_torch,
    check,
    eager,
    hand_over,
    in_effect,
    is_reentrant,
    targets,
    wants_grad,
)
from shim.selfcheck import bare

from ._modules import first_trainable

NAME = "reentrant-frozen-input-grads"


@eager
def _anchor(layer, function, args):
    """A step's ``act``: a call none of whose inputs requires grad, on a layer with a trainable
    parameter, gets one more checkpoint input, a zero-size tensor that requires grad, which the
    recomputation drops: the checkpointed output gets a ``grad_fn``."""
    torch = bind_torch()
    if not torch.is_grad_enabled() or any_grad(args) or any_grad(function.keywords.values()):
        return None
    trainable = first_trainable(layer)
    if trainable is None:
        return None
    record_effect(
        NAME,
        "gave the trainable parameters of %s their gradients under reentrant checkpointing although none "
        "of its inputs requires grad (upstream's checkpointed output has no grad_fn, so they get none)",
        type(layer).__name__,
    )

    def recompute(_layer, *inputs):
        output = function(*inputs[:-1])  # the anchor is the last input; the layer never sees it
        if torch.is_grad_enabled() and not wants_grad(output):
            # The trainable parameters went unused in this call (a conditional adapter, an idle
            # expert): tie the output to the anchor so torch's backward has something to run,
            # where upstream never reached this layer at all. Its value is unchanged (+ 0.0).
            output = _tied(output, inputs[-1])
        return output

    anchor = torch.empty(0, device=trainable.device, requires_grad=True)
    return hand_over(function, recompute, layer), (*args, anchor)


@eager
def _tied(output, anchor):
    torch = bind_torch()
    if isinstance(output, torch.Tensor):
        return output + anchor.sum() if output.is_floating_point() else output
    if isinstance(output, (tuple, list)):
        for index, item in enumerate(output):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                items = list(output)
                items[index] = item + anchor.sum()
                return type(output)(items) if type(output) in (tuple, list) else type(output)(*items)
    return output


STEP = Step(applies=is_reentrant, act=_anchor)

# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """A reentrantly checkpointed layer called with an input that requires no grad, positionally and
    by keyword (``hidden_states=``, as decoder layers are called): the bug is there when its trainable
    weight gets no gradient in one of the two calls (a fix for one way leaves the patch the other)."""
    torch = bare.torch_module()
    layer, lost = bare.checkpointing_layer(bare.reentrant_checkpoint()), []
    for how, call in (("positional", lambda layer, x: layer(x)), ("keyword", lambda layer, x: layer(hidden_states=x))):
        layer.linear.weight.grad = None
        output = call(layer, torch.ones(1, 2))
        if output.requires_grad:
            output.sum().backward()
        if layer.linear.weight.grad is None:
            lost.append(how)
    if lost:
        return Evidence(
            True,
            f"a reentrant layer given an input that requires no grad ({' and '.join(lost)}) leaves its trainable "
            "weight without a gradient",
        )
    return Evidence(
        False,
        "a reentrant layer given an input that requires no grad (positional or keyword) gives its weight a gradient",
    )


PATCH = Patch(
    name=NAME,
    summary="Reentrant checkpointing gives trainable parameters their gradients when a layer's inputs are frozen.",
    distribution="transformers",
    requires=">=4.57",
    targets=targets(STEP, check=check),
    references=(
        "docs/bugs.md#reentrant-frozen-input-grads",
        "huggingface/transformers#21381",
        "huggingface/transformers#23170",
    ),
    bug_probe=BugProbe(_bug_probe),
    in_effect=in_effect(STEP, "anchors reentrant calls none of whose inputs requires grad"),
)
