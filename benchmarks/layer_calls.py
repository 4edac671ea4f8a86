"""What a ``GradientCheckpointingLayer`` call costs with the shim (report: "layer calls"), in ns per
call, and how many of the shim's frames it runs.

A layer whose ``forward`` does nothing, and whose checkpoint function only calls it, is called the
ways a step calls a decoder layer: without checkpointing (evaluation, ``generate()``, training
without it), with reentrant checkpointing and a positional input that requires grad (the
reentrant patches' checkpoint function decides and passes the call on), and with non-reentrant
checkpointing and a keyword input (upstream's function, untouched). Checkpointing is enabled
through ``PreTrainedModel._set_gradient_checkpointing``, as every enable does. Each case is timed
with the shim on and after ``shim.deactivate()`` (bare: upstream's call), ``timeit`` best of 5, and
its shim frames are counted with ``sys.setprofile``.
"""

from __future__ import annotations

import sys

from harness import per_call_ns, table


def shim_frames(call) -> int:
    """Python frames of the shim (``shim``, ``shim.patches``) that one ``call()`` runs."""
    import os

    import shim

    roots = tuple(os.path.dirname(path) + os.sep for path in (shim.__file__, shim.patches.__file__))
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return len(seen)


def measure(args) -> dict:
    """ns per layer call and shim frames per call, per case, shim on and bare."""
    import functools

    import torch
    import transformers.modeling_layers as modeling_layers
    import transformers.modeling_utils as modeling_utils

    import shim

    class Light(modeling_layers.GradientCheckpointingLayer):
        def forward(self, hidden_states, attention_mask=None):
            return hidden_states

    def run(function, *inputs, **options):  # a checkpoint function that only calls the layer
        return function(*inputs)

    light = Light()
    light.train()
    hidden = torch.zeros(1, 1, 4, requires_grad=True)
    mask = torch.zeros(1, 1)
    cases = {
        "no checkpointing": (None, lambda: light(hidden, attention_mask=mask)),
        "reentrant, positional input requires grad": (
            functools.partial(run, use_reentrant=True),
            lambda: light(hidden, attention_mask=mask),
        ),
        "non-reentrant, keyword input requires grad": (
            functools.partial(run, use_reentrant=False),
            lambda: light(hidden_states=hidden, attention_mask=mask),
        ),
    }
    timings: dict = {}

    def time_cases(key: str) -> None:
        for label, (function, call) in cases.items():
            enable = modeling_utils.PreTrainedModel._set_gradient_checkpointing
            enable(light, enable=function is not None, gradient_checkpointing_func=function or run)
            timings.setdefault(label, {})[key] = per_call_ns(call, args.replay_seconds)
            timings[label][f"{key} frames"] = shim_frames(call)

    time_cases("on")
    shim.deactivate()  # the layers removed: upstream's call
    try:
        time_cases("bare")
    finally:
        shim.activate()
    return timings


def report(layer_calls: dict) -> list[str]:
    rows = [
        [label, f"{t['bare']:.0f}", f"{t['on'] - t['bare']:+.0f}", t["on frames"]] for label, t in layer_calls.items()
    ]
    return [
        "Layer calls (a GradientCheckpointingLayer whose forward does nothing): ns per call with the shim "
        "on, over upstream's (shim.deactivate()), and the shim's Python frames per call",
        table(rows, ["layer call", "bare ns", "on +ns", "shim frames"]),
    ]
