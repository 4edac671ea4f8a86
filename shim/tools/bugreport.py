"""``python -m shim bug-report``: what a bug report needs, in one Markdown document to paste.

The versions (the shim, Python, torch and every distribution a patch is gated on), the status as
``python -m shim`` opens it, doctor's table for the patches that apply here, and the ``SHIM_*``
variables set, their values escaped as every message of the shim escapes them. Printed as it is
made: doctor's rows come one by one, as its checks finish.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import __version__
from ..gating import installed_version
from ..settings import shown
from .outlook import APPLIES, outlooks, summary
from .run import as_given

if TYPE_CHECKING:
    from ..registry import Registry

#: How to read the report, said at its end.
ASK = (
    "Say what you ran and what happened (the command, the traceback), and whether it happens with "
    "`SHIM_DISABLE=all` too (then it is upstream's)."
)


def distributions(registry: Registry) -> list[str]:
    """torch, then every distribution a patch is gated on or a target requires, by name."""
    names: set[str] = set()
    for name in registry.names:
        try:
            names.update(registry.patch(name).distributions)
        except Exception:  # a pack's module that cannot be imported: its status row says so
            continue
    return ["torch", *sorted(names - {"torch"})]


def variables(environ: dict[str, str] | None = None) -> list[str]:
    """``NAME=value`` for each ``SHIM_*`` variable set, by name; each value quoted and escaped as
    the shim's warnings quote it (control characters escaped, cut after 40 characters)."""
    env = os.environ if environ is None else environ
    return [f"{as_given(name)}={shown(env[name])}" for name in sorted(env) if name.startswith("SHIM_")]


def write_report(registry: Registry, write: Callable[[str], None]) -> None:
    """The report, through ``write`` (a piece at a time: doctor's rows as its checks finish)."""
    from . import doctor
    from .cli import status_table

    python = f"{platform.python_version()} ({platform.python_implementation()}, {platform.platform()})"
    rows = [("hf-train-shim", __version__), ("Python", python)]
    rows += [(name, installed_version(name) or "not installed") for name in distributions(registry)]
    write("## hf-train-shim bug report\n\n| | version |\n|---|---|")
    write("\n".join(f"| {name} | {version} |" for name, version in rows))
    records = sorted(registry.status(), key=lambda record: record.name)
    seen = outlooks(records, registry)
    write(f"\n### Status\n\n{summary(records, seen)}\n")
    write(
        f"<details><summary>python -m shim</summary>\n\n```text\n{status_table(records, True, seen)}\n```\n</details>"
    )
    applying = [record.name for record in records if seen[record.name].kind == APPLIES]
    write("\n### doctor, for the patches that apply\n")
    if applying:
        write("```text")
        doctor.print_table(registry, applying, True, write)
        write("```")
    else:
        write("No patch applies here: nothing for doctor to check.")
    set_here = variables()
    write("\n### `SHIM_*` variables\n")
    write("```text\n" + "\n".join(set_here) + "\n```" if set_here else "None set.")
    write(f"\n{ASK}")
