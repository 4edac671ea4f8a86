"""A job's ``multiprocessing`` workers in its one exit report, not one line per worker.

Which process says the report: a process that imported the shim marks the workers it starts. The
front door puts this process's key (under ``shim.runtime.WORKERS_KEY``: its pid and a time) in
``multiprocessing``'s per-process config (``current_process()._config``) once
``multiprocessing.process`` is imported, and ``multiprocessing`` copies that config into each process
it starts: in memory for ``fork``, pickled for ``spawn`` and ``forkserver`` (so
``torch.multiprocessing.spawn``, ``Pool``, ``ProcessPoolExecutor`` and DataLoader workers alike). A
worker of a worker carries the same key: every worker hands its counts to the first process.

How a worker hands them over: at its end, it writes what it counted to a file in that process's
folder, ``<tempdir>/hf-train-shim-<uid>/workers-<key>`` (beside the ranks' folders,
``shim.tools.ranks``), and says nothing. A ``fork`` worker ends by ``os._exit``, without ``atexit``,
but ``multiprocessing`` runs its own exit function at the end of every worker it starts: at a
worker's first effect the front door asks it to run the report then (``multiprocessing.util.Finalize``).
The process that started them claims its folder at its exit, adds their counts to its own and says
one line (or table) for all, or, under torchrun, hands the sum to its job (``shim.tools.ranks``). A
worker that ends after that finds the folder claimed, takes its file back and says its own line,
marked as late, so no count is lost or said twice.

What cannot be counted: a worker killed by a signal (``Pool.terminate()``, which leaving a ``with
Pool()`` block calls, kills the workers still waiting for a task; ``Process.terminate()``; the daemonic
workers ``multiprocessing`` terminates at its exit, such as a DataLoader's with
``persistent_workers=True`` still alive then), and a
worker of ``multiprocess`` (the dill-based copy ``datasets`` uses), which has a config of its own:
its fork workers end by ``os._exit`` and say nothing; its spawn workers say their own lines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..runtime import WORKERS_KEY
from . import ranks


def starter() -> str | None:
    """The key of the process this one hands its counts to: this is a ``multiprocessing`` worker
    started (directly or not) by a process with the shim. ``None``: this process says its own."""
    key = _key()
    return key if key is not None and pid_of(key) != os.getpid() and _parent() is not None else None


def hand_over(key: str, counted: dict[str, Any]) -> bool:
    """Give ``counted`` to the process of ``key``, for its report; ``False`` where it has said its
    report already (or is gone): this worker then says its own."""
    try:
        os.kill(pid_of(key), 0)
    except ProcessLookupError:
        return False
    folder = folder_of(key)
    ranks.prepare(folder)
    mine = folder / f"worker-{os.getpid()}.json"
    ranks.write(mine, counted)
    if (folder / ranks.CLAIMED).exists():  # its report is said, or being said: it took the file, or not
        return ranks.take_back(mine) is None
    return True


def collect() -> list[dict[str, Any]]:
    """At this process's exit: what its workers handed over (their files taken, so a worker that
    ends later says its own), by pid; ``[]`` where none did (one look at a folder)."""
    key = _key()
    if key is None or pid_of(key) != os.getpid():
        return []
    folder = folder_of(key)
    running = _running_workers()
    if not running and not folder.is_dir():
        return []  # no worker handed anything over, and none is left to
    try:
        ranks.prepare(folder)
        (folder / ranks.CLAIMED).mkdir()  # a worker still running finds it, and says its own
    except OSError:  # claimed already, or no folder can be made (a read-only temporary directory)
        return []
    records = ranks.take_all(folder, "worker-*.json")
    if running:
        _remove_once_joined(folder)
    else:
        ranks.remove(folder)  # none can come late
    return sorted(records, key=lambda record: int(record["pid"]))


def _remove_once_joined(folder: Path) -> None:
    """Remove ``folder`` once ``multiprocessing``'s own exit function has joined this process's
    workers (it runs after this report where ``multiprocessing`` was imported before the shim); a
    folder left all the same (a worker killed, a process killed) is removed by a later job
    (``ranks.STALE``)."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None and not getattr(util, "_exiting", False):
        util.Finalize(None, ranks.remove, args=(folder,), exitpriority=-1000)


def merged(effects: dict[str, int], last: dict[str, str], records: list[dict[str, Any]]) -> None:
    """Add the workers' ``records`` to this process's ``effects`` and ``last`` effects (a patch's own
    last effect is kept; else the last worker's)."""
    for record in records:
        for name, count in record["effects"].items():
            effects[name] = effects.get(name, 0) + int(count)
            if not last.get(name):
                last[name] = record["last"].get(name, "")


def with_workers(who: str, records: list[dict[str, Any]]) -> str:
    """Who a report speaks for, its workers included: ``pid 12 and 1 worker``, ``pid 12, launcher, and
    3 workers``, or, for a training process, whose line names nobody, ``this process and 2 workers``."""
    if not records:
        return who
    counted = f"{len(records)} worker{'' if len(records) == 1 else 's'}"
    return f"{who}{',' if ',' in who else ''} and {counted}" if who else f"this process and {counted}"


def folder_of(key: str) -> Path:
    return ranks.home() / f"workers-{key}"


def _key() -> str | None:
    process = sys.modules.get("multiprocessing.process")
    key = process.current_process()._config.get(WORKERS_KEY) if process is not None else None
    return key if isinstance(key, str) else None


def pid_of(key: str) -> int:
    return int(key.partition("-")[0])


def _parent() -> object:
    process = sys.modules.get("multiprocessing.process")
    return process.parent_process() if process is not None else None


def _running_workers() -> bool:
    context = sys.modules.get("multiprocessing")
    return bool(context.active_children()) if context is not None else False
