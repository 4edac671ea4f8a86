"""Everything one patch has installed (:class:`Layers`): its layer in each target, the layers a
reload left on old classes, and the consumers' names it rebound; and which of its layers are no
longer in place.

Imported when the first patch applies, never by ``import shim`` itself.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, NamedTuple

from . import rebinding, wrapping
from .runtime import Switch

if TYPE_CHECKING:
    from .patch import Patch, Target

log = logging.getLogger("shim")


class Layer(NamedTuple):
    module: Any  # the module object the target lives in
    path: str  # the attribute path in it
    handle: Any  # our wrapper
    original: Any  # what it wraps
    owner: Callable[[], Any]  # (a weak reference to) the object holding it: a class, or the module
    attribute: str  # its name there
    module_name: str  # the target module's name, under which sys.modules holds ``module``

    @property
    def spec(self) -> str:
        return f"{self.module_name}:{self.path}"


def _reference(obj: object) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # an object without weak references: held, as wrapt holds it anyway
        return lambda: obj


class Resolved(NamedTuple):
    target: Target
    module: Any  # the imported module object
    original: object  # what the target path holds now (for an assign target: what the class holds, or wrapt.MISSING)


class Layers:
    """Everything one patch has installed: its layers and the consumer names it rebound."""

    __slots__ = ("name", "placed", "replaced", "rebound", "consumers")

    def __init__(self, name: str) -> None:
        self.name = name
        self.placed: list[Layer] = []  # in their targets now
        # Layers whose target was replaced (a reload makes new classes): the old class, still the
        # base of models built before, keeps its layer, working, until the patch comes off.
        self.replaced: list[Layer] = []
        self.rebound: list[tuple[Any, str, Any, Any]] = []  # (module, attribute, handle, original)
        self.consumers: tuple[str, ...] = ()  # the patch's consumer module patterns

    def __bool__(self) -> bool:
        return bool(self.placed or self.rebound)

    @property
    def in_place(self) -> bool:
        """Whether any of its layers is in place, also one a reload left on an old class."""
        return bool(self.placed or self.rebound or self.replaced)

    def wrap(
        self, patch: Patch, resolved: list[Resolved], switch: Switch, lookout: Callable[[Any], Any]
    ) -> tuple[Switch, list[str]]:
        """Wrap each resolved target (or adopt the layer already there); rebind the patch's
        consumers. Returns the switch the layers answer to and the names it could not rebind.
        ``lookout(wrapper)``: what a ``Target(..., lookout=True)``'s layer runs instead of its wrapper.
        An exception leaves the layers added so far in :attr:`placed`, for :meth:`remove`."""
        added = []
        for target, module, original in resolved:
            handle = wrapping.find_shim_wrapper(original, patch.name)
            if handle is not None:
                # Another registry (or a reloaded shim) already applied it: adopt that layer
                # and share its switch instead of adding a second one.
                switch = wrapping.layer_switch(handle, patch.name)
                original = handle.__wrapped__
            elif target.shared and (handle := wrapping.find_shared(original, target.wrapper)) is not None:
                wrapping.join_shared(handle, patch.name, switch)
                original = handle.__wrapped__
            else:
                handle = wrapping.install(
                    module,
                    target.path,
                    patch.name,
                    lookout(target.wrapper) if target.lookout else target.wrapper,
                    switch,
                    target.assign,
                    target.shared,
                )
            owner, attribute = wrapping.owner_of(module, target.path)
            layer = Layer(module, target.path, handle, original, _reference(owner), attribute, target.module)
            self.placed.append(layer)
            added.append(layer)
        missed: list[str] = []
        self.consumers = patch.consumers
        for layer in added if patch.consumers else ():
            rebound, failed = rebinding.rebind(patch.consumers, layer.original, layer.handle)
            self.rebound.extend((module, attribute, layer.handle, layer.original) for module, attribute in rebound)
            missed.extend(f"could not rebind {module}.{attribute}" for module, attribute in failed)
        return switch, missed

    def remove(self) -> None:
        """Take every layer off, whatever sits above it; a layer that cannot be spliced out stays,
        and the caller switches it off (it is adopted again on the next activation)."""
        for module, attribute, handle, original in self.rebound:
            rebinding.unbind([(module, attribute)], handle, original)
        self.rebound.clear()
        for layer in self.placed if self.consumers else ():
            # Consumers that imported the name after the shim applied hold the layer without a
            # rebinding to undo (peft's package re-exports its function that way): given back too.
            copies, _failed = rebinding.rebind(self.consumers, layer.handle, layer.original)
            log.debug("%s: gave %d later copies of %s back", self.name, len(copies), layer.path)
        stuck = [
            problem
            for layer in reversed(self.placed)
            if (problem := wrapping.remove(layer.module, layer.path, layer.handle, self.name))
        ]
        for layer in self.replaced:  # from the old object it sits in, if that still holds it
            owner = layer.owner()
            if owner is not None and (problem := wrapping.remove(owner, layer.attribute, layer.handle, self.name)):
                stuck.append(problem)
        self.placed.clear()
        self.replaced.clear()
        if stuck:
            log.warning("%s: left in place switched off: %s", self.name, "; ".join(stuck))

    def stale(self) -> list[Layer]:
        """Layers no longer in place: their target was replaced (``importlib.reload``, assignment),
        or their module was (a failed import discards it; the next one makes a new module)."""
        stale = []
        for layer in self.placed:
            if sys.modules.get(layer.module_name) is not layer.module:
                stale.append(layer)
                continue
            try:
                current = wrapping.object_at(layer.module, layer.path)
            except wrapping.PathResolutionError:
                stale.append(layer)
                continue
            if wrapping.find_shim_wrapper(current, self.name) is not layer.handle and not wrapping.holds(
                current, layer.handle
            ):
                stale.append(layer)
        return stale

    def drop_stale(self, keep: Collection[str] = ()) -> set[str]:
        """Set aside the layers whose target was replaced; returns their modules, to apply again.
        ``keep``: targets (``module:path``) to leave as they are, whose replacement is another
        patcher's (the shim never fights it on its own; ``shim.activate()`` puts the shim on top)."""
        stale = [layer for layer in self.stale() if layer.spec not in keep]
        for layer in stale:
            self.placed.remove(layer)
            self.replaced.append(layer)
        return {layer.module_name for layer in stale}

    def describe(self, layers: list[Layer]) -> str:
        return ", ".join(f"{getattr(layer.module, '__name__', layer.module)}:{layer.path}" for layer in layers)
