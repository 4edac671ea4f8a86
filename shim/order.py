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
in the order they register. One function, :func:`settle`, computes the order and what it must
refuse, where the order is declared; each caller says what a refusal means there: an unknown name,
a cycle or an ``after`` that contradicts a ``place`` is an error when ``python -m shim index``
generates the built-ins' index (which lists them in this order), a pack left out with a warning at
``import shim`` (before its module is imported; an ``after`` naming a patch that is not installed
is dropped), and a ``ValueError`` from ``Registry.register`` for a patch of your own.

Loaded by ``import shim`` (a registered patch's rank is two integers); nothing here imports
``packaging`` or a patch module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def shown(place: str) -> str:
    """A place as the messages write it."""
    return repr(place) if place else "in between"


#: Why a patch cannot take its place (:attr:`Refusal.cause`).
MISSING = "missing"  # its after= names a patch that is not there (nor placed, or it was refused)
OUTSIDE = "outside"  # its after= names a patch whose place sits outside its own
CYCLE = "cycle"  # it sits in a cycle of after= declarations


class Refusal(NamedTuple):
    """Why patch ``patch`` (of place ``place``) cannot take its place: the ``cause``, the name its
    ``after`` gives that it is about (``named``, of place ``named_place``), and for a cycle the
    cycle, its first name again at its end. What it means is the caller's to say."""

    patch: str
    place: str
    cause: str
    named: str
    named_place: str = ""
    cycle: tuple[str, ...] = ()


class Settled(NamedTuple):
    """The patches in the one order (:func:`settle`), those refused and why (in the order found: a
    refusal that follows from another comes after it), and the names each one's ``after`` gives
    that are not there, whose constraints were dropped (with ``drop_missing``)."""

    ordered: list[Any]
    refused: dict[str, Refusal]
    dropped: dict[str, list[str]]


def settle(patches: Sequence[T], placed: Mapping[str, str] | None = None, *, drop_missing: bool = False) -> Settled:
    """The one order of ``patches`` among themselves, after the patches already ``placed`` (name ->
    place), and what it must refuse: each after the patches its ``after`` names, ties as given (the
    index gives the built-ins by place and name, which keeps them by place: a patch waits only for
    patches of its place or one inside it; ``shim.packs`` gives the packs in ``sys.path`` order).

    A patch is refused for the first problem its ``after`` shows, in its order: a name of a place
    that sits outside its own, or (unless ``drop_missing``: that constraint is dropped instead,
    said in ``dropped``) a name that is neither among ``patches`` nor ``placed``, or was refused;
    then the patches of a cycle of ``after`` declarations. Each caller says what a refusal means
    there: an index that cannot be written, a pack left out with its warning, a ``ValueError`` from
    ``Registry.register``."""
    if not any(patch.after for patch in patches):
        return Settled(list(patches), {}, {})  # nothing to decide: a patch of your own, as a rule
    placed = placed or {}
    refused: dict[str, Refusal] = {}
    dropped: dict[str, list[str]] | None = {patch.name: [] for patch in patches} if drop_missing else None
    while True:
        live = [patch for patch in patches if patch.name not in refused]
        places = {**placed, **{patch.name: patch.place for patch in live}}
        problems = _problems(live, places, dropped)
        if problems:
            refused.update(problems)
            continue  # look again without them
        inside = {patch.name: _waits_for(patch, places, placed) for patch in live}
        ordered = _inward_first(live, inside)
        if len(ordered) == len(live):
            return Settled(ordered, refused, {name: names for name, names in (dropped or {}).items() if names})
        refused.update(_in_a_cycle(ordered, inside, places))


def _problems(
    live: Sequence[Ordered], places: Mapping[str, str], dropped: dict[str, list[str]] | None
) -> dict[str, Refusal]:
    """The first problem of each of ``live`` that has one (:func:`_first_problem`)."""
    found = {}
    for patch in live:
        problem = _first_problem(patch, places, None if dropped is None else dropped[patch.name])
        if problem is not None:
            found[patch.name] = problem
    return found


def _waits_for(patch: Ordered, places: Mapping[str, str], placed: Mapping[str, str]) -> set[str]:
    """The others ``patch`` waits for: the names its ``after`` gives that are there (``places``) and
    not placed already (those are before it whatever comes)."""
    return {name for name in patch.after if name in places and name not in placed}


def _in_a_cycle(
    ordered: Sequence[Ordered], inside: Mapping[str, set[str]], places: Mapping[str, str]
) -> dict[str, Refusal]:
    """The patches of one cycle among those that ``ordered`` left out (``inside``: name -> the names
    it waits for; ``places``: name -> place), refused."""
    done = {patch.name for patch in ordered}
    cycle = tuple(_cycle({name: names - done for name, names in inside.items() if name not in done}))
    return {name: Refusal(name, places[name], CYCLE, then, places[then], cycle) for name, then in zip(cycle, cycle[1:])}


def contradiction(refusal: Refusal) -> str:
    """An ``after`` against a ``place`` (:data:`OUTSIDE`) as an error says it: the index's,
    ``Registry.register``'s."""
    return (
        f"patch {refusal.patch!r} ({shown(refusal.place)}) is declared after {refusal.named!r} "
        f"({shown(refusal.named_place)}), which sits outside it: drop one of the two declarations"
    )


def _first_problem(patch: Ordered, places: Mapping[str, str], dropped: list[str] | None) -> Refusal | None:
    """Why ``patch`` cannot sit after the patches its ``after`` names among ``places`` (name ->
    place), or ``None``; a name not there is added to ``dropped`` where that is a list, else refused."""
    for name in patch.after:
        if name not in places:
            if dropped is None:
                return Refusal(patch.name, patch.place, MISSING, name)
            if name not in dropped:
                dropped.append(name)
        elif PLACES.index(places[name]) > PLACES.index(patch.place):
            return Refusal(patch.name, patch.place, OUTSIDE, name, places[name])
    return None


def _inward_first(patches: Sequence[T], inside: Mapping[str, set[str]]) -> list[T]:
    """``patches`` each after those it sits outside of (``inside``: name -> names), ties as given; a
    patch in a cycle is left out."""
    import heapq

    waiting = [set(inside[patch.name]) for patch in patches]
    waiters: dict[str, list[int]] = {}  # name -> the patches (by index) that wait for it
    for index, names in enumerate(waiting):
        for name in names:
            waiters.setdefault(name, []).append(index)
    ready = [index for index, names in enumerate(waiting) if not names]  # ascending: a heap already
    ordered: list[T] = []
    while ready:
        ordered.append(patches[heapq.heappop(ready)])
        for index in waiters.pop(ordered[-1].name, ()):
            waiting[index].discard(ordered[-1].name)
            if not waiting[index]:
                heapq.heappush(ready, index)
    return ordered


def _cycle(waiting: Mapping[str, set[str]]) -> list[str]:
    """One cycle among the patches still ``waiting`` (name -> the names it waits for)."""
    name = next(name for name, names in waiting.items() if names)
    path: list[str] = []
    while name not in path:
        path.append(name)
        name = sorted(waiting[name])[0]
    return [*path[path.index(name) :], name]
