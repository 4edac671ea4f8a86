"""One patch's life in a registry: its state, its switch, and the transitions between them.

An :class:`Entry` owns everything about one patch. The registry only says what happened (the
user switched it, a target module finished importing) and keeps the table, the lock and the
import hooks; the entry decides what that means for the patch. Its life, as ``shim.status()``
reports it (docs/how-it-works.md, "A patch's states", draws it): ``PENDING`` until
:meth:`advance` wraps it (``APPLIED``) or finds it must not (``SKIPPED``, ``FAILED``: final until
``enable()`` or ``deactivate()``); ``DISABLED`` by ``SHIM_DISABLE``, :meth:`disable` or
:meth:`deactivate`. What can change without the registry being told (a layer another patcher
replaced, a reload, the gate of a patch whose targets are not imported yet) is recorded as a
transition by :meth:`refresh`, which the registry calls before a status is read: a status reads the
state, it never re-derives it. Every write of the state goes through :meth:`_set`, which logs it.

Advancing is one straight path: gate → resolve → wrap → settle. What the user asked is kept apart
from where the patch is: ``active`` (``activate()`` / ``deactivate()``), ``choice`` (``enable()``
/ ``disable()``, which outlive a deactivation) and the depth of ``shim.disabled()`` blocks; the
switch the patch's layers answer to follows from them and from whether a layer is in place.
"""

from __future__ import annotations

import enum
import logging
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

from .runtime import Switch

if TYPE_CHECKING:
    from .gating import Gate
    from .layers import Layers
    from .others import Other
    from .patch import Declared, Patch
    from .settings import Settings


class State(str, enum.Enum):
    """The states a patch can be in, as ``shim.status()`` and ``python -m shim`` report them. A
    ``str``: a state compares equal to its name (``status.state == "applied"``) and prints as it."""

    APPLIED = "applied"  # its layers are in place (and act unless switched off)
    PENDING = "pending"  # a target module is not imported yet: the patch applies right after it is
    SKIPPED = "skipped"  # not needed or not safe here (outside its gate, target missing, shape changed)
    DISABLED = "disabled"  # switched off: SHIM_DISABLE, shim.disable(), shim.deactivate(), shim.disabled()
    FAILED = "failed"  # wrapping raised (and was rolled back), a probe could not run, or a layer was bypassed

    def __str__(self) -> str:
        return self.value


APPLIED, PENDING, SKIPPED, DISABLED, FAILED = State

QUIET = -1  # a level for Entry._set: a change said already in other words
OFF_BY_API = "switched off with shim.disable()"


class Choice(enum.Enum):
    """What the user chose for one patch with enable() / disable(): it outlives deactivate()."""

    FOLLOW = "follows SHIM_DISABLE"
    ENABLED = "enabled"  # shim.enable(): wins over SHIM_DISABLE, until shim.disable()
    OFF = "disabled"  # shim.disable()


FOLLOW, ENABLED, OFF = Choice

log = logging.getLogger("shim")


class Progress(NamedTuple):
    """What one :meth:`Entry.advance` leaves for the registry to do."""

    problem: str | None  # why it did not apply, where strict mode must raise
    waiting: tuple[str, ...] = ()  # target modules to hook: it applies there when they are imported
    done: tuple[str, ...] = ()  # target modules it is applied in: applied again after a reload
    wrapped: bool = False  # it wrapped targets just now: time to look for other patchers on them


class Entry:
    """One patch in a registry: its declaration, what the user chose, its state and its layers."""

    __slots__ = (
        "declared", "patch", "state", "reason", "final", "waiting_for", "applied_as", "active", "choice",
        "suspended", "switch", "gate", "notes", "layers", "done_modules", "blocked_by", "retake", "__weakref__",
    )  # fmt: skip

    def __init__(self, declared: Declared, active: bool) -> None:
        self.declared = declared
        self.patch: Patch | None = None  # loaded on the first target import (or a status)
        # The state and why; written only by _set. ``final``: skipped or failed by advance (its
        # targets were looked at), not by what a refresh saw.
        self.state, self.reason, self.final = PENDING, "not activated", False
        self.waiting_for = self.reason  # a pending patch's reason before its gate is known
        self.applied_as = ""  # an applied patch's reason, before a refresh looks at its layers
        self.active = active  # activate() / enable() vs deactivate()
        self.choice = FOLLOW
        self.suspended = 0  # depth of the shim.disabled() blocks around it
        self.switch = Switch()
        self.gate: Gate | None = None  # decided on the first target import
        self.notes: list[str] = []  # what the status adds to the gate: targets left alone, late, ...
        self.blocked_by: list[Other] = []  # other patchers' objects the patch could not apply to
        self.retake = False
        self.layers: Layers | None = None  # what it wrapped and rebound (shim.layers.Layers)
        self.done_modules: set[str] = set()  # target modules whose targets are applied

    @property
    def name(self) -> str:
        return self.declared.name

    @property
    def installed_version(self) -> str | None:
        """The installed release of the patch's distribution, once its gate was decided."""
        return self.gate.versions.installed if self.gate is not None else None

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
        if self.state is FAILED and self.final:
            self._forget_progress()
            self._set(PENDING, "switched on with shim.enable()")
        self._update_switch()

    def disable(self) -> None:
        """Switched off by the user: its layers stay, inert, until :meth:`enable`."""
        self.choice = OFF
        self._update_switch()
        if self.state is not DISABLED and not self.final:
            self._set(DISABLED, OFF_BY_API)

    def suspend(self, depth: int) -> None:
        """Enter (``+1``) or leave (``-1``) a ``shim.disabled()`` block: the switch goes off inside,
        the state stays (a status says ``suspended``)."""
        self.suspended += depth
        self._update_switch()

    @property
    def is_on(self) -> bool:
        """Applied, and its layers act right now."""
        return self.state is APPLIED and self.switch.on

    def settled(self, settings: Settings) -> bool:
        """Skipped or failed for good. In strict mode a problem is raised again at every chance
        (a retried import, ``activate()``); being outside its gate is never one."""
        if not self.final:
            return False
        return not settings.strict or (self.gate is not None and self.gate.skip is not None)

    # -- what happens ---------------------------------------------------------------------------

    def advance(self, ready: Callable[[str], bool], settings: Settings, late: str | None = None) -> Progress:
        """Apply the targets whose module is ``ready`` (finished importing), or say why not.
        ``late``: why they are wrapped only now (their module was imported past the shim's hook)."""
        retake, self.retake = self.retake, False
        if not self.active or self.settled(settings):
            return Progress(None)
        if self.choice is OFF:
            if self.state is DISABLED:  # after deactivate() / activate(): say why it stays off
                self._set(DISABLED, OFF_BY_API)
            return Progress(None)
        self._drop_stale(retake)
        opted_out = settings.disable_all or self.name in settings.disabled
        if opted_out and self.choice is not ENABLED and not self.layers:
            variable = "SHIM_DISABLE=all" if settings.disable_all else f"SHIM_DISABLE={self.name}"
            self._set(DISABLED, f"opted out with {variable}")
            return Progress(None)
        forced = self.name in settings.forced
        todo = [m for m in self.declared.modules if m not in self.done_modules]
        now = [m for m in todo if ready(m)]
        waiting = tuple(m for m in todo if m not in now)
        problem, wrapped = None, False
        if now:
            done = set(self.done_modules)
            verdict = self._wrap(now, forced, late)
            if verdict is not None:
                state, reason, problem = verdict
                self._give_up(state, reason)
                if problem is not None and settings.strict:
                    self._forget_progress()  # tried again at the next chance: a retried import, activate()
            else:
                wrapped = bool(self.layers)
                self._settle(waiting, [m for m in now if m not in done], forced, late)
        else:
            self._settle(waiting, [], forced, late)
        return Progress(problem, waiting, tuple(self.done_modules), wrapped)

    def refresh(self, forced: bool) -> None:
        """Record what can be seen now without applying anything, before a status is read: the
        gate of a patch whose targets are not imported yet (outside it: skipped, though its hooks
        stay, so ``SHIM_FORCE`` set later still applies it), and whether an applied patch's layers
        are still in place (a target replaced since: failed, or pending again if its import failed).
        Said at DEBUG: the others room warns once of another patcher that bypasses a fix."""

        if not self.final and self.gate is None and self.state in (PENDING, SKIPPED):
            # Decided here rather than at activation, where it would cost every ``import shim`` a
            # metadata read (the log decides it the same way, when it shows the line).
            skipped, reason = self._pending_shown(forced)
            self._set(SKIPPED if skipped else PENDING, reason, logging.DEBUG, forced, keep_waiting=True)
        elif not self.final and self.layers and self.state in (APPLIED, FAILED, PENDING):
            self._set(*self._layers_now(self.applied_as), logging.DEBUG)

    # -- the steps ------------------------------------------------------------------------------

    def _wrap(self, module_names: list[str], forced: bool, late: str | None) -> tuple[State, str, str | None] | None:
        """Gate, resolve and wrap the targets in ``module_names``; ``None`` when they are in place,
        else ``(state, reason, problem)``: the problem is what strict mode raises."""
        from . import gating, others
        from .layers import Layers

        try:
            patch = self.load()
        except Exception as exc:
            return self._problem(FAILED, f"the patch module cannot be imported: {exc!r}")
        self.gate = gating.between_releases(gating.gate(self.declared, forced), patch)
        if self.gate.skip is not None:
            return SKIPPED, self.gate.skip, None  # outside its gate is never a problem, not even in strict mode
        self.blocked_by = []
        resolution = gating.resolve_targets(patch, module_names, self.gate)
        if resolution.problem is not None:
            why = resolution.problem.why
            self.blocked_by = others.blocking(patch, module_names)  # whose object the probe refused
            if self.blocked_by:
                why += "; " + "; ".join(f"{o.target} holds {o.by}, another patcher's" for o in self.blocked_by)
            return self._problem(FAILED if resolution.problem.failed else SKIPPED, why)
        self.notes.extend(resolution.notes)
        if self.layers is None:
            self.layers = Layers(patch.name)
        try:
            switch, missed = self.layers.wrap(patch, resolution.targets, self.switch, others.lookout)
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
        return None

    @staticmethod
    def _problem(state: State, reason: str) -> tuple[State, str, str]:
        return state, reason, reason

    def _settle(self, waiting: Iterable[str], added: list[str], forced: bool, late: str | None) -> None:
        """The state after wrapping (``added``: the modules it wrapped now, ``late`` if past the
        shim's hook): applied (maybe in part), pending, or skipped for good."""
        waiting = list(waiting)
        later = f"applies when {and_(waiting)} {'is' if len(waiting) == 1 else 'are'} imported" if waiting else ""
        if self.layers:
            gate = [self.gate.reason] if self.gate is not None else []
            reason = "; ".join(filter(None, [*gate, *self.notes, later and f"the rest {later}"]))
            level: int | None = None
            if self.state is APPLIED:  # said once at INFO; what a later target module adds, at DEBUG
                level = QUIET
                if added:
                    log.log(logging.WARNING if late else logging.DEBUG, "%s: applied to %s as well (%s)",
                            self.name, and_(added), reason)  # fmt: skip
            elif late and added:
                level = logging.WARNING
            self._set(APPLIED, reason, level)
        elif waiting:
            self._set(PENDING, later, forced=forced)
        else:
            self._give_up(SKIPPED, "; ".join(self.notes) or "no target applies")

    def _give_up(self, state: State, reason: str) -> None:
        """Remove whatever the patch already wrapped and settle it as skipped or failed, for good."""
        self._take_off()
        self._set(state, reason, final=True)

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
        if not self.layers:
            return
        keep: set[str] = set()
        if not retake:  # the shim never fights another patcher on its own
            from . import others

            keep = {other.target for other in others.on_layers(self.layers, consumers=False)}
        self.done_modules -= self.layers.drop_stale(keep)

    def _update_switch(self) -> None:
        in_place = self.layers is not None and self.layers.in_place
        self.switch.set(in_place and self.choice is not OFF and not self.suspended)

    def _layers_now(self, reason: str) -> tuple[State, str]:
        """An applied patch's state as its layers stand now: one replaced since says so."""
        assert self.layers is not None
        stale = self.layers.stale()
        modules = {layer.module_name for layer in stale}
        gone = sorted(name for name in modules if sys.modules.get(name) is None)
        if stale and len(gone) == len(modules):
            # The import the patch was applied in failed after it (another hook raised, in strict mode).
            state = PENDING if len(stale) == len(self.layers.placed) else APPLIED
            are = "is" if len(gone) == 1 else "are"
            return (
                state,
                f"{reason}; the import of {and_(gone)} failed: it applies again when {and_(gone)} {are} imported",
            )
        if stale:
            from . import others

            specs = {layer.spec for layer in stale}
            named = [o.text() for o in others.of_entry(self) if o.relation == others.BYPASSED and o.target in specs]
            if named:
                return FAILED, "; ".join(named) + "; shim.activate() wraps it again, on top"
            replaced = self.layers.describe(stale)
            return FAILED, f"{replaced} was replaced after the shim wrapped it; shim.activate() wraps it again"
        return APPLIED, reason

    def _pending_shown(self, forced: bool) -> tuple[bool, str]:
        """A pending patch whose gate is not decided yet, as status and log show it: skipped outside
        its gate (``gating.pending``), else pending with the gate's reason."""
        from .gating import pending

        skipped, shown, _installed = pending(self.declared, self.waiting_for, forced)
        return skipped, shown

    def _set(
        self,
        state: State,
        reason: str,
        level: int | None = None,
        forced: bool = False,
        final: bool = False,
        keep_waiting: bool = False,
    ) -> None:
        """The one place the state is written, and logged when it changes (``level``: how loud).
        ``final``: skipped or failed for good (:meth:`settled`); ``keep_waiting``: a refresh's
        pending reason, which adds the gate to the reason advance gave (kept for the next one)."""
        if state is PENDING and not keep_waiting:
            self.waiting_for = reason
        if state is APPLIED:
            self.applied_as = reason
        if (self.state, self.reason) != (state, reason):
            if level is None:
                level = logging.WARNING if state is FAILED else logging.INFO if state is APPLIED else logging.DEBUG
            if level is not QUIET and log.isEnabledFor(level):
                shown = (state, reason)
                if state is PENDING and self.gate is None and not keep_waiting:  # as a status shows it
                    skipped, why = self._pending_shown(forced)
                    shown = (SKIPPED if skipped else PENDING, why)
                log.log(level, "%s: %s (%s)", self.name, *shown)
        self.state, self.reason, self.final = state, reason, final


def and_(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""
