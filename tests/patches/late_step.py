"""A step on the checkpointing path declared after the built-ins were written, as a new patch (or a
pack's) would be, with the public API (``shim.checkpointing``): "after reentrant-frozen-input-grads",
naming no other step. Its act notes whether the function it is handed already carries the layer
both ways (checkpoint-function-finds-layer's hand-over), then hands on a recomputation of its own in
the shape the layer used. tests/patches/test_checkpointing_path.py registers it in a fresh
interpreter."""

from shim import Patch
from shim.checkpointing import Step, check, hand_over, targets

NAME = "late-step"
SEEN: list = []  # per act: whether the function already had the layer as func.func.__self__


def _act(layer, function, args):
    SEEN.append(hasattr(function.func, "__self__"))

    def recompute(_layer, *inputs):
        return function(*inputs)

    return hand_over(function, recompute, layer), args


STEP = Step(applies=callable, act=_act)

PATCH = Patch(
    name=NAME,
    summary="A late step that hands over its own recomputation.",
    distribution="transformers",
    requires=">=4.57",
    targets=targets(STEP, check=check),
    after=("reentrant-frozen-input-grads",),
)
