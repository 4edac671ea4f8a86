"""The patch registry: when to apply each patch, and the record of what happened.

Applying is lazy: each target is wrapped right after its module finishes importing (post-import
hooks, ``shim.importhooks``), or at once if it already has; the patch's module, its version gate
and its shape probes are loaded and decided then. If a target fails, the targets of that patch
already wrapped are unwrapped again. Nothing here imports a target module, and ``import shim``
imports neither wrapt, nor ``packaging``, nor a patch module: they wait for the first target.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import effects, importhooks, settings
from .errors import PatchError
from .switch import Switch

if TYPE_CHECKING:
    from typing import Protocol

    from .patch import Patch
    from .records import PatchStatus
    from .versions import GateDecision

    class Declared(Protocol):
        """What the registry needs of a patch before applying it: a :class:`~shim.Patch`, or a
        catalogue listing that imports the patch's module on :meth:`load`."""

        name: str
        distribution: str
        requires: str

        @property
        def modules(self) -> tuple[str, ...]: ...

        def load(self) -> Patch: ...


log = logging.getLogger("shim")

APPLIED, PENDING, SKIPPED, DISABLED, FAILED = "applied", "pending", "skipped", "disabled", "failed"
SUSPENDED_REASON = "inside shim.disabled()"


def _imported(module_name: str) -> bool:
    """In ``sys.modules`` and done executing: a module that is still running its body (because it
    imported another target on the way, as ``transformers.modeling_utils`` imports
    ``core_model_loading``) is not ready to be patched yet; its own post-import hook fires once it
    is (importlib clears ``_initializing`` only after the hooks ran, hence ``finished``)."""
    module = sys.modules.get(module_name)
    return module is not None and not importhooks.executing(module)


class _Entry:
    """The registry's state for one patch."""

    __slots__ = (
        "declared", "patch", "switch", "state", "reason", "installed", "active", "explicit", "layers",
        "rebound", "hooked", "reload_hooked", "done_modules", "gate", "notes", "applied_reason", "settled",
    )  # fmt: skip

    def __init__(self, declared: Declared, active: bool) -> None:
        self.declared = declared
        self.patch: Patch | None = None  # loaded on the first target import (or a status)
        self.switch = Switch()
        self.state, self.reason = PENDING, "not activated"
        self.installed: str | None = None
        self.active = active  # activate()/enable() vs deactivate()
        self.explicit = False  # switched on with enable(): wins over SHIM_DISABLE, until disable()
        # (module object, attribute path, wrapper handle, original) for each target we wrapped or adopted
        self.layers: list[tuple[Any, str, Any, Any]] = []
        self.rebound: list[tuple[Any, str, Any, Any]] = []
        self.hooked: set[str] = set()
        self.reload_hooked: set[str] = set()  # modules whose reload re-applies the patch
        self.done_modules: set[str] = set()
        self.gate: GateDecision | None = None
        self.notes: list[str] = []
        self.applied_reason = ""
        self.settled = False  # skipped or failed for good (until deactivate/activate)


class Registry:
    """An ordered set of patches and their state. ``shim`` keeps one for the built-in catalogue."""

    def __init__(self, patches: Sequence[Declared] = ()) -> None:
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._active = False
        for patch in patches:
            self.register(patch)

    # -- declaring ------------------------------------------------------------------------------

    def register(self, patch: Declared) -> Declared:
        """Add ``patch``; if the registry is active it is applied now or on its targets' import."""
        with self._lock:
            existing = self._entries.get(patch.name)
            if existing is not None:
                if existing.declared is patch or self._load(existing) == patch.load():
                    return patch
                raise ValueError(f"a different patch named {patch.name!r} is already registered")
            self._entries[patch.name] = _Entry(patch, active=self._active)
            active = self._active
        if active:
            self._try_apply(patch.name)
        return patch

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def patch(self, name: str) -> Patch:
        """The declaration of patch ``name`` (this imports its module if it was not yet)."""
        entry = self._entry(name)
        with self._lock:
            return self._load(entry)

    # -- switching --------------------------------------------------------------------------------

    def activate(self) -> None:
        """Apply every enabled patch now, or right after its target modules are imported."""
        with self._lock:
            self._active = True
            for entry in self._entries.values():
                entry.active = True
            names = tuple(self._entries)
        for name in names:
            self._try_apply(name)

    def deactivate(self) -> None:
        """Remove every layer this shim installed, leaving other libraries' wrappers working."""
        with self._lock:
            self._active = False
            for entry in self._entries.values():
                entry.active = False
                self._remove(entry)
                entry.done_modules.clear()
                entry.notes.clear()
                entry.settled = False
                self._set(entry, DISABLED, "shim.deactivate() was called")

    def enable(self, *names: str) -> None:
        """Switch patches on (all when no names are given) and apply them if needed.

        Explicit: it wins over ``SHIM_DISABLE`` and lasts until :meth:`disable`, across
        :meth:`deactivate`/:meth:`activate`. After :meth:`deactivate` it applies the named
        patches again (and only those).
        """
        for name in self._resolve(names):
            with self._lock:
                entry = self._entries[name]
                entry.switch.disabled = False
                entry.switch.update()
                entry.explicit = True
                entry.active = True
            with self._lock:
                if entry.settled and entry.state == FAILED:  # an explicit retry
                    entry.settled = False
                    entry.done_modules.clear()
                    entry.notes.clear()
            self._try_apply(name)

    def disable(self, *names: str) -> None:
        """Switch patches off at once (all when no names are given); their layers stay, inert."""
        with self._lock:
            for name in self._resolve(names):
                entry = self._entries[name]
                entry.switch.disabled = True
                entry.switch.update()
                entry.explicit = False
                if entry.state in (APPLIED, PENDING):
                    self._set(entry, DISABLED, "switched off with shim.disable()")

    @contextlib.contextmanager
    def disabled(self, *names: str) -> Iterator[None]:
        """Switch patches off inside the block (all when no names are given). Process-wide, not per thread."""
        with self._lock:
            switches = [self._entries[name].switch for name in self._resolve(names)]
            for switch in switches:
                switch.suspended += 1
                switch.update()
        try:
            yield
        finally:
            with self._lock:
                for switch in switches:
                    switch.suspended -= 1
                    switch.update()

    def is_on(self, name: str) -> bool:
        """Whether patch ``name`` is applied and its wrappers act right now."""
        entry = self._entry(name)
        return entry.state == APPLIED and bool(entry.switch)

    # -- reporting ------------------------------------------------------------------------------

    def status(self) -> list[PatchStatus]:
        """One record per patch: its state and why, its versions, and what it changed so far."""
        with self._lock:
            return [self._status(entry) for entry in self._entries.values()]

    def report(self) -> str:
        """The effects table: which patches changed something in this process, how often, the last what."""
        from .records import report

        return report(self.status())

    def _status(self, entry: _Entry) -> PatchStatus:
        from . import versions
        from .records import PatchStatus

        declared = entry.declared
        installed, state, reason = entry.installed, entry.state, entry.reason
        if state == PENDING and installed is None:
            # The gate needs no import, but deciding it costs a metadata read, so it is done here
            # rather than at activation: a patch outside its gate reads as skipped even when its
            # target module does not exist in that release (transformers 4.57 has no
            # core_model_loading). Its hooks stay, so SHIM_FORCE set later still applies it.
            decision = versions.decide(declared.distribution, versions.specifier_set(declared.requires))
            installed = decision.installed
            forced = declared.name in settings.read(self._entries).forced
            if installed is None:
                state, reason = SKIPPED, decision.reason
            elif decision.gated_as is not None and not decision.admitted and not forced:
                state, reason = SKIPPED, decision.reason
            else:
                reason = f"{reason}; {decision.reason}"
        elif installed is None:
            installed = versions.installed_version(declared.distribution)
        if state == APPLIED and entry.layers:
            stale = self._stale(entry)
            if stale:
                replaced = ", ".join(f"{getattr(m, '__name__', m)}:{path}" for m, path, _h, _o in stale)
                state, reason = (
                    FAILED,
                    f"{replaced} was replaced after the shim wrapped it; shim.activate() wraps it again",
                )
        if entry.switch.suspended and state in (APPLIED, PENDING):
            state, reason = DISABLED, SUSPENDED_REASON
        try:
            patch: Patch | None = self._load(entry)
        except Exception as exc:  # reported, never raised: a status must always come back
            patch, reason = None, f"{reason}; the patch module cannot be imported: {exc!r}"
        return PatchStatus(
            name=declared.name,
            state=state,
            reason=reason,
            targets=tuple(t.spec for t in patch.targets) if patch else (),
            requires=f"{declared.distribution}{declared.requires}",
            installed=installed,
            summary=patch.summary if patch else "",
            references=patch.references if patch else (),
            effects=effects.count(declared.name),
            last_effect=effects.last(declared.name),
        )

    # -- applying -------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no patch named {name!r}; known: {', '.join(self._entries)}") from None

    def _resolve(self, names: tuple[str, ...]) -> tuple[str, ...]:
        if not names:
            return tuple(self._entries)
        for name in names:
            self._entry(name)
        return tuple(names)

    @staticmethod
    def _load(entry: _Entry) -> Patch:
        if entry.patch is None:
            entry.patch = entry.declared.load()
        return entry.patch

    def _set(self, entry: _Entry, state: str, reason: str) -> None:
        if (entry.state, entry.reason) != (state, reason):
            level = logging.WARNING if state == FAILED else logging.INFO if state == APPLIED else logging.DEBUG
            log.log(level, "%s: %s (%s)", entry.declared.name, state, reason)
        entry.state, entry.reason = state, reason

    def _on_import(self, name: str, module: object) -> None:
        """Post-import hook: must never let an exception escape into the user's import (unless strict)."""
        try:
            self._try_apply(name, finished=getattr(module, "__name__", None))
        except PatchError:
            raise
        except Exception:  # pragma: no cover - defensive: _try_apply already records failures
            log.exception("%s: unexpected error in the post-import hook; the patch is not applied", name)

    def _hook(self, name: str) -> importhooks.Hook:
        def hook(module: object) -> None:
            self._on_import(name, module)

        return hook

    def _reload_hook(self, name: str) -> importhooks.Hook:
        def hook(module: object) -> None:
            try:
                with self._lock:
                    self._drop_stale(self._entries[name])
                self._try_apply(name, finished=getattr(module, "__name__", None))
            except PatchError:
                raise
            except Exception:  # pragma: no cover - defensive, as _on_import
                log.exception("%s: unexpected error re-applying after a reload", name)

        return hook

    def _stale(self, entry: _Entry) -> list[tuple[Any, str, Any, Any]]:
        """Layers no longer in place: their target was replaced (``importlib.reload``, assignment)."""
        from . import wrapping

        stale = []
        for layer in entry.layers:
            module, path, handle, _original = layer
            try:
                current = wrapping.resolve(module, path)
            except wrapping.PathResolutionError:
                stale.append(layer)
                continue
            if wrapping.find_shim_wrapper(current, entry.declared.name) is not handle:
                stale.append(layer)
        return stale

    def _drop_stale(self, entry: _Entry) -> bool:
        """Forget layers whose target was replaced, so the patch applies to the new one."""
        stale = self._stale(entry) if entry.layers else []
        for layer in stale:
            entry.layers.remove(layer)
            entry.done_modules.discard(getattr(layer[0], "__name__", ""))
        return bool(stale)

    def _try_apply(self, name: str, finished: str | None = None) -> None:
        waiting: tuple[str, ...] = ()
        watch_reloads: set[str] = set()
        with self._lock:
            entry = self._entries[name]
            if not entry.active or entry.settled or entry.switch.disabled:
                return
            self._drop_stale(entry)
            config = settings.read(self._entries)
            if (config.disable_all or name in config.disabled) and not entry.explicit and not entry.layers:
                variable = "SHIM_DISABLE=all" if config.disable_all else f"SHIM_DISABLE={name}"
                self._set(entry, DISABLED, f"opted out with {variable}")
                return
            todo = [m for m in entry.declared.modules if m not in entry.done_modules]
            ready = [m for m in todo if m == finished or _imported(m)]
            waiting = tuple(m for m in todo if m not in ready)
            problem = self._apply_modules(entry, ready, forced=name in config.forced) if ready else None
            if not entry.settled:
                self._settle_state(entry, waiting)
            watch_reloads = entry.done_modules - entry.reload_hooked
            entry.reload_hooked |= watch_reloads
            if problem is not None and config.strict:
                raise PatchError(f"patch {name!r} did not apply: {problem} (SHIM_STRICT=1)")
        # Registering outside the lock: the hook runs at once if another thread just finished
        # the import, and the hook takes the lock itself.
        for module_name in watch_reloads:
            importhooks.when_reloaded(module_name, self._reload_hook(name))
        for module_name in waiting:
            if module_name not in entry.hooked:
                entry.hooked.add(module_name)
                importhooks.when_imported(module_name, self._hook(name))

    def _settle_state(self, entry: _Entry, waiting: tuple[str, ...]) -> None:
        later = f"applies when {', '.join(waiting)} is imported" if waiting else ""
        if entry.layers:
            self._set(entry, APPLIED, "; ".join(filter(None, [entry.applied_reason, later and f"the rest {later}"])))
        elif waiting:
            self._set(entry, PENDING, later)
        else:
            self._give_up(entry, SKIPPED, "; ".join(entry.notes) or "no target applies")

    def _give_up(self, entry: _Entry, state: str, reason: str) -> str:
        """Remove whatever the patch already wrapped and settle it as skipped or failed."""
        self._remove(entry)
        entry.settled = True
        self._set(entry, state, reason)
        return reason

    def _apply_modules(self, entry: _Entry, module_names: list[str], forced: bool) -> str | None:
        """Load, gate, probe and wrap the targets in ``module_names``; returns a problem for strict mode."""
        from . import versions, wrapping

        try:
            patch = self._load(entry)
        except Exception as exc:
            return self._give_up(entry, FAILED, f"the patch module cannot be imported: {exc!r}")
        if entry.gate is None:
            entry.gate = versions.decide(patch.distribution, patch.specifier)
            entry.installed = entry.gate.installed
        gate = entry.gate
        if not gate.admitted:
            if not forced or gate.gated_as is None:
                self._give_up(entry, SKIPPED, gate.reason)
                return None
            entry.applied_reason = f"{gate.reason}, applied anyway because of SHIM_FORCE"
        else:
            entry.applied_reason = gate.reason

        resolved = []
        for target in patch.targets:
            if target.module not in module_names:
                continue
            if target.requirement is not None:
                decision = versions.decide(target.requirement.name, target.requirement.specifier)
                if not decision.admitted:
                    entry.notes.append(f"left alone: {target.path} (needs {target.requires})")
                    continue
            module = sys.modules[target.module]
            try:
                original = wrapping.resolve(module, target.path)
            except wrapping.PathResolutionError:
                return self._give_up(entry, SKIPPED, f"target {target.spec} does not exist in {gate.installed}")
            if target.probe is not None:
                try:
                    problem = target.probe(original)
                except Exception as exc:
                    # Not proof that upstream changed: the probe itself could not run here.
                    return self._give_up(
                        entry,
                        FAILED,
                        f"the shape probe of {target.spec} raised {exc!r}, so the patch is not applied; that is "
                        f"a fault of the probe, not a sign that upstream changed: please report it "
                        f"(shim.enable({patch.name!r}) tries again)",
                    )
                if problem:
                    return self._give_up(entry, SKIPPED, f"{problem} ({gate.reason})")
            resolved.append((target, module, original))

        added = []
        try:
            for target, module, original in resolved:
                handle = wrapping.find_shim_wrapper(original, patch.name)
                if handle is not None:
                    # Another registry (or a reloaded shim) already applied it: adopt that layer
                    # and share its switch instead of adding a second one.
                    entry.switch = wrapping.switch_of(handle)
                    original = handle.__wrapped__
                else:
                    handle = wrapping.install(module, target.path, patch.name, target.wrapper, entry.switch)
                layer = (module, target.path, handle, original)
                entry.layers.append(layer)
                added.append(layer)
        except Exception as exc:
            return self._give_up(entry, FAILED, f"wrapping failed and was rolled back: {exc!r}")

        for _module, _path, handle, original in added if patch.consumers else ():
            rebound, missed = wrapping.rebind(patch.consumers, original, handle)
            entry.rebound.extend((module, attribute, handle, original) for module, attribute in rebound)
            entry.notes.extend(f"could not rebind {module}.{attribute}" for module, attribute in missed)
        entry.done_modules.update(module_names)
        if entry.notes:
            entry.applied_reason = "; ".join([entry.applied_reason, *entry.notes])
        entry.switch.removed = False
        entry.switch.update()
        return None

    def _remove(self, entry: _Entry) -> None:
        if not (entry.layers or entry.rebound):
            return
        from . import wrapping

        for module, attribute, handle, original in entry.rebound:
            wrapping.unbind([(module, attribute)], handle, original)
        entry.rebound.clear()
        stuck = []
        for module, path, handle, _original in reversed(entry.layers):
            problem = wrapping.remove(module, path, handle)
            if problem:
                stuck.append(problem)
        entry.layers.clear()
        # A layer that could not be spliced out stays in place, inert, until it is adopted again.
        entry.switch.removed = True
        entry.switch.update()
        if stuck:
            log.warning("%s: left in place switched off: %s", entry.declared.name, "; ".join(stuck))
