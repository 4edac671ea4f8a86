"""The patch registry: when to apply each patch, and its switches.

Applying is lazy: each target is wrapped right after its module finishes importing (post-import
hooks, ``shim.importhooks``), or at once if it already has. Each patch's own life is in
``shim.entry``: what applies is decided by ``shim.gating`` (gate, probes), how by ``shim.layers``
(wrap, rebind, roll back), and what to tell the user by ``shim.records``. Nothing here imports a target module, and ``import shim`` imports
neither wrapt, nor ``packaging``, nor a patch module: they wait for the first target.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from . import forksafe, importhooks, settings
from .entry import Entry
from .errors import PatchError
from .states import APPLIED, DISABLED, FAILED, OFF_BY_API, PENDING

if TYPE_CHECKING:
    from .patch import Declared, Patch
    from .records import PatchStatus
    from .switch import Switch

log = logging.getLogger("shim")


class Registry:
    """An ordered set of patches and their state. ``shim`` keeps one for the built-in catalogue."""

    def __init__(self, patches: Sequence[Declared] = ()) -> None:
        self._lock = forksafe.rlock()
        self._entries: dict[str, Entry] = {}
        self._active = False
        for patch in patches:
            self.register(patch)

    def register(self, patch: Declared) -> Declared:
        """Add ``patch``; if the registry is active it is applied now or on its targets' import."""
        with self._lock:
            existing = self._entries.get(patch.name)
            if existing is not None:
                if existing.declared is patch or existing.load() == patch.load():
                    return patch
                raise ValueError(f"a different patch named {patch.name!r} is already registered")
            self._entries[patch.name] = Entry(patch, active=self._active)
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
            return entry.load()

    # -- switching ------------------------------------------------------------------------------

    def activate(self) -> None:
        """Apply every enabled patch now, or right after its target modules are imported."""
        with self._lock:
            self._active = True
            for entry in self._entries.values():
                entry.active = True
            names = tuple(self._entries)
        importhooks.sweep("shim.activate()")
        for name in names:
            self._try_apply(name)

    def deactivate(self) -> None:
        """Remove every layer this shim installed, leaving other libraries' wrappers working, and
        its import hooks (the shim's finder leaves ``sys.meta_path`` when no registry has any)."""
        with self._lock:
            self._active = False
            hooks: list[tuple[str, importhooks.Hook]] = []
            for entry in self._entries.values():
                entry.active = False
                entry.remove()
                entry.forget_progress()
                entry.set(DISABLED, "shim.deactivate() was called")
                hooks += entry.hooked.items()
                entry.hooked.clear()
        for key, hook in hooks:
            importhooks.cancel(key.removeprefix("reload:"), hook)

    def enable(self, *names: str) -> None:
        """Switch patches on (all when no names are given) and apply them if needed.

        Explicit: it wins over ``SHIM_DISABLE`` and lasts until :meth:`disable`, across
        :meth:`deactivate`/:meth:`activate`. After :meth:`deactivate` it applies the named
        patches again (and only those); a patch that failed is tried again.
        """
        names = self._resolve(names)
        with self._lock:
            for name in names:
                entry = self._entries[name]
                entry.switch.disabled = False
                entry.switch.update()
                entry.explicit = entry.active = True
                if entry.settled and entry.state == FAILED:
                    entry.forget_progress()
        importhooks.sweep("shim.enable()")
        for name in names:
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
                    entry.set(DISABLED, OFF_BY_API)

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

    def switch_of(self, name: str) -> Switch:
        """The live on/off switch of patch ``name``, for a hook or function the patch installs
        outside its wrappers: true while the patch is applied and switched on (it follows
        ``SHIM_DISABLE``, ``disable``, ``disabled`` and ``deactivate``)."""
        return self._entry(name).switch

    # -- reporting ------------------------------------------------------------------------------

    def status(self) -> list[PatchStatus]:
        """One record per patch: its state and why, its versions, and what it changed so far."""
        from .records import status_of

        try:  # a target module imported past the shim's hook is patched now, and says so
            importhooks.sweep("shim.status()")
        except PatchError:  # strict mode: the status records it, and a status always comes back
            pass
        with self._lock:
            forced = settings.read(self._entries).forced
            return [status_of(entry, entry.name in forced) for entry in self._entries.values()]

    # -- applying -------------------------------------------------------------------------------

    def _entry(self, name: str) -> Entry:
        """The entry of patch ``name``, written as ``SHIM_DISABLE`` takes it (any case, ``_`` or ``-``)."""
        entry = self._entries.get(settings.canonical(name)) if isinstance(name, str) else None
        if entry is None:
            raise KeyError(unknown(name, list(self._entries)))
        return entry

    def _resolve(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(self._entry(name).name for name in names) or tuple(self._entries)

    def _hook(self, name: str, reload: bool = False) -> importhooks.Hook:
        def hook(module: object) -> None:
            # Never let an exception escape into the user's import, unless strict mode asks for it.
            try:
                if reload:
                    with self._lock:
                        self._entries[name].drop_stale()
                self._try_apply(name, getattr(module, "__name__", None), importhooks.late_note())
            except PatchError:
                raise
            except Exception:  # pragma: no cover - defensive: _try_apply records its failures
                log.exception("%s: unexpected error in the post-import hook; the patch is not applied", name)

        return hook

    def _try_apply(self, name: str, finished: str | None = None, late: str | None = None) -> None:
        """Apply what is ready; ``finished``: the module whose hook fired (``late``: past it)."""
        with self._lock:
            entry = self._entries[name]
            if not entry.active or entry.settled:
                return
            if entry.switch.disabled:
                if entry.state == DISABLED:  # after deactivate()/activate(): say why it stays off
                    entry.set(DISABLED, OFF_BY_API)
                return
            entry.drop_stale()
            config = settings.read(self._entries)
            opted_out = config.disable_all or name in config.disabled
            if opted_out and not entry.explicit and not entry.layers:
                variable = "SHIM_DISABLE=all" if config.disable_all else f"SHIM_DISABLE={name}"
                entry.set(DISABLED, f"opted out with {variable}")
                return
            todo = [m for m in entry.declared.modules if m not in entry.done_modules]
            ready = [m for m in todo if m == finished or importhooks.finished(m)]
            waiting = [m for m in todo if m not in ready]
            done = set(entry.done_modules)
            problem = entry.apply(ready, name in config.forced, late) if ready else None
            if not entry.settled:
                added = [m for m in ready if m in entry.done_modules and m not in done]
                entry.settle(waiting, added, name in config.forced, late)
            keys = [m for m in waiting if m not in entry.hooked]
            keys += [f"reload:{m}" for m in entry.done_modules if f"reload:{m}" not in entry.hooked]
            new_hooks = {key: self._hook(name, reload=key.startswith("reload:")) for key in keys}
            entry.hooked.update(new_hooks)
            if problem is not None and config.strict:
                entry.forget_progress()  # not settled: a retried import (or activate) tries again
                raise PatchError(f"patch {name!r} did not apply: {problem} (SHIM_STRICT=1)")
        # Registered outside the lock: a hook runs at once if another thread has just finished the
        # import, and it takes the lock itself.
        for key, hook in new_hooks.items():
            if key.startswith("reload:"):
                importhooks.when_reloaded(key.removeprefix("reload:"), hook)
            else:
                importhooks.when_imported(key, hook)


def unknown(name: object, known: list[str]) -> str:
    """A short message for a patch name that is not known, with the closest known names."""
    shown = repr(name) if len(repr(name)) <= 40 else repr(name)[:36] + "...'"
    head = f"no patch named {shown}; "
    return head + settings.did_you_mean(str(name), known, width=88 - len(head))
