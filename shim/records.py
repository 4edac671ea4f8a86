"""Reporting: the status record of a patch, and the tables made of them.

Imported only when a status is asked for (``shim.status()``, ``python -m shim``, the exit
report), never by ``import shim`` itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import effects, gating, versions
from .entry import and_
from .states import APPLIED, DISABLED, FAILED, PENDING, SUSPENDED_REASON

if TYPE_CHECKING:
    from .entry import Entry
    from .patch import Patch


@dataclass(frozen=True)
class PatchStatus:
    """What the registry did with one patch, and what the patch did since (``shim.status()``).

    ``effects`` counts the times the patch changed something in this process (calls it passed
    through do not count); ``last_effect`` describes the last one (``""`` while there is none).
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
        references=patch.references if patch else (),
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


def rank() -> str | None:
    """The process's rank under torchrun, accelerate or deepspeed (``RANK``), if any."""
    return os.environ.get("RANK") or None


def report(records: Sequence[PatchStatus]) -> str:
    """The compact effects table that ``SHIM_REPORT=1`` prints at exit and ``shim.report()`` returns."""
    changed = [r for r in records if r.effects]
    quiet = [r.name for r in records if r.state == APPLIED and not r.effects]
    idle = [f"{r.name} ({r.state})" for r in records if r.state != APPLIED and not r.effects]
    lines = [f"hf-train-shim report (pid {os.getpid()}): {len(changed)} of {len(records)} patches changed something"]
    if changed:
        rows = [[r.name, r.effects, r.last_effect] for r in changed]
        lines += ["  " + line for line in table(rows, ["patch", "effects", "last effect"], right=(1,)).splitlines()]
    if quiet:
        lines.append(f"  applied, nothing to change: {', '.join(quiet)}")
    if idle:
        lines.append(f"  not applied: {', '.join(idle)}")
    prefix = f"[rank {rank()}] " if rank() else ""
    return "\n".join(prefix + line for line in lines)
