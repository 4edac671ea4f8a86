"""The runtime on/off state of one patch, shared by all of its wrappers."""

from __future__ import annotations

import logging
from collections.abc import Callable


class Switch:
    """Handed to wrapt as each wrapper's ``enabled``; wrapt evaluates it on every call, so
    flipping it acts at once, even when other wrappers sit on top of ours. ``on`` is kept
    precomputed so the per-call check is one attribute read. A switch is off until its patch is
    applied, so a hook or function a patch installs outside its wrappers (``shim.switch_of``)
    acts only while the patch is applied and switched on.

    A patch that changes something outside its wrappers that must not outlive its switch (a
    class attribute it replaced) registers :meth:`watch`: the callback is told each time ``on``
    changes, so it can put things back when the patch goes off and again when it comes back.
    """

    __slots__ = ("disabled", "suspended", "removed", "on", "watchers")

    def __init__(self) -> None:
        self.disabled = False  # shim.disable() / shim.enable()
        self.suspended = 0  # nesting depth of shim.disabled() blocks
        self.removed = True  # not applied (yet), or deactivated (a layer left in place is inert)
        self.on = False
        self.watchers: list[Callable[[bool], object]] = []

    def __bool__(self) -> bool:
        return self.on

    def update(self) -> None:
        on = not (self.disabled or self.suspended or self.removed)
        if on == self.on:
            return
        self.on = on
        for watcher in tuple(self.watchers):
            try:
                watcher(on)
            except Exception:  # a switch must always switch: the watcher's failure is logged
                logging.getLogger("shim").exception("a watcher of a patch's switch failed")

    def watch(self, watcher: Callable[[bool], object]) -> None:
        """Call ``watcher(on)`` whenever the switch goes on or off (once per watcher)."""
        if watcher not in self.watchers:
            self.watchers.append(watcher)

    def adopt_watchers(self, other: Switch) -> None:
        """Take over ``other``'s watchers (the registry adopted this switch in its place)."""
        for watcher in other.watchers:
            self.watch(watcher)
