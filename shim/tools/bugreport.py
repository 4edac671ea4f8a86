"""``python -m shim bug-report``: what a bug report needs, in one Markdown document to paste.

The versions (the shim, Python, torch and every distribution a patch is gated on), the status as
``python -m shim`` opens it, doctor's table for the patches that apply here, and the ``SHIM_*``
variables set. Printed as it is made: doctor's rows come one by one, as its checks finish.

It is made to be pasted in a public issue, so it names no user and no private folder: a Python file
in a folder of ``sys.path`` (site-packages, ``PYTHONPATH``) is shown as its module name, a path under
the current folder as ``./...`` and one under the home folder as ``~/...``; a ``SHIM_*`` value is
shown only where it is a patch list or a switch (escaped as every message of the shim escapes it),
any other as ``<set>``. The same path rules apply to what it prints on stderr meanwhile: the
``shim`` logger's lines (``SHIM_LOG_LEVEL=INFO`` names another patcher's file) and the warnings shown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TextIO

from .. import __version__
from ..gating import installed_version
from ..settings import shown
from .outlook import APPLIES, outlooks
from .render import status_table, summary
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


#: The ``SHIM_*`` variables whose values a report shows: patch lists, and switches (a word each).
PATCH_LISTS = ("SHIM_DISABLE", "SHIM_FORCE")
SWITCHES = ("SHIM_STRICT", "SHIM_REPORT", "SHIM_LOG_LEVEL")
_PATCH_LIST = re.compile(r"[\w*, -]*")  # names, ``all``, ``*``, commas: nothing a path or a secret needs
_SWITCH = re.compile(r" *[A-Za-z0-9]{0,12} *")


def variables(environ: dict[str, str] | None = None) -> list[str]:
    """``NAME=value`` for each ``SHIM_*`` variable set, by name: a patch list or a switch quoted and
    escaped as the shim's warnings quote it, a value of any other shape and any other variable as
    ``<set>`` (a user's own ``SHIM_*`` variable may hold a path or a token)."""
    env = os.environ if environ is None else environ
    return [f"{as_given(name)}={_value(name, env[name])}" for name in sorted(env) if name.startswith("SHIM_")]


def _value(name: str, value: str) -> str:
    if name in PATCH_LISTS and _PATCH_LIST.fullmatch(value):
        return repr(value)
    if name in SWITCHES and _SWITCH.fullmatch(value):
        return shown(value)
    return "<set>"


def without_private_paths(text: str, home: str, cwd: str, search_path: Iterable[str]) -> str:
    """``text`` naming no user's folder: a Python file in a folder of ``search_path`` (``sys.path``,
    the current folder left out) as its module name, then a path under ``cwd`` as ``./...`` and one
    under ``home`` as ``~/...`` (the more specific first)."""
    folders = {os.path.normpath(folder) for folder in search_path if folder and os.path.isabs(folder)}
    for folder in sorted(folders - {cwd, os.sep}, key=len, reverse=True):
        file = re.escape(folder + os.sep) + r"([\w.-]+(?:/[\w.-]+)*?)(?:/__init__)?\.pyc?(?![\w.])"
        text = re.sub(file, lambda found: found.group(1).replace("/", "."), text)
    for folder, shorter in ((cwd, "."), (home, "~")):
        if folder and folder != os.sep:
            text = re.sub(re.escape(folder) + r"(?![\w.-])", shorter, text)
    return text


@contextlib.contextmanager
def stderr_with(hide: Callable[[str], str]) -> Iterator[None]:
    """Inside the block, the ``shim`` logger's records and the warnings shown pass through ``hide``
    first (what a report prints on stderr names no user's folder either)."""
    logger = logging.getLogger("shim")
    shown = warnings.showwarning

    def hidden(record: logging.LogRecord) -> bool:
        record.msg, record.args = hide(record.getMessage()), None
        return True

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        shown(hide(str(message)), category, hide(filename), lineno, file, line)

    logger.addFilter(hidden)
    warnings.showwarning = showwarning
    try:
        yield
    finally:
        logger.removeFilter(hidden)
        if warnings.showwarning is showwarning:
            warnings.showwarning = shown


def first_step_audit() -> str:
    """The audit's state here, and what it named in this process (a run's own lines are in its log)."""
    from .. import audit, settings

    if settings.audit_switched_off():
        return f"Switched off (`SHIM_DISABLE` names `{audit.NAME}` or `all`)."
    said = [finding.line() for finding in audit.found] + audit.notes
    named = "\n\n```text\n" + "\n".join(said) + "\n```" if said else ""
    return (
        "On: at each optimizer's first step it warns where trainable parameters got no gradient while modules after "
        "them got theirs, and where checkpointing did not run; a branch the loss leaves out is data (INFO); paste its "
        "`hf-train-shim first-step audit` lines from your run's log here." + named
    )


def write_report(registry: Registry, write_out: Callable[[str], None]) -> None:
    """The report, through ``write_out`` (a piece at a time: doctor's rows as its checks finish),
    naming no user's folder (:func:`without_private_paths`), on stderr meanwhile neither."""
    home, cwd = os.path.expanduser("~"), os.getcwd()
    search_path = list(sys.path)

    def hide(text: str) -> str:
        return without_private_paths(text, home, cwd, search_path)

    def write(text: str) -> None:
        write_out(hide(text))

    with stderr_with(hide):
        _write(registry, write)


def _write(registry: Registry, write: Callable[[str], None]) -> None:
    from . import doctor

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
    for message in registry.left_out:  # a pack's patch refused at import shim has no row
        write(f"\nnote: {message}")
    applying = [record.name for record in records if seen[record.name].kind == APPLIES]
    write("\n### doctor, for the patches that apply\n")
    if applying:
        write("```text")
        doctor.print_table(registry, applying, True, write)
        write("```")
    else:
        write("No patch applies here: nothing for doctor to check.")
    write(f"\n### First-step audit\n\n{first_step_audit()}")
    set_here = variables()
    write("\n### `SHIM_*` variables\n")
    write("```text\n" + "\n".join(set_here) + "\n```" if set_here else "None set.")
    write(f"\n{ASK}")
