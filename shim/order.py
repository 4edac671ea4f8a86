"""The one order of the parts on a target: declared by the patches, checked where the catalogue is
built, never discovered inside a user's call.

Where several patches wrap one target, the engine puts one layer there (``shim.parts``) and runs
their parts in this order on every call, the outermost first and the innermost last, next to
upstream: a function's wrappers call each other inward; an assign target's value passes outermost
first; the checkpointing path's steps act on a call in the same order. A patch places itself with

- ``Patch.after``: the patches whose parts its own sit outside of (it runs before them on a call);
- ``Patch.place``: ``"innermost"`` or ``"outermost"``, for a part that must sit there whoever else
  is on the target, without naming them (as pluggy's ``tryfirst``/``trylast``); ``""`` in between.

Each place holds the built-ins first, then the patch packs and patches given to ``shim.register()``,
in the order they register. The order is checked where it is declared: an unknown name, a cycle or
an ``after`` that contradicts a ``place`` is an error when ``python -m shim index``
generates the built-ins' index (which lists them in this order), a pack refused with a warning by
:func:`settle` at ``import shim`` (before its module is imported), and a ``ValueError`` from
``Registry.register`` for a patch of your own.

Loaded by ``import shim`` (a registered patch's rank is two integers); nothing here imports
``packaging`` or a patch module.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

#: Where a patch's parts can sit among the others on a target, innermost (next to upstream) first.
PLACES = ("innermost", "", "outermost")


class OrderError(ValueError):
    """An order that cannot hold: an unknown name, a cycle, an ``after`` against a ``place``."""


class Ordered(Protocol):
    """A patch as the order sees it: a ``Patch`` or a record of one (``shim.catalogue.Listing``)."""

    @property
    def name(self) -> str: ...

    @property
    def place(self) -> str: ...

    @property
    def after(self) -> Sequence[str]: ...


T = TypeVar("T", bound=Ordered)


def rank(place: str, sequence: int) -> tuple[int, int]:
    """The sort key of a registered patch's parts: its place, then when it registered."""
    return PLACES.index(place), sequence


def _shown(place: str) -> str:
    return repr(place) if place else "in between"


def arrange(patches: Sequence[T]) -> list[T]:
    """``patches`` in the order given, each moved after the patches its ``after`` names among them
    (an unknown name or a cycle is left for :func:`check_after` to say)."""
    if not any(patch.after for patch in patches):
        return list(patches)  # the built-ins at ``import shim``: their index lists them in order
    position = {patch.name: index for index, patch in enumerate(patches)}
    inside = {p.name: {n for n in p.after if n in position and n != p.name} for p in patches}
    ordered = _inward_first(patches, inside, lambda patch: (position[patch.name],))
    return ordered + [p for p in patches if p not in ordered]


def _inward_first(
    patches: Sequence[T], inside: Mapping[str, set[str]], priority: Callable[[T], tuple[int, ...]]
) -> list[T]:
    """``patches`` each after those it sits outside of (``inside``: name -> names), ties by ``priority``
    (lowest first); a patch in a cycle is left out."""
    import heapq

    by_name = {patch.name: patch for patch in patches}
    waiting = {name: set(names) for name, names in inside.items()}
    ready = [(priority(p), p.name) for p in patches if not waiting[p.name]]
    heapq.heapify(ready)
    ordered: list[T] = []
    while ready:
        _key, name = heapq.heappop(ready)
        ordered.append(by_name[name])
        for other, names in waiting.items():
            if name in names:
                names.discard(name)
                if not names:
                    heapq.heappush(ready, (priority(by_name[other]), other))
    return ordered


def check_after(patch: Ordered, placed: Mapping[str, str]) -> None:
    """Whether ``patch`` can sit outside every patch its ``after`` names, among the patches already
    ``placed`` (name -> place); raises :class:`OrderError` naming the problem and the fix."""
    for name in patch.after:
        if name not in placed:
            raise OrderError(
                f"patch {patch.name!r} is declared after {name!r}, which is not registered before it "
                f"(register {name!r} first, or take it out of after=)"
            )
        if PLACES.index(placed[name]) > PLACES.index(patch.place):
            raise OrderError(
                f"patch {patch.name!r} ({_shown(patch.place)}) is declared after {name!r} "
                f"({_shown(placed[name])}), which sits outside it: drop one of the two declarations"
            )


def stacking_order(patches: Sequence[T]) -> list[T]:
    """The built-in ``patches`` innermost first, as their index lists them: by place, each after the
    patches its ``after`` names, ties by name. Raises :class:`OrderError` for an unknown name, a
    cycle, or an ``after`` against a ``place``."""
    by_name = {patch.name: patch for patch in patches}
    inside: dict[str, set[str]] = {}
    for patch in patches:
        unknown = [name for name in patch.after if name not in by_name]
        if unknown:
            raise OrderError(f"patch {patch.name!r} is declared after {unknown[0]!r}, which is no built-in patch")
        named = {name for name in patch.after if name in by_name}
        for name in named:
            if PLACES.index(by_name[name].place) > PLACES.index(patch.place):
                check_after(patch, {name: by_name[name].place})  # raises, naming both
        inside[patch.name] = named
    ordered = _inward_first(patches, inside, lambda patch: (PLACES.index(patch.place),))
    if len(ordered) < len(patches):
        done = {patch.name for patch in ordered}
        left = {name: names - done for name, names in inside.items() if name not in done}
        raise OrderError(f"the after= declarations form a cycle: {' -> '.join(_cycle(left))}")
    return sorted(ordered, key=lambda patch: PLACES.index(patch.place))  # a stable sort: topology kept


class Settled(NamedTuple):
    """The patch packs in the order they register (:func:`settle`), those refused and why, and the
    constraints dropped from each, in words."""

    ordered: list[Any]
    refused: dict[str, str]
    dropped: dict[str, list[str]]


def settle(packs: Sequence[T], placed: Mapping[str, str], left_out: Collection[str] = ()) -> Settled:
    """The one order of ``packs`` among themselves and the patches already ``placed`` (name ->
    place: the built-ins), decided from their records before any of their modules is imported:
    each after the patches its ``after`` names, ties as given (``sys.path`` order).

    A pack is refused (one problem each, its own) where its ``after`` names a patch whose place sits
    outside its own, or where it sits in a cycle of ``after`` declarations; an ``after`` that names
    a patch that is not there, or was refused (here, or before: ``left_out``), is dropped (said in
    ``dropped``), not the pack."""
    refused: dict[str, str] = {}
    dropped: dict[str, list[str]] = {patch.name: [] for patch in packs}
    position = {patch.name: index for index, patch in enumerate(packs)}
    while True:
        live = [patch for patch in packs if patch.name not in refused]
        places = {**placed, **{patch.name: patch.place for patch in live}}
        inside: dict[str, set[str]] = {}
        for patch in live:
            inside[patch.name] = set()
            for name in patch.after:
                if name not in places:
                    gone = "was refused" if name in refused or name in left_out else "is not installed"
                    note = f"declared after {name!r}, which {gone}: that constraint is dropped"
                    if note not in dropped[patch.name]:
                        dropped[patch.name].append(note)
                elif PLACES.index(places[name]) > PLACES.index(patch.place):
                    refused[patch.name] = (
                        f"its place ({_shown(patch.place)}) and its after= {name!r} ({_shown(places[name])}, "
                        "which sits outside it) contradict each other: drop one of the two declarations"
                    )
                elif name not in placed:  # another pack, wherever it is in the list
                    inside[patch.name].add(name)
        if any(patch.name in refused for patch in live):
            continue  # said in the loop: look again without it
        ordered = _inward_first(live, inside, lambda patch: (position[patch.name],))
        if len(ordered) == len(live):
            return Settled(ordered, refused, {name: notes for name, notes in dropped.items() if notes})
        done = {patch.name for patch in ordered}
        waiting = {name: names - done for name, names in inside.items() if name not in done}
        cycle = _cycle(waiting)
        for name in cycle[:-1]:
            refused[name] = f"its after= declarations form a cycle: {' -> '.join(cycle)}"


def _cycle(waiting: Mapping[str, set[str]]) -> list[str]:
    """One cycle among the patches still ``waiting`` (name -> the names it waits for)."""
    name = next(name for name, names in waiting.items() if names)
    path: list[str] = []
    while name not in path:
        path.append(name)
        name = sorted(waiting[name])[0]
    return [*path[path.index(name) :], name]
