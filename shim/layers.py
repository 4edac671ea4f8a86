"""Applying a patch: wrapping its targets, rebinding names bound before it applied, and taking all
of it off again (on ``shim.deactivate()``, or when a later target of the same patch fails).

The sentinel that makes applying idempotent lives on the wrapper in the target (``shim.wrapping``):
a target that already carries this patch's layer, from a reloaded ``shim`` or a second registry,
is adopted together with its switch instead of being wrapped twice.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import wrapping

if TYPE_CHECKING:
    from .gating import Resolved
    from .patch import Patch
    from .switch import Switch

log = logging.getLogger("shim")


class Layer(NamedTuple):
    module: Any  # the module object the target lives in
    path: str  # the attribute path in it
    handle: Any  # our wrapper
    original: Any  # what it wraps
    owner: Callable[[], Any]  # (a weak reference to) the object holding it: a class, or the module
    attribute: str  # its name there
    module_name: str  # the target module's name, under which sys.modules holds ``module``


def _reference(obj: object) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # an object without weak references: held, as wrapt holds it anyway
        return lambda: obj


class Layers:
    """Everything one patch has installed: its layers and the consumer names it rebound."""

    __slots__ = ("name", "installed", "replaced", "rebound")

    def __init__(self, name: str) -> None:
        self.name = name
        self.installed: list[Layer] = []
        # Layers whose target was replaced (a reload makes new classes): the old class, still the
        # base of models built before, keeps its layer, working, until the patch comes off.
        self.replaced: list[Layer] = []
        self.rebound: list[tuple[Any, str, Any, Any]] = []  # (module, attribute, handle, original)

    def __bool__(self) -> bool:
        return bool(self.installed or self.rebound)

    def wrap(self, patch: Patch, resolved: list[Resolved], switch: Switch) -> tuple[Switch, list[str]]:
        """Wrap each resolved target (or adopt the layer already there); rebind the patch's
        consumers. Returns the switch the layers answer to and the names it could not rebind.
        An exception leaves the layers added so far in :attr:`installed`, for :meth:`remove`."""
        added = []
        for target, module, original in resolved:
            handle = wrapping.find_shim_wrapper(original, patch.name)
            if handle is not None:
                # Another registry (or a reloaded shim) already applied it: adopt that layer
                # and share its switch instead of adding a second one.
                switch = wrapping.switch_of(handle)
                original = handle.__wrapped__
            else:
                handle = wrapping.install(module, target.path, patch.name, target.wrapper, switch, target.assign)
            owner, attribute = wrapping.owner_of(module, target.path)
            layer = Layer(module, target.path, handle, original, _reference(owner), attribute, target.module)
            self.installed.append(layer)
            added.append(layer)
        missed: list[str] = []
        for layer in added if patch.consumers else ():
            rebound, failed = wrapping.rebind(patch.consumers, layer.original, layer.handle)
            self.rebound.extend((module, attribute, layer.handle, layer.original) for module, attribute in rebound)
            missed.extend(f"could not rebind {module}.{attribute}" for module, attribute in failed)
        return switch, missed

    def remove(self) -> None:
        """Take every layer off, whatever sits above it; a layer that cannot be spliced out stays,
        and the caller switches it off (it is adopted again on the next activation)."""
        for module, attribute, handle, original in self.rebound:
            wrapping.unbind([(module, attribute)], handle, original)
        self.rebound.clear()
        stuck = [problem for layer in reversed(self.installed) if (problem := wrapping.remove(*layer[:3]))]
        for layer in self.replaced:  # from the old object it sits in, if that still holds it
            owner = layer.owner()
            if owner is not None and (problem := wrapping.remove(owner, layer.attribute, layer.handle)):
                stuck.append(problem)
        self.installed.clear()
        self.replaced.clear()
        if stuck:
            log.warning("%s: left in place switched off: %s", self.name, "; ".join(stuck))

    def stale(self) -> list[Layer]:
        """Layers no longer in place: their target was replaced (``importlib.reload``, assignment),
        or their module was (a failed import discards it; the next one makes a new module)."""
        stale = []
        for layer in self.installed:
            if sys.modules.get(layer.module_name) is not layer.module:
                stale.append(layer)
                continue
            try:
                current = wrapping.resolve(layer.module, layer.path)
            except wrapping.PathResolutionError:
                stale.append(layer)
                continue
            if wrapping.find_shim_wrapper(current, self.name) is not layer.handle:
                stale.append(layer)
        return stale

    def drop_stale(self) -> set[str]:
        """Set aside the layers whose target was replaced; returns their modules, to apply again."""
        stale = self.stale() if self.installed else []
        for layer in stale:
            self.installed.remove(layer)
            self.replaced.append(layer)
        return {layer.module_name for layer in stale}

    def describe(self, layers: list[Layer]) -> str:
        return ", ".join(f"{getattr(layer.module, '__name__', layer.module)}:{layer.path}" for layer in layers)
