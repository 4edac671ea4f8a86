"""A Ray job's workers in its driver's one exit report, not one line per worker.

``ray-workers-get-the-shim`` gives the workers of a job that a driver with the shim starts a setup hook
that imports the shim, and names the job in their environment (``shim.runtime.RAY_JOB``). Ray ends its
workers without an interpreter exit (a Ray Train worker is killed once its training function
returned), so a worker cannot say its counts at its end as a ``multiprocessing`` worker does
(``shim.tools.workers``): from its first effect on, a daemon thread hands them over while it runs
(at once at that first effect, then within :data:`PERIOD` seconds of each change) to the job's part
of Ray's internal key-value store, which every node reaches (``shim.patches._ray_jobs``). The driver
collects them before Ray disconnects it and says one line for the job (``shim.tools.report``); a
worker whose counts the driver can no longer take (it collected already, or Ray is gone) says its
own line at its exit, if it has one, with what the driver did not get.

What cannot be counted: the effects of a worker's last :data:`PERIOD` before Ray kills it, other
than its first (a worker ending soon after it is still named in the driver's line), and those of a
worker that outlives its driver's collection and is killed (a detached actor).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any

from .. import runtime
from ..forks import fork_safe_lock

#: How often a Ray worker's thread looks at its counts, handing them over when they changed.
PERIOD = 0.2

_sent: dict[str, int] = {}  # the counts the driver has, as last handed over (a fork child has none)
_lock = fork_safe_lock()
_running_in = 0  # the pid whose thread hands the counts over (a fork child starts over)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_sent.clear)


def job() -> str | None:
    """The job this process is a Ray worker of, with a driver that imported the shim; ``None`` otherwise
    (the driver, or a process the worker started without Ray)."""
    name = os.environ.get(runtime.RAY_JOB)
    worker = sys.modules.get("ray._private.worker")
    if not name or worker is None:
        return None
    mode = getattr(getattr(worker, "global_worker", None), "mode", None)
    return name if mode == getattr(worker, "WORKER_MODE", object()) else None


def hand_over_while_running() -> None:
    """Start the thread that hands this worker's counts over while it runs (once per process)."""
    global _running_in
    if _running_in == os.getpid() or job() is None:
        return
    _running_in = os.getpid()
    threading.Thread(target=_run, name="hf-train-shim: counts to the Ray driver", daemon=True).start()


def _run() -> None:
    while True:  # the first effect at once: a short-lived worker is still named in its driver's line
        hand_over()
        time.sleep(PERIOD)


def _effects() -> dict[str, int]:
    """This worker's counts, of the patches that acted."""
    counts = {name: runtime.count(name) for name in sys.modules["shim"].registry.names}
    return {name: count for name, count in counts.items() if count}


def counted(effects: dict[str, int]) -> dict[str, Any]:
    """What this worker counted (``effects``, from :func:`_effects`), as its driver's report reads it."""
    return {
        "pid": os.getpid(),
        "node": _node(),
        "rank": _rank(),
        "effects": effects,
        "last": {name: runtime.last(name) for name in effects},
    }


def hand_over() -> bool:
    """Hand this worker's counts to its driver where they changed; ``False`` where the driver can no
    longer take them (it collected the job, or Ray is gone)."""
    name = job()
    if name is None:
        return False
    with _lock:
        effects = _effects()
        if effects == _sent:  # the thread's usual look: nothing new, no record built
            return True
        record = counted(effects)
        from ..patches import _ray_jobs

        if not _ray_jobs.put(name, f"worker-{record['node']}-{record['pid']}", record):
            return False
        _sent.clear()
        _sent.update(record["effects"])
    return True


def at_exit() -> dict[str, int]:
    """At a Ray worker's exit (where it has one): its last counts handed over, and what its driver did not
    get (``{}`` where it got everything), for a line of this worker's own."""
    if hand_over():
        return {}
    late = {name: count - _sent.get(name, 0) for name, count in _effects().items()}
    return {name: count for name, count in late.items() if count > 0}


def who() -> str:
    """This worker, for a line of its own: ``ray worker 1, pid 12, after its driver's report``."""
    rank = _rank()
    worker = f"ray worker {rank}" if rank is not None else "ray worker"
    return f"{worker}, pid {os.getpid()}, after its driver's report"


def collected() -> list[dict[str, Any]]:
    """In a driver: what the workers of its Ray jobs handed over, as collected before Ray disconnected it."""
    jobs = sys.modules.get("shim.patches._ray_jobs")
    return list(jobs.collected) if jobs is not None else []


def _rank() -> int | None:
    """A Ray Train worker's world rank (torch's variables, set by Ray Train), or ``None``."""
    rank = os.environ.get("RANK")
    return int(rank) if rank and rank.isdigit() else None


@functools.cache  # a process stays on its node
def _node() -> str:
    try:
        return str(sys.modules["ray"].get_runtime_context().get_node_id())
    except Exception:
        import socket

        return socket.gethostname()
