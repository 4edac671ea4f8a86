"""Patch packs: patches that other distributions declare in the entry-point group ``hf_train_shim.patches``.

A pack declares each patch as an entry point whose name is the patch's name and whose value points at
its :class:`shim.Patch`; its record, the rest of what the registry needs before importing anything
(``shim.catalogue.Listing``), sits beside it in two more groups, which ``python -m shim index``
writes from the patches themselves::

    [project.entry-points."hf_train_shim.patches"]
    my-fix = "my_pack.fixes:PATCH"

    [project.entry-points."hf_train_shim.targets"]
    "my-fix.transformers.trainer_utils" = "transformers.trainer_utils"

    [project.entry-points."hf_train_shim.order"]    # only for a patch with a place or an after=
    "my-fix.after.other-fix" = "my_pack.fixes"
    "my-fix.place.outermost" = "my_pack.fixes"

Every value is an object reference and every name free of ``=`` and ``[``, as setuptools'
validation of ``pyproject.toml`` requires; so a version range, which needs ``=``, cannot be written
there: a pack's gate is read from its ``Patch`` once its module is imported, which happens only when
one of its target modules is (or a status asks), as for a built-in.

Laziness, as for the built-ins: ``import shim`` reads the pack's metadata and imports nothing of it,
and decides there, for every pack at once, its name and its place in the one order (``shim.order``):
a pack refused there (a name it cannot have, no record, an ``after=`` cycle, an ``after=`` against
its place) is left out with one ``ShimWarning`` and its module never imported. A patch switched off
(``SHIM_DISABLE=all`` or by name) never has its module imported. Off is off: with ``SHIM_DISABLE=all``
nothing left out is warned about at ``import shim`` (nor raised under ``SHIM_STRICT``); the registry
keeps what was left out (``Registry.left_out``), which ``python -m shim`` and doctor say below their
tables whether the shim is on or off.

Discovery lists each ``sys.path`` entry and reads, of each distribution there, its
``entry_points.txt`` as bytes, looking for the group's name: most distributions declare no pack, and
this costs a directory listing per entry and one small read per distribution, where
``importlib.metadata.entry_points(group=...)`` parses every distribution's metadata (measured with 104
distributions: 1.6 ms against 5.5 ms; docs/performance.md, "Patch packs at import"). A distribution
that declares the group is handed to ``importlib.metadata`` (``PathDistribution``), which parses it;
a zip archive on ``sys.path`` (a PEX) is searched by ``importlib.metadata`` alone. As with
``importlib.metadata``: every ``*.dist-info`` and ``*.egg-info`` folder directly in each entry
(``""`` is the current directory), in ``sys.path`` order; a distribution found twice counts where it
is found first, names compared lower case with runs of ``-``, ``_`` and ``.`` as one.

A file is read only if it is a regular file of at most :data:`LIMIT` bytes, as UTF-8. A distribution
whose ``entry_points.txt``, ``METADATA`` or ``PKG-INFO`` breaks one of those rules (bytes that are not
UTF-8, a huge file, a FIFO or a folder where a file should be) is left out, with one ``ShimWarning``
where it declares the group and silence where it does not (a huge ``entry_points.txt`` is searched for
the group in its first :data:`LIMIT` bytes only; a file that is not a regular one is never opened for
reading, so nothing hangs).

Fail-safe: an entry point whose module cannot be imported (it raises anything, ``SystemExit``
included; ``KeyboardInterrupt`` passes through), whose value is no ``shim.Patch``, whose record is
stale (the Patch's name, targets, place or ``after`` differ from it), or whose name is a built-in's or
an earlier pack's is left out with one ``ShimWarning`` naming the distribution, the entry point and
the fix; everything else keeps working. With ``SHIM_STRICT=1`` it raises :class:`shim.PatchError`
instead. A built-in is never replaced by a pack.
"""

from __future__ import annotations

import functools
import os
import stat
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import order, settings
from .catalogue import PACK_REWRITE, Listing, pack_message

if TYPE_CHECKING:
    from .registry import Registry  # packs.load registers into it; the registry never imports this

#: The entry-point group a pack declares its patches in.
GROUP = "hf_train_shim.patches"
#: The entry-point group a pack lists its patches' target modules in (``python -m shim index``).
TARGETS = "hf_train_shim.targets"
#: The entry-point group a pack lists its patches' places and ``after`` in (``python -m shim index``).
ORDER = "hf_train_shim.order"
#: The most bytes read of one metadata file; a larger one is not a pack's.
LIMIT = 1 << 20
_MARK = GROUP.encode()


class Unreadable(Exception):
    """A metadata file that breaks the rules of discovery (the module docstring): ``why``, in words,
    and whether it ``declares`` the group, as far as could be seen."""

    def __init__(self, why: str, declares: bool = True) -> None:
        super().__init__(why)
        self.why, self.declares = why, declares


# -- finding them ----------------------------------------------------------------------------------


def found(paths: Iterable[str] | None = None) -> list[Listing]:
    """The record of every entry point of :data:`GROUP` of the distributions in ``paths`` (default:
    ``sys.path``), in ``sys.path`` order and, within a folder, by name; a patch with no target
    modules listed has ``modules == ()``. A distribution that breaks the rules of discovery is left
    out (the module docstring)."""
    seen: set[str] = set()
    out: list[Listing] = []
    for entry in sys.path if paths is None else paths:
        folder = entry or os.curdir
        try:
            names = sorted(os.listdir(folder))
        except NotADirectoryError:  # a zip archive (a PEX): importlib.metadata reads it
            out += _in_archive(folder, seen)
            continue
        except OSError:  # not there
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            key = normalized(_named_in(name)[0])
            if key in seen:  # shadowed by the same distribution earlier on sys.path, as importlib.metadata says
                continue
            seen.add(key)
            out += _declared(os.path.join(folder, name))
    return out


def _declared(metadata: str) -> list[Listing]:
    """The records of one distribution's metadata folder; ``[]`` where it declares no pack, or where it
    is left out (with one warning where it declares the group)."""
    texts: dict[str, str] = {}
    try:
        for file_name, mark in (("entry_points.txt", _MARK), ("METADATA", b""), ("PKG-INFO", b"")):
            try:
                text = read(os.path.join(metadata, file_name), mark)
            except Unreadable as problem:
                declares = problem.declares or not mark  # its METADATA is read once the group was seen
                raise Unreadable(f"its {file_name} {problem.why}", declares) from None
            if text is None and mark:
                return []  # most distributions declare no entry point at all, or none of this group
            if text is not None:
                texts[file_name] = text
                if not mark:
                    break  # METADATA, else PKG-INFO, as importlib.metadata reads them
    except Unreadable as problem:
        if problem.declares:
            _left_out_distribution(metadata, problem.why)
        return []
    headers = texts.get("METADATA", texts.get("PKG-INFO", ""))
    try:
        return _records(_read_distribution(texts), _identity(headers, os.path.basename(metadata)))
    except Exception as exc:  # importlib.metadata refuses a line it cannot parse
        _left_out_distribution(metadata, f"its entry points cannot be read ({exc!r})")
        return []


def _read_distribution(texts: dict[str, str]) -> Any:
    """An ``importlib.metadata.Distribution`` of the files already read (its documented way to be
    given files from elsewhere: ``read_text``), which parses them as it parses any distribution's."""
    distribution = _read_class()()
    distribution.texts = texts
    return distribution


@functools.cache
def _read_class() -> type:
    import importlib.metadata

    class Read(importlib.metadata.Distribution):
        texts: dict[str, str]

        def read_text(self, filename: str) -> str | None:
            return self.texts.get(filename)

        def locate_file(self, path: Any) -> Any:
            raise FileNotFoundError(path)  # a record needs no file of the distribution

    return Read


def _in_archive(archive: str, seen: set[str]) -> list[Listing]:
    """The records of the distributions in a zip archive on ``sys.path``."""
    import importlib.metadata

    out = []
    try:
        for distribution in importlib.metadata.distributions(path=[archive]):
            key = normalized(distribution.metadata["Name"] or "")
            if key and key not in seen:
                seen.add(key)
                out += _records(distribution, (distribution.metadata["Name"], distribution.version))
    except Exception as exc:  # a broken archive: never the user's import
        _left_out_distribution(archive, f"its distributions cannot be read ({exc!r})")
    return out


def _records(distribution: Any, identity: tuple[str, str]) -> list[Listing]:
    """The records of one distribution's entry points (``identity``: its name and version): each of
    :data:`GROUP`, with its target modules (:data:`TARGETS`: ``<patch>.<module>``) and its order
    (:data:`ORDER`: ``<patch>.place.<place>``, ``<patch>.after.<patch>``)."""
    listed: dict[str, dict[str, list[str]]] = {}
    patches = []
    for point in distribution.entry_points:  # one pass: select() would walk them once per group
        if point.group == GROUP:
            patches.append(point)
        elif point.group == TARGETS:
            listed.setdefault(point.name.partition(".")[0], {}).setdefault("modules", []).append(point.value.strip())
        elif point.group == ORDER:
            patch, _, rest = point.name.partition(".")
            field, _, value = rest.partition(".")
            listed.setdefault(patch, {}).setdefault(field, []).append(value)
    provider, version = identity
    out = []
    for point in patches:
        module, _, attribute = point.value.partition(":")
        record = listed.get(point.name, {})
        out.append(
            Listing(
                point.name,
                module.strip(),
                tuple(record.get("modules", ())),
                attribute=attribute.strip(),
                provider=provider,
                version=version,
                place=(record.get("place") or [""])[-1],
                after=tuple(record.get("after", ())),
            )
        )
    return out


def read(path: str, mark: bytes = b"") -> str | None:
    """The text of the metadata file ``path``, ``None`` where there is none, or where ``mark`` is
    given and not in it; raises :class:`Unreadable` (why, and whether ``mark`` was seen) where it
    is no regular file, over :data:`LIMIT` bytes or not UTF-8. Opened without blocking: a FIFO is
    told apart before anything is read from it."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # not there (or a folder, where the system refuses to open one)
        if os.path.isdir(path):
            raise Unreadable("is a folder, not a file", declares=False) from None
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # what it declares is never seen
            raise Unreadable("is not a regular file (a folder, a FIFO or a device)", declares=False)
        data = os.read(descriptor, LIMIT + 1)
        while len(data) <= LIMIT:  # os.read may return less than asked
            more = os.read(descriptor, LIMIT + 1 - len(data))
            if not more:
                break
            data += more
    finally:
        os.close(descriptor)
    seen = mark in data  # b"" is in any data
    if len(data) > LIMIT:
        raise Unreadable(f"is over {LIMIT >> 20} MiB", seen)
    if not seen:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(f"is not UTF-8 (byte {exc.start})") from None


def normalized(name: str) -> str:
    """A distribution's name as ``importlib.metadata`` compares them: lower case, runs of ``-``, ``_``
    and ``.`` as one ``-``."""
    return "-".join(filter(None, name.lower().replace("_", "-").replace(".", "-").split("-")))


def _identity(headers: str, folder_name: str) -> tuple[str, str]:
    """``Name`` and ``Version`` from the headers of a distribution's ``METADATA`` (its folder's name
    where they are missing): two fields, where ``importlib.metadata`` would import ``email`` to read
    them."""
    name, version = _named_in(folder_name)
    fields = {"name": name, "version": version or "?"}
    for line in headers.splitlines():
        if not line.strip():  # the end of the headers
            break
        key, _, value = line.partition(":")
        if key.lower() in fields:
            fields[key.lower()] = value.strip()
    return fields["name"], fields["version"]


def _named_in(folder_name: str) -> tuple[str, str]:
    """The name and version in a metadata folder's name: ``my_pack-1.0.dist-info``, ``my_pack.egg-info``."""
    name, _, version = folder_name.rpartition(".")[0].partition("-")
    return name, version.partition("-")[0]


# -- handing them to the registry ------------------------------------------------------------------


_said: list[str] | None = None  # while load() runs: its registry's record of what was left out


def load(registry: Registry, paths: Iterable[str] | None = None) -> None:
    """Register with ``registry`` the record of each installed pack's patch, in the one order decided
    over all of them (``shim.order.settle``), none of their modules imported (the registry imports
    one when it needs it: ``shim.catalogue.Listing.load``). A record refused here (a name it cannot
    have, no target modules listed, an ``after=`` cycle or one against its place) is left out with
    one ``ShimWarning``; with ``SHIM_STRICT=1`` it raises :class:`shim.PatchError`; with
    ``SHIM_DISABLE=all`` neither. Each is kept in ``registry.left_out``, as it was said."""
    global _said
    _said = registry.left_out
    try:
        _load(registry, paths)
    finally:
        _said = None


def _load(registry: Registry, paths: Iterable[str] | None) -> None:
    records = found(paths)
    if not records:  # the usual case: nothing else is imported
        return
    claimed: dict[str, Listing] = {}
    taken = registry.names
    left_out = set()
    for record in records:
        problem = _claim(record, taken, claimed)
        if problem is not None:
            _left_out(record, problem)
            left_out.add(record.name)
        else:
            claimed[record.name] = record
    places = {name: registry.declared(name).place for name in taken}
    settled = order.settle(list(claimed.values()), places, drop_missing=True)
    for name, refusal in settled.refused.items():
        _left_out(claimed[name], f"its place in the order cannot hold: {_misplaced(refusal)}")
    refused = left_out | set(settled.refused)
    for record in settled.ordered:
        record.note = "; ".join(_dropped(name, name in refused) for name in settled.dropped.get(record.name, ()))
        registry.register(record, ordered=True)


def _dropped(name: str, refused: bool) -> str:
    """An ``after`` naming a patch that is not there, whose constraint is dropped: said in the status."""
    gone = "was refused" if refused else "is not installed"
    return f"declared after {name!r}, which {gone}: that constraint is dropped"


def _misplaced(refusal: order.Refusal) -> str:
    """What ``refusal`` means for a pack: why it is left out, and the fix."""
    if refusal.cause == order.CYCLE:
        return f"its after= declarations form a cycle: {' -> '.join(refusal.cycle)}"
    return (
        f"its place ({order.shown(refusal.place)}) and its after= {refusal.named!r} ({order.shown(refusal.named_place)}, "
        "which sits outside it) contradict each other: drop one of the two declarations"
    )


def _claim(record: Listing, taken: Iterable[str], claimed: dict[str, Listing]) -> str | None:
    """Why ``record`` may not join, or ``None``: decided before any module is imported."""
    if not settings.PATCH_NAME.match(record.name):
        return f"{record.name!r} is not a patch name (kebab-case, e.g. 'my-team-fix'): rename the entry point"
    if not record.module or not record.attribute or "[" in record.attribute:
        return f"its value {record.entry_point.partition(' = ')[2]!r} is not 'module:attribute': point it at the module's Patch"
    if not record.modules:
        return f"its record lists no target modules ({TARGETS}): {PACK_REWRITE}"
    if record.place not in order.PLACES:
        return f"its record places it {record.place!r}, which is none of {', '.join(map(repr, order.PLACES))}: {PACK_REWRITE}"
    if record.name in taken:
        return (
            f"claims the name of the built-in patch {record.name!r}, which a pack never replaces: rename the "
            "entry point and its patch (or SHIM_DISABLE the built-in, if yours is meant to stand in for it)"
        )
    first = claimed.get(record.name)
    if first is not None:
        return (
            f"claims the name of {first.provider} {first.version}'s patch {record.name!r} ({first.entry_point}), "
            "which was found first on sys.path and is kept: rename one of them"
        )
    return None


def _left_out(record: Listing, problem: str) -> None:
    """Warn once that ``record`` is left out; under ``SHIM_STRICT`` raise instead."""
    _say(pack_message(record, problem))


def _left_out_distribution(folder: str, problem: str) -> None:
    """Warn once that the distribution of metadata ``folder`` is left out (under ``SHIM_STRICT``: raise)."""
    _say(
        f"patch pack {settings.shown(os.path.basename(folder), 80)}: {problem}; its patches are left out, "
        "the rest of the shim works"
    )


def _say(message: str) -> None:
    """One ``ShimWarning``; under ``SHIM_STRICT`` a ``PatchError`` instead; nothing where
    ``SHIM_DISABLE=all`` switches the shim off. Kept for the registry being loaded, either way."""
    if _said is not None and message not in _said:
        _said.append(message)
    if not settings.all_disabled():
        settings.strict_or_warn(message)
