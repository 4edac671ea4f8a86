"""The runtime on/off state of one patch, shared by all of its wrappers."""

from __future__ import annotations


class Switch:
    """Handed to wrapt as each wrapper's ``enabled``; wrapt evaluates it on every call, so
    flipping it acts at once, even when other wrappers sit on top of ours. ``on`` is kept
    precomputed so the per-call check is one attribute read. A switch is off until its patch is
    applied, so a hook or function a patch installs outside its wrappers (``shim.switch_of``)
    acts only while the patch is applied and switched on.
    """

    __slots__ = ("disabled", "suspended", "removed", "on")

    def __init__(self) -> None:
        self.disabled = False  # shim.disable() / shim.enable()
        self.suspended = 0  # nesting depth of shim.disabled() blocks
        self.removed = True  # not applied (yet), or deactivated (a layer left in place is inert)
        self.on = False

    def __bool__(self) -> bool:
        return self.on

    def update(self) -> None:
        self.on = not (self.disabled or self.suspended or self.removed)
