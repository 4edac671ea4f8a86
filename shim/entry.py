"""One patch's life in a registry: its state, its switch, and the transitions between them.

An :class:`Entry` owns everything about one patch. The registry only says what happened (the
user switched it, a target module finished importing) and keeps the table, the lock and the
import hooks; the entry decides what that means for the patch. Its life, as ``shim.status()``
reports it (docs/how-it-works.md, "A patch's states", draws it): ``PENDING`` until
:meth:`advance` wraps it (``APPLIED``) or finds it must not (``SKIPPED``, ``FAILED``: final until
``enable()`` or ``deactivate()``); ``DISABLED`` by ``SHIM_DISABLE``, :meth:`disable` or
:meth:`deactivate`.

Advancing is one straight path: gate → resolve → wrap → settle. What the user asked is kept apart
from where the patch is: ``active`` (``activate()`` / ``deactivate()``), ``choice`` (``enable()``
/ ``disable()``, which outlive a deactivation) and the depth of ``shim.disabled()`` blocks; the
switch the patch's layers answer to follows from them and from whether a layer is in place.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

from .runtime import Switch

if TYPE_CHECKING:
    from .gating import Gate
    from .patch import Declared, Patch
    from .settings import Settings
    from .wrapping import Layers, Other


# -- the states a patch can be in, as shim.status() and python -m shim report them -----------------
APPLIED = "applied"  # its layers are in place (and act unless switched off)
PENDING = "pending"  # a target module is not imported yet: the patch applies right after it is
SKIPPED = "skipped"  # not needed or not safe here (outside its gate, target missing, shape changed)
DISABLED = "disabled"  # switched off: SHIM_DISABLE, shim.disable(), shim.deactivate(), shim.disabled()
FAILED = "failed"  # wrapping raised (and was rolled back), or a probe could not run

SUSPENDED_REASON = "inside shim.disabled()"
OFF_BY_API = "switched off with shim.disable()"

# -- what the user chose for one patch with enable() / disable(): it outlives deactivate() ----------
FOLLOW = "follows SHIM_DISABLE"
ENABLED = "enabled"  # shim.enable(): wins over SHIM_DISABLE, until shim.disable()
OFF = "disabled"  # shim.disable()

log = logging.getLogger("shim")


class Progress(NamedTuple):
    """What one :meth:`Entry.advance` leaves for the registry to do."""

    problem: str | None  # why it did not apply, where strict mode must raise
    waiting: tuple[str, ...] = ()  # target modules to hook: it applies there when they are imported
    done: tuple[str, ...] = ()  # target modules it is applied in: applied again after a reload


class Entry:
    """One patch in a registry: its declaration, what the user chose, its state and its layers."""

    __slots__ = (
        "declared", "patch", "state", "reason", "active", "choice", "suspended", "switch",
        "gate", "notes", "layers", "done_modules", "blocked_by", "retake",
    )  # fmt: skip

    def __init__(self, declared: Declared, active: bool) -> None:
        self.declared = declared
        self.patch: Patch | None = None  # loaded on the first target import (or a status)
        self.state, self.reason = PENDING, "not activated"
        self.active = active  # activate() / enable() vs deactivate()
        self.choice = FOLLOW
        self.suspended = 0  # depth of the shim.disabled() blocks around it
        self.switch = Switch()
        self.gate: Gate | None = None  # decided on the first target import
        self.notes: list[str] = []  # what the status adds to the gate: targets left alone, late, ...
        self.blocked_by: list[Other] = []  # other patchers' objects the patch could not apply to
        self.retake = False
        self.layers: Layers | None = None  # what it wrapped and rebound (shim.wrapping.Layers)
        self.done_modules: set[str] = set()  # target modules whose targets are applied

    @property
    def name(self) -> str:
        return self.declared.name

    @property
    def installed(self) -> str | None:
        return self.gate.decision.installed if self.gate is not None else None

    def load(self) -> Patch:
        """The patch's declaration (imports its module the first time)."""
        if self.patch is None:
            self.patch = self.declared.load()
        return self.patch

    # -- what the user asks ---------------------------------------------------------------------

    def activate(self) -> None:
        self.active = self.retake = True  # retake: wrap again a target another patcher replaced

    def deactivate(self) -> None:
        """Take every layer off and start over at the next activation."""
        self.active = False
        self._take_off()
        self._forget_progress()
        self._set(DISABLED, "shim.deactivate() was called")

    def enable(self) -> None:
        """Switched on by the user: wins over ``SHIM_DISABLE``; a failed patch is tried again."""
        self.choice, self.active = ENABLED, True
        if self.state == FAILED:
            self._forget_progress()
            self._set(PENDING, "switched on with shim.enable()")
        self._update_switch()

    def disable(self) -> None:
        """Switched off by the user: its layers stay, inert, until :meth:`enable`."""
        self.choice = OFF
        self._update_switch()
        if self.state in (APPLIED, PENDING):
            self._set(DISABLED, OFF_BY_API)

    def suspend(self, depth: int) -> None:
        """Enter (``+1``) or leave (``-1``) a ``shim.disabled()`` block."""
        self.suspended += depth
        self._update_switch()

    @property
    def is_on(self) -> bool:
        """Applied, and its layers act right now."""
        return self.state == APPLIED and self.switch.on

    def settled(self, settings: Settings) -> bool:
        """Skipped or failed for good. In strict mode a problem is raised again at every chance
        (a retried import, ``activate()``); being outside its gate is never one."""
        if self.state not in (SKIPPED, FAILED):
            return False
        return not settings.strict or (self.gate is not None and self.gate.skip is not None)

    # -- what happens ---------------------------------------------------------------------------

    def advance(self, ready: Callable[[str], bool], settings: Settings, late: str | None = None) -> Progress:
        """Apply the targets whose module is ``ready`` (finished importing), or say why not.
        ``late``: why they are wrapped only now (their module was imported past the shim's hook)."""
        retake, self.retake = self.retake, False
        if not self.active or self.settled(settings):
            return Progress(None)
        if self.choice == OFF:
            if self.state == DISABLED:  # after deactivate() / activate(): say why it stays off
                self._set(DISABLED, OFF_BY_API)
            return Progress(None)
        self._drop_stale(retake)
        opted_out = settings.disable_all or self.name in settings.disabled
        if opted_out and self.choice != ENABLED and not self.layers:
            variable = "SHIM_DISABLE=all" if settings.disable_all else f"SHIM_DISABLE={self.name}"
            self._set(DISABLED, f"opted out with {variable}")
            return Progress(None)
        forced = self.name in settings.forced
        todo = [m for m in self.declared.modules if m not in self.done_modules]
        now = [m for m in todo if ready(m)]
        waiting = tuple(m for m in todo if m not in now)
        problem = None
        if now:
            done = set(self.done_modules)
            verdict = self._wrap(now, forced, late)
            if verdict is not None:
                state, reason, problem = verdict
                self._give_up(state, reason)
                if problem is not None and settings.strict:
                    self._forget_progress()  # tried again at the next chance: a retried import, activate()
            else:
                self._settle(waiting, [m for m in now if m not in done], forced, late)
        else:
            self._settle(waiting, [], forced, late)
        return Progress(problem, waiting, tuple(self.done_modules))

    def view(self, forced: bool) -> tuple[str, str, str | None]:
        """The state, its reason and the installed version, as ``shim.status()`` shows them: the
        state, and what can be known without applying anything (the gate of a patch still
        pending, a layer replaced since, a ``shim.disabled()`` block)."""
        from . import gating

        state, reason, installed = self.state, self.reason, self.installed
        if state == PENDING and self.gate is None:
            # Decided here rather than at activation, where it would cost every ``import shim`` a
            # metadata read (the log decides it the same way, when it shows the line).
            state, reason, installed = self._pending_shown(reason, forced)
        elif installed is None:
            installed = gating.installed_version(self.declared.distribution)
        if state == APPLIED and self.layers:
            state, reason = self._layers_now(reason)
        if self.suspended and state in (APPLIED, PENDING):
            state, reason = DISABLED, SUSPENDED_REASON
        return state, reason, installed

    # -- the steps ------------------------------------------------------------------------------

    def _wrap(self, module_names: list[str], forced: bool, late: str | None) -> tuple[str, str, str | None] | None:
        """Gate, resolve and wrap the targets in ``module_names``; ``None`` when they are in place,
        else ``(state, reason, problem)``: the problem is what strict mode raises."""
        from . import gating
        from .wrapping import Layers

        try:
            patch = self.load()
        except Exception as exc:
            return self._problem(FAILED, f"the patch module cannot be imported: {exc!r}")
        self.gate = gating.between_releases(gating.gate(self.declared, forced), patch)
        if self.gate.skip is not None:
            return SKIPPED, self.gate.skip, None  # outside its gate is never a problem, not even in strict mode
        self.blocked_by = []
        resolution = gating.resolve(patch, module_names, self.gate)
        if resolution.problem is not None:
            why = resolution.problem.why
            from .wrapping import foreign_targets

            self.blocked_by = foreign_targets(patch, module_names)  # whose object the probe refused
            if self.blocked_by:
                why += "; " + "; ".join(f"{o.target} holds {o.by}, another patcher's" for o in self.blocked_by)
            return self._problem(FAILED if resolution.problem.failed else SKIPPED, why)
        self.notes.extend(resolution.notes)
        if self.layers is None:
            self.layers = Layers(patch.name)
        try:
            switch, missed = self.layers.wrap(patch, resolution.targets, self.switch)
        except Exception as exc:
            return self._problem(FAILED, f"wrapping failed and was rolled back: {exc!r}")
        if switch is not self.switch:  # adopted a layer already there, with its switch
            for watcher in self.switch.watchers:
                switch.watch(watcher)
            self.switch = switch
        self.notes.extend(missed)
        if late is not None and resolution.targets:
            self.notes.append(late)
        self.done_modules.update(module_names)
        self._update_switch()
        try:
            # Another patcher's code under the new layers is said once, now; the consumer modules
            # are looked at when a status is asked for, not on the import of a target.
            self.others(consumers=False)
        except Exception:  # naming it must never cost the user's import
            log.debug("%s: could not look for other patchers", self.name, exc_info=True)
        return None

    @staticmethod
    def _problem(state: str, reason: str) -> tuple[str, str, str]:
        return state, reason, reason

    def _settle(self, waiting: Iterable[str], added: list[str], forced: bool, late: str | None) -> None:
        """The state after wrapping (``added``: the modules it wrapped now, ``late`` if past the
        shim's hook): applied (maybe in part), pending, or skipped for good."""
        waiting = list(waiting)
        later = f"applies when {and_(waiting)} {'is' if len(waiting) == 1 else 'are'} imported" if waiting else ""
        if self.layers:
            gate = [self.gate.reason] if self.gate is not None else []
            reason = "; ".join(filter(None, [*gate, *self.notes, later and f"the rest {later}"]))
            if self.state != APPLIED:
                self._set(APPLIED, reason, logging.WARNING if late and added else logging.INFO)
            elif added:  # said once at INFO; what a later target module adds, at DEBUG
                level = logging.WARNING if late else logging.DEBUG
                log.log(level, "%s: applied to %s as well (%s)", self.name, and_(added), reason)
            self.state, self.reason = APPLIED, reason
        elif waiting:
            self._set(PENDING, later, forced=forced)
        else:
            self._give_up(SKIPPED, "; ".join(self.notes) or "no target applies")

    def _give_up(self, state: str, reason: str) -> None:
        """Remove whatever the patch already wrapped and settle it as skipped or failed."""
        self._take_off()
        self._set(state, reason)

    def _take_off(self) -> None:
        if self.layers is not None:
            # A layer that could not be spliced out stays in place, switched off, until adopted again.
            self.layers.remove()
        self._update_switch()

    def _forget_progress(self) -> None:
        """Start over at the next target import: nothing applied, nothing noted."""
        self.done_modules.clear()
        self.notes.clear()

    def _drop_stale(self, retake: bool) -> None:
        """Forget layers whose target was replaced (a reload; another patcher's replacement only
        when ``retake``: ``shim.activate()``), so the patch applies to the new one."""
        if self.layers:
            self.done_modules -= self.layers.drop_stale(foreign_too=retake)

    def _update_switch(self) -> None:
        in_place = self.layers is not None and self.layers.in_place
        self.switch.set(in_place and self.choice != OFF and not self.suspended)

    def _layers_now(self, reason: str) -> tuple[str, str]:
        """An applied patch's state as its layers stand now: one replaced since says so."""
        assert self.layers is not None
        stale = self.layers.stale()
        modules = {layer.module_name for layer in stale}
        gone = sorted(name for name in modules if sys.modules.get(name) is None)
        if stale and len(gone) == len(modules):
            # The import the patch was applied in failed after it (another hook raised, in strict mode).
            state = PENDING if len(stale) == len(self.layers.installed) else APPLIED
            are = "is" if len(gone) == 1 else "are"
            return (
                state,
                f"{reason}; the import of {and_(gone)} failed: it applies again when {and_(gone)} {are} imported",
            )
        if stale:
            from .wrapping import BYPASSED

            specs = {f"{layer.module_name}:{layer.path}" for layer in stale}
            named = [other.text() for other in self.others() if other.relation == BYPASSED and other.target in specs]
            if named:
                return FAILED, "; ".join(named) + "; shim.activate() wraps it again, on top"
            replaced = self.layers.describe(stale)
            return FAILED, f"{replaced} was replaced after the shim wrapped it; shim.activate() wraps it again"
        return APPLIED, reason

    def others(self, consumers: bool = True) -> list[Other]:
        """Other patchers on this patch's targets (:meth:`shim.wrapping.Layers.others`), and those
        known to fix the same bug beside them (``Patch.same_fix``) while the patch is on, each
        logged the first time it is seen: a warning where it bypasses the fix."""
        if not self.layers and not self.blocked_by:
            return []
        from .wrapping import BYPASSED, same_fixes

        found = (self.layers.others(consumers) if self.layers else []) + self.blocked_by
        if self.layers and self.patch is not None:
            found += same_fixes(self.patch)
        for other in found:
            if other not in _seen:
                _seen.add(other)
                level = logging.WARNING if other.relation == BYPASSED else logging.INFO
                log.log(level, "%s: %s", self.name, other.text())
        return found

    def _pending_shown(self, reason: str, forced: bool) -> tuple[str, str, str | None]:
        """A pending patch whose gate is not decided yet, as status and log show it: skipped outside
        its gate (``gating.pending``), else pending with the gate's reason; and the installed version."""
        from .gating import pending

        skipped, shown, installed = pending(self.declared, reason, forced)
        return (SKIPPED if skipped else PENDING), shown, installed

    def _set(self, state: str, reason: str, level: int | None = None, forced: bool = False) -> None:
        if (self.state, self.reason) != (state, reason):
            if level is None:
                level = logging.WARNING if state == FAILED else logging.INFO if state == APPLIED else logging.DEBUG
            if log.isEnabledFor(level):
                shown = (state, reason)
                if state == PENDING and self.gate is None:  # as shim.status() shows it (a metadata read)
                    shown = self._pending_shown(reason, forced)[:2]
                log.log(level, "%s: %s (%s)", self.name, *shown)
        self.state, self.reason = state, reason


_seen: set[Other] = set()  # other patchers already logged (once per process each)


def and_(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""
