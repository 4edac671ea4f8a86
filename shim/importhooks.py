"""Post-import hooks: call a function right after a module has finished executing.

The shim registers one hook per target module at ``import shim`` and wraps the target when it
fires. wrapt has the same facility (``wrapt.register_post_import_hook``); the shim keeps its own
because of three measured problems with it in this role:

- ``import wrapt`` costs about 3.6 ms, most of what ``import shim`` may cost before any target is
  imported; with this module, wrapt is imported only when a patch is applied.
- wrapt's finder resolves the module by calling ``importlib.util.find_spec`` from inside the
  import, which imports (and locks) the parent package while the child's lock is held: a thread
  importing ``transformers`` and another importing ``transformers.modeling_utils`` can deadlock.
  This finder asks the finders after it directly, with the ``path`` the import system gave it.
- wrapt calls a hook at once for a module that is in ``sys.modules`` but still executing (another
  thread is importing it, or this one, further up the stack); the patch then finds its target
  missing and is skipped for good. Here its hooks fire once it has finished, in the importing
  thread, before that import returns: importlib marks the end of a module's body on its spec
  (``spec._initializing = False``), which the shim watches for that one module (:class:`_Ending`).
  A module whose spec is of another kind, or that is not in ``sys.modules`` yet, is watched by a
  small daemon thread instead.

Hooks run in the importing thread, while the module's import lock is still held, and outside
this module's own lock. Every hook of a module runs even if one raises; the first exception then
propagates into the import (the registry lets only ``shim.PatchError`` out, in strict mode), and
since that import fails, every hook of the module fires again at its next import.

A finder in front of this one (typeguard's or jaxtyping's import hook, installed after ``import
shim``) answers for a module without asking this one. :func:`sweep` finds such modules (in
``sys.modules``, hooks still waiting) and fires their hooks late, saying so (:func:`late_note`), at
the next import through this finder and when the registry asks (``shim.status()``,
``shim.activate()``, ``shim.enable()``): never per call.

The finder (:class:`Finder`) finds nothing by itself. For a module it is told to watch, it asks the
finders after it in ``sys.meta_path`` directly, with the ``path`` the import system gave it (never
``importlib.util.find_spec``, which would import and lock the parent package from inside the
import), and wraps the loader they return so that the module's hooks run right after its body. For
every other module it answers ``None`` at once.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from typing import Any

from .forks import fork_safe_lock

# -- the finder ------------------------------------------------------------------------------------

#: ``execute(module, run_body)``: runs the module's body (``run_body()``), then its hooks.
Execute = Callable[[Any, Callable[[], None]], None]

_resolving = threading.local()  # names this thread is resolving (another finder may call back)


class Finder:
    """A meta path finder that only ever answers for modules ``wanted`` names, through the others."""

    def __init__(self, wanted: Callable[[str], bool], execute: Execute) -> None:
        self.wanted = wanted
        self.execute = execute

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not self.wanted(fullname):
            return None
        resolving = _resolving.__dict__.setdefault("names", set())
        if fullname in resolving:  # another finder re-entered the import system for this name
            return None
        resolving.add(fullname)
        try:
            spec = self._find_with_the_others(fullname, path, target)
        finally:
            resolving.discard(fullname)
        if spec is not None and hasattr(spec.loader, "exec_module") and not isinstance(spec.loader, Loader):
            spec.loader = Loader(spec.loader, self.execute)
        return spec

    def _find_with_the_others(self, fullname: str, path: Any, target: Any) -> Any:
        finders = sys.meta_path
        start = next((i + 1 for i, finder in enumerate(finders) if finder is self), 0)
        for finder in finders[start:]:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def invalidate_caches(self) -> None:
        pass


class Loader:
    """The module's own loader, then the module's hooks. Everything else is the loader's."""

    def __init__(self, loader: Any, execute: Execute) -> None:
        self.loader = loader
        self.execute = execute

    def create_module(self, spec: Any) -> Any:
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        # Introspection (inspect.getsource, importlib.resources) must meet the real loader.
        if getattr(module, "__loader__", None) in (None, self):
            try:
                module.__loader__ = self.loader
            except AttributeError:
                pass
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        self.execute(module, lambda: self.loader.exec_module(module))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


# -- post-import hooks -----------------------------------------------------------------------------

Hook = Callable[[Any], None]

_lock = fork_safe_lock()
_hooks: dict[str, list[Hook]] = {}  # module name -> hooks waiting for it to finish executing
_on_reload: dict[str, list[Hook]] = {}  # module name -> hooks for every later reload of it
_watchers: dict[str, threading.Thread] = {}  # module another thread is still executing -> its watcher
_through_us: set[str] = set()  # modules executing under our loader: their hooks fire when they finish
_late = threading.local()  # .note: why the hooks running now were fired late (None when on time)
_finder: Finder | None = None


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once module ``name`` has finished executing (now, if it has)."""
    with _lock:
        _install()
        module = sys.modules.get(name)
        if module is None or executing(module):
            _hooks.setdefault(name, []).append(hook)
            # Another thread is executing it, or importing it past this finder (it had asked the
            # finders before this hook existed): watch it. Any other import comes through here.
            waiting = name in _through_us or name in _watchers or name in _ending
            if not waiting and (module is not None or _importing(name)):
                _start_watcher(name, module, None)
            return
    hook(module)


def when_reloaded(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` after each ``importlib.reload`` of module ``name`` (reload asks the
    finders for the module again, so it passes through this one)."""
    with _lock:
        _install()
        _on_reload.setdefault(name, []).append(hook)


def cancel(name: str, hook: Hook) -> None:
    """Forget ``hook`` for module ``name``; the finder leaves ``sys.meta_path`` once no hook waits."""
    with _lock:
        for table in (_hooks, _on_reload):
            hooks = table.get(name, [])
            if hook in hooks:
                hooks.remove(hook)
                if not hooks:
                    del table[name]
        if not _hooks and not _on_reload and _installed():
            # A new list rather than a removal in place: an import that another thread is running
            # iterates the old list, and would skip the finder after ours if it shifted under it.
            sys.meta_path = [finder for finder in sys.meta_path if finder is not _finder]


def sweep(when: str) -> None:
    """Fire, late, the hooks of modules that were imported without passing through this finder.

    A module still executing is watched and fired when it is done. ``when`` says where the sweep
    runs, for :func:`late_note`. Every such hook runs; the first exception propagates.
    """
    due = []
    with _lock:
        for name in [name for name in _hooks if sys.modules.get(name) is not None and name not in _through_us]:
            module = sys.modules[name]
            if not executing(module):
                due.append((module, _hooks.pop(name), _note(name, module, when)))
            elif name not in _watchers and name not in _ending:  # applied once it has finished
                _start_watcher(name, module, _note(name, module, f"the end of its import (noticed at {when})"))
    errors = [error for module, hooks, note in due if (error := _run(module, hooks, note)) is not None]
    if errors:
        raise errors[0]


def late_note() -> str | None:
    """Inside a hook: why it runs late (its module was imported past this finder), else ``None``."""
    note: str | None = getattr(_late, "note", None)
    return note


def _note(name: str, module: Any, when: str) -> str:
    loader = type(getattr(getattr(module, "__spec__", None), "loader", None))
    return (
        f"late: {name} was imported without passing the shim's import hook (loader "
        f"{loader.__module__}.{loader.__qualname__}), so this applied only at {when}"
    )


class _Ending(ModuleSpec):
    """The spec of a module whose import is running, while its hooks wait: importlib sets
    ``_initializing`` to false on it right after the module's body (in a ``finally``, with the
    module back in ``sys.modules`` where the body succeeded), in the importing thread. The spec
    goes back to its own class then."""

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "_initializing" and not value:
            self.__class__ = ModuleSpec  # type: ignore[assignment]  # its own class, as it was
            with _lock:
                note = _ending.pop(self.name, None)
            module = sys.modules.get(self.name)
            if module is not None and getattr(module, "__spec__", None) is self:  # not a failed import
                _fire(module, late=note)


_ending: dict[str, str | None] = {}  # modules whose spec is an _Ending -> why their hooks fire late


def _start_watcher(name: str, module: Any, note: str | None) -> None:
    """Fire ``name``'s hooks once its import has finished: at the end of its body where its spec
    allows (:class:`_Ending`), else from a daemon thread."""
    spec = getattr(module, "__spec__", None)
    if type(spec) is ModuleSpec:
        _ending[name] = note
        spec.__class__ = _Ending
        return
    watcher = threading.Thread(target=_watch, args=(name, module, note), name=f"shim: waits for {name}", daemon=True)
    _watchers[name] = watcher
    watcher.start()


def _importing(name: str) -> bool:
    """Whether a thread holds (or waits for) importlib's lock for module ``name``: it is importing
    it. ``importlib._bootstrap._module_locks`` is private; where it is missing, :func:`sweep` is
    left to notice the module."""
    locks = getattr(sys.modules.get("importlib._bootstrap"), "_module_locks", None)
    reference = locks.get(name) if isinstance(locks, dict) else None
    return reference is not None and reference() is not None


def _watch(name: str, module: Any, note: str | None) -> None:
    """Wait, without importing anything, until the thread importing ``name`` is done with it."""
    delay = 0.001
    try:
        while module is None:  # not in sys.modules yet: until it is, or its import is over
            importing = _importing(name)  # first: a module is in sys.modules before its lock goes
            module = sys.modules.get(name)
            if module is None:
                if not importing:
                    return  # it failed; the next import goes through the finder
                time.sleep(0.001)
        # importlib clears the flag only once the module is back in sys.modules for good (it takes it
        # out and puts it back at the end of an import), or out of it for a failed import.
        while executing(module):
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        current = sys.modules.get(name)
        if current is None or executing(current):  # failed, or being imported again: through the finder
            return
        _fire(current, late=note)
    finally:
        with _lock:
            _watchers.pop(name, None)


def finished(name: str) -> bool:
    """Whether module ``name`` is in ``sys.modules`` and done executing: a module still running its
    body (it imported another target on the way, as ``transformers.modeling_utils`` imports
    ``core_model_loading``) is not ready to be patched; its own hooks fire once it is."""
    module = sys.modules.get(name)
    return module is not None and not executing(module)


def executing(module: Any) -> bool:
    """Whether ``module`` is still running its body (importlib sets this flag around ``exec_module``)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _run(module: Any, hooks: list[Hook], note: str | None = None) -> Exception | None:
    """Call every hook, whatever the others raise; returns the first exception."""
    first = None
    previous, _late.note = getattr(_late, "note", None), note
    try:
        for hook in hooks:
            try:
                hook(module)
            except Exception as exc:
                first = first or exc
    finally:
        _late.note = previous
    return first


def _fire(module: Any, late: str | None = None, importing: bool = False) -> None:
    """Run the module's hooks. ``importing``: called from the module's own import, which fails if
    a hook raises; the module is then discarded, so its hooks wait for the next import again."""
    name = str(getattr(module, "__name__", ""))
    with _lock:
        hooks = _hooks.pop(name, [])
        again = list(_on_reload.get(name, []))
    error = _run(module, hooks + again, late)
    if error is None and importing:
        try:
            sweep(f"the import of {name}")
        except Exception as exc:
            error = exc
    if error is not None:
        if importing:
            with _lock:
                _hooks[name] = hooks + _hooks.get(name, [])
        raise error


def _executing(module: Any, execute: Callable[[], None]) -> None:
    """Run the module's body under our loader, then its hooks."""
    name = str(getattr(module, "__name__", ""))
    with _lock:
        _through_us.add(name)
    try:
        execute()
        _fire(module, importing=True)
    finally:
        with _lock:
            _through_us.discard(name)


def _install() -> None:
    global _finder
    if _finder is None:
        _finder = Finder(lambda name: name in _hooks or name in _on_reload, _executing)
    if not _installed():
        sys.meta_path.insert(0, _finder)


def _installed() -> bool:
    return any(finder is _finder for finder in sys.meta_path)


if hasattr(os, "register_at_fork"):  # the watchers' threads do not exist in a child
    os.register_at_fork(after_in_child=_watchers.clear)
