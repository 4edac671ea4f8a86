"""Command line: ``python -m shim [status] [--json] [--import-targets]`` and ``python -m shim doctor``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _status(args, shim) -> int:
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
        return 0
    rows = [[r.name, r.state, r.installed or "-", r.requires, r.reason] for r in records]
    print(_table(rows, ["patch", "state", "installed", "requires", "reason"]))
    return 0


def _doctor(args, shim) -> int:
    from . import doctor
    from .selfcheck import quiet_transformers

    quiet_transformers()
    findings = doctor.run(shim.registry)
    if args.json:
        print(json.dumps([finding.as_dict() for finding in findings], indent=2))
    else:
        rows = [[f.name, f.installed, f.state, f.bug_upstream, f.bug_with_shim, f.verdict] for f in findings]
        print(_table(rows, ["patch", "installed", "state", "bug upstream", "bug with shim", "verdict"]))
        for finding in findings:
            if finding.verdict in doctor.FAILING or finding.verdict == doctor.NOT_REPRODUCED:
                print(f"\n{finding.name}: {finding.verdict}: {finding.detail}")
    failing = [f.name for f in findings if f.verdict in doctor.FAILING]
    if failing:
        print(f"\ndoctor: not fixed: {', '.join(failing)}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shim", description="What hf-train-shim did in this environment.")
    parser.add_argument("command", nargs="?", default="status", choices=["status", "doctor"])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--import-targets",
        action="store_true",
        help="status: import every target module first, so the table shows applied/skipped instead of pending",
    )
    args = parser.parse_args(argv)
    import shim

    return _doctor(args, shim) if args.command == "doctor" else _status(args, shim)
