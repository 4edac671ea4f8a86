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

Advancing is one straight path: gate → resolve → wrap → settle. What the user asked is kept apart
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
from .runtime import Switch

if TYPE_CHECKING:
    from .catalogue import Listing
    from .gating import Gate
    from .layers import Layers
    from .patch import BugProbe, Patch
    from .probing import Answer
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
        "retake", "switch", "gate", "notes", "layers", "done_modules", "answers",
        "waiting_probes", "stepped_aside",
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
        # What its bug probes said, by library: asked once per process (shim.probing), kept across
        # deactivate() and enable(), as the installed code does not change.
        self.answers: dict[str, Answer] = {}
        # Probes due whose ``needs`` are not imported yet, by library, with why each is asked.
        self.waiting_probes: dict[str, tuple[BugProbe, str]] = {}
        self.stepped_aside: set[str] = set()  # libraries where it left targets alone: their probe found no bug

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
        self.forced = self.name in settings.forced
        if not self.active or self.settled(settings):
            return Progress(None)
        if self.choice is OFF:
            if self.state is DISABLED:  # after deactivate() / activate(): say why it stays off
                self._set(DISABLED, OFF_BY_API)
            return Progress(None)
        if self.layers:
            self.done_modules -= self.layers.drop_stale(retake)
        opted_out = settings.disable_all or self.name in settings.disabled
        if opted_out and self.choice is not ENABLED and not self.layers:
            variable = "SHIM_DISABLE=all" if settings.disable_all else f"SHIM_DISABLE={self.name}"
            self._set(DISABLED, f"opted out with {variable}")
            return Progress(None)
        todo = [m for m in self.declared.modules if m not in self.done_modules]
        now = [m for m in todo if ready(m)]
        try:
            now, needed = self._probe(now, ready, settings.probe)
        except Unfinished as unfinished:  # its module imports its own target: it applies once that module is done
            return Progress(None, (*(m for m in todo if not ready(m)), unfinished.module))
        except Exception as exc:  # a pack's module that cannot be imported
            self._give_up(FAILED, unloadable(exc))
            return Progress(unloadable(exc))
        waiting = tuple(dict.fromkeys([*(m for m in todo if m not in now), *needed]))
        problem, wrapped = None, False
        if now:
            done = set(self.done_modules)
            verdict = self._wrap(now, late, settings.strict)
            if verdict is not None:
                state, problem = verdict
                self._give_up(state, problem)
                if state is SKIPPED and self.gate is not None and self.gate.skip == problem:
                    problem = None  # outside its gate is never a problem, not even in strict mode
                elif settings.strict:
                    self._forget_progress()  # tried again at the next chance: a retried import, activate()
            else:
                wrapped = bool(self.layers)
                self._settle([m for m in todo if m not in now], [m for m in now if m not in done], late)
        else:
            self._settle([m for m in todo if m not in now], [], late)
        if problem is None and settings.strict:
            problem = self._probe_problem()
        return Progress(problem, waiting, tuple(self.done_modules), wrapped)

    def refresh(self, forced: bool) -> None:
        """Record what can be seen now without applying anything, before a status is read: the
        gate of a patch whose targets are not imported yet (outside it: skipped, though its hooks
        stay, so ``SHIM_FORCE`` set later still applies it), and whether an applied patch's parts
        are still in place (a target replaced since: failed, or pending again if its import failed).
        Said at DEBUG: a status names another patcher that bypasses a fix, with a warning, once."""
        self.forced = forced
        if self.final:
            return
        if self.gate is None and not self.layers and self.state in (PENDING, SKIPPED) and not self.waiting_probes:
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
            return "; ".join(filter(None, parts + [said for said in self.probes_said() if not _in(said, parts)]))
        if state is PENDING and self.waiting_probes:  # held outside its gate until its probe can run
            return "; ".join([self._gate_now()[1], *self.probes_said()])
        if state is PENDING:
            why = self.why or _applies_when(self.waiting())
            return why if self.gate is not None else f"{why}; {self._gate_now()[1]}"
        return self.why

    def shown(self) -> tuple[State, str]:
        """The state and reason as a status shows them: a pending patch outside its gate, not
        decided yet, shows as skipped, as a refresh will record it."""
        if self.state is PENDING and self.gate is None and not self.layers and not self.waiting_probes:
            skip, why = self._gate_now()
            if skip:
                return SKIPPED, why
        return self.state, self.reason

    def probes_said(self) -> list[str]:
        """What each bug probe answered here, a sentence each (``shim.probing.Answer.said``), and where
        one still waits for a module it needs."""
        from .gating import installed_version

        said = []
        for answer in self.answers.values():
            sentence = answer.said(installed_version(answer.library))
            if answer.present is False and self.forced:
                sentence += "; applied anyway because of SHIM_FORCE"
            said.append(sentence)
        for library, (probe, why) in self.waiting_probes.items():
            verb = "finishes" if len(probe.needs) == 1 else "finish"
            said.append(f"its bug probe for {library} is asked once {and_(list(probe.needs))} {verb} importing ({why})")
        return said

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

    def _probe(self, now: list[str], ready: Callable[[str], bool], mode: str) -> tuple[list[str], list[str]]:
        """Ask the bug probes due before the targets in ``now`` are wrapped, and those that waited for
        a module they need; step aside where one that waited finds no bug. A probe whose ``needs`` are
        not all imported waits for them: meanwhile the release decides (its targets are wrapped, and
        taken off again if the probe then finds no bug), or, where the release leaves the patch out,
        the targets wait with it. Returns the modules to wrap now and the modules the probes wait for."""
        if not now and not self.waiting_probes:
            return now, []
        from . import gating

        patch = self.load()
        for library, due in self._due_probes(patch, now, mode).items():
            self.waiting_probes[library] = due
        askable = {lib: due for lib, due in self.waiting_probes.items() if all(map(_importable(ready), due[0].needs))}
        for library in askable:
            del self.waiting_probes[library]
        self._ask(patch, askable)
        if askable and self.layers:  # wrapped while they waited: the answers decide now
            self._step_aside_where_fixed(patch)
        needed = [m for probe, _ in self.waiting_probes.values() for m in probe.needs if not ready(m)]
        if patch.distribution in self.waiting_probes and gating.gate(patch, self.forced).skip is not None:
            return [], needed  # outside the gate: the probe may yet find the bug there, so the targets wait
        return now, needed

    def _due_probes(self, patch: Patch, module_names: list[str], mode: str) -> dict[str, tuple[BugProbe, str]]:
        """The bug probes to ask before the targets in ``module_names`` are wrapped, by library, with
        why each is asked (``shim.probing``): those not asked, nor waiting, yet in this process."""
        from .gating import why_asked

        libraries = {patch.library_of(t) for t in patch.targets if t.module in module_names}
        due = {}
        for library in sorted(libraries - set(self.answers) - set(self.waiting_probes)):
            probe = patch.probe_for(library)
            why = why_asked(library, mode) if probe is not None else None
            if probe is not None and why is not None:
                due[library] = (probe, why)
        return due

    def _ask(self, patch: Patch, probes: dict[str, tuple[BugProbe, str]]) -> None:
        """Ask ``probes`` with the patch's own parts off (it may have parts in another library)."""
        from . import gating, probing

        for library, (probe, why) in probes.items():
            with self._switched_off():
                answer = self.answers[library] = probing.ask(probe, library, why)
            log.log(
                logging.WARNING if answer.present is None else logging.INFO,
                "%s: %s",
                self.name,
                answer.said(gating.installed_version(library)),
            )

    def _aside(self) -> dict[str, Answer]:
        """The libraries where a probe found no bug: the patch steps aside there (not under SHIM_FORCE)."""
        return {} if self.forced else {lib: a for lib, a in self.answers.items() if a.present is False}

    def _step_aside_where_fixed(self, patch: Patch) -> None:
        """Take the patch's parts off the targets of each library whose probe found no bug."""
        from . import gating

        assert self.layers is not None
        for library, answer in self._aside().items():
            modules = {t.module for t in patch.targets if patch.library_of(t) == library}
            if self.layers.remove(modules):
                self.stepped_aside.add(library)
                note = f"steps aside: {answer.said(gating.installed_version(library))}"
                if note not in self.notes:
                    self.notes.append(note)
        self._update_switch()

    def _probe_problem(self) -> str | None:
        """What strict mode raises for: a probe that could not run."""
        from . import gating

        failed = [a.said(gating.installed_version(a.library)) for a in self.answers.values() if a.present is None]
        return "; ".join(failed) or None

    # -- the steps ------------------------------------------------------------------------------

    def _wrap(self, module_names: list[str], late: str | None, strict: bool) -> tuple[State, str] | None:
        """Gate (with what the bug probes answered), resolve and wrap the targets in ``module_names``;
        ``None`` when they are in place, else ``(state, why)``."""
        from . import gating
        from .layers import Layers

        try:
            patch = self.load()
        except Exception as exc:
            return FAILED, unloadable(exc)
        problem = self._probe_problem() if strict else None
        if problem is not None:
            return FAILED, problem
        self.gate = gating.with_answers(gating.gate(patch, self.forced), patch, self.answers)
        if self.gate.skip is not None:
            return SKIPPED, self.gate.skip
        resolution = gating.resolve_targets(patch, module_names, self.gate, self._aside())
        if resolution.problem is not None:
            return (FAILED if resolution.problem.failed else SKIPPED), resolution.problem.why
        self.notes.extend(note for note in resolution.notes if note not in self.notes)  # a reload resolves again
        self.stepped_aside |= resolution.aside
        if self.layers is None:
            self.layers = Layers(patch.name)
        try:
            rank = order.rank(patch.place, self.sequence)
            switch, missed = self.layers.wrap(patch, resolution.targets, self.switch, rank)
        except Exception as exc:
            return FAILED, f"wrapping failed and was rolled back: {exc!r}"
        if switch is not self.switch:  # adopted a part already there, with its switch
            for watcher in self.switch.watchers:
                switch.watch(watcher)
            self.switch = switch
        self.notes.extend(missed)
        if late is not None and resolution.targets:
            self.notes.append(late)
        self.done_modules.update(module_names)
        self._update_switch()
        return None

    @contextlib.contextmanager
    def _switched_off(self) -> Iterator[None]:
        """The patch's own parts off inside the block (a bug probe asks upstream, not the fix)."""
        self.suspend(+1)
        try:
            yield
        finally:
            self.suspend(-1)

    def _settle(self, waiting: Iterable[str], added: list[str], late: str | None) -> None:
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
        """Remove whatever the patch already wrapped and settle it as skipped or failed, for good."""
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
        self.stepped_aside.clear()

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
        ``final``: skipped or failed for good (:meth:`settled`)."""
        if level is None:
            level = logging.WARNING if state is FAILED else logging.INFO if state is APPLIED else logging.DEBUG
        before = (self.state, self.reason) if log.isEnabledFor(level) else None
        self.state, self.why, self.final = state, why, final
        if before is not None and (what or before != (state, self.reason)):
            shown_state, reason = self.shown()
            log.log(level, "%s: %s (%s)", self.name, what or shown_state, reason)


def _in(sentence: str, parts: list[str]) -> bool:
    return any(sentence in part for part in parts if part)


def _importable(ready: Callable[[str], bool]) -> Callable[[str], bool]:
    """Whether a module a probe needs is ready for it: finished importing, or not there at all in this
    release (the probe then takes the release's other way, and says so)."""

    def ready_or_absent(name: str) -> bool:
        if ready(name):
            return True
        parent_name = name.rpartition(".")[0]
        parent = sys.modules.get(parent_name) if parent_name else None
        if parent_name and (parent is None or getattr(getattr(parent, "__spec__", None), "_initializing", False)):
            return False  # looking it up would import (and lock) its package: wait for it instead
        import importlib.util

        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True

    return ready_or_absent


def unloadable(exc: Exception) -> str:
    """Why a patch's declaration cannot be had (its record's error says all; any other is quoted)."""
    return str(exc) if isinstance(exc, ImportError) else f"the patch module cannot be imported: {exc!r}"


def _applies_when(modules: list[str], again: bool = False) -> str:
    """``applies when a and b are imported``."""
    verb = "is" if len(modules) == 1 else "are"
    return f"applies{' again' if again else ''} when {and_(modules)} {verb} imported"


def and_(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""
