#!/usr/bin/env python3
"""The version matrix: every patch tested on the transformers × trl (and peft, accelerate, torch) releases it targets.

Each cell is one virtual environment, ``.venvs/<cell>`` (the default cell is ``.venv``), built by
``scripts/setup.sh`` from ``constraints/<cell>.txt`` exactly as a user builds the default one:
torch first (2.13.0 CPU; the torch cells pin 2.14.1 and 2.15.0), then the shim and the pinned stack,
with uv from one shared cache (cells are hard links of the same files). Builds run two at a time ahead
of the tests (``--jobs``). In each cell the script runs tests (doctor-only edge cells excepted; outside
the default cell each patch's own tests and the everyday workflows, :func:`matrixlib.runs.cell_tests`,
or the focused cell's own list) and ``python -m shim doctor --json-file``, saving doctor's table, its
findings and the cell's versions under ``doctor-reports/<cell>/``. Then it checks every patch's version
gate against what doctor measured, regenerates the README's compatibility table (one version range per
patch, and what the cells measured), the matrix of every cell's verdicts in docs/testing.md and the
measured ranges the shim ships (``shim/measured.json``), and checks them against the files.

The gate check, for every patch (a new patch is a new row, nothing to configure) and every cell:

* inside the gate: doctor must say ``fixed`` (the bug reproduces with the patch off, is gone on);
* outside the gate: ``not affected`` (the bug does not reproduce), or ``not installed``, or the bug
  is present and ``constraints/known-unfixed.txt`` says why the patch is skipped there;
* a gate's lower bound ``>=X`` above the oldest cell must be a cell's exact version, so the first
  release inside the gate is measured (edge cells exist for that: they run doctor only).

The ``latest`` cell is built from the newest releases on the index when it runs (nothing pinned but the
test tools): doctor and the checkpointing families, and the same gate check for it alone, printed as its
verdict. It never fails the matrix and is in none of the tables nor ``shim/measured.json``: a new
upstream release shows there the first day the matrix runs after it.

Usage (stdlib only, any python3 >= 3.10; run from anywhere)::

    python3 scripts/matrix.py                      # every cell, then the gate check and the tables' check
    python3 scripts/matrix.py tf5.0-trl0.29        # some cells (the tables' check needs all reports)
    python3 scripts/matrix.py latest               # the newest releases today: its verdict (exit 0)
    python3 scripts/matrix.py --without latest     # every other cell
    python3 scripts/matrix.py --skip-suite default # CI: .ci/run's first line ran the default suite
    python3 scripts/matrix.py --doctor-only        # every cell, doctor but no suite: a quick gate check
    python3 scripts/matrix.py --report-only        # no runs: check and table from doctor-reports/
    python3 scripts/matrix.py --write-readme       # rewrite the two tables and shim/measured.json
    python3 scripts/matrix.py --lock tf5.0-trl0.29 # re-resolve a cell's top pins, write full pins
    python3 scripts/matrix.py --jobs 0             # build each cell just before its tests (no overlap)
    python3 scripts/matrix.py --build-only         # build every cell, run nothing
    python3 scripts/matrix.py --share DIR          # beside another run with the same DIR: each cell once
                                                   # (then --report-only for the checks)

The code is the package ``scripts/matrixlib/``, one module per job: ``cells`` (the cells and their
builds), ``runs`` (suites and doctor in each cell), ``lock`` (``--lock``), ``gates`` (the gate
check), ``table`` (the two tables) and ``measured`` (``shim/measured.json``). This file is the
command line.
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

from matrixlib import measured  # noqa: E402
from matrixlib.cells import BY_NAME, CELLS, say  # noqa: E402
from matrixlib.gates import check, load_reports  # noqa: E402
from matrixlib.lock import lock  # noqa: E402
from matrixlib.runs import build_cells, run_cells  # noqa: E402
from matrixlib.table import block, render, render_ranges, write_block  # noqa: E402

#: The cells whose measurements decide: every cell but the latest (its verdict is printed, never failing).
MEASURED = [cell for cell in CELLS if not cell.latest]


def parser() -> argparse.ArgumentParser:
    """The command line: which cells, the options that leave some out, then :func:`add_modes`."""
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
        "--without",
        action="append",
        default=[],
        metavar="CELL",
        help="leave CELL out",
    )
    add_modes(parser)
    return parser


def add_modes(parser: argparse.ArgumentParser) -> None:
    """The options that say what a run does with its cells (check, build, share, rewrite, lock) and how
    many it builds at once."""
    parser.add_argument(
        "--doctor-only", action="store_true", help="run doctor but no suite in every cell (a quick gate check)"
    )
    parser.add_argument("--report-only", action="store_true", help="run nothing; check doctor-reports/")
    parser.add_argument(
        "--build-only", action="store_true", help="build the cells and run nothing (CI: while the suite runs)"
    )
    parser.add_argument(
        "--share",
        metavar="DIR",
        type=Path,
        help="share the cells with other runs given the same DIR: each cell is run by the first to reach it; "
        "the gate, table and measured checks are left to a later --report-only (CI: its two lanes)",
    )
    parser.add_argument(
        "--write-readme",
        action="store_true",
        help="rewrite the README's table, docs/testing.md's cells and shim/measured.json instead of checking them",
    )
    parser.add_argument("--lock", metavar="CELL", help="re-resolve CELL's top pins and write its full pins")
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        metavar="N",
        help="build N cells at a time, ahead of the tests (default 2; 0: each just before its tests); "
        "suites and doctors run one cell at a time",
    )


def parsed(argv) -> argparse.Namespace:
    """The arguments, every cell they name known (the usage error otherwise)."""
    command = parser()
    args = command.parse_args(argv)
    for name in args.cells + args.skip_suite + args.without + ([args.lock] if args.lock else []):
        if name not in BY_NAME:
            command.error(f"unknown cell {name!r}; cells: {', '.join(BY_NAME)}")
    if args.lock and BY_NAME[args.lock].latest:
        command.error(f"{args.lock} is resolved from the newest releases whenever it runs: nothing to lock")
    return args


def main(argv=None) -> int:
    args = parsed(argv)
    if args.lock:
        lock(BY_NAME[args.lock])
        return 0
    selected = [cell for cell in ([BY_NAME[n] for n in args.cells] or CELLS) if cell.name not in args.without]
    if args.build_only:
        return 0 if build_cells(selected, args.jobs) else 1
    skips = suites_skipped(args, selected)
    if args.share:
        args.share.mkdir(parents=True, exist_ok=True)
        # Cells with a suite first, the doctor-only ones (20 s each) last: the lanes then end within a
        # short cell of each other.
        selected.sort(key=lambda cell: not (cell.suite and cell.name not in skips))
    records, total = [], 0.0
    if not args.report_only:
        started = time.monotonic()
        records = run_cells(selected, skips, args.jobs, args.share)
        total = time.monotonic() - started
    if selected and all(cell.latest for cell in selected) and not args.report_only:
        # Only the latest cell ran: its verdict is all there is to say, and it never fails.
        latest_verdicts(records)
        return 0
    if args.share:
        return shared_run(records, args.jobs, total)
    return checked_run(records, args, total)


def suites_skipped(args: argparse.Namespace, selected: list) -> dict[str, str]:
    """``{cell: why its suite is not run}``: every cell with ``--doctor-only``, else the ``--skip-suite`` ones."""
    return {
        cell.name: "doctor only" if args.doctor_only else "suite not run here (--skip-suite)"
        for cell in selected
        if args.doctor_only or cell.name in args.skip_suite
    }


def shared_run(records: list, jobs: int, total: float) -> int:
    """``--share``: some of the cells ran here, the rest in the other runs: what each cell did, and
    whether any failed; the checks that need every cell's report follow with ``--report-only``."""
    latest = latest_verdicts(records)
    show_times(records, jobs, total)
    failed = [r["cell"] for r in records if not r["ok"] and not BY_NAME[r["cell"]].latest]
    ran = [r["cell"] for r in records if not BY_NAME[r["cell"]].latest]
    say(
        f"matrix (shared, this run's cells): {len(ran) - len(failed)} passed, {len(failed)} failed"
        + "".join(f"; {line}" for line in latest)
    )
    return 1 if failed else 0


def checked_run(records: list, args: argparse.Namespace, total: float) -> int:
    """The gate check and the tables' check on every measured cell's report, then the cells that ran
    here and one closing line: 1 where a cell failed, a gate does not hold or a table differs."""
    reports = load_reports(MEASURED)
    problems, notes = check(reports)
    failed_cells = [r["cell"] for r in records if not r["ok"] and not BY_NAME[r["cell"]].latest]
    show_gate_check(reports, problems, notes)
    files_ok = check_files(reports, args.write_readme)
    latest = latest_verdicts(records)
    if records:
        show_times(records, args.jobs, total)
        # One plain closing line: cells that passed (setup, suite, doctor, gate check) and those that did not;
        # the latest cell's verdict after it, which never fails the matrix.
        ran = {r["cell"] for r in records if not BY_NAME[r["cell"]].latest}
        failing = (set(failed_cells) | {cell for cell, _ in problems}) & ran
        say(f"matrix: {len(ran - failing)} passed, {len(failing)} failed" + "".join(f"; {line}" for line in latest))
    return 1 if failed_cells or problems or not files_ok else 0


def show_gate_check(reports: dict, problems: list, notes: list[str]) -> None:
    say("\n=== gate check (doctor verdict of every patch in every cell against its version gate)")
    for note in notes:
        say(f"  {note}")
    for _cell, problem in problems:
        say(f"  FAIL {problem}")
    if not problems:
        say(f"  every gate holds in {len(reports)} cells")


def check_files(reports: dict, write: bool) -> bool:
    """The README's and docs/testing.md's tables and shim/measured.json against ``reports`` (or, with
    ``write``, rewritten from them): whether they match. Not checked without every measured cell's report."""
    tables = {"README.md": render_ranges(reports), "docs/testing.md": render(reports)}
    ranges = measured.render(reports)
    missing = [c.name for c in MEASURED if c.name not in reports]
    if missing:
        say(f"\nthe tables and shim/measured.json not checked: no reports for {', '.join(missing)} (run all cells)")
        return True
    if write:
        for name, table in tables.items():
            write_block(name, table)
        measured.write(ranges)
        say("\nthe README's and docs/testing.md's tables and shim/measured.json rewritten from doctor-reports/")
        return True
    files = [*((name, block(name), table) for name, table in tables.items())]
    files.append(("shim/measured.json", measured.current(), ranges))
    return all([matches(what, current, now) for what, current, now in files])


def matches(what: str, current: str | None, now: str) -> bool:
    """Whether the file ``what`` holds ``now``, what doctor measured (said, with the diff where not)."""
    if current == now:
        say(f"\n{what} matches what doctor measured")
        return True
    say(
        f"\nFAIL {what} differs from what doctor measured "
        "(python3 scripts/matrix.py --report-only --write-readme rewrites it):"
    )
    say("\n".join(difflib.unified_diff((current or "").splitlines(), now.splitlines(), what, "measured", lineterm="")))
    return False


def show_times(records: list, jobs: int, total: float) -> None:
    overlap = f"builds ran {jobs} ahead of the tests" if jobs else "no builds ahead"
    say(f"\n=== cell times (seconds; {overlap})")
    say(f"  {'cell':<16} {'setup':>6} {'waited':>7} {'suite':>6} {'doctor':>7}  result")
    for r in records:
        t = r["times"]
        say(
            f"  {r['cell']:<16} {t.get('setup', 0):>6.0f} {t.get('waited', 0):>7.0f} {t.get('suite', 0):>6.0f} "
            f"{t.get('doctor', 0):>7.0f}  {'ok' if r['ok'] else 'FAILED'}{'  ' + r['note'] if r['note'] else ''}"
        )
    say(f"  matrix wall time {total:.0f}s")


def latest_verdicts(records: list) -> list[str]:
    """Each latest cell that ran: its versions, its own gate check and its result, printed as a verdict
    that never fails the matrix (one line each, returned for the closing line)."""
    lines = []
    for record in records:
        cell = BY_NAME[record["cell"]]
        if not cell.latest:
            continue
        if record.get("same_as"):
            # The newest releases are a measured cell's pins: that cell's result, in this matrix, is the verdict.
            say(f"\n=== {cell.name} (the newest releases on the index today; its verdict never fails the matrix)")
            say(f"  {cell.name}: the same releases as {record['same_as']}, which this matrix measures: its verdict")
            lines.append(f"{cell.name}: the releases of {record['same_as']} (not failing the matrix)")
            continue
        report = load_reports([cell]).get(cell.name)
        problems = [text for where, text in check({cell.name: report})[0] if where == cell.name] if report else []
        versions = " | ".join(f"{d} {v}" for d, v in (report or {}).get("versions", {}).items() if v)
        say(f"\n=== {cell.name} (the newest releases on the index today; its verdict never fails the matrix)")
        say(f"  {versions or 'no doctor report'}")
        for problem in problems:
            say(f"  NEW {problem}")
        ok = record["ok"] and report is not None and not problems
        times = ", ".join(f"{k} {v:.0f}s" for k, v in record["times"].items())
        verdict = "every gate holds, its tests pass" if ok else f"FAILED: see above and doctor-reports/{cell.name}"
        say(f"  {cell.name}: {verdict} ({times})")
        lines.append(f"{cell.name}: {'ok' if ok else 'FAILED'} (not failing the matrix)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
