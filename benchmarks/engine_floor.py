"""The engine's floor and the effects ledger's cost, in ns per call (report: "One shim layer with a
pass-through wrapper" and "Effects ledger").

The floor: a fake module's function and a class's method, called bare, then through one shim layer
(a patch registered with ``shim.register``) whose wrapper only passes the call through, switched on and then
off (inert). The ledger: one ``shim.record_effect`` call, which a patch makes only on the branch
where it changed something, beside the effects the in-process workloads counted. Both with
``timeit``, best of 5.
"""

from __future__ import annotations

import types

from harness import per_call_ns, table


def measure_floor(args) -> dict:
    """The raw cost of one shim layer (pass-through wrapper) on a module function and a method,
    registered as any patch of the user's is (``shim.register``)."""
    import sys

    import shim

    module = types.ModuleType("shim_overhead_fake")

    def function(a, b=None):
        return a

    class Class:
        def method(self, a, b=None):
            return a

    module.function, module.Class = function, Class
    sys.modules[module.__name__] = module
    instance = Class()
    bare_function = per_call_ns(lambda: module.function(1, b=2), args.replay_seconds)
    bare_method = per_call_ns(lambda: instance.method(1, b=2), args.replay_seconds)
    passthrough = lambda wrapped, instance_, a, k: wrapped(*a, **k)
    targets = tuple(shim.Target(f"{module.__name__}:{path}", passthrough) for path in ("function", "Class.method"))
    # Gated on wrapt, which is always installed where a layer can be.
    shim.register(shim.Patch("engine-floor", "a pass-through layer", "wrapt", ">=1", targets))
    assert len(shim.wrappers(module.function)) == 1 and len(shim.wrappers(Class.method)) == 1, shim.status()[-1]
    on_function = per_call_ns(lambda: module.function(1, b=2), args.replay_seconds)
    on_method = per_call_ns(lambda: instance.method(1, b=2), args.replay_seconds)
    shim.disable("engine-floor")
    off_function = per_call_ns(lambda: module.function(1, b=2), args.replay_seconds)
    off_method = per_call_ns(lambda: instance.method(1, b=2), args.replay_seconds)
    return {
        "module function": (bare_function, on_function, off_function),
        "method via instance": (bare_method, on_method, off_method),
    }


def measure_ledger(args, counted: dict | None) -> dict:
    """What one effects-ledger record costs (it runs only on the branch where a patch changed
    something: a call passed through never reaches it), beside what the workloads counted."""
    from shim import record_effect

    record_ns = per_call_ns(lambda: record_effect("benchmark-probe", "probe %d", 1), args.replay_seconds)
    return {"counted": counted, "record_ns": record_ns}


def report_floor(engine: dict) -> list[str]:
    rows = [
        [kind, f"{bare:.0f}", f"{on - bare:+.0f}", f"{off - bare:+.0f}"] for kind, (bare, on, off) in engine.items()
    ]
    return [
        "One shim layer with a pass-through wrapper (the engine's floor):",
        table(rows, ["call", "bare ns", "on +ns", "inert +ns"]),
    ]


def report_ledger(ledger: dict) -> list[str]:
    if ledger["counted"] is None:
        counted = "not measured in this run"
    else:
        counted = ", ".join(f"{name} {count}" for name, count in ledger["counted"].items())
    return [
        f"Effects ledger: one record costs {ledger['record_ns']:.0f} ns and runs only on a call that changed "
        f"something (the per-layer rows above replay pass-through calls, which never reach it); "
        f"effects counted by the in-process workloads (load, steps, trl cycles): {counted}"
    ]
