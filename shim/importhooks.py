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
  thread is importing it); the patch then finds its target missing and is skipped for good. Here
  a small daemon thread watches such a module and fires its hooks once it has finished.

Hooks run in the importing thread, while the module's import lock is still held, and outside
this module's own lock. An exception from a hook propagates into the import (the registry lets
only ``shim.PatchError`` out, in strict mode).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import forksafe

Hook = Callable[[Any], None]

_lock = forksafe.lock()
_hooks: dict[str, list[Hook]] = {}  # module name -> hooks waiting for it to finish executing
_on_reload: dict[str, list[Hook]] = {}  # module name -> hooks for every later reload of it
_watchers: dict[str, threading.Thread] = {}  # module another thread is still executing -> its watcher
_resolving = threading.local()  # names this thread is resolving (another finder may call back)
_finder: _Finder | None = None


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once module ``name`` has finished executing (now, if it has)."""
    with _lock:
        _install()
        module = sys.modules.get(name)
        if module is None or executing(module):
            _hooks.setdefault(name, []).append(hook)
            if module is not None and name not in _watchers:
                watcher = threading.Thread(target=_watch, args=(name,), name=f"shim: waits for {name}", daemon=True)
                _watchers[name] = watcher
                watcher.start()
            return
    hook(module)


def when_reloaded(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` after each ``importlib.reload`` of module ``name`` (reload asks the
    finders for the module again, so it passes through this one)."""
    with _lock:
        _install()
        _on_reload.setdefault(name, []).append(hook)


def _watch(name: str) -> None:
    """Wait, without importing anything, until the thread importing ``name`` is done with it."""
    delay = 0.001
    try:
        while True:
            module = sys.modules.get(name)
            if module is None:  # that import failed: the next one goes through the finder
                return
            if not executing(module):
                _fire(module)
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    finally:
        with _lock:
            _watchers.pop(name, None)


def wait(timeout: float = 10.0) -> bool:
    """Wait until no module is being watched; whether that happened within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with _lock:
            watchers = list(_watchers.values())
        if not watchers:
            return True
        for watcher in watchers:
            watcher.join(max(0.0, deadline - time.monotonic()))
        if time.monotonic() >= deadline:
            with _lock:
                return not _watchers


def finished(name: str) -> bool:
    """Whether module ``name`` is in ``sys.modules`` and done executing: a module still running its
    body (it imported another target on the way, as ``transformers.modeling_utils`` imports
    ``core_model_loading``) is not ready to be patched; its own hooks fire once it is."""
    module = sys.modules.get(name)
    return module is not None and not executing(module)


def executing(module: Any) -> bool:
    """Whether ``module`` is still running its body (importlib sets this flag around ``exec_module``)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _fire(module: Any) -> None:
    name = str(getattr(module, "__name__", ""))
    with _lock:
        hooks = _hooks.pop(name, []) + _on_reload.get(name, [])
    for hook in hooks:
        hook(module)


if hasattr(os, "register_at_fork"):  # the watchers' threads do not exist in a child
    os.register_at_fork(after_in_child=_watchers.clear)


def _install() -> None:
    global _finder
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)


class _Finder:
    """A meta path finder that only ever answers for modules with hooks, through the others."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _hooks and fullname not in _on_reload:
            return None
        resolving = _resolving.__dict__.setdefault("names", set())
        if fullname in resolving:  # another finder re-entered the import system for this name
            return None
        resolving.add(fullname)
        try:
            spec = self._find_with_the_others(fullname, path, target)
        finally:
            resolving.discard(fullname)
        if spec is not None and hasattr(spec.loader, "exec_module") and not isinstance(spec.loader, _Loader):
            spec.loader = _Loader(spec.loader)
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


class _Loader:
    """The module's own loader, then the module's hooks. Everything else is the loader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

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
        self.loader.exec_module(module)
        _fire(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
