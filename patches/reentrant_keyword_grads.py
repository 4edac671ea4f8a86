"""``reentrant-keyword-grads``: reentrant checkpointing keeps the gradients of keyword tensor inputs.

Symptom (silent): with ``use_reentrant=True``, a ``GradientCheckpointingLayer`` called as
``layer(hidden_states=h, ...)`` gives ``h`` (and, when no positional input requires grad, the
layer's own weights and everything before it) no gradient: only positional arguments become inputs
of ``torch.utils.checkpoint``; keywords ride hidden in a ``partial``. The only trace is torch's
``UserWarning: None of the inputs have requires_grad=True``.

Fix: a step of the checkpointing path (``shim.checkpointing``): whenever a layer is given a
reentrant checkpoint function (an enable, a restore, a direct assignment, an unpickled model), each
checkpointed call with grad-requiring tensors in the keywords (also nested in tuples, lists, dicts)
hands them to the checkpoint as extra inputs, put back into their keyword places on every run of
the layer. Layer calls that do not checkpoint, and non-reentrant checkpointing, run no code of this
patch.

Limits: tensors in other containers (dataclasses, ``ModelOutput``) are not lifted; a layer's
``forward`` called directly is not covered; a model enabled before ``import shim`` gets the step
when its layers are next given a function.

Full story, versions measured and references: docs/bugs.md#reentrant-keyword-grads
"""

from __future__ import annotations

from shim import BugProbe, Evidence, Patch, record_effect
from shim.checkpointing import Step, any_grad, bind_torch, check, eager, hand_over, in_effect, is_reentrant, targets
from shim.selfcheck import bare

NAME = "reentrant-keyword-grads"


@eager
def _lift(layer, function, args):
    """A step's ``act``: the call with its grad-requiring keyword tensors as checkpoint inputs."""
    keywords = function.keywords
    if not keywords or not bind_torch().is_grad_enabled() or not any_grad(keywords.values()):
        return None
    lifted: list = []
    template = {key: _template(value, lifted) for key, value in keywords.items()}
    run, bound, count = function.func, function.args, len(args)
    record_effect(
        NAME,
        "passed %d grad-requiring keyword tensor(s) (%s) of %s to reentrant checkpointing as inputs, "
        "which upstream leaves inside the partial, without gradients",
        len(lifted), ", ".join(key for key, value in template.items() if value is not keywords[key]),
        type(layer).__name__,
    )  # fmt: skip

    def recompute(_layer, *inputs):
        filled = {key: _fill(value, inputs[count:]) for key, value in template.items()}
        return run(*bound, *inputs[:count], **filled)

    return hand_over(function, recompute, layer), (*args, *lifted)


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Rebuild:
    __slots__ = ("kind", "items")

    def __init__(self, kind, items) -> None:
        self.kind = kind
        self.items = items


@eager
def _template(value, lifted: list):
    """A template of ``value``: grad-requiring tensors appended to ``lifted``, their places marked."""
    if isinstance(value, bind_torch().Tensor):
        if value.requires_grad:
            lifted.append(value)
            return _Slot(len(lifted) - 1)
        return value
    if isinstance(value, (tuple, list)):
        items = [_template(item, lifted) for item in value]
        return value if all(new is old for new, old in zip(items, value)) else _Rebuild(type(value), items)
    if type(value) is dict:
        items = {key: _template(item, lifted) for key, item in value.items()}
        return value if all(items[key] is item for key, item in value.items()) else _Rebuild(dict, items)
    return value


@eager
def _fill(template, tensors):
    kind = type(template)
    if kind is _Slot:
        return tensors[template.index]
    if kind is not _Rebuild:
        return template
    if template.kind is dict:
        return {key: _fill(item, tensors) for key, item in template.items.items()}
    filled = [_fill(item, tensors) for item in template.items]
    if template.kind in (list, tuple):
        return template.kind(filled)
    if hasattr(template.kind, "_make"):  # a named tuple
        return template.kind._make(filled)
    return template.kind(filled)


STEP = Step(applies=is_reentrant, act=_lift)

# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """One reentrantly checkpointed layer called three times, each time with one grad-requiring tensor,
    by keyword, beside hidden states that require none: the hidden states themselves
    (``hidden_states=``), another tensor (``context=``, as a cross-attention layer gets its encoder's
    output) and one in a tuple in a dict (``extra=``). The bug is there when that tensor, or the layer's
    weight, gets no gradient in one of the calls: a fix that lifts ``hidden_states=`` alone, or
    top-level tensors only, leaves the patch the calls it still breaks."""
    torch = bare.torch_module()
    layer = bare.checkpointing_layer(bare.reentrant_checkpoint())
    calls = (
        ("hidden_states=", lambda tensor: {"hidden_states": tensor}),
        ("context=", lambda tensor: {"hidden_states": torch.ones(1, 2), "context": tensor}),
        ("a tensor nested in extra=", lambda tensor: {"hidden_states": torch.ones(1, 2), "extra": {"pair": (tensor,)}}),
    )
    lost = []
    for name, keywords in calls:
        layer.linear.weight.grad = None
        tensor = torch.ones(1, 2, requires_grad=True)
        output = layer(**keywords(tensor))
        if output.requires_grad:
            output.sum().backward()
        if tensor.grad is None or layer.linear.weight.grad is None:
            lost.append(name)
    if lost:
        return Evidence(
            True,
            f"a reentrant layer given its only grad-requiring tensor as {', '.join(lost)} leaves it or the weight "
            "without a gradient",
        )
    return Evidence(
        False,
        "a reentrant layer gives a grad-requiring tensor it gets by keyword (also nested) and the weight a gradient",
    )


PATCH = Patch(
    name=NAME,
    summary="Reentrant checkpointing keeps the gradients of tensors passed to a layer by keyword.",
    distribution="transformers",
    requires=">=4.57",
    targets=targets(STEP, check=check),
    references=("docs/bugs.md#reentrant-keyword-grads", "huggingface/transformers#41818"),
    bug_probe=BugProbe(_bug_probe),
    in_effect=in_effect(STEP, "lifts grad-requiring keyword tensors into reentrant checkpoint inputs"),
)
