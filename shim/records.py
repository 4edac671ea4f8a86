"""Reporting: the status record of a patch, and the tables made of them.

Imported only when a status is asked for (``shim.status()``, ``python -m shim``, the exit
report), never by ``import shim`` itself.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import bugdocs, effects, gating, processes, versions
from .entry import and_
from .states import APPLIED, DISABLED, FAILED, PENDING, SUSPENDED_REASON

if TYPE_CHECKING:
    from .entry import Entry
    from .patch import Patch

#: Columns a table, report or help text fits, unless the user asks for ``--wide``.
WIDTH = 100


@dataclass(frozen=True)
class PatchStatus:
    """What the registry did with one patch, and what the patch did since (``shim.status()``).

    ``effects`` counts the times the patch changed something in this process (calls it passed
    through do not count); ``last_effect`` describes the last one (``""`` while there is none).
    ``references`` are GitHub addresses and ``python -m shim explain <name>``, which prints the
    bug's story (``docs/bugs.md``, shipped with the package).
    """

    name: str
    state: str
    reason: str
    targets: tuple[str, ...]
    requires: str
    installed: str | None
    summary: str = ""
    references: tuple[str, ...] = ()
    effects: int = 0
    last_effect: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def status_of(entry: Entry, forced: bool) -> PatchStatus:
    """What ``shim.status()`` says of one patch: the registry's state, refined by what can be known
    without applying anything (the gate of a patch still pending, a layer replaced since)."""
    declared = entry.declared
    state, reason, installed = entry.state, entry.reason, entry.installed
    if state == PENDING and entry.gate is None:
        # Decided here rather than at activation, where it would cost every ``import shim`` a
        # metadata read (the log decides it the same way, when it shows the line).
        state, reason, installed = gating.pending(declared, reason, forced)
    elif installed is None:
        installed = versions.installed_version(declared.distribution)
    if state == APPLIED and entry.layers:
        stale = entry.layers.stale()
        gone = sorted({layer.module_name for layer in stale if sys.modules.get(layer.module_name) is None})
        if stale and len(gone) == len({layer.module_name for layer in stale}):
            # The import the patch was applied in failed after it (another hook raised, in strict mode).
            state = PENDING if len(stale) == len(entry.layers.installed) else APPLIED
            are = "is" if len(gone) == 1 else "are"
            reason = f"{reason}; the import of {and_(gone)} failed: it applies again when {and_(gone)} {are} imported"
        elif stale:
            replaced = entry.layers.describe(stale)
            state, reason = FAILED, f"{replaced} was replaced after the shim wrapped it; shim.activate() wraps it again"
    if entry.switch.suspended and state in (APPLIED, PENDING):
        state, reason = DISABLED, SUSPENDED_REASON
    try:
        patch: Patch | None = entry.load()
    except Exception as exc:  # reported, never raised: a status must always come back
        patch, reason = None, f"{reason}; the patch module cannot be imported: {exc!r}"
    return PatchStatus(
        name=declared.name,
        state=state,
        reason=reason,
        targets=tuple(t.spec for t in patch.targets) if patch else (),
        requires=f"{declared.distribution}{declared.requires}",
        installed=installed,
        summary=patch.summary if patch else "",
        references=bugdocs.links(patch.references) if patch else (),
        effects=effects.count(declared.name),
        last_effect=effects.last(declared.name),
    )


def table(rows: Sequence[Sequence[object]], header: Sequence[str], right: Sequence[int] = ()) -> str:
    """A plain text table; columns listed in ``right`` are right-aligned (numbers)."""
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        parts = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        return "  ".join(parts).rstrip()

    lines = [line(row) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
    return "\n".join(prefix + line for line in lines)
