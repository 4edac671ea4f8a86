"""The patch registry: the table of patches, its lock, the import hooks, and the public API.

Applying is lazy: each target is wrapped right after its module finishes importing (post-import
hooks, ``shim.importhooks``), or at once if it already has. The registry only says what happened
(the user switched a patch, a target module finished importing); each patch's life, what that
means for it, is its :class:`~shim.entry.Entry`'s. Nothing here imports a target module, and
``import shim`` imports neither wrapt, nor ``packaging``, nor a patch module: they wait for the
first target.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from . import forks, importhooks, order, settings
from .catalogue import Listing
from .entry import Entry
from .settings import PatchError

if TYPE_CHECKING:
    from .patch import Patch
    from .runtime import Switch
    from .statuses import PatchStatus

log = logging.getLogger("shim")


class Registry:
    """An ordered set of patches and their state. ``shim`` keeps one for the built-in catalogue."""

    def __init__(self, patches: Sequence[Patch | Listing] = ()) -> None:
        self._lock = forks.fork_safe_rlock()
        self._entries: dict[str, Entry] = {}
        self._hooks: dict[tuple[str, str], importhooks.Hook] = {}  # (patch, module or "reload:" + module) -> hook
        self._active = False
        #: What ``shim.packs`` left out before registering (a patch pack's patch refused at ``import
        #: shim``, a distribution whose metadata cannot be read), each as it was said.
        self.left_out: list[str] = []
        # In the one order (shim.order): a patch given before one it is declared after goes after it;
        # one whose order cannot hold raises from register(), the first problem found first.
        settled = order.settle(patches)
        for patch in settled.ordered:  # their order holds: settle() decided it for all of them at once
            self.register(patch, ordered=True)
        for patch in [patch for name in settled.refused for patch in patches if patch.name == name]:
            self.register(patch)

    def register(self, patch: Patch | Listing, *, ordered: bool = False, settled: bool = False) -> Patch | Listing:
        """Add ``patch``; if the registry is active it is applied now or on its targets' import.
        Its parts sit outside those of every patch registered before it in the same place
        (``shim.order``); an ``after`` that cannot hold raises :class:`shim.order.OrderError`.
        ``ordered``: its order was decided with its peers' already (``shim.packs``); ``settled`` is
        that keyword's old name, still taken."""
        ordered = ordered or settled
        record = patch if isinstance(patch, Listing) else Listing.of(patch)
        with self._lock:
            existing = self._entries.get(patch.name)
            if existing is not None:
                if existing.declared is patch or existing.load() == record.load():
                    return patch
                raise ValueError(f"a different patch named {patch.name!r} is already registered")
            if not ordered:
                self.check_order(record)
            self._entries[patch.name] = Entry(record, active=self._active, sequence=len(self._entries))
            active = self._active
        if active:
            self._try_apply(patch.name)
        return patch

    def check_order(self, patch: Listing) -> None:
        """Raise :class:`shim.order.OrderError` where ``patch``'s ``after`` cannot hold among the patches
        registered before it."""
        with self._lock:
            placed = {name: entry.declared.place for name, entry in self._entries.items() if name != patch.name}
        refused = order.settle([patch], placed).refused
        if refused:
            raise order.OrderError(_misplaced(refused[patch.name]))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def declared(self, name: str) -> Listing:
        """How patch ``name`` was registered: its record (``shim.catalogue.Listing``: a built-in's or a
        patch pack's) or the :class:`Patch` given to :meth:`register` (nothing is imported)."""
        return self._entry(name).declared

    def gated(self, name: str) -> Patch | Listing:
        """What patch ``name``'s gate is read from: its record, or its Patch where the record holds
        none (a pack's: this imports its module)."""
        entry = self._entry(name)
        with self._lock:
            return entry.gated()

    def patch(self, name: str) -> Patch:
        """The declaration of patch ``name`` (this imports its module if it was not yet)."""
        entry = self._entry(name)
        with self._lock:
            return entry.load()

    # -- switching ------------------------------------------------------------------------------

    def activate(self) -> None:
        """Apply every enabled patch now, or right after its target modules are imported (a target
        another patcher replaced is wrapped again, on top)."""
        with self._lock:
            self._active = True
            for entry in self._entries.values():
                entry.activate()
            names = tuple(self._entries)
        importhooks.sweep("shim.activate()")
        for name in names:
            self._try_apply(name)

    def deactivate(self) -> None:
        """Remove every layer this shim installed, leaving other libraries' wrappers working, and
        its import hooks (the shim's finder leaves ``sys.meta_path`` when no registry has any)."""
        with self._lock:
            self._active = False
            for entry in self._entries.values():
                entry.deactivate()
            hooks, self._hooks = self._hooks, {}
        for (_, key), hook in hooks.items():
            importhooks.cancel(key.removeprefix("reload:"), hook)

    def enable(self, *names: str) -> None:
        """Switch patches on (all when no names are given) and apply them if needed.

        Explicit: it wins over ``SHIM_DISABLE`` and lasts until :meth:`disable`, across
        :meth:`deactivate`/:meth:`activate`. After :meth:`deactivate` it applies the named
        patches again (and only those); a patch that failed is tried again.
        """
        names = self._names_or_all(names)
        with self._lock:
            for name in names:
                self._entries[name].enable()
        importhooks.sweep("shim.enable()")
        for name in names:
            self._try_apply(name)

    def disable(self, *names: str) -> None:
        """Switch patches off at once (all when no names are given); their layers stay, inert."""
        with self._lock:
            for name in self._names_or_all(names):
                self._entries[name].disable()

    @contextlib.contextmanager
    def disabled(self, *names: str) -> Iterator[None]:
        """Switch patches off inside the block (all when no names are given). Process-wide, not per thread."""
        with self._lock:
            entries = [self._entries[name] for name in self._names_or_all(names)]
            for entry in entries:
                entry.suspend(+1)
        try:
            yield
        finally:
            with self._lock:
                for entry in entries:
                    entry.suspend(-1)

    def is_on(self, name: str) -> bool:
        """Whether patch ``name`` is applied and its wrappers act right now."""
        return self._entry(name).is_on

    def switch_of(self, name: str) -> Switch:
        """The live on/off switch of patch ``name``, for a hook or function the patch installs
        outside its wrappers: true while the patch is applied and switched on (it follows
        ``SHIM_DISABLE``, ``disable``, ``disabled`` and ``deactivate``)."""
        return self._entry(name).switch

    # -- reporting ------------------------------------------------------------------------------

    def status(self) -> list[PatchStatus]:
        """One status per patch: its state and why, its versions, and what it changed so far."""
        with forks.lazy_imports:
            from .statuses import status_of

        try:  # a target module imported past the shim's hook is patched now, and says so
            importhooks.sweep("shim.status()")
        except PatchError:  # strict mode: the status records it, and a status always comes back
            pass
        with self._lock:
            forced = settings.read(self._entries).forced
            if any(entry.layers for entry in self._entries.values()):
                from . import others

                others.note_upstream(e.declared for e in self._entries.values())
            for entry in self._entries.values():
                entry.refresh(entry.name in forced)
            return [status_of(entry) for entry in self._entries.values()]

    def _look_at(self, entries: list[Entry]) -> None:
        """Name the other patchers on ``entries``' targets (lock held); never raises."""
        from . import others

        others.note_upstream(e.declared for e in self._entries.values())
        for entry in entries:
            try:
                others.of_entry(entry, consumers=False)
            except Exception:  # naming another patcher must never cost the user's import or training
                log.debug("%s: could not look for other patchers", entry.name, exc_info=True)

    # -- applying -------------------------------------------------------------------------------

    def _entry(self, name: str) -> Entry:
        """The entry of patch ``name``, written as ``SHIM_DISABLE`` takes it (any case, ``_`` or ``-``)."""
        entry = self._entries.get(settings.canonical(name)) if isinstance(name, str) else None
        if entry is None:
            raise KeyError(unknown(name, list(self._entries)))
        return entry

    def _names_or_all(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(self._entry(name).name for name in names) or tuple(self._entries)

    def _hook(self, name: str) -> importhooks.Hook:
        def hook(module: object) -> None:
            # Never let an exception escape into the user's import, unless strict mode asks for it.
            try:
                self._try_apply(name, getattr(module, "__name__", None), importhooks.late_note())
            except PatchError:
                raise
            except Exception:  # pragma: no cover - defensive: _try_apply records its failures
                log.exception("%s: unexpected error in the post-import hook; the patch is not applied", name)

        return hook

    def _try_apply(self, name: str, finished: str | None = None, late: str | None = None) -> None:
        """Let patch ``name`` advance; ``finished``: the module whose hook fired (``late``: past it)."""
        with self._lock:
            config = settings.read(self._entries)
            progress = self._entries[name].advance(
                lambda module: module == finished or importhooks.finished(module), config, late
            )
            if progress.wrapped and log.isEnabledFor(logging.DEBUG):  # asked for: SHIM_LOG_LEVEL=DEBUG
                self._look_at([self._entries[name]])
            keys = [*progress.waiting, *(f"reload:{module}" for module in progress.done)]
            new_hooks = {key: self._hook(name) for key in keys if (name, key) not in self._hooks}
            self._hooks.update(((name, key), hook) for key, hook in new_hooks.items())
        # Registered outside the lock: a hook runs at once if another thread has just finished the
        # import, and it takes the lock itself.
        for key, hook in new_hooks.items():
            if key.startswith("reload:"):
                importhooks.when_reloaded(key.removeprefix("reload:"), hook)
            else:
                importhooks.when_imported(key, hook)
        if progress.problem is not None and config.strict:
            raise PatchError(f"patch {name!r} did not apply: {progress.problem} (SHIM_STRICT=1)")


def _misplaced(refusal: order.Refusal) -> str:
    """What ``refusal`` means for a patch given to :meth:`Registry.register`: the problem and the fix."""
    if refusal.cause == order.OUTSIDE:
        return order.contradiction(refusal)
    # a name not registered before it (among one patch, a cycle is the patch after itself)
    return (
        f"patch {refusal.patch!r} is declared after {refusal.named!r}, which is not registered before it "
        f"(register {refusal.named!r} first, or take it out of after=)"
    )


def unknown(name: object, known: list[str]) -> str:
    """A short message for a patch name that is not known, with the closest known names."""
    said = settings.not_a_patch(name) if isinstance(name, str) else None  # the audit's: SHIM_DISABLE takes it
    if said is not None:
        return said
    shown = repr(name) if len(repr(name)) <= 40 else repr(name)[:36] + "...'"
    head = f"no patch named {shown}; "
    return head + settings.did_you_mean(str(name), known, width=88 - len(head))
