"""Per-call cost of the two reentrant patches stacked on ``GradientCheckpointingLayer.__call__``
(report: "GradientCheckpointingLayer calls that no reentrant patch diverts"), in ns per call.

A layer whose ``forward`` does nothing, and whose checkpoint function only calls it, is called the
ways a training step calls a decoder layer (no checkpointing; reentrant with a positional input
that requires grad; non-reentrant with a keyword one): none is diverted, so what is timed is the
layers' decision itself. Each case is timed with both patches on, with each switched off alone,
with both off (inert), and after ``shim.deactivate()`` (bare: upstream's call), ``timeit`` best of 5.
The per-wrapper rows time whole decoder layers, whose own noise hides this.
"""

from __future__ import annotations

from harness import per_call_ns, table

REENTRANT = ("reentrant-keyword-grads", "reentrant-frozen-input-grads")


def measure(args) -> dict:
    """ns per ``GradientCheckpointingLayer`` call that neither reentrant patch diverts, per case and setting."""
    import functools

    import torch
    import transformers.modeling_layers as modeling_layers

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
        "no checkpointing": (False, None, lambda: light(hidden, attention_mask=mask)),
        "reentrant, positional input requires grad": (
            True,
            functools.partial(run, use_reentrant=True),
            lambda: light(hidden, attention_mask=mask),
        ),
        "non-reentrant, keyword input requires grad": (
            True,
            functools.partial(run, use_reentrant=False),
            lambda: light(hidden_states=hidden, attention_mask=mask),
        ),
    }
    timings: dict = {}

    def time_cases(key: str) -> None:
        for label, (checkpointing, function, call) in cases.items():
            light.gradient_checkpointing = checkpointing
            light._gradient_checkpointing_func = function
            timings.setdefault(label, {})[key] = per_call_ns(call, args.replay_seconds)

    time_cases("on")
    for name in REENTRANT:
        with shim.disabled(name):
            time_cases(name)
    with shim.disabled(*REENTRANT):
        time_cases("inert")
    shim.deactivate()  # the layers removed: upstream's call
    try:
        time_cases("bare")
    finally:
        shim.activate()
    return timings


def report(layer_calls: dict) -> list[str]:
    rows = [
        [
            label,
            f"{t['bare']:.0f}",
            f"{t['on'] - t['bare']:+.0f}",
            *(f"{t['on'] - t[name]:+.0f}" for name in REENTRANT),
            f"{t['inert'] - t['bare']:+.0f}",
        ]
        for label, t in layer_calls.items()
    ]
    return [
        "GradientCheckpointingLayer calls that no reentrant patch diverts (a layer whose forward does nothing): "
        "ns per call; 'on' both layers acting, '<patch> +ns' what that patch's decision adds, 'inert' both "
        "switched off",
        table(rows, ["layer call", "bare ns", "on +ns", *(f"{n} +ns" for n in REENTRANT), "inert +ns"]),
    ]
