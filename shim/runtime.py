"""What a patch's code uses while the model runs: its switch, and the effects ledger.

The switch (:class:`Switch`, ``shim.switch_of``) says whether the patch acts right now; its entry
(``shim.entry``) sets it. The effects ledger counts how often each patch changed something in this
process, and what: a patch calls :func:`record` only on the branch where it does something other than upstream (a
parameter kept frozen, a configuration restored, a call adapted), never on the path where it
passes a call through, so counting costs nothing there. The first effect of each patch is logged
once at INFO on the ``shim`` logger; every effect is counted and the last one described in
``shim.status()`` (``effects``, ``last_effect``) and in ``shim.report()``.

The ledger is per process and keyed by patch name, so it survives a reload of ``shim``. A child
made by ``os.fork()`` starts it over: it counts what changes in it, which a multiprocessing worker
hands to its parent's exit report (``shim.tools.workers``), where the parent's own are counted once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

from .forks import fork_safe_lock

log = logging.getLogger("shim")
_lock = fork_safe_lock()
_counts: dict[str, int] = {}
_last: dict[str, tuple[str, tuple[object, ...]]] = {}
_muted = threading.local()  # depth of muted() blocks in this thread: a bug probe running (shim.probing)
#: Told of each patch's first effect in this process (the front door: a multiprocessing worker, which
#: may end by ``os._exit`` without running ``atexit``, then arranges to hand its counts over at its end).
first_effect_hooks: list[Callable[[], object]] = []
#: Where a worker's counts go. The key, in ``multiprocessing``'s per-process config, of the process
#: whose exit report says the counts of the workers it starts (the front door sets it, each process it
#: starts gets a copy, ``shim.tools.workers`` reads it); and the variable that names a Ray job whose
#: driver imported the shim, set in the job's runtime environment by ``ray-workers-get-the-shim``: a
#: worker of it hands its counts to that driver's exit report (``shim.tools.rayjobs``).
WORKERS_KEY = "hf-train-shim exit report"
RAY_JOB = "HF_TRAIN_SHIM_RAY_JOB"


class Switch:
    """Whether one patch acts right now. ``on`` is set by the patch's entry; the layers the patch
    has a part in watch it (``shim.parts``) and change which parts they run when it flips, so a
    call never checks it. A switch is off until its patch is applied, so a hook or function a patch
    installs outside its parts (``shim.switch_of``) acts only while the patch is applied and on.

    A patch that changes something outside its wrappers that must not outlive its switch (a
    class attribute it replaced) registers :meth:`watch`: the callback is told each time ``on``
    changes, so it can put things back when the patch goes off and again when it comes back.
    """

    __slots__ = ("on", "watchers")

    def __init__(self) -> None:
        self.on = False
        self.watchers: list[Callable[[bool], object]] = []

    def __bool__(self) -> bool:
        return self.on

    def set(self, on: bool) -> None:
        if on == self.on:
            return
        self.on = on
        for watcher in tuple(self.watchers):
            try:
                watcher(on)
            except Exception:  # a switch must always switch: the watcher's failure is logged
                log.exception("a watcher of a patch's switch failed")

    def watch(self, watcher: Callable[[bool], object]) -> None:
        """Call ``watcher(on)`` whenever the switch goes on or off (once per watcher)."""
        if watcher not in self.watchers:
            self.watchers.append(watcher)

    def unwatch(self, watcher: Callable[[bool], object]) -> None:
        if watcher in self.watchers:
            self.watchers.remove(watcher)


def record(patch: str, message: str, *args: object) -> None:
    """Count one effect of ``patch``, described by ``message % args``.

    The text is formatted only when it is read; ``args`` should be strings and numbers (a class
    name, never the model), so that the ledger keeps nothing alive. Inside :func:`muted` (a bug
    probe's tiny case, in its thread) nothing is counted: the user's run did not change.
    """
    if getattr(_muted, "depth", 0):
        return
    with _lock:
        count = _counts.get(patch, 0) + 1
        _counts[patch] = count
        _last[patch] = (message, args)
    if count == 1:
        log.info("%s: %s (first effect in this process; shim.status() counts the others)", patch, message % args)
        for hook in first_effect_hooks:
            try:
                hook()
            except Exception:  # the exit report's business must never cost the user's training
                log.debug("a hook of the first effect failed", exc_info=True)


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """Effects recorded in this thread inside the block are not counted (a bug probe's own case)."""
    _muted.depth = getattr(_muted, "depth", 0) + 1
    try:
        yield
    finally:
        _muted.depth -= 1


def count(patch: str) -> int:
    return _counts.get(patch, 0)


def last(patch: str) -> str:
    """The description of the last effect of ``patch``, or ``""`` while it has none."""
    entry = _last.get(patch)
    if entry is None:
        return ""
    message, args = entry
    return message % args


def clear() -> None:
    """Forget every count: a forked child starts its ledger over (below); the tests start each from empty."""
    with _lock:
        _counts.clear()
        _last.clear()


if hasattr(os, "register_at_fork"):  # a child counts what changes in it (the locks are reset by shim.forks)
    os.register_at_fork(after_in_child=clear)
