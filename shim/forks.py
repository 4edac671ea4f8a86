"""Locks that survive ``os.fork()``: every lock the shim owns is made here.

A lock that another thread holds at the moment of ``fork`` stays held forever in the child, where
that thread does not exist: a DataLoader worker started with ``fork`` while a thread was applying
a patch would hang at its first target import. So, as ``logging`` does for its own locks, every
lock the shim owns is created here and:

- before ``fork``, taken by the forking thread (registries' first, then the module locks), so the
  child never sees the state they protect half-changed; a lock still held after
  :data:`FORK_WAIT` seconds is left alone (the fork is never blocked for long);
- after ``fork``, released in the parent and re-initialised in the child.

``fork`` from a thread that is itself inside a registry operation (a hook that forks) is fine:
the registries' locks are re-entrant.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

#: How long the forking thread waits for each lock another thread holds before forking anyway.
FORK_WAIT = 5.0

_guard = threading.Lock()  # protects the two collections below
_outer: weakref.WeakSet[Any] = weakref.WeakSet()  # registries' locks (one per registry)
_inner: list[Any] = []  # module-level locks (lazy imports, import hooks, effects ledger), in creation order
_taken: list[Any] = []  # what the forking thread holds between "before" and "after"


#: Held while the shim imports one of its own modules on first use, outside a registry's lock (a
#: status's records, the front door's tools): a child forked while another thread is inside such an
#: import would wait for Python's lock on that module forever. The forking thread takes it too.
lazy_imports = threading.RLock()
_inner.append(lazy_imports)


def fork_safe_rlock() -> threading.RLock:
    """A re-entrant lock for one registry (kept weakly: a registry may be thrown away)."""
    lock = threading.RLock()
    with _guard:
        _outer.add(lock)
    return lock


def fork_safe_lock() -> threading.Lock:
    """A module-level lock, taken after every registry's lock around a fork."""
    new = threading.Lock()
    with _guard:
        _inner.append(new)
    return new


def _before() -> None:
    _guard.acquire()
    # Registries' locks first: code that holds one may take a module lock, never the reverse.
    for each in [*_outer, *_inner]:
        if each.acquire(timeout=FORK_WAIT):
            _taken.append(each)


def _after_in_parent() -> None:
    while _taken:
        _taken.pop().release()
    _guard.release()


def _after_in_child() -> None:
    _taken.clear()
    for each in [*_outer, *_inner, _guard]:
        each._at_fork_reinit()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
