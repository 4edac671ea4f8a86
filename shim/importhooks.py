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
  thread is importing it); the patch then finds its target missing. Here such a module is
  remembered and its hooks fire once it has finished, at the next import anywhere or the next
  :func:`poll`.

Hooks run in the importing thread, while the module's import lock is still held, and outside
this module's own lock. An exception from a hook propagates into the import (the registry lets
only ``shim.PatchError`` out, in strict mode).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

Hook = Callable[[Any], None]

_lock = threading.Lock()
_hooks: dict[str, list[Hook]] = {}  # module name -> hooks waiting for it to finish executing
_unfinished: set[str] = set()  # names with hooks whose module another loader is still executing
_resolving = threading.local()  # names this thread is resolving (another finder may call back)
_finder: _Finder | None = None


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once module ``name`` has finished executing (now, if it has)."""
    with _lock:
        _install()
        module = sys.modules.get(name)
        if module is None or executing(module):
            _hooks.setdefault(name, []).append(hook)
            if module is not None:
                _unfinished.add(name)
            return
    hook(module)


def poll() -> None:
    """Fire the hooks of modules that other threads finished importing since they were registered."""
    if not _unfinished:
        return
    with _lock:
        done = [name for name in _unfinished if name in sys.modules and not executing(sys.modules[name])]
        _unfinished.difference_update(done)
    for name in done:
        _fire(sys.modules[name])


def executing(module: Any) -> bool:
    """Whether ``module`` is still running its body (importlib sets this flag around ``exec_module``)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _fire(module: Any) -> None:
    with _lock:
        hooks = _hooks.pop(str(getattr(module, "__name__", "")), [])
    for hook in hooks:
        hook(module)


def _install() -> None:
    global _finder
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)


class _Finder:
    """A meta path finder that only ever answers for modules with hooks, through the others."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if _unfinished:
            poll()
        if fullname not in _hooks:
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
