"""The tools' text, in one place: the tables and lines that ``python -m shim``, doctor, the bug report,
``shim.report()``, the exit report and ``shim.in_effect()`` print, fitted to :data:`WIDTH` columns,
each character that does not print escaped (:func:`printable`). The tools gather what to say; this
says it.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..catalogue import PROVIDER as BUILTIN
from ..entry import APPLIED
from ..ranges import runs

if TYPE_CHECKING:
    from ..statuses import PatchStatus
    from .outlook import Outlook

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
    return [max(len(printable(str(row[i]))) for row in rows) for i in range(len(rows[0]))]


def table_line(row: Sequence[object], widths: Sequence[int], right: Sequence[int] = ()) -> str:
    """One line of a table whose columns are ``widths`` wide (a wider cell pushes the rest along):
    doctor prints each row as its check finishes, before the others are known."""
    cells = [printable(str(cell)) for cell in row]
    parts = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(cells, widths))]
    return "  ".join(parts).rstrip()


def rule(widths: Sequence[int]) -> str:
    """The line below a table's header."""
    return "  ".join("-" * w for w in widths)


def fitted(text: str, wide: bool = False, indent: str = "", more: str = "  ") -> list[str]:
    """``text`` as lines of :data:`WIDTH` columns, or one line where ``wide``; :func:`printable`."""
    text = printable(text)
    return [indent + text] if wide else _wrap(text, WIDTH, indent, more)


def printable(text: str, keep: str = "") -> str:
    """``text`` for a terminal: each character that does not print (ESC, BEL, a carriage return, a
    bidirectional override) escaped as ``repr`` escapes it, as the shim's messages quote ``SHIM_*``
    values; ``keep``: characters left as they are (explain keeps its newlines). A patch pack's
    summary, story, reason or bug probe error cannot move the cursor or colour the screen."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def _wrap(text: str, width: int, indent: str, more: str) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=more, break_on_hyphens=False)


# -- python -m shim's status table and its opening line -------------------------------------------


class _HasName(Protocol):
    @property
    def name(self) -> str: ...


_Named = TypeVar("_Named", bound=_HasName)


def by_name(records: Sequence[_Named]) -> list[_Named]:
    """``records`` in the one order every table of the shim uses: by patch name."""
    return sorted(records, key=lambda record: record.name)


def status_table(records: Sequence[PatchStatus], wide: bool = False, seen: Mapping[str, Outlook] | None = None) -> str:
    """The status table: a row per patch, by name, then its summary, the reason for its state and
    its last effect indented below, wrapped to :data:`WIDTH` columns (``wide``: one line each).
    ``seen``: each patch's :class:`~shim.tools.outlook.Outlook`, whose state and reason a pending
    patch shows (``will apply``); the effects column is there only once a patch has changed something."""
    records = by_name(records)
    counted = any(r.effects for r in records)
    rows: list[list[object]] = []
    for r in records:
        state = seen[r.name].state if seen else str(r.state)
        rows.append([r.name, f"{state}, suspended" if r.suspended else state, r.installed or "-"])
        if counted:
            rows[-1].append(r.effects)
    header = ["patch", "state", "installed", *(["effects"] if counted else [])]
    lines = table(rows, header, right=(3,)).splitlines()
    out = lines[:2]
    for record, line in zip(records, lines[2:]):
        out.append(line)
        notes = [record.summary, f"reason: {seen[record.name].reason if seen else record.reason}"]
        if record.provider not in ("", BUILTIN):  # a patch pack's: say whose
            notes.insert(1, f"from: {record.provider} (a patch pack)")
        if record.suspended:
            notes.append("suspended: off inside a shim.disabled() block, whatever its state")
        if record.last_effect:
            notes.append(f"last effect: {record.last_effect}")
        notes += [f"other patcher: {other['text']}" for other in record.others]
        for note in notes:
            out += fitted(note, wide, "    ", "      ")
    out += ["", "python -m shim explain <patch>: the bug, the versions measured, the fix and its limits"]
    return "\n".join(out)


def summary(records: Sequence[PatchStatus], seen: dict[str, Outlook]) -> str:
    """The line that opens ``python -m shim``: ``16 of 19 patches apply to the installed releases; 1
    outside its versions: peft-adapter-trainability; 2 need a library that is not installed: ...``."""
    from .outlook import APPLIES, BROKEN, FIXED_UPSTREAM, NOT_INSTALLED, OPTED_OUT, OUTSIDE, SKIPPED

    # How the summary line names each kind besides APPLIES, for one patch and for several.
    said = {
        OUTSIDE: ("outside its versions", "outside their versions"),
        NOT_INSTALLED: ("needs a library that is not installed", "need a library that is not installed"),
        FIXED_UPSTREAM: (
            "fixed upstream (its bug probe found the fix: it steps aside)",
            "fixed upstream (their bug probes found the fix: they step aside)",
        ),
        OPTED_OUT: ("opted out", "opted out"),
        BROKEN: ("failed", "failed"),
        SKIPPED: ("skipped (see its reason)", "skipped (see their reasons)"),
    }
    if not records:
        return "no patch is registered"
    names: dict[str, list[str]] = {}
    for record in sorted(records, key=lambda r: r.name):
        names.setdefault(seen[record.name].kind, []).append(record.name)
    applying = len(names.get(APPLIES, ()))
    verb = "applies" if applying == 1 else "apply"
    parts = [
        f"{applying} of {len(records)} {'patch' if len(records) == 1 else 'patches'} {verb} to the installed releases"
    ]
    for kind, (one, many) in said.items():
        if names.get(kind):
            parts.append(f"{len(names[kind])} {one if len(names[kind]) == 1 else many}: {', '.join(names[kind])}")
    return "; ".join(parts)


# -- the effects table (shim.report(), SHIM_REPORT=1 at exit) --------------------------------------


@dataclass(frozen=True)
class Row:
    """One patch in the effects table: of one process, or of a job's ranks together."""

    name: str
    effects: int
    last_effect: str
    group: str  # the line it is listed on when it changed nothing: "applied, nothing to change", "skipped", ...
    others: tuple[str, ...] = ()
    ranks: str = ""  # a job's table: the ranks it changed something in
    last_rank: int | None = None  # a job's table: the rank the last effect shown is from


def idle_group(state: str) -> str:
    """The line a patch that changed nothing is listed on in the effects table: its state."""
    return "applied, nothing to change" if state == APPLIED else state


def effects_table(who: str, rows: Sequence[Row], prefix: str, footer: Sequence[str] = ()) -> str:
    width = max(WIDTH - len(prefix), 40)
    rows = sorted(rows, key=lambda row: row.name)
    changed = [row for row in rows if row.effects]
    title = f"hf-train-shim report ({who}): {len(changed)} of {len(rows)} patches changed something"
    lines = _wrap(title, width, "", "  ")
    if changed:
        ranked = any(row.ranks for row in changed)
        cells = [[row.name, row.effects, *([row.ranks] if ranked else [])] for row in changed]
        header = ["patch", "effects", *(["ranks"] if ranked else [])]
        shown = table(cells, header, right=(1,)).splitlines()
        lines += ["  " + line for line in shown[:2]]
        for row, line in zip(changed, shown[2:]):
            source = "" if row.last_rank is None else f" (rank {row.last_rank})"
            lines += ["  " + line, *_wrap(f"last effect{source}: {row.last_effect}", width, " " * 6, " " * 8)]
    groups: dict[str, list[str]] = {idle_group(APPLIED): []}  # then skipped, pending, ...
    for row in rows:
        if not row.effects:
            groups.setdefault(row.group, []).append(row.name)
    for label, names in groups.items():
        if names:
            lines += _wrap(f"{label}: {', '.join(names)}", width, "  ", "    ")
    for row in rows:  # another patcher on a target: said at exit too, where it decides what ran
        for other in row.others:
            lines += _wrap(f"{row.name}: other patcher: {other}", width, "  ", "    ")
    for line in footer:
        lines += _wrap(line, width, "  ", "    ")
    return "\n".join(prefix + line for line in lines)


# -- shim.in_effect(model) ----------------------------------------------------------------------------


_NUMBERED = re.compile(r"^(.*\.)(\d+)$")


def view_text(view: Any) -> str:
    """``str(shim.in_effect(model))``: a :class:`~shim.tools.model_view.ModelView` (read by its
    fields, not imported: it renders itself through this module) as lines."""
    lines = [f"hf-train-shim on this {view.model}:"]
    if not view.checkpointing:
        lines.append("  checkpointing: no module of it can checkpoint")
    for group in view.checkpointing:
        state = "on" if group.on else "off"
        lines.append(f"  checkpointing {state}: {spans(group.modules)} ({len(group.modules)} module(s))")
        if group.on:
            lines.append(f"    through {group.function} {group.kwargs}")
    acting = {name: said for name, said in view.patches.items() if said}
    for name, said in acting.items():
        lines += [f"  {name}: {sentence}" for sentence in said]
    idle = sorted(name for name, said in view.patches.items() if not said)
    if idle:
        lines.append(f"  on, with nothing to do on this model now: {', '.join(idle)}")
    for name, adapter in view.adapters.items():
        active = "active" if adapter["active"] else "inactive"
        lines.append(
            f"  adapter {name!r}: {active}, {adapter['trainable']} of {adapter['parameters']} parameter(s) trainable"
        )
    lines += [f"  {line}" for line in view.audit]
    return "\n".join(lines)


def spans(names: Iterable[str]) -> str:
    """``model.layers.0-3, lm_head``: the numbered names of one parent in a row, each run of
    consecutive numbers written as one (:func:`shim.ranges.runs`)."""
    out: list[str] = []
    prefix = ""  # the parent of the numbered names in this row
    numbers: list[int] = []  # their numbers

    def flush() -> None:
        out.extend(prefix + run for run in runs(numbers))
        numbers.clear()

    for name in names:
        match = _NUMBERED.match(name)
        if match is None or match.group(1) != prefix:
            flush()
        if match is None:
            out.append(name)
        else:
            prefix = match.group(1)
            numbers.append(int(match.group(2)))
    flush()
    return ", ".join(out)
