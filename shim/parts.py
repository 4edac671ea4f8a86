"""The parts in one target's layer: each applied patch's wrapper there, with its switch, in the
catalogue's one order (``shim.order``), and which of them act now.

The engine puts one layer in a target however many patches wrap it (``shim.wrapping`` for a function
or method, ``shim.assigning`` for an assign target), and the layer runs its :class:`Parts`. A patch
joins with its wrapper and its switch when it applies and leaves when it comes off. Which parts act
is worked out again when one of their switches flips (``SHIM_DISABLE``, ``shim.disable``,
``shim.disabled``, ``shim.deactivate``), never per call: a call runs the active wrappers, outermost
first, or goes straight to upstream where none is active.

Imported when the first patch applies, never by ``import shim`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .runtime import Switch


class Part(NamedTuple):
    rank: tuple[int, int]  # where it sits (shim.order.rank): sorted innermost first
    name: str  # the patch's
    wrapper: Callable[..., Any]  # wrapt's (wrapped, instance, args, kwargs), or (instance, value) on an assign target
    switch: Switch  # the patch's


class Parts:
    """The parts of one target's layer, innermost first, and the wrappers that act now, outermost first."""

    __slots__ = ("parts", "active")

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.active: tuple[Callable[..., Any], ...] = ()

    def join(self, name: str, wrapper: Callable[..., Any], switch: Switch, rank: tuple[int, int]) -> Switch:
        """Add patch ``name``'s part; where it has one already (put there by another registry, or a
        shim imported again), adopt that one. Returns the switch the part answers to."""
        for part in self.parts:
            if part.name == name:
                return part.switch
        self.parts.append(Part(rank, name, wrapper, switch))
        self.parts.sort(key=lambda part: (part.rank, part.name))
        switch.watch(self.flipped)
        self.flipped()
        return switch

    def leave(self, name: str) -> None:
        """Take patch ``name``'s part out (the layer comes off its target once no part is left)."""
        for part in [part for part in self.parts if part.name == name]:
            self.parts.remove(part)
            if all(other.switch is not part.switch for other in self.parts):
                part.switch.unwatch(self.flipped)
        self.flipped()

    def names(self) -> tuple[str, ...]:
        """The patches with a part here, outermost first."""
        return tuple(part.name for part in reversed(self.parts))

    def flipped(self, _on: bool = False) -> None:
        """A switch flipped (or a part came or went): the wrappers to run from now on."""
        self.active = tuple(part.wrapper for part in reversed(self.parts) if part.switch.on)

    def __call__(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A function layer's wrapt wrapper: the active parts, each calling the next one inward."""
        active = self.active
        if not active:
            return wrapped(*args, **kwargs)
        if len(active) == 1:
            return active[0](wrapped, instance, args, kwargs)
        inner = _new(_Inward)  # no __init__ frame: it is made on every call through two parts or more
        inner.active, inner.index, inner.__wrapped__, inner.instance = active, 1, wrapped, instance
        return active[0](inner, instance, args, kwargs)


class _Inward:
    """What a part calls as ``wrapped`` where active parts sit inside it: the next of them, and
    upstream's callable after the last. ``__wrapped__`` is upstream's callable, so ``inspect.signature``
    of it reads upstream's signature, as it does for the innermost part."""

    __slots__ = ("active", "index", "__wrapped__", "instance")
    active: tuple[Callable[..., Any], ...]
    index: int
    __wrapped__: Any
    instance: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active, index = self.active, self.index
        if index + 1 < len(active):
            inner = _new(_Inward)
            inner.active, inner.index, inner.instance = active, index + 1, self.instance
            inner.__wrapped__ = self.__wrapped__
        else:
            inner = self.__wrapped__
        return active[index](inner, self.instance, args, kwargs)


_new = object.__new__
