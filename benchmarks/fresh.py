"""Load, training steps and peak memory in fresh interpreters (report section 3-4, 6): shim on
against ``SHIM_DISABLE=all``, where nothing is wrapped, the honest baseline for load and memory.

Each round starts two children of this file (ABBA order), each of which imports the shim first (on,
or off through the environment) and then: loads the saved model once cold and reads the peak RSS
of the process and above the start of the load, times warm ``from_pretrained`` calls, and builds a
checkpointed model for each of reentrant and non-reentrant, reads the peak RSS of its first two
steps, and times further steps. CPU times are medians within a child; the ratio is the median over
the rounds. Peak RSS is ``VmHWM``, restarted before each phase.

    python benchmarks/fresh.py SPEC_JSON    # the child; benchmarks/overhead.py starts it
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from harness import (
    HEADERS,
    Clock,
    answer,
    child_env,
    compare,
    comparison_row,
    interleave,
    median_sample,
    peak_mib,
    reset_peak,
    rss_mib,
    run_child,
    table,
)
from workloads import batch, load, quiet_libraries, train_step, training_model


def measure(args, directory: str, log) -> dict:
    """Load and training step in fresh interpreters: shim on vs SHIM_DISABLE=all (nothing wrapped)."""
    spec = json.dumps(
        {
            "directory": directory,
            "sizes": args.sizes,
            "loads": max(2, args.rounds // 2),
            "steps": args.steps_per_block * 5,
        }
    )
    argv = [sys.executable, str(Path(__file__).resolve()), spec]
    on, off = interleave(
        lambda: run_child(argv, child_env()),
        lambda: run_child(argv, child_env(SHIM_DISABLE="all")),
        args.worker_rounds,
    )
    out = {}
    for key in on[0]:
        if key not in ("applied", "waiting") and key in off[0]:
            out[key] = compare([r[key] for r in on], [r[key] for r in off])
    out["applied_on"] = on[0]["applied"]
    out["applied_off"] = off[0]["applied"]
    out["waiting"] = on[0]["waiting"]
    return out


def worker(spec_json: str) -> None:
    """One fresh interpreter: ``import shim`` first (on, or off through SHIM_DISABLE), then the workloads."""
    spec = json.loads(spec_json)
    import shim  # SHIM_DISABLE decides whether anything is wrapped

    quiet_libraries()
    sizes = spec["sizes"]
    result = {}
    tracked = reset_peak()

    # The phase is the load itself: the model classes are imported first. That import is where the
    # shim's patches apply (their modules, wrapt and packaging are imported lazily, ~2 MiB), which
    # the whole-process peak below counts.
    from transformers import LlamaForCausalLM  # noqa: F401

    start = rss_mib()
    model = load(spec["directory"])  # cold: the first load of the process
    result["load_peak_mib"] = peak_mib()
    if tracked:
        result["load_peak_delta_mib"] = peak_mib() - start
    del model
    times = []
    for _ in range(spec["loads"]):
        gc.collect()
        with Clock() as clock:
            load(spec["directory"])
        times.append(clock.sample)
    result["load_s"] = median_sample(times)

    for reentrant in (True, False):
        name = "reentrant" if reentrant else "non_reentrant"
        input_ids = batch(sizes["step_config"], sizes["batch"])
        reset_peak()
        start = rss_mib()
        model, optimizer = training_model(sizes["step_config"], reentrant)
        train_step(model, optimizer, input_ids)  # first step: optimizer state, autograd buffers
        train_step(model, optimizer, input_ids)
        result[f"step_{name}_peak_mib"] = peak_mib()
        if tracked:
            result[f"step_{name}_peak_delta_mib"] = peak_mib() - start
        times = []
        for _ in range(spec["steps"]):
            with Clock() as clock:
                train_step(model, optimizer, input_ids)
            times.append(clock.sample)
        result[f"step_{name}_s"] = median_sample(times)
        del model, optimizer
    result["applied"] = sum(s.state == "applied" for s in shim.status())
    result["waiting"] = [s.name for s in shim.status() if s.state == "pending"]
    answer(result)


LABELS = {
    "load_s": ("from_pretrained, warm", 1e3, "load"),
    "load_peak_mib": ("  peak RSS of the process, first load", 1, "memory"),
    "load_peak_delta_mib": ("  peak RSS above start of load", 1, "memory"),
    "step_reentrant_s": ("training step, reentrant", 1e3, "cross"),
    "step_reentrant_peak_mib": ("  peak RSS, first two steps", 1, "memory"),
    "step_reentrant_peak_delta_mib": ("  peak RSS above start", 1, "memory"),
    "step_non_reentrant_s": ("training step, non-reentrant", 1e3, "cross"),
    "step_non_reentrant_peak_mib": ("  peak RSS, first two steps", 1, "memory"),
    "step_non_reentrant_peak_delta_mib": ("  peak RSS above start", 1, "memory"),
}


def report(args, workers: dict) -> list[str]:
    out = []
    out.append(
        f"3-4, 6. Fresh interpreters, shim on vs SHIM_DISABLE=all (nothing wrapped): "
        f"{workers['applied_on']} patches applied vs {workers['applied_off']}"
        + (
            f" ({', '.join(workers['waiting'])} waits for a module these workloads do not import)"
            if workers["waiting"]
            else ""
        )
        + "; time in ms, memory in MiB"
    )
    rows = [
        comparison_row(label, workers[key], scale, kind, args.quick)
        for key, (label, scale, kind) in LABELS.items()
        if key in workers
    ]
    out.append(table(rows, HEADERS))
    out.append(
        "(*) a step takes milliseconds and its time scatters by several % between interpreters (memory "
        "layout) whatever the shim does: the step target is judged in the same process, below"
    )
    out.append(
        "torch allocator peak: not applicable on CPU (the CPU allocator keeps no statistics); RSS is the measure"
    )
    return out


if __name__ == "__main__":
    worker(sys.argv[1])
