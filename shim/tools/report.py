"""What the shim says at exit (the line, or the effects table with ``SHIM_REPORT=1``) and
``shim.report()``: the counts of this process, its workers and its job's ranks, gathered here and
rendered by ``shim.tools.render``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from ..ranges import runs
from . import processes, ranks, rayjobs, workers
from .render import Row, effects_table, idle_group

if TYPE_CHECKING:
    from ..statuses import PatchStatus


def report(
    records: Sequence[PatchStatus],
    handed_over: list[dict[str, Any]] | None = None,
    ray_workers: list[dict[str, Any]] | None = None,
) -> str:
    """The compact effects table that ``SHIM_REPORT=1`` prints at exit and ``shim.report()`` returns:
    a row per patch that changed something, by name, its last effect below it, then the other patches
    by state; :data:`WIDTH` columns wide, the ``[rank N]`` prefix included. ``handed_over``: what this
    process's multiprocessing workers counted (``shim.tools.workers``), added in; ``ray_workers``: what
    the workers of its Ray jobs counted (``shim.tools.rayjobs``), added in too."""
    role = processes.helper(spec.partition(":")[0] for r in records for spec in r.targets)
    who = f"pid {os.getpid()}, {role}" if role else f"pid {os.getpid()}"
    effects = {r.name: r.effects for r in records}
    last = {r.name: r.last_effect for r in records}
    if handed_over:
        workers.merged(effects, last, handed_over)
        who = workers.with_workers(who, handed_over)
    if ray_workers:
        workers.merged(effects, last, ray_workers)
        who = f"{who}, {ray_names(ray_workers)}"
    rows = [
        Row(r.name, effects[r.name], last[r.name], idle_group(str(r.state)), tuple(o["text"] for o in r.others))
        for r in records
    ]
    return effects_table(who, rows, _prefix(), [f.line() for f in _audit_findings()])


def _audit_findings() -> list[Any]:
    """What the first-step audit named in this process (``shim.audit``, loaded once an optimizer was)."""
    audit = sys.modules.get("shim.audit")
    return list(audit.found) if audit is not None else []


def _prefix(rank: object = None) -> str:
    rank = processes.rank() if rank is None else rank
    return f"[rank {rank}] " if rank is not None else ""


def acted_line(
    effects: Mapping[str, int], who: str = "", prefix: str = "", ranks: Mapping[str, str] | None = None
) -> str:
    """The line said at exit where a fix acted: ``hf-train-shim: 2 fixes acted: checkpointing-restore
    ×4, input-grad-hook-dedupe ×3 (SHIM_REPORT=1 for the table)``; ``""`` where none did. ``ranks``:
    the ranks each fix acted in, where not in all of a job's. One line however long, not fitted to
    :data:`WIDTH` like the tables: a log is searched for it line by line (``grep hf-train-shim``)."""
    acted = sorted(name for name, count in effects.items() if count)
    if not acted:
        return ""
    ranks = ranks or {}
    each = [f"{name} ×{effects[name]}" + (f" ({ranks[name]})" if ranks.get(name) else "") for name in acted]
    head = "hf-train-shim" + (f" ({who})" if who else "")
    fixes = f"{len(acted)} {'fix' if len(acted) == 1 else 'fixes'} acted"
    return f"{prefix}{head}: {fixes}: {', '.join(each)} (SHIM_REPORT=1 for the table)"


def rank_list(ranks: Iterable[int], noun: str = "rank") -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0, 2``, ``ranks 0-1, 3``: the numbers in order, each run of
    two or more consecutive ones as a span (:func:`shim.ranges.runs`); ``noun``: what is numbered
    (``ray worker``)."""
    numbers = sorted(set(ranks))
    return f"{noun if len(numbers) == 1 else noun + 's'} {', '.join(runs(numbers))}"


def ray_names(records: Sequence[dict[str, Any]]) -> str:
    """The Ray workers of ``records``: by their Ray Train ranks (``ray workers 0-1``) where each has
    one, else counted (``3 ray workers``)."""
    numbers = [record["rank"] for record in records]
    if all(isinstance(number, int) for number in numbers):
        return rank_list(numbers, "ray worker")
    return f"{len(records)} ray worker{'' if len(records) == 1 else 's'}"


def ray_places(own: Mapping[str, int], records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Where each fix acted, for the driver's line, where that is not every Ray worker of the job:
    ``driver``, ``ray worker 1``, ``driver, ray workers 0-1``."""
    places = {}
    for name in {*own, *(name for record in records for name in record["effects"])}:
        acted = [record for record in records if record["effects"].get(name)]
        if own.get(name) or len(acted) < len(records):
            places[name] = ", ".join((["driver"] if own.get(name) else []) + ([ray_names(acted)] if acted else []))
    return places


# -- at exit ---------------------------------------------------------------------------------------

_said = False


def silence_at_exit() -> None:
    """Say nothing at exit in this process: ``python -m shim``'s own, whose effects are its bug probes'."""
    global _said
    _said = True


def at_exit(table: bool) -> None:
    """What ``import shim`` runs at exit (once, whatever registered it): never raises, imports nothing
    for the line, and waits only as :mod:`shim.tools.ranks` says, with a timeout."""
    global _said
    shim = sys.modules.get("shim")
    if _said or shim is None:
        return
    _said = True
    try:
        text = _at_exit(shim, table)
    except Exception as exc:  # the user's program is over: say why, never raise at exit
        text = f"hf-train-shim report failed: {exc!r}"
    if _audit_findings() and not table:  # the table lists them itself
        text = "\n".join(filter(None, [text, _prefix() + sys.modules["shim.audit"].exit_line()]))
    if text:
        write_whole_lines(text)


class Counted(NamedTuple):
    """What a process counted, at its exit, by patch name: its workers' counts added in."""

    effects: dict[str, int]  # this process's, its multiprocessing workers' and its Ray workers'
    last: dict[str, str]  # the last effect of each patch that acted
    own: dict[str, int]  # what acted in this process and its multiprocessing workers, not its Ray workers
    handed_over: list[dict[str, Any]]  # what its multiprocessing workers handed over (shim.tools.workers)
    ray_workers: list[dict[str, Any]]  # what the workers of its Ray jobs handed over (shim.tools.rayjobs)


def _at_exit(shim: ModuleType, table: bool) -> str:
    """What this process says at exit: a ``multiprocessing`` worker hands its counts to the process
    that started it, a Ray worker to its driver; one process says its own with its workers', a rank
    of a job its job's (or nothing, where another rank says it)."""
    from .. import runtime  # the effects ledger: counts read without a status, which would import patch modules

    names = shim.registry.names
    effects = {name: runtime.count(name) for name in names}
    last = {name: runtime.last(name) for name, count in effects.items() if count}
    starter = workers.starter()
    if starter is not None:  # a multiprocessing worker: the process that started it says its counts
        return _worker_line(starter, effects, last)
    if rayjobs.job() is not None:  # a Ray worker: its driver says its counts, or it says what it could not get
        return acted_line(rayjobs.at_exit(), rayjobs.who())
    counted = _with_workers(effects, last)
    role = processes.helper(module for name in names for module in shim.registry.declared(name).modules)
    found = ranks.job() if role is None else None
    if found is None:  # one process: the script, a helper, or a rank started alone
        return _process_report(shim, table, role, counted)
    return _rank_report(shim, table, found, counted)


def _worker_line(starter: str, effects: dict[str, int], last: dict[str, str]) -> str:
    """A ``multiprocessing`` worker's: its counts handed to the process of key ``starter``, and nothing
    said; its own line where that process has said its report already."""
    if not any(effects.values()):
        return ""
    counted = {"pid": os.getpid(), "effects": {name: n for name, n in effects.items() if n}, "last": last}
    if workers.hand_over(starter, counted):
        return ""
    who = f"pid {os.getpid()}, multiprocessing worker, finished after the report of pid {workers.pid_of(starter)}"
    return acted_line(effects, who, _prefix())


def _with_workers(effects: dict[str, int], last: dict[str, str]) -> Counted:
    """This process's ``effects`` and ``last`` effects, what its multiprocessing workers and the
    workers of its Ray jobs handed over added in."""
    handed_over = workers.collect()
    workers.merged(effects, last, handed_over)
    own = {name: count for name, count in effects.items() if count}
    ray_workers = rayjobs.collected()
    workers.merged(effects, last, ray_workers)
    return Counted(effects, last, own, handed_over, ray_workers)


def _process_report(shim: ModuleType, table: bool, role: str | None, counted: Counted) -> str:
    """The line (or ``table``) of one process: the script, or a helper of ``role`` (a launcher, a
    worker) where something changed in it; its workers named and counted in."""
    effects, _last, own, handed_over, ray_workers = counted
    if role is not None and not any(effects.values()):
        return ""  # a helper (launcher, worker) in which nothing changed
    if table:
        return report(shim.status(), handed_over, ray_workers)
    who = workers.with_workers(f"pid {os.getpid()}, {role}" if role else "", handed_over)
    if not ray_workers:
        return acted_line(effects, who, _prefix())
    who = f"{who}, {ray_names(ray_workers)}" if who else ray_names(ray_workers)
    return acted_line(effects, who, _prefix(), ray_places(own, ray_workers))


def _rank_report(shim: ModuleType, table: bool, found: ranks.Job, counted: Counted) -> str:
    """A rank's counts joined to its job's: the job's line (or ``table``) where this rank says it, ``""``
    where another rank does."""
    acted = {name: count for name, count in counted.effects.items() if count}
    mine: dict[str, object] = {
        "pid": os.getpid(),
        "effects": acted,
        "last": {name: counted.last[name] for name in acted},
    }
    if table:
        mine["records"] = [_kept(record) for record in shim.status()]
    try:
        joined = ranks.join(found, mine)
    except OSError:  # no folder for the job (a read-only temporary directory): this rank says its own
        joined = ranks.Joined([mine | {"rank": found.rank}], late=True)
    if joined is None:
        return ""  # another rank says it for the job
    return job_report(joined, found.expected, table)


def _kept(record: PatchStatus) -> dict[str, object]:
    """What a rank's table needs of a status record (its file holds it)."""
    return {
        "name": record.name,
        "state": str(record.state),
        "effects": record.effects,
        "last_effect": record.last_effect,
        "others": [other["text"] for other in record.others],
    }


def job_report(joined: ranks.Joined, expected: int, table: bool) -> str:
    """The line (or, with ``table``, the effects table) for the ranks in ``joined``, by patch name:
    each patch's effects summed over the ranks, the ranks it acted in where not all."""
    records = joined.records
    numbers = [int(record["rank"]) for record in records]
    totals: dict[str, int] = {}
    acted_in: dict[str, list[int]] = {}
    for record in records:
        for name, count in record["effects"].items():
            totals[name] = totals.get(name, 0) + int(count)
            acted_in.setdefault(name, []).append(int(record["rank"]))
    where = {name: rank_list(found) for name, found in acted_in.items() if len(found) < len(numbers)}
    every = {name: rank_list(found) for name, found in acted_in.items()}
    prefix = _prefix(numbers[0]) if joined.late else ""
    missing = expected - len(records)
    if joined.late:
        who = "finished after the job's report"
    else:
        who = rank_list(numbers) + (f"; {missing} of {expected} had not finished" if missing > 0 else "")
    if not table:
        return acted_line(totals, who, prefix, where)
    return effects_table(who, _job_rows(records, totals, every), prefix)


def _job_rows(records: Sequence[dict[str, Any]], totals: Mapping[str, int], acted_in: Mapping[str, str]) -> list[Row]:
    """A row per patch for a job's table, from every rank's records: a patch whose state differs
    between ranks is listed as ``applied in rank 0, pending in rank 1``."""
    states: dict[str, dict[str, list[int]]] = {}
    others: dict[str, list[str]] = {}
    for record in records:
        for kept in record.get("records", ()):
            states.setdefault(kept["name"], {}).setdefault(kept["state"], []).append(int(record["rank"]))
            others.setdefault(kept["name"], []).extend(kept["others"])
    rows = []
    for name, seen in states.items():
        if len(seen) == 1:
            group = idle_group(next(iter(seen)))
        else:
            group = ", ".join(f"{state} in {rank_list(found)}" for state, found in seen.items())
        last, rank = "", None
        if totals.get(name):  # the highest rank's: the ranks are alike, and rank 0 often does more (saving)
            rank, last = next((int(r["rank"]), r["last"][name]) for r in reversed(records) if name in r["last"])
        kept = tuple(dict.fromkeys(others[name]))
        rows.append(Row(name, totals.get(name, 0), last, group, kept, acted_in.get(name, ""), rank))
    return rows


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
