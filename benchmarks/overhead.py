#!/usr/bin/env python
"""What ``import shim`` costs: every patch, shim on against shim off, in one run.

    python benchmarks/overhead.py            # full run (a few minutes on 2 busy cores)
    python benchmarks/overhead.py --quick    # smoke run: few repeats, small models (~1 min)
    python benchmarks/overhead.py --only imports --only engine    # some sections alone

Run it with the interpreter of the environment to measure (``.venv/bin/python``); it puts the
checkout it lives in first on ``sys.path``. It never fails on a ratio: it prints the numbers and
whether each target holds. Two kinds of "off" are measured and always labelled:

- ``SHIM_DISABLE=all`` (or no ``import shim`` at all) in a fresh interpreter: nothing is wrapped.
  This is the honest baseline for import time, load time and peak memory.
- ``shim.disabled()`` in the same process: the wrappers stay, inert (wrapt's ``enabled=``
  short-circuit). The in-process comparisons interleave on and off on identical models.

Every measurement alternates on and off (ABBA order) and reports medians; a ratio is the median of
the per-round ratios, with their interquartile range as the noise. Shim layers are found from the
registry, so a new patch shows up in the per-layer table without changes here.

This file is the entry point and the report; each section is measured by its own module beside it:
``imports.py``, ``fresh.py`` (fresh interpreters; also the child they run), ``in_process.py``,
``wrappers.py``, ``engine_floor.py`` (the engine's floor and the effects ledger) and
``layer_calls.py``, on the workloads of ``workloads.py`` and the statistics, memory readings, child
interpreters and tables of ``harness.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import engine_floor
import fresh
import imports
import in_process
import layer_calls
import wrappers
from harness import ROOT, noise_line, pin
from workloads import STEP_CONFIG, STEP_SHAPE, quiet_libraries, save_model

SECTIONS = ("imports", "fresh", "in-process", "wrappers", "engine", "layer-calls")


# -- settings ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats and small models (a smoke run)")
    parser.add_argument("--rounds", type=int, help="on/off rounds per measurement (default 12, quick 2)")
    parser.add_argument("--cpu", default="last", help="CPU to pin to: an index, 'last' (default) or 'none'")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    parser.add_argument(
        "--only", action="append", choices=SECTIONS, help="measure and report this section alone (repeatable)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the fresh-interpreter child (fresh.py)
    args = parser.parse_args(argv)
    quick = args.quick
    args.sizes = {
        # from_pretrained: a Llama with 9 tensors per layer (+3); 112 layers = 1011 tensors.
        "load_layers": 12 if quick else 112,
        # the training step
        "step_config": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=128,
        )
        if quick
        else STEP_CONFIG,
        "batch": (2, 32) if quick else STEP_SHAPE,
        # trl's disable/enable cycle is also measured on a deep model: its cost grows with the modules
        "deep_layers": 8 if quick else 32,
    }
    args.rounds = args.rounds or (2 if quick else 12)
    args.import_rounds = 2 if quick else max(args.rounds, 12)
    args.worker_rounds = 1 if quick else 6
    args.steps_per_block = 3 if quick else 8
    args.cycles_per_block = 5 if quick else 100  # ~50 ms blocks: long enough to shrug off scheduler noise
    args.replay_seconds = 0.01 if quick else 0.1
    args.only = list(dict.fromkeys(args.only or SECTIONS))
    return args


# -- the run ----------------------------------------------------------------------------------------


def measure(args, log) -> dict:
    """Every section of ``args.only``, in the report's order: the results by their JSON key."""
    results = {}
    if "imports" in args.only:
        log("imports in fresh interpreters")
        results["imports"] = imports.measure(args, log)

    import shim  # the user's first line, before torch and transformers

    quiet_libraries()
    import trl  # noqa: F401  (imported before the workloads, as by a training script)
    import wrapt  # noqa: F401

    counted = None
    if {"fresh", "in-process", "wrappers"} & set(args.only):
        with tempfile.TemporaryDirectory() as directory:
            tensors = save_model(directory, args.sizes["load_layers"])
            if "fresh" in args.only:
                log(f"load and training step in fresh interpreters ({tensors} tensors)")
                results["workers"] = fresh.measure(args, directory, log)
            if "in-process" in args.only:
                results["in_process"] = in_process.measure(args, directory, log)
                counted = {record.name: record.effects for record in shim.status()}  # before the replays add more
            if "wrappers" in args.only:
                results["wrappers"] = wrappers.measure(args, directory, log)
    if "engine" in args.only:
        results["engine"] = engine_floor.measure_floor(args)
    if "layer-calls" in args.only:
        results["layer_calls"] = layer_calls.measure(args)
    if "engine" in args.only:
        results["effects"] = engine_floor.measure_ledger(args, counted)
    return results


def report(args, info: str, results: dict) -> str:
    only = "" if set(args.only) == set(SECTIONS) else f", only {', '.join(args.only)}"
    out = []
    out.append(f"hf-train-shim overhead ({'quick' if args.quick else 'full'} run{only}): shim on / shim off, same run")
    out.append(info)
    out.append(
        "times are CPU time of the measuring process (time.process_time: robust against other load on a "
        "shared machine; the work is single-threaded); 'wall ratio' is the same with wall-clock time"
    )
    out.append(
        "ratio = median of per-round on/off ratios (rounds alternate ABBA); noise = relative IQR of the noisier side"
    )
    out.append("")
    if "imports" in results:
        out += [*imports.report(args, results["imports"]), ""]
    if "workers" in results:
        out += [*fresh.report(args, results["workers"]), ""]
    if "in_process" in results:
        out += [*in_process.report(args, results["in_process"]), ""]
    if "wrappers" in results:
        out += wrappers.report(results["wrappers"])
    if "engine" in results:
        out += engine_floor.report_floor(results["engine"])
    if "layer_calls" in results:
        out += layer_calls.report(results["layer_calls"])
    if "effects" in results:
        out += engine_floor.report_ledger(results["effects"])
    out += noise_line(results.get(key, {}) for key in ("imports", "workers", "in_process"))
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        fresh.worker(args.worker)
        return 0
    pinned = pin(args.cpu)
    sys.path.insert(0, str(ROOT))
    started = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    log = lambda message: print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    results = measure(args, log)

    import torch
    import transformers
    import trl
    import wrapt

    import shim

    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    applied = [s.name for s in shim.status() if s.state == "applied"]
    info = (
        f"python {platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__} | "
        f"trl {trl.__version__} | wrapt {wrapt.__version__} | {pinned}, 1 torch thread | load average "
        f"{load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs | {time.perf_counter() - started:.0f} s\n"
        f"patches applied ({len(applied)}): {', '.join(applied)}"
    )
    print(report(args, info, results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
