"""The meta path finder behind ``shim.importhooks``: it finds nothing by itself.

For a module it is told to watch, it asks the finders after it in ``sys.meta_path`` directly, with
the ``path`` the import system gave it (never ``importlib.util.find_spec``, which would import and
lock the parent package from inside the import), and wraps the loader they return so that the
module's hooks run right after its body. For every other module it answers ``None`` at once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

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
