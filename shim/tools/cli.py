"""Command line: ``python -m shim [status] [--json] [--import-targets] [--wide]``, ``python -m shim doctor``,
``python -m shim explain <patch>``, ``python -m shim bug-report``, ``python -m shim new-pack NAME [DIR]``,
``python -m shim index [DIR] [--check]`` and ``python -m shim run [--] <command ...>`` (the
``shim-run`` console script): :data:`COMMANDS`. The help texts are in ``shim.tools.helptext``, the
tables and lines it prints in ``shim.tools.render``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import IO, TYPE_CHECKING

from .. import __version__
from ..packs import GROUP, ORDER, TARGETS
from ..settings import did_you_mean, shown
from .helptext import DESCRIPTION, DOCTOR_DESCRIPTION, ENVIRONMENT, EXIT_CODES, STATES
from .render import WIDTH, by_name, fitted, status_table  # the tables and the help texts fit WIDTH columns
from .run import as_given, cannot_write, lenient, reader_gone, say

if TYPE_CHECKING:
    from ..registry import Registry


COMMANDS = ("status", "doctor", "explain", "bug-report", "new-pack", "index", "run")


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, width=WIDTH)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shim",
        description=DESCRIPTION,
        epilog=f"{ENVIRONMENT}\n\n{EXIT_CODES}",
        formatter_class=_formatter,
    )
    parser.add_argument("--version", action="version", version=f"hf-train-shim {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    status = commands.add_parser(
        "status",
        help="what each patch did (the default command)",
        description="One row per patch: state, installed version, effects so far and the reason; the\n"
        "patch's one-line summary (and its last effect) below it.",
        epilog=f"{STATES}\n\n{ENVIRONMENT}\n\n{EXIT_CODES}",
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
    doctor.add_argument("patches", nargs="*", metavar="patch", help="check only these patches (default: every one)")
    doctor.add_argument(
        "--json-file",
        metavar="PATH",
        help="also write the JSON records to PATH (the table or --json is printed as usual)",
    )
    explain = commands.add_parser(
        "explain",
        help="the story of a patch's bug: symptom, versions measured, the fix, its limits",
        description="Print the section of docs/bugs.md (shipped with the package) on a patch's bug: the "
        "symptom,\nthe upstream mechanism, the versions measured, what the fix does, its limits and "
        "the references;\nas plain text wrapped to the terminal's width. Without a name: every patch "
        "and its summary.",
        formatter_class=_formatter,
    )
    explain.add_argument(
        "patch", nargs="?", help="a patch name, as python -m shim lists them ('_', '-' and case are equal)"
    )
    explain.add_argument("--markdown", action="store_true", help=f"print the Markdown, wrapped to {WIDTH} columns")
    explain.set_defaults(parser=explain)
    report = commands.add_parser(
        "bug-report",
        help="what a bug report needs, as Markdown: versions, status, doctor, SHIM_* variables",
        description="Print, as Markdown to paste into a bug report: the versions of the shim, Python, torch and\n"
        "every patched library; the status; doctor's table for the patches that apply here (it runs\n"
        "their bug probes); and the SHIM_* variables set.",
        formatter_class=_formatter,
    )
    report.set_defaults(parser=report)
    new_pack = commands.add_parser(
        "new-pack",
        help="write a patch pack that works as it is, to start one from",
        description="Write a patch pack called NAME into DIR (default: ./NAME): pyproject.toml with its entry\n"
        "points, a module with a Patch gated on the installed transformers' major release, a bug probe,\n"
        "a test and a README. It installs with pip, and is listed, opted out and doctor-checked as it is.",
        formatter_class=_formatter,
    )
    new_pack.add_argument("name", help="the pack's name, kebab-case: its distribution, package and first patch")
    new_pack.add_argument("dir", nargs="?", help="the folder to write it into (default: ./NAME; new or empty)")
    new_pack.set_defaults(parser=new_pack)
    index = commands.add_parser(
        "index",
        help="write each patch's record (a pack's pyproject.toml tables, or this repository's index)",
        description=f"Import the patches a pack's pyproject.toml declares ({GROUP}) and write their records:\n"
        f"the modules each targets ({TARGETS}) and its place and after= ({ORDER}), which the shim\n"
        "reads before importing a patch's module. In hf-train-shim's checkout: the built-ins' index.",
        formatter_class=_formatter,
    )
    index.add_argument("dir", nargs="?", default=".", help="the pack's folder (default: the current one)")
    index.add_argument("--check", action="store_true", help="change nothing; exit 1 where a record is stale")
    index.set_defaults(parser=index)
    commands.add_parser(  # parsed by shim.tools.run: everything after it is the command's
        "run",
        help="run [--] <command ...> with the shim in every Python process (the shim-run command)",
        add_help=False,
    )
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(parser=parser)  # its own usage for an argument it does not know
    parser.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    parser.add_argument("--wide", action="store_true", help=f"do not fit the table to {WIDTH} columns")


def _status(args: argparse.Namespace, shim: ModuleType) -> int:
    if args.import_targets:
        from .targets import import_targets

        import_targets(shim.registry, shim.registry.names)
    records = by_name(shim.status())
    if args.json:
        print(json.dumps([record.as_dict() for record in records], indent=2))
        return 0
    from .outlook import outlooks
    from .render import summary

    seen = outlooks(records, shim.registry)
    print("\n".join([*fitted(summary(records, seen), args.wide), "", status_table(records, args.wide, seen)]))
    for note in [*newer_than_measured(), *(f"note: {message}" for message in shim.registry.left_out)]:
        print("\n" + "\n".join(fitted(note, args.wide)))
    return 0


def newer_than_measured() -> list[str]:
    """Below the status table, once per distribution (the reasons above say it per patch): each
    installed release newer than the newest the shim was measured on."""
    from .. import gating
    from ..statuses import RUN_DOCTOR

    notes = (gating.newer_than_measured(name) for name in gating.newest_measured())
    return [f"note: {note}: {RUN_DOCTOR}" for note in notes if note]


def _open_for_writing(path: str) -> tuple[IO[str] | None, str | None]:
    """``path`` opened for writing, or why it cannot be written: a missing folder, a directory, no
    permission, or a file that opens and refuses writes (``/proc/version``, ``/dev/full``)."""
    try:
        file = open(path, "w", encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        return None, f"--json-file {as_given(path, 200)}: {getattr(exc, 'strerror', None) or exc}"
    problem = cannot_write(file)
    if problem:
        file.close()
        return None, f"--json-file {as_given(path, 200)}: {problem}"
    return file, None


def _doctor(args: argparse.Namespace, shim: ModuleType) -> int:
    from . import doctor
    from .targets import quiet_transformers

    json_file, unwritten = None, None
    if args.json_file is not None:  # opened before the run: a file that cannot be written fails at once
        json_file, unwritten = _open_for_writing(args.json_file)
        if unwritten:
            args.parser.error(unwritten)
    names = [_known(args, shim, name) for name in args.patches]
    quiet_transformers()
    if args.json:
        findings = doctor.run(shim.registry, names)
        concerned = doctor.concerned(shim.registry, [f.name for f in findings])
        for note in [*doctor.notes(concerned), *doctor.left_out(shim.registry, names)]:
            print("\n" + "\n".join(fitted(f"note: {note}")), file=sys.stderr)  # stdout stays the records
    else:
        findings = doctor.print_table(shim.registry, names, args.wide, lambda text: print(text, flush=True))
    records = json.dumps([finding.as_dict() for finding in findings], indent=2)
    if json_file is not None:
        try:
            with json_file:
                json_file.write(records + "\n")
        except OSError as exc:  # the disk filled up during the run: said below the table, still printed
            unwritten = f"--json-file {as_given(args.json_file, 200)}: {exc.strerror or exc}"
    if args.json:
        print(records)
    failing = [f.name for f in findings if f.verdict in doctor.FAILING]
    if failing:
        print("\n" + "\n".join(fitted(f"doctor: not fixed: {', '.join(failing)}")), file=sys.stderr)
    if unwritten:
        say(f"python -m shim doctor: error: {unwritten}")
        return 2  # not 1: the file asked for is missing, whatever the verdicts
    return 1 if failing else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shim``; its exit codes are ``EXIT_CODES`` (``shim/tools/helptext.py``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # everything after it is the command's, not ours to parse
        from .run import main as run

        return run(argv[1:])
    from .report import silence_at_exit

    silence_at_exit()  # the fixes act in doctor's own cases: no line about them at exit
    lenient(sys.stdout)  # PYTHONIOENCODING=ascii: explain's en dashes print as \u2013
    problem = cannot_write(sys.stdout)
    if problem:  # python -m shim >&-: said before any work, as a command line that cannot be used
        say(f"python -m shim: cannot write to stdout: {problem}; give it a file (> /dev/null discards the output)")
        return 2
    try:
        try:
            return _command(argv)
        finally:
            sys.stdout.flush()  # here, not at exit: a reader that went away shows in this try
    except BrokenPipeError:  # python -m shim doctor --json | head: stop quietly, as Unix tools do
        return reader_gone()


def _command(argv: list[str]) -> int:
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "status")  # the default command, with its options: python -m shim --json
    parser = _parser()
    if argv[0] not in COMMANDS and not argv[0].startswith("-"):
        parser.error(
            f"no command {shown(argv[0])}; {did_you_mean(argv[0], COMMANDS, 'python -m shim --help lists them')}"
        )
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # shown with the usage of the command they were given to, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "new-pack":
        from .newpack import new_pack

        return new_pack(args.name, args.dir)
    import shim

    if args.command == "index":
        from .index import index

        return index(args.dir, args.check)
    if args.command == "explain":
        return _explain(args, shim)
    if args.command == "bug-report":
        from .bugreport import write_report
        from .targets import quiet_transformers

        quiet_transformers()
        write_report(shim.registry, lambda text: print(text, flush=True))
        return 0
    return _doctor(args, shim) if args.command == "doctor" else _status(args, shim)


def _known(args: argparse.Namespace, shim: ModuleType, given: str) -> str:
    """``given`` as the registry names it, or the command's usage error."""
    from ..settings import canonical, not_a_patch

    name = canonical(given)
    said = not_a_patch(name)  # the audit's: SHIM_DISABLE takes it
    if said is not None:
        args.parser.error(said)
    if name not in shim.registry.names:
        args.parser.error(f"no patch named {shown(given)}; {did_you_mean(name, shim.registry.names)}")
    return name


def _explain(args: argparse.Namespace, shim: ModuleType) -> int:
    from . import bugdocs

    if args.patch is None:
        print(patch_list(shim.registry))
        return 0
    name = _known(args, shim, args.patch)
    text = bugdocs.section(name) or bugdocs.of_pack(shim.registry, name)
    if text is None:
        say("python -m shim explain: docs/bugs.md is not installed with this copy of the shim")
        return 1
    from .render import printable

    if args.markdown:
        print(printable(bugdocs.reflow(text, WIDTH), keep="\n"))
    else:
        print(printable(bugdocs.reflow(text, terminal_width(), plain=True), keep="\n"))
    return 0


def terminal_width() -> int:
    """The terminal's columns (``COLUMNS`` where set), :data:`WIDTH` where the output is no terminal;
    40 at least."""
    import shutil

    return max(shutil.get_terminal_size((WIDTH, 24)).columns, 40)


def patch_list(registry: Registry) -> str:
    """``explain`` without a name: every patch by name, its summary below it."""
    from ..catalogue import PROVIDER

    lines = []
    for name in sorted(registry.names):
        try:
            summary = registry.patch(name).summary
        except Exception as exc:  # a module that cannot be imported: say so, list the rest
            summary = f"(its module cannot be imported: {exc!r})"
        provider = registry.declared(name).provider
        lines += fitted(name + (f"  (from {provider}, a patch pack)" if provider not in ("", PROVIDER) else ""), True)
        lines += fitted(summary, False, "    ", "    ")
    lines += ["", "python -m shim explain <patch>: the bug, the versions measured, the fix and its limits"]
    return "\n".join(lines)
