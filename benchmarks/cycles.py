#!/usr/bin/env python
"""N disable/enable cycles of checkpointing on a 4-layer tiny Llama, nothing else: trl's cycle
(``activation_checkpointing_disable()`` + ``activation_checkpointing_enable({"use_reentrant": True})``),
counted in instructions (repeatable, unlike time on a shared machine) or timed in CPU.

Instructions, the whole process (the second total minus the first, over 2000: per cycle; the start's
noise, up to 100 M instructions, is ±50 000 per cycle)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/cycles.py 0
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/cycles.py 2000

Instructions of the cycles alone (the loop runs inside ``functools.reduce``, which nothing else here
calls, so callgrind counts only it; exact to a few instructions per cycle, with a few hundred cycles)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null --collect-atstart=no \\
        --toggle-collect=functools_reduce .venv/bin/python benchmarks/cycles.py 400

``SHIM_DISABLE=all`` for off (upstream). The objects made before the loop are moved out of the
garbage collector's sight (``gc.freeze()``), so a collection in the loop costs what the loop made,
not the size of the heap torch and transformers leave behind.

CPU time, shim on against ``SHIM_DISABLE=all`` in fresh interpreters alternating ABBA, each timing
``--blocks`` blocks of ``--cycles`` cycles after a warm-up and answering its median block; prints the
median of the per-round ratios with their quartiles::

    .venv/bin/python benchmarks/cycles.py --cpu 20
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

KWARGS = {"use_reentrant": True}


def reentrant_model():
    """The 4-layer tiny Llama in training mode, reentrant checkpointing enabled, the heap frozen."""
    import shim  # noqa: F401  (as a training script starts)
    from shim.tools.targets import quiet_transformers
    from tests.tinymodels import tiny_llama

    quiet_transformers()
    warnings.simplefilter("ignore")
    model = tiny_llama(4)
    model.train()
    model.activation_checkpointing_enable(KWARGS)
    gc.collect()
    gc.freeze()
    return model


def cycles(model, count: int) -> None:
    """``count`` disable/enable cycles, inside ``functools.reduce`` (callgrind's toggle)."""

    def cycle(_done: None, _index: int) -> None:
        model.activation_checkpointing_disable()
        model.activation_checkpointing_enable(KWARGS)

    functools.reduce(cycle, range(count), None)


def timed_blocks(count: int, blocks: int) -> float:
    """CPU seconds per cycle: the median of ``blocks`` blocks of ``count`` cycles, after a warm-up."""
    from harness import timed

    model = reentrant_model()
    cycles(model, count)
    return statistics.median(timed(lambda: cycles(model, count), per=count)[0] for _ in range(blocks))


def compare_cpu(rounds: int, count: int, blocks: int, cpu: str) -> None:
    from harness import answer, child_env, compare, interleave, pin, run_child

    pinned = pin(cpu)
    argv = [sys.executable, __file__, "--child", "--cycles", str(count), "--blocks", str(blocks)]
    on, off = interleave(
        lambda: run_child(argv, child_env())["seconds"],
        lambda: run_child(argv, child_env(SHIM_DISABLE="all"))["seconds"],
        rounds,
    )
    result = compare(on, off)
    print(
        f"{rounds} rounds of fresh interpreters ({pinned}), each the median of {blocks} blocks of {count} cycles:\n"
        f"  shim on {result['on'] * 1e6:.1f} µs, SHIM_DISABLE=all {result['off'] * 1e6:.1f} µs per cycle (CPU), "
        f"ratio {result['ratio']:.3f} (IQR {result['ratio_q25']:.3f} - {result['ratio_q75']:.3f}), "
        f"noise {result['noise'] * 100:.0f}%"
    )
    answer(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", nargs="?", type=int, default=200, help="cycles to run (instruction counts)")
    parser.add_argument("--cpu", type=int, metavar="ROUNDS", help="time the cycle, on against off, ROUNDS rounds")
    parser.add_argument("--cycles", type=int, default=500, help="cycles per timed block (--cpu)")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per interpreter (--cpu)")
    parser.add_argument("--pin", default="last", help="the CPU to pin to: an index, 'last' or 'none' (--cpu)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from harness import answer

        answer({"seconds": timed_blocks(args.cycles, args.blocks)})
    elif args.cpu:
        compare_cpu(args.cpu, args.cycles, args.blocks, args.pin)
    else:
        cycles(reentrant_model(), args.count)


if __name__ == "__main__":
    main()
