"""The cost of each shim layer per call, in ns (report: "Per-wrapper cost").

Each target holds one shim layer, whatever the number of patches with a part in it. The layers are
found through the registry (every target of every patch whose part is in place), so a new patch
shows up here without changes. A temporary outermost wrapt layer on each wrapped attribute
(:class:`Recorder`) counts the calls of each workload (load, both training steps, trl's two cycles)
and keeps a sample of them; each layer is then timed by replaying an evenly spaced sample through it
(on: its parts active), through it with its patches switched off (inert), and around it (bare), with
``timeit``, best of 5. The cost of a workload is its call count times (on - bare).
"""

from __future__ import annotations

import sys

from harness import per_call_ns, table
from workloads import batch, load, train_step, training_model, trl_cycle, trl_reference_cycle


def shim_layers() -> list[dict]:
    """Every shim layer in place right now, one per target, found through the registry (nothing
    listed by hand), with the patches that have a part in it, outermost first."""
    import wrapt

    import shim

    layers = {}
    for name in shim.registry.names:
        for target in shim.registry.patch(name).targets:
            parts = shim.wrappers(target.spec)
            handle = dict(parts).get(name)
            if handle is None or target.spec in layers:
                continue
            module = sys.modules[target.module]
            parent, attribute, _outer = wrapt.resolve_path(module, target.path)
            layers[target.spec] = {
                "patches": [part for part, _layer in parts],
                "spec": target.spec,
                "parent": parent,
                "attribute": attribute,
                "handle": handle,
                "inner": handle.__wrapped__,
                "module": module,
                "path": target.path,
            }
    return list(layers.values())


class Recorder:
    """A temporary outermost wrapt layer on each wrapped attribute: counts calls, keeps a sample."""

    def __init__(self, layers):
        import wrapt

        self.counts: dict = {}
        self.calls: dict = {}
        self.workload = ""
        self._installed = []
        for spec in dict.fromkeys(layer["spec"] for layer in layers):
            layer = next(layer for layer in layers if layer["spec"] == spec)

            def record(wrapped, instance, args, kwargs, spec=spec):
                if self.workload:
                    key = (spec, self.workload)
                    self.counts[key] = self.counts.get(key, 0) + 1
                    kept = self.calls.setdefault(spec, [])
                    if len(kept) < 2000:
                        kept.append((instance, args, dict(kwargs)))
                return wrapped(*args, **kwargs)

            factory = lambda original, r=record: wrapt.FunctionWrapper(original, r)
            handle = wrapt.wrap_object(layer["module"], layer["path"], factory)
            self._installed.append((layer["module"], layer["path"], handle))

    def __call__(self, workload: str):
        self.workload = workload
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.workload = ""

    def remove(self):
        import wrapt

        for module, path, handle in reversed(self._installed):
            wrapt.unwrap_object(module, path, handle)


def record_workloads(args, directory: str, layers: list) -> tuple[dict, dict]:
    """The calls each layer's attribute receives in each workload: (counts, kept calls)."""
    import accelerate

    recorder = Recorder(layers)
    config, shape = args.sizes["step_config"], args.sizes["batch"]
    input_ids = batch(config, shape)
    accelerator = accelerate.Accelerator(cpu=True)
    try:
        with recorder("load"):
            load(directory)
        for reentrant in (True, False):
            model, optimizer = training_model(config, reentrant)
            train_step(model, optimizer, input_ids)
            with recorder("step (reentrant)" if reentrant else "step (non-reentrant)"):
                train_step(model, optimizer, input_ids)
        with recorder("trl unwrap cycle"):
            trl_cycle(model, accelerator, {"use_reentrant": False})
        with recorder("trl disable_gc cycle"):
            trl_reference_cycle(model, {"use_reentrant": False})
        return dict(recorder.counts), dict(recorder.calls)
    finally:
        recorder.remove()


def measure(args, directory: str, log) -> dict:
    """Count calls through each shim layer in each workload, then time each layer by replaying them."""
    import trl.models.utils  # noqa: F401  (the trl cycles' module: its layers are in place to be listed)

    import shim

    layers = shim_layers()
    counts, calls = record_workloads(args, directory, layers)

    log("per-wrapper replays")
    rows = []
    for layer in layers:
        row = {
            "patches": layer["patches"],
            "target": layer["spec"],
            "calls": {w: c for (s, w), c in counts.items() if s == layer["spec"]},
        }
        if layer["spec"] not in calls:
            row["replay"] = "not called by these workloads"
            rows.append(row)
            continue
        recorded = calls[layer["spec"]]
        sample = recorded[:: max(1, len(recorded) // 50)]  # evenly spaced: short and long paths alike

        def bind(function, instance):
            if instance is not None and isinstance(layer["parent"], type) and hasattr(function, "__get__"):
                return function.__get__(instance, type(instance))
            return function

        def replay(function):  # binding is part of the call, as in ``model.method(...)``
            return lambda: [bind(function, instance)(*a, **k) for instance, a, k in sample]

        try:
            on = per_call_ns(replay(layer["handle"]), args.replay_seconds) / len(sample)
            with shim.disabled(*layer["patches"]):
                inert = per_call_ns(replay(layer["handle"]), args.replay_seconds) / len(sample)
            bare = per_call_ns(replay(layer["inner"]), args.replay_seconds) / len(sample)
        except Exception as exc:  # a call that cannot be repeated out of its context
            row["replay"] = f"replay failed: {exc!r}"[:120]
        else:
            row.update(on_ns=on, inert_ns=inert, bare_ns=bare)
        rows.append(row)
    return {"rows": rows}


def report(wrappers: dict) -> list[str]:
    out = [
        "Per-layer cost, ns/call (timeit, best of 5, replaying a call recorded in the workloads); "
        "cost = through the target's one shim layer (its parts, outermost first) - around it"
    ]
    rows = []
    for row in wrappers["rows"]:
        extra = lambda c: f" ({c * (row['on_ns'] - row['bare_ns']) / 1e3:+.1f} us)" if "on_ns" in row else ""
        calls = ", ".join(f"{w} {c}{extra(c)}" for w, c in row["calls"].items()) or "-"
        if "on_ns" in row:
            rows.append(
                [
                    row["target"],
                    ", ".join(row["patches"]),
                    f"{row['bare_ns']:.0f}",
                    f"{row['on_ns'] - row['bare_ns']:+.0f}",
                    f"{row['inert_ns'] - row['bare_ns']:+.0f}",
                    calls,
                ]
            )
        else:
            rows.append([row["target"], ", ".join(row["patches"]), "", "", "", f"{calls}: {row['replay']}"])
    headers = ["target", "parts", "call ns", "on +ns", "inert +ns", "calls per workload (cost)"]
    out.append(table(rows, headers, left=(0, 1, 5)))
    out.append(
        "(a target missing here is not applied on this version; 'step' workloads absent from 'calls' mean "
        "no shim layer runs during a training step)"
    )
    return out
