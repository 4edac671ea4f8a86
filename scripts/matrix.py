#!/usr/bin/env python3
"""The version matrix: every patch tested on the transformers × trl (and peft) releases it targets.

Each cell is one virtual environment, ``.venvs/<cell>`` (the default cell is ``.venv``), built by
``scripts/setup.sh`` from ``constraints/<cell>.txt`` exactly as a user builds the default one:
torch 2.13.0 CPU first, then the shim and the pinned stack, with uv from one shared cache (cells
are hard links of the same files). Builds run two at a time ahead of the tests (``--jobs``). In each
cell the script runs tests (doctor-only edge cells excepted; outside the default cell each patch's
own tests and the everyday workflows, :func:`matrixlib.runs.cell_tests`) and ``python -m shim doctor
--json-file``, saving doctor's table, its findings and the cell's versions under
``doctor-reports/<cell>/``. Then it checks every patch's version gate against what doctor measured
and regenerates the README's compatibility table.

The gate check, for every patch (a new patch is a new row, nothing to configure) and every cell:

* inside the gate: doctor must say ``fixed`` (the bug reproduces with the patch off, is gone on);
* outside the gate: ``not affected`` (the bug does not reproduce), or ``not installed``, or the bug
  is present and ``constraints/known-unfixed.txt`` says why the patch is skipped there;
* a gate's lower bound ``>=X`` above the oldest cell must be a cell's exact version, so the first
  release inside the gate is measured (edge cells exist for that: they run doctor only).

Usage (stdlib only, any python3 >= 3.10; run from anywhere)::

    python3 scripts/matrix.py                      # every cell, then the gate check and README check
    python3 scripts/matrix.py tf5.0-trl0.29        # some cells (README check needs all reports)
    python3 scripts/matrix.py --skip-suite default # CI: .ci/run's first line ran the default suite
    python3 scripts/matrix.py --doctor-only        # every cell, doctor but no suite: a quick gate check
    python3 scripts/matrix.py --report-only        # no runs: check and table from doctor-reports/
    python3 scripts/matrix.py --write-readme       # rewrite the README table instead of checking it
    python3 scripts/matrix.py --lock tf5.0-trl0.29 # re-resolve a cell's top pins, write full pins
    python3 scripts/matrix.py --jobs 0             # build each cell just before its tests (no overlap)

The code is the package ``scripts/matrixlib/``, one module per job: ``cells`` (the cells and their
builds), ``runs`` (suites and doctor in each cell), ``lock`` (``--lock``), ``gates`` (the gate
check) and ``table`` (the README table). This file is the command line.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path

# The package sits beside this file. Python puts the script's folder on sys.path, but not under -I
# or PYTHONSAFEPATH, nor when this file is loaded by path (tests/project/test_matrix.py): add it first.
HERE = str(Path(__file__).resolve().parent)
if sys.path[:1] != [HERE]:
    sys.path.insert(0, HERE)

from matrixlib.cells import BY_NAME, CELLS, say  # noqa: E402
from matrixlib.gates import check, load_reports  # noqa: E402
from matrixlib.lock import lock  # noqa: E402
from matrixlib.runs import run_cells  # noqa: E402
from matrixlib.table import readme_block, render, write_readme  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="*", help=f"cells to run (default: all): {', '.join(BY_NAME)}")
    parser.add_argument(
        "--skip-suite",
        action="append",
        default=[],
        metavar="CELL",
        help="run doctor but not the suite in CELL (CI: the first line ran the default suite)",
    )
    parser.add_argument(
        "--doctor-only", action="store_true", help="run doctor but no suite in every cell (a quick gate check)"
    )
    parser.add_argument("--report-only", action="store_true", help="run nothing; check doctor-reports/")
    parser.add_argument("--write-readme", action="store_true", help="rewrite the README table instead of checking it")
    parser.add_argument("--lock", metavar="CELL", help="re-resolve CELL's top pins and write its full pins")
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        metavar="N",
        help="build N cells at a time, ahead of the tests (default 2; 0: each just before its tests); "
        "suites and doctors run one cell at a time",
    )
    args = parser.parse_args(argv)
    for name in args.cells + args.skip_suite + ([args.lock] if args.lock else []):
        if name not in BY_NAME:
            parser.error(f"unknown cell {name!r}; cells: {', '.join(BY_NAME)}")
    if args.lock:
        lock(BY_NAME[args.lock])
        return 0

    selected = [BY_NAME[n] for n in args.cells] if args.cells else list(CELLS)
    records = []
    if not args.report_only:
        started = time.monotonic()
        skips = {
            cell.name: "doctor only" if args.doctor_only else "suite not run here (--skip-suite)"
            for cell in selected
            if args.doctor_only or cell.name in args.skip_suite
        }
        records = run_cells(selected, skips, args.jobs)
        total = time.monotonic() - started

    reports = load_reports(CELLS)
    problems, notes = check(reports)
    failed_cells = [r["cell"] for r in records if not r["ok"]]
    missing = [c.name for c in CELLS if c.name not in reports]

    say("\n=== gate check (doctor verdict of every patch in every cell against its version gate)")
    for note in notes:
        say(f"  {note}")
    for _cell, problem in problems:
        say(f"  FAIL {problem}")
    if not problems:
        say(f"  every gate holds in {len(reports)} cells")

    table = render(reports)
    readme_ok = True
    if missing:
        say(f"\nREADME table not checked: no reports for {', '.join(missing)} (run all cells)")
    elif args.write_readme:
        write_readme(table)
        say("\nREADME compatibility table rewritten from doctor-reports/")
    else:
        current = readme_block()
        readme_ok = current == table
        if readme_ok:
            say("\nREADME compatibility table matches what doctor measured")
        else:
            say(
                "\nFAIL README compatibility table differs from what doctor measured "
                "(python3 scripts/matrix.py --report-only --write-readme rewrites it):"
            )
            say(
                "\n".join(
                    difflib.unified_diff(
                        (current or "").splitlines(), table.splitlines(), "README.md", "measured", lineterm=""
                    )
                )
            )

    if records:
        overlap = f"builds ran {args.jobs} at a time ahead of the tests" if args.jobs else "no builds ahead"
        say(f"\n=== cell times (seconds; {overlap})")
        say(f"  {'cell':<16} {'setup':>6} {'waited':>7} {'suite':>6} {'doctor':>7}  result")
        for r in records:
            t = r["times"]
            say(
                f"  {r['cell']:<16} {t.get('setup', 0):>6.0f} {t.get('waited', 0):>7.0f} {t.get('suite', 0):>6.0f} "
                f"{t.get('doctor', 0):>7.0f}  {'ok' if r['ok'] else 'FAILED'}{'  ' + r['note'] if r['note'] else ''}"
            )
        say(f"  matrix wall time {total:.0f}s")
    bad = bool(failed_cells or problems or not readme_ok)
    if records:
        # One plain closing line: cells that passed (setup, suite, doctor, gate check) and those that did not.
        ran = {r["cell"] for r in records}
        failing = (set(failed_cells) | {cell for cell, _ in problems}) & ran
        say(f"matrix: {len(ran - failing)} passed, {len(failing)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
