"""The effects table (``shim.report()``, ``SHIM_REPORT=1`` at exit) and the plain tables of
``python -m shim`` and doctor, made of status records.
"""

from __future__ import annotations

import atexit
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..entry import APPLIED
from . import processes

if TYPE_CHECKING:
    from ..records import PatchStatus

#: Columns a table, report or help text fits, unless the user asks for ``--wide``.
WIDTH = 100


def table(rows: Sequence[Sequence[object]], header: Sequence[str], right: Sequence[int] = ()) -> str:
    """A plain text table; columns listed in ``right`` are right-aligned (numbers)."""
    widths = column_widths([header, *rows])
    lines = [table_line(row, widths, right) for row in [header, *rows]]
    lines.insert(1, rule(widths))
    return "\n".join(lines)


def column_widths(rows: Sequence[Sequence[object]]) -> list[int]:
    """The width of each column of ``rows`` (the header among them): its widest cell."""
    return [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]


def table_line(row: Sequence[object], widths: Sequence[int], right: Sequence[int] = ()) -> str:
    """One line of a table whose columns are ``widths`` wide (a wider cell pushes the rest along):
    doctor prints each row as its check finishes, before the others are known."""
    cells = [str(cell) for cell in row]
    parts = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(cells, widths))]
    return "  ".join(parts).rstrip()


def rule(widths: Sequence[int]) -> str:
    """The line below a table's header."""
    return "  ".join("-" * w for w in widths)


def _wrap(text: str, width: int, indent: str, more: str) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=more, break_on_hyphens=False)


def report(records: Sequence[PatchStatus]) -> str:
    """The compact effects table that ``SHIM_REPORT=1`` prints at exit and ``shim.report()`` returns:
    a row per patch that changed something, its last effect below it, then the other patches by
    state; :data:`WIDTH` columns wide, the ``[rank N]`` prefix included."""
    role = processes.helper(spec for r in records for spec in r.targets)
    prefix = f"[rank {processes.rank()}] " if processes.rank() else ""
    width = max(WIDTH - len(prefix), 40)
    changed = [r for r in records if r.effects]
    who = f"pid {os.getpid()}, {role}" if role else f"pid {os.getpid()}"
    lines = _wrap(
        f"hf-train-shim report ({who}): {len(changed)} of {len(records)} patches changed something", width, "", "  "
    )
    if changed:
        rows = table([[r.name, r.effects] for r in changed], ["patch", "effects"], right=(1,)).splitlines()
        lines += ["  " + line for line in rows[:2]]
        for record, row in zip(changed, rows[2:]):
            lines += ["  " + row, *_wrap(f"last effect: {record.last_effect}", width, " " * 6, " " * 8)]
    groups: dict[str, list[str]] = {"applied, nothing to change": []}  # then skipped, pending, ...
    for r in records:
        if not r.effects:
            groups.setdefault("applied, nothing to change" if r.state == APPLIED else r.state, []).append(r.name)
    for label, names in groups.items():
        if names:
            lines += _wrap(f"{label}: {', '.join(names)}", width, "  ", "    ")
    for r in records:  # another patcher on a target: said at exit too, where it decides what ran
        for other in r.others:
            lines += _wrap(f"{r.name}: other patcher: {other['text']}", width, "  ", "    ")
    return "\n".join(prefix + line for line in lines)


_registered = False


def report_at_exit() -> None:
    """Print ``shim.report()`` to stderr when the interpreter exits (once per process)."""
    global _registered
    if not _registered:  # called by ``import shim`` under SHIM_REPORT=1: under the import lock
        _registered = True
        atexit.register(_print_report)


def _print_report() -> None:
    shim = sys.modules.get("shim")
    if shim is None:
        return
    try:
        if processes.quiet_at_exit(shim.status()):
            return  # a helper process (launcher, multiprocessing worker) in which nothing changed
        text = shim.report()
    except Exception as exc:  # the user's program is over: say why, never raise at exit
        text = f"hf-train-shim report failed: {exc!r}"
    write_whole_lines(text)


#: The most bytes one ``write`` to a pipe puts in it at once, never interleaved with another process's
#: (POSIX guarantees at least 512; Linux's is 4096).
PIPE_BUF = 4096


def write_whole_lines(text: str) -> None:
    """``text`` and its newline to stderr in as few ``os.write`` calls as it takes, each of whole lines
    and at most :data:`PIPE_BUF` bytes: the ranks of a launcher share one stderr, and ``print`` writes
    the text and its newline apart, so another rank's report could land inside a line. A stderr
    without a file descriptor (a captured one) gets one ``write``."""
    try:
        stream = sys.stderr
        stream.flush()
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        return
    encoding = getattr(stream, "encoding", None) or "utf-8"
    chunk = b""
    for line in (text + "\n").splitlines(keepends=True):
        data = line.encode(encoding, "backslashreplace")
        if chunk and len(chunk) + len(data) > PIPE_BUF:
            _write_all(fd, chunk)
            chunk = b""
        chunk += data
    _write_all(fd, chunk)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]
