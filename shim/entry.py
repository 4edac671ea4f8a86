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
state, it never re-derives it. Every write of the state goes through :meth:`_set`, which logs it;
the reason a status shows is made in one place (:attr:`Entry.reason`) from the state, its cause,
the gate and the parts.

Advancing is one straight path: ask the bug probes due (``shim.probing``, the room that keeps their
life: the entry asks it) → gate → resolve → wrap → the state it leaves. What the user asked is kept apart
from where the patch is: ``active`` (``activate()`` / ``deactivate()``), ``choice`` (``enable()``
/ ``disable()``, which outlive a deactivation) and the depth of ``shim.disabled()`` blocks; the
switch the patch's parts answer to follows from them and from whether a part is in place.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from . import order
from .catalogue import Unfinished
from .ranges import and_
from .runtime import Switch

if TYPE_CHECKING:
    from .catalogue import Listing
    from .gating import Gate
    from .layers import Layers, Resolved
    from .patch import Patch
    from .probing import Probes
    from .settings import Settings


class State(str, enum.Enum):
    """The states a patch can be in, as ``shim.status()`` and ``python -m shim`` report them. A
    ``str``: a state compares equal to its name (``status.state == "applied"``) and prints as it."""

    APPLIED = "applied"  # its layers are in place (and act unless switched off)
    PENDING = "pending"  # a target module is not imported yet: the patch applies right after it is
    SKIPPED = "skipped"  # not needed or not safe here (outside its gate, target missing, shape changed)
    DISABLED = "disabled"  # switched off: SHIM_DISABLE, shim.disable(), shim.deactivate(), shim.disabled()
    FAILED = "failed"  # wrapping raised (and was rolled back), a shape check or, in strict mode, a bug probe
    # could not run, or a layer was bypassed

    def __str__(self) -> str:
        return self.value


APPLIED, PENDING, SKIPPED, DISABLED, FAILED = State

OFF_BY_API = "switched off with shim.disable()"
NOT_ACTIVATED = "not activated"


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
    wrapped: bool = False  # it wrapped targets just now


class Entry:
    """One patch in a registry: its declaration, what the user chose, its state and its layers."""

    __slots__ = (
        "declared", "patch", "sequence", "state", "why", "final", "active", "choice", "suspended", "forced",
        "retake", "switch", "gate", "notes", "layers", "done_modules", "_probes",
    )  # fmt: skip

    def __init__(self, declared: Listing, active: bool, sequence: int = 0) -> None:
        self.declared = declared
        self.patch: Patch | None = None  # loaded on the first target import (or a status)
        self.sequence = sequence  # when it registered: with its place, where its parts sit (shim.order.rank)
        # The state and what caused it, written only by _set (``reason`` is made from them). ``final``:
        # skipped or failed by advance (its targets were looked at), not by what a refresh saw.
        self.state, self.why, self.final = PENDING, NOT_ACTIVATED, False
        self.active = active  # activate() / enable() vs deactivate()
        self.choice = FOLLOW
        self.suspended = 0  # depth of the shim.disabled() blocks around it
        self.forced = False  # named in SHIM_FORCE, as last read
        self.retake = False  # activate() asked to wrap again a target another patcher replaced
        self.switch = Switch()
        self.gate: Gate | None = None  # decided on the first target import
        self.notes: list[str] = []  # what the reason adds to the gate: targets left alone, late, ...
        self.layers: Layers | None = None  # its parts in the targets, and what it rebound (shim.layers.Layers)
        self.done_modules: set[str] = set()  # target modules whose targets are applied
        self._probes: Probes | None = None  # its bug probes' life (shim.probing), once a target is imported

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

    def gated(self) -> Patch | Listing:
        """What its gate is read from: its record, or its Patch where the record holds none (a
        pack's: this imports its module)."""
        return self.declared if self.declared.requires is not None else self.load()

    @property
    def probes(self) -> Probes:
        """Its bug probes in this process: what they answered, which wait, where it stepped aside
        (``shim.probing``, imported the first time a status or a target import needs it)."""
        if self._probes is None:
            from .probing import Probes

            self._probes = Probes()
        return self._probes

    def _probes_wait(self) -> bool:
        """Whether a bug probe waits for a module it needs (without making the probes' room, where none
        was asked: ``import shim`` and a status need not import it)."""
        return self._probes is not None and bool(self._probes.waiting)

    # -- what the user asks ---------------------------------------------------------------------

    def activate(self) -> None:
        self.active = self.retake = True

    def deactivate(self) -> None:
        """Take every part off and start over at the next activation."""
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
        """Switched off by the user: its parts stay, inert, until :meth:`enable`."""
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
        """Applied, and its parts act right now."""
        return self.state is APPLIED and self.switch.on

    def gave_up(self, settings: Settings) -> bool:
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
        self.forced = self.name in settings.forced
        if not self.active or self.gave_up(settings) or self._kept_off():
            return Progress(None)
        if self.layers:
            self.done_modules -= self.layers.drop_stale(retake)
        if self._opted_out(settings):
            return Progress(None)
        return self._apply_ready(ready, settings, late)

    def _apply_ready(self, ready: Callable[[str], bool], settings: Settings, late: str | None) -> Progress:
        """Ask the bug probes due, then apply the targets whose module is ``ready``."""
        todo = self.waiting()
        try:
            now, needed = self._ask_probes([m for m in todo if ready(m)], ready, settings.probe)
        except Unfinished as unfinished:  # its module imports its own target: it applies once that module is done
            return Progress(None, (*(m for m in todo if not ready(m)), unfinished.module))
        except Exception as exc:  # a pack's module that cannot be imported
            self._give_up(FAILED, unloadable(exc))
            return Progress(unloadable(exc))
        problem, wrapped = self._apply(todo, now, late, settings.strict)
        waiting = dict.fromkeys([*(m for m in todo if m not in now), *needed])
        return Progress(problem, tuple(waiting), tuple(self.done_modules), wrapped)

    def _kept_off(self) -> bool:
        """Switched off with ``disable()``: it stays off (after ``deactivate()`` and ``activate()``,
        saying why)."""
        if self.choice is not OFF:
            return False
        if self.state is DISABLED:
            self._set(DISABLED, OFF_BY_API)
        return True

    def _opted_out(self, settings: Settings) -> bool:
        """Named in ``SHIM_DISABLE`` (or all are), not enabled by the user, nothing placed: it stays off."""
        opted_out = settings.disable_all or self.name in settings.disabled
        if not opted_out or self.choice is ENABLED or self.layers:
            return False
        variable = "SHIM_DISABLE=all" if settings.disable_all else f"SHIM_DISABLE={self.name}"
        self._set(DISABLED, f"opted out with {variable}")
        return True

    def _apply(self, todo: list[str], now: list[str], late: str | None, strict: bool) -> tuple[str | None, bool]:
        """Wrap the targets in ``now`` and write the state that leaves; returns what strict mode raises
        for, if anything, and whether targets were wrapped just now."""
        done = set(self.done_modules)
        verdict = self._wrap(now, late, strict) if now else None
        if verdict is not None:
            problem, wrapped = self._refused(*verdict, strict), False
        else:
            problem, wrapped = None, bool(now) and bool(self.layers)
            self._after_wrapping([m for m in todo if m not in now], [m for m in now if m not in done], late)
        if problem is None and strict and self._probes is not None:  # no probe asked: nothing to raise for
            problem = self._probes.problem()
        return problem, wrapped

    def _refused(self, state: State, why: str, strict: bool) -> str | None:
        """Give up (skipped or failed, for good) and say what strict mode raises for: nothing where
        the patch is outside its gate, which is never a problem, not even in strict mode."""
        self._give_up(state, why)
        if state is SKIPPED and self.gate is not None and self.gate.skip == why:
            return None
        if strict:
            self._forget_progress()  # tried again at the next chance: a retried import, activate()
        return why

    def refresh(self, forced: bool) -> None:
        """Record what can be seen now without applying anything, before a status is read: the
        gate of a patch whose targets are not imported yet (outside it: skipped, though its hooks
        stay, so ``SHIM_FORCE`` set later still applies it), and whether an applied patch's parts
        are still in place (a target replaced since: failed, or pending again if its import failed).
        Said at DEBUG: a status names another patcher that bypasses a fix, with a warning, once."""
        self.forced = forced
        if self.final:
            return
        if self.gate is None and not self.layers and self.state in (PENDING, SKIPPED) and not self._probes_wait():
            # Decided here rather than at activation, where it would cost every ``import shim`` a
            # metadata read (the log decides it the same way, when it shows the line).
            from .gating import gate

            try:
                skip = gate(self.gated(), forced).skip
            except Unfinished:  # asked from inside its own module's import: decided once that is done
                return
            except Exception as exc:
                self._give_up(FAILED, unloadable(exc))
                return
            if skip is not None:
                self._set(SKIPPED, skip, level=logging.DEBUG)
            elif self.state is SKIPPED:
                self._set(PENDING, "" if self.active else NOT_ACTIVATED, level=logging.DEBUG)
        elif self.layers and self.state in (APPLIED, FAILED, PENDING):
            state, why = self._layers_now()
            self._set(state, why, level=logging.DEBUG)

    # -- the reason -----------------------------------------------------------------------------

    @property
    def reason(self) -> str:
        """Why the patch is in its state, made here and only here: from the state, its cause, the
        gate, the notes and the target modules it still waits for."""
        state = self.state
        if state is APPLIED or (state is PENDING and self.layers):
            gate = self.gate.reason if self.gate is not None else ""
            waiting = self.waiting()
            rest = f"the rest {_applies_when(waiting)}" if waiting else ""
            parts = [gate, *self.notes, rest, self.why]
            said = self.probes.said(self.forced)
            return "; ".join(filter(None, parts + [sentence for sentence in said if not _in(sentence, parts)]))
        if state is PENDING and self._probes_wait():  # held outside its gate until its probe can run
            return "; ".join([self._gate_now()[1], *self.probes.said(self.forced)])
        if state is PENDING:
            why = self.why or _applies_when(self.waiting())
            return why if self.gate is not None else f"{why}; {self._gate_now()[1]}"
        return self.why

    def shown(self) -> tuple[State, str]:
        """The state and reason as a status shows them: a pending patch outside its gate, not
        decided yet, shows as skipped, as a refresh will record it."""
        if self.state is PENDING and self.gate is None and not self.layers and not self._probes_wait():
            skip, why = self._gate_now()
            if skip:
                return SKIPPED, why
        return self.state, self.reason

    def waiting(self) -> list[str]:
        """The target modules it applies in once they are imported."""
        return [m for m in self.declared.modules if m not in self.done_modules]

    def _gate_now(self) -> tuple[bool, str]:
        """Whether the gate leaves the patch out (its targets not imported yet), and what it says."""
        from .gating import gate

        try:
            found = gate(self.gated(), self.forced)
        except Unfinished as unfinished:
            return False, str(unfinished)
        except Exception as exc:  # a pack's module that cannot be imported (its gate is in it)
            return True, unloadable(exc)
        return (True, found.skip) if found.skip is not None else (False, found.versions.reason)

    # -- the bug probes (shim.probing) ---------------------------------------------------------

    def _ask_probes(self, now: list[str], ready: Callable[[str], bool], mode: str) -> tuple[list[str], list[str]]:
        """Ask the bug probes due before the targets in ``now`` are wrapped, and those that waited for
        a module they need (``shim.probing``), and take the parts off where one that waited finds no
        bug. Returns the modules to wrap now and the modules the probes wait for."""
        if not now and not self._probes_wait():
            return now, []
        patch, probes = self.load(), self.probes
        if probes.ask_due(patch, now, ready, mode, self.switched_off) and self.layers:
            self._note(probes.step_aside(patch, self.layers, self.forced))  # wrapped while they waited
            self._update_switch()
        return ([] if probes.hold_targets(patch, self.forced) else now), probes.needed(ready)

    # -- the steps ------------------------------------------------------------------------------

    def _wrap(self, module_names: list[str], late: str | None, strict: bool) -> tuple[State, str] | None:
        """Gate (with what the bug probes answered), resolve and wrap the targets in ``module_names``;
        ``None`` when they are in place, else ``(state, why)``."""
        from . import gating

        try:
            patch = self.load()
        except Exception as exc:
            return FAILED, unloadable(exc)
        problem = self.probes.problem() if strict else None
        if problem is not None:
            return FAILED, problem
        self.gate = self.probes.gate(gating.gate(patch, self.forced), patch)
        if self.gate.skip is not None:
            return SKIPPED, self.gate.skip
        resolution = gating.resolve_targets(patch, module_names, self.gate, self.probes.aside(self.forced))
        if resolution.problem is not None:
            return (FAILED if resolution.problem.failed else SKIPPED), resolution.problem.why
        self._note(resolution.notes)  # a reload resolves again
        self.probes.stepped_aside |= resolution.left_alone_in
        return self._place(patch, resolution.targets, module_names, late)

    def _place(
        self, patch: Patch, targets: list[Resolved], module_names: list[str], late: str | None
    ) -> tuple[State, str] | None:
        """Put the patch's parts into the layers of the resolved ``targets``; ``None`` when they are in
        place, else why not (anything placed is rolled back)."""
        from .layers import Layers

        if self.layers is None:
            self.layers = Layers(patch.name)
        try:
            rank = order.rank(patch.place, self.sequence)
            switch, missed = self.layers.wrap(patch, targets, self.switch, rank)
        except Exception as exc:
            return FAILED, f"wrapping failed and was rolled back: {exc!r}"
        if switch is not self.switch:  # adopted a part already there, with its switch
            for watcher in self.switch.watchers:
                switch.watch(watcher)
            self.switch = switch
        self.notes.extend(missed)
        if late is not None and targets:
            self.notes.append(late)
        self.done_modules.update(module_names)
        self._update_switch()
        return None

    def _note(self, notes: Iterable[str]) -> None:
        """Add what the reason says beside the gate, each once."""
        self.notes.extend(note for note in notes if note not in self.notes)

    @contextlib.contextmanager
    def switched_off(self) -> Iterator[None]:
        """The patch's own parts off inside the block (a bug probe asks upstream, not the fix)."""
        self.suspend(+1)
        try:
            yield
        finally:
            self.suspend(-1)

    def _after_wrapping(self, waiting: Iterable[str], added: list[str], late: str | None) -> None:
        """The state after wrapping (``added``: the modules it wrapped now, ``late`` if past the
        shim's hook): applied (maybe in part), pending, or skipped for good."""
        if self.layers:
            if self.state is APPLIED:  # said once at INFO; what a later target module adds, at DEBUG
                what = f"applied to {and_(added)} as well" if added else ""
                self._set(APPLIED, level=logging.WARNING if late and added else logging.DEBUG, what=what)
            else:
                self._set(APPLIED, level=logging.WARNING if late and added else None)
        elif list(waiting):
            self._set(PENDING)
        else:
            self._give_up(SKIPPED, "; ".join(self.notes) or "no target applies")

    def _give_up(self, state: State, why: str) -> None:
        """Remove whatever the patch already wrapped and leave it skipped or failed, for good."""
        self._take_off()
        self._set(state, why, final=True)

    def _take_off(self) -> None:
        if self.layers is not None:
            # A layer that could not be spliced out stays in place with no part, until joined again.
            self.layers.remove()
        self._update_switch()

    def _forget_progress(self) -> None:
        """Start over at the next target import: nothing applied, nothing noted."""
        self.done_modules.clear()
        self.notes.clear()
        if self._probes is not None:
            self._probes.stepped_aside.clear()

    def _update_switch(self) -> None:
        in_place = self.layers is not None and self.layers.in_place
        self.switch.set(in_place and self.choice is not OFF and not self.suspended)

    def _layers_now(self) -> tuple[State, str]:
        """An applied patch's state as its parts stand now, and the cause where one was replaced."""
        assert self.layers is not None
        stale = self.layers.stale()
        if not stale:
            return APPLIED, ""
        modules = {layer.module_name for layer in stale}
        gone = sorted(name for name in modules if sys.modules.get(name) is None)
        if len(gone) == len(modules):
            # The import the patch was applied in failed after it (another hook raised, in strict mode).
            state = PENDING if len(stale) == len(self.layers.placed) else APPLIED
            return state, f"the import of {and_(gone)} failed: it {_applies_when(gone, again=True)}"
        from . import others  # a status asks: naming another patcher is its business

        specs = {layer.spec for layer in stale}
        named = [o.text() for o in others.of_entry(self) if o.relation == others.BYPASSED and o.target in specs]
        if named:
            return FAILED, "; ".join(named) + "; shim.activate() wraps it again, on top"
        replaced = self.layers.describe(stale)
        return FAILED, f"{replaced} was replaced after the shim wrapped it; shim.activate() wraps it again"

    def _set(
        self, state: State, why: str = "", *, final: bool = False, level: int | None = None, what: str = ""
    ) -> None:
        """The one place the state is written, and logged when what a status shows changes
        (``level``: how loud, by default by the state; ``what``: the line says this for the state).
        ``final``: skipped or failed for good (:meth:`gave_up`)."""
        if level is None:
            level = logging.WARNING if state is FAILED else logging.INFO if state is APPLIED else logging.DEBUG
        before = (self.state, self.reason) if log.isEnabledFor(level) else None
        self.state, self.why, self.final = state, why, final
        if before is not None and (what or before != (state, self.reason)):
            shown_state, reason = self.shown()
            log.log(level, "%s: %s (%s)", self.name, what or shown_state, reason)


def _in(sentence: str, parts: list[str]) -> bool:
    return any(sentence in part for part in parts if part)


def unloadable(exc: Exception) -> str:
    """Why a patch's declaration cannot be had (its record's error says all; any other is quoted)."""
    return str(exc) if isinstance(exc, ImportError) else f"the patch module cannot be imported: {exc!r}"


def _applies_when(modules: list[str], again: bool = False) -> str:
    """``applies when a and b are imported``."""
    verb = "is" if len(modules) == 1 else "are"
    return f"applies{' again' if again else ''} when {and_(modules)} {verb} imported"
