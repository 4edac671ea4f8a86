"""One patch's life in a registry: its state, and applying it module by module.

The registry decides *when* (imports, switches, locks); an :class:`Entry` applies what
``shim.gating`` admits with ``shim.layers``, and rolls everything back if a target fails.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .states import APPLIED, FAILED, PENDING, SKIPPED
from .switch import Switch

if TYPE_CHECKING:
    from .importhooks import Hook
    from .layers import Layers
    from .patch import Declared, Patch
    from .versions import GateDecision


log = logging.getLogger("shim")


class Entry:
    """One patch in a registry: its declaration, its switch, its state and what it has wrapped."""

    __slots__ = (
        "declared", "patch", "switch", "state", "reason", "active", "explicit", "settled",
        "gate", "reasons", "layers", "done_modules", "hooked",
    )  # fmt: skip

    def __init__(self, declared: Declared, active: bool) -> None:
        self.declared = declared
        self.patch: Patch | None = None  # loaded on the first target import (or a status)
        self.switch = Switch()
        self.state, self.reason = PENDING, "not activated"
        self.active = active  # activate()/enable() vs deactivate()
        self.explicit = False  # switched on with enable(): wins over SHIM_DISABLE, until disable()
        self.settled = False  # skipped or failed for good (until deactivate/activate or enable)
        self.gate: GateDecision | None = None  # decided on the first target import
        self.reasons: list[str] = []  # why it applies (the gate), then the targets it left alone
        self.layers: Layers | None = None  # what it wrapped and rebound (shim.layers)
        self.done_modules: set[str] = set()  # target modules whose targets are applied
        self.hooked: dict[str, Hook] = {}  # module -> our import hook for it; "reload:" + name for reloads

    @property
    def name(self) -> str:
        return self.declared.name

    @property
    def installed(self) -> str | None:
        return self.gate.installed if self.gate is not None else None

    def load(self) -> Patch:
        """The patch's declaration (imports its module the first time)."""
        if self.patch is None:
            self.patch = self.declared.load()
        return self.patch

    def forget_progress(self) -> None:
        """Start over at the next target import: nothing applied, nothing decided for good."""
        self.done_modules.clear()
        self.reasons.clear()
        self.settled = False

    def set(self, state: str, reason: str, level: int | None = None, forced: bool = False) -> None:
        if (self.state, self.reason) != (state, reason):
            if level is None:
                level = logging.WARNING if state == FAILED else logging.INFO if state == APPLIED else logging.DEBUG
            if log.isEnabledFor(level):
                shown = (state, reason)
                if state == PENDING and self.gate is None:  # as shim.status() shows it (a metadata read)
                    from .gating import pending

                    shown = pending(self.declared, reason, forced)[:2]
                log.log(level, "%s: %s (%s)", self.name, *shown)
        self.state, self.reason = state, reason

    def apply(self, module_names: list[str], forced: bool, late: str | None = None) -> str | None:
        """Load, decide and wrap the targets in ``module_names``; returns a problem for strict mode.
        ``late``: why they are wrapped only now (their module was imported past the shim's hook)."""
        from . import gating
        from .layers import Layers

        try:
            patch = self.load()
        except Exception as exc:
            return self.give_up(FAILED, f"the patch module cannot be imported: {exc!r}")
        decision = gating.gate(self.declared, forced)
        self.gate = decision.decision
        if decision.skip is not None:
            self.give_up(SKIPPED, decision.skip)
            return None  # outside its gate is never a problem, not even in strict mode
        resolution = gating.resolve(patch, module_names, decision)
        if resolution.problem is not None:
            return self.give_up(*resolution.problem)
        self.reasons[:] = [decision.reason, *self.reasons[1:], *resolution.notes]
        if self.layers is None:
            self.layers = Layers(patch.name)
        try:
            switch, missed = self.layers.wrap(patch, resolution.targets, self.switch)
        except Exception as exc:
            return self.give_up(FAILED, f"wrapping failed and was rolled back: {exc!r}")
        if switch is not self.switch:  # adopted a layer already there, with its switch
            switch.adopt_watchers(self.switch)
            self.switch = switch
        self.reasons.extend(missed)
        if late is not None and resolution.targets:
            self.reasons.append(late)
        self.done_modules.update(module_names)
        self.switch.removed = False
        self.switch.update()
        return None

    def settle(self, waiting: list[str], added: list[str], forced: bool, late: str | None) -> None:
        """The state after an apply (``added``: the modules it wrapped now, ``late`` if past the
        shim's hook): applied (maybe in part), pending, or skipped for good."""
        later = f"applies when {and_(waiting)} {'is' if len(waiting) == 1 else 'are'} imported" if waiting else ""
        if self.layers:
            reason = "; ".join(filter(None, [*self.reasons, later and f"the rest {later}"]))
            level = logging.WARNING if late and added else logging.INFO
            if self.state != APPLIED:
                self.set(APPLIED, reason, level)
            elif added:  # said once at INFO; what a later target module adds, at DEBUG
                level = logging.WARNING if late else logging.DEBUG
                log.log(level, "%s: applied to %s as well (%s)", self.name, and_(added), reason)
            self.state, self.reason = APPLIED, reason
        elif waiting:
            self.set(PENDING, later, forced=forced)
        else:
            self.give_up(SKIPPED, "; ".join(self.reasons[1:]) or "no target applies")

    def give_up(self, state: str, reason: str) -> str:
        """Remove whatever the patch already wrapped and settle it as skipped or failed."""
        self.remove()
        self.settled = True
        self.set(state, reason)
        return reason

    def remove(self) -> None:
        if self.layers is None:
            return
        self.layers.remove()
        # A layer that could not be spliced out stays in place, inert, until it is adopted again.
        self.switch.removed = True
        self.switch.update()

    def drop_stale(self) -> None:
        """Forget layers whose target was replaced (a reload), so the patch applies to the new one."""
        if self.layers:
            self.done_modules -= self.layers.drop_stale()


def and_(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""
