"""Command line: ``python -m shim [status] [--json] [--import-targets] [--wide]``, ``python -m shim doctor``
and ``python -m shim run [--] <command ...>`` (the ``shim-run`` console script)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import PatchStatus

WIDTH = 100  # the tables fit this many columns unless --wide

ENVIRONMENT = """\
environment variables (read when a patch applies, so set them before importing transformers):
  SHIM_DISABLE=all | name,name   apply nothing / opt these patches out ('_', '-' and case are equal)
  SHIM_FORCE=name,name           apply these patches even outside their version gate
  SHIM_STRICT=1                  a patch that should apply but cannot raises shim.PatchError
  SHIM_LOG_LEVEL=INFO            show the shim's log lines (what applied, first effects) on stderr
  SHIM_REPORT=1                  print the effects table to stderr when the process exits"""

DESCRIPTION = """\
hf-train-shim: what the shim did in this environment, and whether the bugs it fixes are there.

commands:
  status    (default) one row per patch: state, installed version, effects so far, the reason;
            the patch's one-line summary below it
  doctor    reproduce each bug on a tiny model built in code, with its patch off and then on
  run       run [--] <command ...> with the shim imported first in every Python process it starts
            (torchrun, accelerate launch, deepspeed and their ranks); also the shim-run command"""

EXIT_CODES = """\
exit codes:
  0  success (status always; doctor: nothing that applies here is left unfixed)
  1  doctor: a bug that applies to the installed versions is NOT FIXED, or a self-check errored
  2  the command line was not understood"""

DOCTOR_DESCRIPTION = """\
Run every patch's self-check on a tiny model built in code (nothing is downloaded), once with the
patch switched off (does the bug show on the installed versions?) and once on (is it gone?).

verdicts:
  fixed           the bug shows upstream and the patch removes it
  NOT FIXED       the bug shows and the patch does not remove it (or cannot apply here)
  not affected    the patch does not apply here and the bug does not show
  not reproduced  the patch applies but its self-check does not show the bug here
  opted out       switched off (SHIM_DISABLE); the self-check ran without it
  not installed   the library the patch is for is not installed
  check error     the self-check itself raised (the detail says what)"""


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, width=WIDTH)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shim",
        description=DESCRIPTION,
        epilog=f"{ENVIRONMENT}\n\n{EXIT_CODES}",
        formatter_class=_formatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="{status,doctor}")
    status = commands.add_parser(
        "status",
        help="what each patch did (the default command)",
        description="One row per patch: state, installed version, effects so far and the reason; "
        "the patch's one-line summary (and its last effect) below it.",
        epilog=f"states: applied, pending (target module not imported yet), skipped (not needed or not "
        f"safe here), disabled (switched off), failed (wrapping raised and was rolled back)\n\n"
        f"{ENVIRONMENT}\n\n{EXIT_CODES}",
        formatter_class=_formatter,
    )
    _common(status)
    status.add_argument(
        "--import-targets",
        action="store_true",
        help="import every target module first, so the table shows applied/skipped instead of pending",
    )
    doctor = commands.add_parser(
        "doctor",
        help="reproduce each bug with its patch off, then on",
        description=DOCTOR_DESCRIPTION,
        epilog=f"{ENVIRONMENT}\n\n{EXIT_CODES}",
        formatter_class=_formatter,
    )
    _common(doctor)
    doctor.add_argument(
        "--json-file",
        metavar="PATH",
        help="also write the JSON records to PATH (the table or --json is printed as usual)",
    )
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    parser.add_argument("--wide", action="store_true", help=f"do not fit the table to {WIDTH} columns")


def status_table(records: Sequence[PatchStatus], wide: bool = False) -> str:
    """The status table: a row per patch, then its summary, the reason for its state and its last
    effect indented below, wrapped to :data:`WIDTH` columns (``wide``: one line each)."""
    from .records import table

    rows = [[r.name, r.state, r.installed or "-", r.effects] for r in records]
    lines = table(rows, ["patch", "state", "installed", "effects"], right=(3,)).splitlines()
    out = lines[:2]
    for record, line in zip(records, lines[2:]):
        out.append(line)
        notes = [record.summary, f"reason: {record.reason}"]
        if record.last_effect:
            notes.append(f"last effect: {record.last_effect}")
        for note in notes:
            if wide:
                out.append(f"    {note}")
            else:
                out += textwrap.wrap(
                    note, WIDTH, initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False
                )
    return "\n".join(out)


def _status(args: argparse.Namespace, shim: ModuleType) -> int:
    if args.import_targets:
        for name in shim.registry.names:
            for module_name in shim.registry.patch(name).modules:
                try:
                    importlib.import_module(module_name)
                except ImportError:
                    pass
    records = shim.status()
    if args.json:
        print(json.dumps([record.as_dict() for record in records], indent=2))
    else:
        print(status_table(records, wide=args.wide))
    return 0


def _doctor(args: argparse.Namespace, shim: ModuleType) -> int:
    from . import doctor
    from .records import table
    from .selfcheck import quiet_transformers

    quiet_transformers()
    findings = doctor.run(shim.registry)
    records = json.dumps([finding.as_dict() for finding in findings], indent=2)
    if args.json_file:
        with open(args.json_file, "w", encoding="utf-8") as file:
            file.write(records + "\n")
    if args.json:
        print(records)
    else:
        rows = [[f.name, f.installed, f.state, f.bug_upstream, f.bug_with_shim, f.verdict] for f in findings]
        print(table(rows, ["patch", "installed", "state", "bug upstream", "bug with shim", "verdict"]))
        for finding in findings:
            if finding.verdict in doctor.FAILING or finding.verdict == doctor.NOT_REPRODUCED:
                detail = f"{finding.name}: {finding.verdict}: {finding.detail}"
                print("\n" + (detail if args.wide else textwrap.fill(detail, WIDTH, subsequent_indent="  ")))
    failing = [f.name for f in findings if f.verdict in doctor.FAILING]
    if failing:
        print(f"\ndoctor: not fixed: {', '.join(failing)}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after it is the command's, not ours to parse
        from .run import main as run

        return run(argv[1:])
    if not any(arg in ("status", "doctor", "-h", "--help") for arg in argv[:1]):
        argv.insert(0, "status")  # the default command, with its options: python -m shim --json
    args = _parser().parse_args(argv)
    import shim

    return _doctor(args, shim) if args.command == "doctor" else _status(args, shim)
