"""The effects ledger: how often each patch changed something in this process, and what.

A patch calls :func:`record` only on the branch where it does something other than upstream (a
parameter kept frozen, a configuration restored, a call adapted), never on the path where it
passes a call through, so counting costs nothing there. The first effect of each patch is logged
once at INFO on the ``shim`` logger; every effect is counted and the last one described in
``shim.status()`` (``effects``, ``last_effect``) and in ``shim.report()``.

The ledger is per process and keyed by patch name, so it survives a reload of ``shim``.
"""

from __future__ import annotations

import logging

from . import forksafe

log = logging.getLogger("shim")
_lock = forksafe.lock()
_counts: dict[str, int] = {}
_last: dict[str, tuple[str, tuple[object, ...]]] = {}


def record(patch: str, message: str, *args: object) -> None:
    """Count one effect of ``patch``, described by ``message % args``.

    The text is formatted only when it is read; ``args`` should be strings and numbers (a class
    name, never the model), so that the ledger keeps nothing alive.
    """
    with _lock:
        count = _counts.get(patch, 0) + 1
        _counts[patch] = count
        _last[patch] = (message, args)
    if count == 1:
        log.info("%s: %s (first effect in this process; shim.status() counts the others)", patch, message % args)


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
    """Forget every count (tests; a long-lived process that wants a fresh report)."""
    with _lock:
        _counts.clear()
        _last.clear()
