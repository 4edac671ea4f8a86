"""Patch packs: patches that other distributions declare in the entry-point group ``hf_train_shim.patches``.

A pack declares each patch as an entry point whose name is the patch's name and whose value points at
its :class:`shim.Patch`, and lists the modules each patch targets in a second group, which
``python -m shim pack-index`` writes from the patches themselves::

    [project.entry-points."hf_train_shim.patches"]
    my-fix = "my_pack.fixes:PATCH"

    [project.entry-points."hf_train_shim.targets"]
    "my-fix.transformers.trainer_utils" = "transformers.trainer_utils"

Laziness, as for the built-ins: ``import shim`` reads the pack's metadata and imports nothing of it.
A patch's module is imported when one of its target modules is (or when a status asks for its
summary and gate, as it does a built-in's); a patch switched off (``SHIM_DISABLE=all`` or by name)
never has its module imported. A pack without the second group says nothing of its targets: its
module is imported when the shim activates (``import shim``), unless the patch is switched off, and
its status says so.

Discovery reads each distribution's ``entry_points.txt`` itself, the file
``importlib.metadata.entry_points()`` reads: importing ``importlib.metadata`` and letting it parse
every distribution's metadata would cost every ``import shim`` 16-34 ms, pack or not, where this
costs a directory listing per ``sys.path`` entry and one small read per distribution
(docs/performance.md, "Patch packs at import"). What it keeps identical to ``importlib.metadata``:

- the folders: every ``*.dist-info`` and ``*.egg-info`` folder directly in each ``sys.path`` entry
  (``""`` is the current directory), in ``sys.path`` order;
- shadowing: a distribution found twice counts where it is found first on ``sys.path``;
- name normalisation: names are compared lower case with runs of ``-``, ``_`` and ``.`` as one;
- the file: ``entry_points.txt``, an INI file, ``name = value`` lines under ``[group]`` headers,
  ``#`` and ``;`` comments.

Where it differs, on purpose: zip archives on ``sys.path`` are not searched; only the two groups'
sections are parsed; a file is read only if it is a regular file of at most :data:`LIMIT` bytes,
as UTF-8. A distribution whose ``entry_points.txt``, ``METADATA`` or ``PKG-INFO`` breaks one of those
rules (bytes that are not UTF-8, a huge file, a FIFO or a folder where a file should be) is left
out, with one ``ShimWarning`` where it declares the group and silence where it does not (a huge
``entry_points.txt`` is searched for the group in its first :data:`LIMIT` bytes only; a file that
is not a regular one is never opened for reading, so nothing hangs).

Fail-safe: an entry point whose module cannot be imported (it raises anything, ``SystemExit``
included; ``KeyboardInterrupt`` passes through), whose value is no ``shim.Patch`` (or names another
patch), whose targets are not the ones its metadata lists, or whose name is a built-in's or an
earlier pack's is left out with one ``ShimWarning`` naming the distribution and the entry point;
everything else keeps working. With ``SHIM_STRICT=1`` it raises :class:`shim.PatchError` instead.
A built-in is never replaced by a pack.
"""

from __future__ import annotations

import functools
import importlib
import os
import stat
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from . import importhooks, settings

if TYPE_CHECKING:
    from .patch import Patch
    from .registry import Registry  # packs.load registers into it; the registry never imports this

#: The entry-point group a pack declares its patches in.
GROUP = "hf_train_shim.patches"
#: The entry-point group a pack lists its patches' target modules in (``python -m shim pack-index``).
TARGETS = "hf_train_shim.targets"
#: The most bytes read of one metadata file; a larger one is not a pack's.
LIMIT = 1 << 20
_MARK = GROUP.encode()


class Unreadable(Exception):
    """A metadata file that breaks the rules of discovery (the module docstring): ``why``, in words,
    and whether it ``declares`` the group, as far as could be seen."""

    def __init__(self, why: str, declares: bool = True) -> None:
        super().__init__(why)
        self.why, self.declares = why, declares


class Found:
    """One entry point of :data:`GROUP`, as a distribution's ``entry_points.txt`` declares it, with
    the target modules its :data:`TARGETS` section lists (``None`` where it lists none)."""

    __slots__ = ("name", "value", "folder", "distribution", "version", "modules")

    def __init__(self, name: str, value: str, folder: str, identity: tuple[str, str], modules: tuple[str, ...] | None):
        self.name = name  # the patch's name
        self.value = value  # module:attribute
        self.folder = folder  # the distribution's .dist-info or .egg-info folder
        self.distribution, self.version = identity  # from its metadata
        self.modules = modules

    @property
    def module(self) -> str:
        """The module that declares the patch (its docstring is what ``explain`` prints)."""
        return self.value.partition(":")[0].strip()

    @property
    def attribute(self) -> str:
        """The Patch's name in :attr:`module`, a dotted path."""
        return self.value.partition(":")[2].strip()

    def __str__(self) -> str:
        return f"{self.name} = {self.value}"

    def __repr__(self) -> str:
        return f"<Found {self} of {self.distribution} {self.version}>"


class Pack:
    """A pack's patch as a registry knows it (``shim.patch.Declared``): its name and target modules
    from the pack's metadata, the rest from its :class:`Patch`, whose module :meth:`load` imports.
    ``place`` and ``after`` are its Patch's once loaded (the registry checks the order then), in
    between and none before; ``distribution`` and ``requires``, its gate, load it. ``foreign``: its module is another
    distribution's, which a status imports only where the patch is not switched off."""

    __slots__ = ("found", "patch", "problem", "_check")
    foreign = True

    def __init__(self, found: Found, check: Callable[[Patch], None]) -> None:
        self.found = found
        self.patch: Patch | None = None  # loaded
        self.problem = ""  # why it cannot be loaded, once tried
        self._check = check  # the registry's order check

    @property
    def name(self) -> str:
        return self.found.name

    @property
    def provider(self) -> str:  # PatchStatus.provider
        return self.found.distribution

    @property
    def version(self) -> str:
        return self.found.version

    @property
    def module(self) -> str:
        return self.found.module

    @property
    def entry_point(self) -> str:
        return str(self.found)

    @property
    def note(self) -> str:
        """What its status adds to the reason: where its module was imported without a target."""
        if self.found.modules is None and self.patch is not None:
            return f"the pack lists no target modules, so {self.module} was imported when the shim started"
        return ""

    @property
    def modules(self) -> tuple[str, ...]:
        """The target modules: as the pack lists them, else as its Patch declares them (``()`` before
        its module is imported)."""
        if self.found.modules is not None:
            return self.found.modules
        return self.patch.modules if self.patch is not None else ()

    @property
    def place(self) -> str:  # its order (shim.order)
        return self.patch.place if self.patch is not None else ""

    @property
    def after(self) -> tuple[str, ...]:
        return self.patch.after if self.patch is not None else ()

    @property
    def distribution(self) -> str:
        return self.load().distribution

    @property
    def requires(self) -> str:
        return self.load().requires

    def load(self) -> Patch:
        """The pack's Patch, its module imported the first time; a :class:`PackError` (after one
        ``ShimWarning``) where it cannot be had."""
        if self.patch is not None:
            return self.patch
        if not self.problem:
            patch, self.problem = _patch(self.found)
            if patch is not None:
                self.problem = _checked(patch, self.found, self._check)
            if patch is not None and not self.problem:
                self.patch = patch
                return patch
            _left_out(self.found, self.problem, strict=False)  # strict mode raises where the patch applies
        raise settings.PackError(_message(self.found, self.problem))

    def __repr__(self) -> str:
        return f"<Pack {self.name} from {self.provider} {self.version}>"


# -- finding them ----------------------------------------------------------------------------------


def found(paths: Iterable[str] | None = None) -> list[Found]:
    """Every entry point of :data:`GROUP` of the distributions in ``paths`` (default: ``sys.path``),
    in ``sys.path`` order and, within a folder, by name. A distribution that breaks the rules of
    discovery is left out (the module docstring)."""
    seen: set[str] = set()
    out: list[Found] = []
    for entry in sys.path if paths is None else paths:
        folder = entry or os.curdir
        try:
            names = sorted(os.listdir(folder))
        except OSError:  # not a directory (a zip archive) or not there
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


def _declared(metadata: str) -> list[Found]:
    """The entry points of :data:`GROUP` of one distribution's metadata folder; ``[]`` where it has
    none, or where it is left out (with one warning where it declares the group)."""
    try:
        text = read(os.path.join(metadata, "entry_points.txt"), _MARK)
    except Unreadable as problem:
        if problem.declares:
            _left_out_distribution(metadata, f"its entry_points.txt {problem.why}")
        return []
    if text is None:  # most distributions declare no entry point at all, or none of this group
        return []
    sections = _sections(text, (GROUP, TARGETS))
    if not sections[GROUP]:
        return []
    try:
        identity = _identity(metadata)
    except Unreadable as problem:
        _left_out_distribution(metadata, problem.why)
        return []
    modules: dict[str, list[str]] = {}
    for key, module in sections[TARGETS]:
        modules.setdefault(key.partition(".")[0], []).append(module)
    return [
        Found(name, value, metadata, identity, tuple(modules[name]) if name in modules else None)
        for name, value in sections[GROUP]
    ]


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


def _sections(text: str, groups: tuple[str, ...]) -> dict[str, list[tuple[str, str]]]:
    """The ``(name, value)`` pairs of ``groups`` in the text of an ``entry_points.txt``; the lines of
    any other section are not looked at beyond their first character."""
    out: dict[str, list[tuple[str, str]]] = {group: [] for group in groups}
    into: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            into = out.get(line[1:-1].strip()) if line.endswith("]") else None
        elif into is not None and line and not line.startswith(("#", ";")):
            name, _, value = line.partition("=")
            into.append((name.strip(), value.strip()))
    return out


def normalized(name: str) -> str:
    """A distribution's name as ``importlib.metadata`` compares them: lower case, runs of ``-``, ``_``
    and ``.`` as one ``-``."""
    return "-".join(filter(None, name.lower().replace("_", "-").replace(".", "-").split("-")))


def _named_in(folder_name: str) -> tuple[str, str]:
    """The name and version in a metadata folder's name: ``my_pack-1.0.dist-info``, ``my_pack.egg-info``."""
    name, _, version = folder_name.rpartition(".")[0].partition("-")
    return name, version.partition("-")[0]


def _identity(folder: str) -> tuple[str, str]:
    """``Name`` and ``Version`` of a distribution's metadata (its folder's name where they are
    missing); raises :class:`Unreadable` where the file breaks the rules of discovery."""
    name, version = _named_in(os.path.basename(folder))
    fields = {"name": name, "version": version or "?"}
    for file_name in ("METADATA", "PKG-INFO"):
        try:
            text = read(os.path.join(folder, file_name))
        except Unreadable as problem:
            raise Unreadable(f"its {file_name} {problem.why}") from None
        if text is None:
            continue
        for line in text.splitlines():
            if not line.strip():  # the end of the headers
                break
            key, _, value = line.partition(":")
            if key.lower() in fields:
                fields[key.lower()] = value.strip()
        break
    return fields["name"], fields["version"]


# -- handing them to the registry ------------------------------------------------------------------


def load(registry: Registry, paths: Iterable[str] | None = None) -> None:
    """Register with ``registry`` the patch of each installed pack, in :func:`found`'s order, none of
    their modules imported (the registry imports one when it needs it: :class:`Pack`). An entry
    point whose name is taken (a built-in's, or an earlier pack's) or no patch name is left out
    with one ``ShimWarning``; with ``SHIM_STRICT=1`` it raises :class:`shim.PatchError`.

    A pack's module that is being imported right now (it was imported before the shim, and
    imported the shim at its top, as the pack's own tests do) holds no ``Patch`` yet: it joins
    once its import has finished (``importhooks.when_imported``: a watcher, or at the latest the
    next ``shim.status()``, ``activate()`` or ``enable()``)."""
    entries = found(paths)
    if not entries:  # the usual case: nothing else is imported
        return
    claimed: dict[str, Found] = {}
    taken = registry.names
    for entry in entries:
        problem = _claim(entry, taken, claimed)
        if problem is not None:
            _left_out(entry, problem)
            continue
        claimed[entry.name] = entry
        pack = Pack(entry, registry.check_order)
        module = sys.modules.get(entry.module)
        if module is not None and importhooks.executing(module):
            importhooks.when_imported(entry.module, functools.partial(_join_when_imported, pack, registry.register))
        else:
            registry.register(pack)


def _join_when_imported(pack: Pack, join: Callable[[Pack], object], module: object) -> None:
    join(pack)


def _claim(entry: Found, taken: Iterable[str], claimed: dict[str, Found]) -> str | None:
    """Why ``entry`` may not have its name, or ``None``: the name is decided before any module is imported."""
    if not settings.PATCH_NAME.match(entry.name):
        return f"{entry.name!r} is not a patch name (kebab-case, e.g. 'my-team-fix'): rename the entry point"
    if not entry.module or not entry.attribute or "[" in entry.attribute:
        return f"its value {entry.value!r} is not 'module:attribute': point it at the module's Patch"
    if entry.name in taken:
        return (
            f"claims the name of the built-in patch {entry.name!r}, which a pack never replaces: rename the "
            "entry point and its patch (or SHIM_DISABLE the built-in, if yours is meant to stand in for it)"
        )
    first = claimed.get(entry.name)
    if first is not None:
        return (
            f"claims the name of {first.distribution} {first.version}'s patch {entry.name!r} ({first}), which "
            f"was found first on sys.path and is kept: rename one of them"
        )
    return None


def _patch(entry: Found) -> tuple[Patch | None, str]:
    """The ``shim.Patch`` an entry point names, or ``None`` and why not."""
    from .patch import Patch  # only here, where a pack's patch is loaded: it imports ``packaging``

    try:  # the value's shape is _claim's
        value: object = importlib.import_module(entry.module)
        for part in entry.attribute.split("."):
            value = getattr(value, part)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a broken pack (an argparse at its top exits): never the user's import
        return None, f"cannot be imported ({exc!r}): fix the pack, or uninstall {entry.distribution}"
    if not isinstance(value, Patch):
        return None, f"is a {type(value).__name__}, not a shim.Patch: point the entry point at the pack's Patch"
    if value.name != entry.name:
        return None, f"names a patch called {value.name!r}: the entry point's name must be the patch's name"
    return value, ""


def _checked(patch: Patch, entry: Found, check: Callable[[Patch], None]) -> str:
    """Why a loaded ``patch`` cannot join (its listed targets are stale, its order cannot hold), or ``""``."""
    if entry.modules is not None and set(entry.modules) != set(patch.modules):
        return (
            f"its metadata lists the target modules {', '.join(entry.modules)}, its Patch targets "
            f"{', '.join(patch.modules)}: run python -m shim pack-index in the pack and reinstall it"
        )
    from .order import OrderError

    try:
        check(patch)
    except OrderError as exc:  # declared after a patch it cannot sit outside of (shim.order)
        return f"its place in the order cannot hold: {exc}"
    return ""


def _message(entry: Found, problem: str) -> str:
    return (
        f"patch pack {entry.distribution} {entry.version}, entry point {GROUP} '{entry}': {problem}; "
        "this patch is left out, the rest of the shim works"
    )


def _left_out(entry: Found, problem: str, strict: bool = True) -> None:
    """Warn once that ``entry`` is left out; under ``SHIM_STRICT`` raise instead, where ``strict``."""
    message = _message(entry, problem)
    if strict and settings.flag("SHIM_STRICT"):
        raise settings.PatchError(f"{message} (SHIM_STRICT=1)")
    settings.warn_once(message)


def _left_out_distribution(folder: str, problem: str) -> None:
    """Warn once that the distribution of metadata ``folder`` is left out (under ``SHIM_STRICT``: raise)."""
    message = (
        f"patch pack {settings.shown(os.path.basename(folder), 80)}: {problem}; its patches are left out, "
        "the rest of the shim works"
    )
    if settings.flag("SHIM_STRICT"):
        raise settings.PatchError(f"{message} (SHIM_STRICT=1)")
    settings.warn_once(message)
