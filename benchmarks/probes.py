"""The bug probes' cost (``Patch.bug_probe``, ``shim.probing``): what asking every probe adds where
the release cannot vouch for the code, in fresh interpreters.

Each round runs two children, ABBA: one imports every target module (and the modules the probes
need) with ``SHIM_PROBE=always``, one with ``SHIM_PROBE=never``; the CPU time of that import is
compared, and the first child reports the seconds each probe took, cold (its one ask in the process,
at its targets' import, as on a user's dev build) and warm (asked again after), and the CPU time of
a warm ask (the median of five: on a machine other work shares, the wall-clock figures grow with
its load, the CPU time much less). A third child with
the default, ``SHIM_PROBE=auto``, on the installed (measured) releases checks that no probe is asked
there: nothing added. Target: every probe together at most 50 ms cold on the CPU.

    .venv/bin/python benchmarks/probes.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from harness import child_env, compare, interleave, pin, quartiles, run_child, table

TARGET_MS = 50.0

CHILD = """
import json, time
import torch  # the probes' cost is what comes after the libraries' own import
import shim
from shim import probing
from shim.tools.targets import import_targets
names = list(shim.registry.names)
cpu = time.process_time()
import_targets(shim.registry, names)
cpu = time.process_time() - cpu
cold = {f"{s.name} ({a['library']})": a["seconds"] for s in shim.status() for a in s.probe or ()}
warm, warm_cpu = {}, {}
for name in names:
    patch = shim.registry.patch(name)
    for probe in patch.probes:
        library = probe.library or patch.distribution
        key = f"{name} ({library})"
        if key in cold:
            with shim.registry.disabled(name):
                warm[key] = probing.ask(probe, library, "again").seconds
                spent = []
                for _ in range(5):
                    start = time.process_time()
                    probing.ask(probe, library, "again")
                    spent.append(time.process_time() - start)
                warm_cpu[key] = sorted(spent)[2]
print("RESULT " + json.dumps({"cpu": cpu, "cold": cold, "warm": warm, "warm_cpu": warm_cpu}))
"""


def child(mode: str) -> dict:
    return run_child([sys.executable, "-c", CHILD], child_env(SHIM_PROBE=mode))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cpu", default="last", help="the CPU to pin to ('none': not pinned)")
    args = parser.parse_args(argv)
    print(pin(args.cpu))
    always, never = interleave(lambda: child("always"), lambda: child("never"), args.rounds)
    auto = child("auto")
    import_cost = compare([r["cpu"] for r in always], [r["cpu"] for r in never])
    keys = sorted(always[0]["cold"])
    rows = []
    for key in keys:
        cold = quartiles([r["cold"][key] * 1000 for r in always])
        warm = quartiles([r["warm"][key] * 1000 for r in always])
        warm_cpu = quartiles([r["warm_cpu"][key] * 1000 for r in always])
        rows.append([key, f"{cold[1]:.2f}", f"{cold[0]:.2f}-{cold[2]:.2f}", f"{warm[1]:.3f}", f"{warm_cpu[1]:.3f}"])
    totals = [sum(r["cold"].values()) * 1000 for r in always]
    total = quartiles(totals)
    print(table(rows, ["probe (library)", "cold ms", "cold IQR", "warm ms", "warm CPU ms"]))
    print()
    print(
        f"every probe, cold, summed: {total[1]:.1f} ms (IQR {total[0]:.1f}-{total[2]:.1f}, {len(totals)} rounds); "
        f"target <= {TARGET_MS:.0f} ms: {'met' if total[1] <= TARGET_MS else 'MISSED'}"
    )
    added = (import_cost["on"] - import_cost["off"]) * 1000
    print(
        f"importing every target module: {import_cost['on'] * 1000:.0f} ms CPU with SHIM_PROBE=always, "
        f"{import_cost['off'] * 1000:.0f} ms with never (+{added:.0f} ms; ratio {import_cost['ratio']:.3f}, "
        f"IQR {import_cost['ratio_q25']:.3f}-{import_cost['ratio_q75']:.3f})"
    )
    print(
        f"SHIM_PROBE=auto on the installed releases: {len(auto['cold'])} probes asked "
        f"({'nothing added' if not auto['cold'] else 'probes run on a measured release'})"
    )
    print(f"median per probe, warm: {statistics.median(v for r in always for v in r['warm'].values()) * 1000:.3f} ms")
    cpu_totals = quartiles([sum(r["warm_cpu"].values()) * 1000 for r in always])
    print(f"every probe, warm, summed CPU: {cpu_totals[1]:.1f} ms (IQR {cpu_totals[0]:.1f}-{cpu_totals[2]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
