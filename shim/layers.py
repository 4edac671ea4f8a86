"""Everything one patch has installed (:class:`Layers`): its part in each target's layer, the parts
a reload left on old classes, and the consumers' names it rebound; which of them are no longer in
place, and whether a target replaced since holds upstream's own object again (a reload) or
another patcher's.

Imported when the first patch applies, never by ``import shim`` itself.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from . import rebinding, wrapping
from .parts import Parts
from .runtime import Switch

if TYPE_CHECKING:
    from .patch import AssignPart, Patch, Target

log = logging.getLogger("shim")


class Layer(NamedTuple):
    """One patch's part in one target: the target, and the engine's layer there that runs the part."""

    module: Any  # the module object the target lives in
    path: str  # the attribute path in it
    handle: Any  # the engine's layer in the target (shared with the other patches that have a part there)
    original: Any  # what the layer wraps
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
        self, patch: Patch, resolved: list[Resolved], switch: Switch, rank: tuple[int, int]
    ) -> tuple[Switch, list[str]]:
        """Put the patch's part into each resolved target's layer (the layer put in first where the
        target has none); rebind the patch's consumers. Returns the switch the parts answer to (a
        part of the same patch found there, put by another registry or a reloaded shim, is adopted
        with its switch) and the names it could not rebind. An exception leaves the parts added so
        far in :attr:`placed`, for :meth:`remove`."""
        added = []
        for target, module, original in resolved:
            handle = wrapping.find_layer(original)
            if handle is None:
                handle = wrapping.install(module, target.path, Parts(), target.assign)
            else:
                original = handle.__wrapped__
            owner, attribute = wrapping.owner_of(module, target.path)
            layer = Layer(module, target.path, handle, original, _reference(owner), attribute, target.module)
            self.placed.append(layer)
            added.append(layer)
            # an assign target's part is made for its patch: it is handed the name and switch it answers to
            wrapper = cast("AssignPart", target.wrapper)(patch.name, switch) if target.assign else target.wrapper
            switch = wrapping.parts_of(handle).join(patch.name, wrapper, switch, rank)  # type: ignore[union-attr]
        missed: list[str] = []
        self.consumers = patch.consumers
        for layer in added if patch.consumers else ():
            rebound, failed = rebinding.rebind(patch.consumers, layer.original, layer.handle)
            self.rebound.extend((module, attribute, layer.handle, layer.original) for module, attribute in rebound)
            missed.extend(f"could not rebind {module}.{attribute}" for module, attribute in failed)
        return switch, missed

    def remove(self, modules: set[str] | None = None) -> bool:
        """Take the patch's part out of every layer (only of the targets in ``modules``, where given),
        and a layer left with no part off its target, whatever sits above it; a layer that cannot be
        spliced out stays as a pass-through (a part joins it again on the next activation). Returns
        whether it took anything out."""
        chosen, old = _of(self.placed, modules), _of(self.replaced, modules)
        unbound = self._give_back(chosen, every=modules is None)
        stuck = self._take_out(chosen, old)
        self.placed = [layer for layer in self.placed if layer not in chosen]
        self.replaced = [layer for layer in self.replaced if layer not in old]
        if stuck:
            log.warning("%s: left in place switched off (a layer with no part): %s", self.name, "; ".join(stuck))
        return bool(chosen or old or unbound)

    def _give_back(self, chosen: list[Layer], every: bool) -> bool:
        """Give the consumers their names back: those rebound to ``chosen``'s layers (``every``: all
        rebound), and the copies taken of them since. Returns whether any was rebound."""
        handles = {id(layer.handle) for layer in chosen}
        rebound = [entry for entry in self.rebound if every or id(entry[2]) in handles]
        for module, attribute, handle, original in rebound:
            rebinding.unbind([(module, attribute)], handle, original)
        self.rebound = [entry for entry in self.rebound if entry not in rebound]
        for layer in chosen if self.consumers else ():
            # Consumers that imported the name after the shim applied hold the layer without a
            # rebinding to undo (peft's package re-exports its function that way): given back too.
            copies, _failed = rebinding.rebind(self.consumers, layer.handle, layer.original)
            log.debug("%s: gave %d later copies of %s back", self.name, len(copies), layer.path)
        return bool(rebound)

    def _take_out(self, chosen: list[Layer], old: list[Layer]) -> list[str]:
        """Take the part out of ``chosen``'s layers, the last put in first, and out of ``old``'s, from
        the old object each sits in, where that still holds it; what stays, and why."""
        stuck = [problem for layer in reversed(chosen) if (problem := self._leave(layer.module, layer.path, layer))]
        for layer in old:
            owner = layer.owner()
            if owner is not None and (problem := self._leave(owner, layer.attribute, layer)):
                stuck.append(problem)
        return stuck

    def _leave(self, holder: object, path: str, layer: Layer) -> str | None:
        parts = wrapping.parts_of(layer.handle)
        if parts is not None:
            parts.leave(self.name)
            if parts.parts:
                return None  # other patches' parts stay: so does the layer
        return wrapping.remove(holder, path, layer.handle)

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
            if wrapping.find_layer(current) is not layer.handle and not wrapping.holds(current, layer.handle):
                stale.append(layer)
        return stale

    def drop_stale(self, retake: bool) -> set[str]:
        """Set aside the layers whose target was replaced; returns their modules, to apply again.
        A target that holds another patcher's object now is left as it is unless ``retake``
        (``shim.activate()`` puts the shim on top): the shim never fights a patcher on its own;
        one that holds upstream's own object again (a reload) is applied again."""
        stale = [layer for layer in self.stale() if retake or upstream_again(layer)]
        for layer in stale:
            self.placed.remove(layer)
            self.replaced.append(layer)
        return {layer.module_name for layer in stale}

    def describe(self, layers: list[Layer]) -> str:
        return ", ".join(f"{getattr(layer.module, '__name__', layer.module)}:{layer.path}" for layer in layers)


def _of(layers: list[Layer], modules: set[str] | None) -> list[Layer]:
    """Those of ``layers`` in the target modules ``modules`` (all, where ``None``)."""
    return [layer for layer in layers if modules is None or layer.module_name in modules]


def upstream_again(layer: Layer) -> bool:
    """Whether ``layer``'s target holds upstream's own object again, written in the target's package
    (``importlib.reload`` made new ones), not another patcher's.

    A class made again in the target's package is a reload, whatever its attribute holds now: an
    inherited method (torch's ``nn.Module.__setstate__``), nothing (an assign target), or the layer
    another patch of this shim put there first when the same reload fired its hook."""
    module = sys.modules.get(layer.module_name)
    if module is None:
        return False
    package = layer.module_name.partition(".")[0]
    owner_path = layer.path.rpartition(".")[0]
    if owner_path:
        try:
            owner = wrapping.object_at(module, owner_path)
        except wrapping.PathResolutionError:
            return False
        if owner is not layer.owner():
            return isinstance(owner, type) and _written_in(owner, package)
    try:
        current = wrapping.object_at(module, layer.path)
    except wrapping.PathResolutionError:
        return False
    if wrapping.parts_of(current) is not None:  # the shim's own layer, put on the new object by another patch
        current = getattr(current, "__wrapped__", None)
    return _written_in(current, package)


def _written_in(obj: object, package: str) -> bool:
    """Whether the code of ``obj`` (a function, a method, a class) was written in ``package``: a
    function by its globals (which ``functools.wraps`` does not copy), a class by its module. A
    function the standard library made around another (``contextlib.contextmanager``'s, as trl's
    ``disable_gradient_checkpointing`` is) counts as the one it wraps."""
    function = getattr(obj, "__func__", obj)
    name = _module_of(function)
    inner = getattr(function, "__wrapped__", None)
    while name in sys.stdlib_module_names and callable(inner):
        function, name = inner, _module_of(inner)
        inner = getattr(function, "__wrapped__", None)
    if name is None:
        name = getattr(obj if isinstance(obj, type) else type(obj), "__module__", None)
    return isinstance(name, str) and name.partition(".")[0] == package


def _module_of(function: object) -> str | None:
    """The name of the module whose globals ``function`` runs in, or ``None`` (no function)."""
    globals_ = getattr(function, "__globals__", None)
    name = globals_.get("__name__") if isinstance(globals_, dict) else None
    return name if isinstance(name, str) else None
