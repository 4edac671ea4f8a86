"""Patch packs: patches that other distributions declare in the entry-point group ``hf_train_shim.patches``.

A pack declares each patch as an entry point whose name is the patch's name and whose value points at
its :class:`shim.Patch`::

    [project.entry-points."hf_train_shim.patches"]
    my-fix = my_pack.fixes:PATCH

Discovery reads the ``entry_points.txt`` of each distribution on ``sys.path`` itself, the file
``importlib.metadata.entry_points()`` reads too: importing ``importlib.metadata`` and letting it parse
every distribution's metadata would cost ``import shim`` about 48 ms CPU in any environment, pack
or not, where this costs 1.6 ms: a directory listing per ``sys.path`` entry and one ``open`` per
distribution (docs/performance.md, "Patch packs at import"). As ``importlib.metadata`` does, a distribution
found twice counts where it is found first on ``sys.path``; a zip archive on ``sys.path`` is not searched.

Laziness: a built-in patch's module waits for its first target, because the shim ships an index of
every built-in's target modules and gate. A pack has no such index (its target modules, its
distribution and its gate exist only in the ``Patch`` its module builds), so where a pack is installed
its module is imported when the shim activates (``import shim``), and ``packaging`` with it. Where none
is installed, nothing more is imported. A pack's module should therefore be light: the heavy libraries
in its wrappers and self-check, not at its top (``examples/patch-pack`` shows how).

Fail-safe: an entry point whose module cannot be imported, whose value is no ``shim.Patch`` (or
names another patch), or whose name is a built-in's or an earlier pack's is left out with one
``ShimWarning`` naming the distribution and the entry point; everything else keeps working. With
``SHIM_STRICT=1`` it raises :class:`shim.PatchError` instead. A built-in is never replaced by a pack.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from . import importhooks, settings
from .order import OrderError

if TYPE_CHECKING:
    from .patch import Patch

#: The entry-point group a pack declares its patches in.
GROUP = "hf_train_shim.patches"


class Found:
    """One entry point of :data:`GROUP`, as a distribution's ``entry_points.txt`` declares it."""

    __slots__ = ("name", "value", "folder", "_identity")

    def __init__(self, name: str, value: str, folder: str) -> None:
        self.name = name  # the patch's name
        self.value = value  # module:attribute
        self.folder = folder  # the distribution's .dist-info or .egg-info folder
        self._identity: tuple[str, str] | None = None

    @property
    def distribution(self) -> str:
        return self.identity[0]

    @property
    def version(self) -> str:
        return self.identity[1]

    @property
    def identity(self) -> tuple[str, str]:
        """The distribution's name and version, from its metadata (read only for a pack)."""
        if self._identity is None:
            self._identity = _identity(self.folder)
        return self._identity

    @property
    def module(self) -> str:
        """The module that declares the patch (its docstring is what ``explain`` prints)."""
        return self.value.partition(":")[0].strip()

    def __str__(self) -> str:
        return f"{self.name} = {self.value}"

    def __repr__(self) -> str:
        return f"<Found {self} of {self.distribution} {self.version}>"


class Pack:
    """A pack's patch, loaded: what a registry needs of it (``shim.patch.Declared``), and where it is from."""

    __slots__ = (
        "name", "distribution", "requires", "after", "place", "patch", "provider", "version", "entry_point", "module",
    )  # fmt: skip

    def __init__(self, patch: Patch, found: Found) -> None:
        self.name, self.distribution, self.requires = patch.name, patch.distribution, patch.requires  # its gate
        self.after, self.place = patch.after, patch.place  # its order (shim.order)
        self.patch = patch
        self.provider = found.distribution  # PatchStatus.provider
        self.version = found.version
        self.entry_point = str(found)
        self.module = found.module

    @property
    def modules(self) -> tuple[str, ...]:
        return self.patch.modules

    def load(self) -> Patch:
        return self.patch

    def __repr__(self) -> str:
        return f"<Pack {self.name} from {self.provider} {self.version}>"


def found(paths: Iterable[str] | None = None) -> list[Found]:
    """Every entry point of :data:`GROUP` of the distributions in ``paths`` (default: ``sys.path``),
    in ``sys.path`` order and, within a folder, by name."""
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
            key = settings.canonical(_named_in(name)[0].replace(".", "-"))
            if key in seen:  # shadowed by the same distribution earlier on sys.path, as importlib.metadata says
                continue
            seen.add(key)
            metadata = os.path.join(folder, name)
            try:
                with open(os.path.join(metadata, "entry_points.txt"), encoding="utf-8") as file:
                    text = file.read()
            except OSError:  # most distributions declare no entry point at all
                continue
            if GROUP in text:
                out += _entries(text, metadata)
    return out


def _entries(text: str, folder: str) -> list[Found]:
    """The entry points of :data:`GROUP` in the text of an ``entry_points.txt`` (an INI file)."""
    out, section = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
        elif section == GROUP:
            name, _, value = line.partition("=")
            out.append(Found(name.strip(), value.strip(), folder))
    return out


def _named_in(folder_name: str) -> tuple[str, str]:
    """The name and version in a metadata folder's name: ``my_pack-1.0.dist-info``, ``my_pack.egg-info``."""
    name, _, version = folder_name.rpartition(".")[0].partition("-")
    return name, version.partition("-")[0]


def _identity(folder: str) -> tuple[str, str]:
    """``Name`` and ``Version`` of a distribution's metadata (its folder's name where they are missing)."""
    name, version = _named_in(os.path.basename(folder))
    fields = {"name": name, "version": version or "?"}
    for file_name in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(folder, file_name), encoding="utf-8") as file:
                for line in file:
                    if not line.strip():  # the end of the headers
                        break
                    key, _, value = line.partition(":")
                    if key.lower() in fields:
                        fields[key.lower()] = value.strip()
        except OSError:
            continue
        break
    return fields["name"], fields["version"]


def load(builtin: Sequence[str], join: Callable[[Pack], object], paths: Iterable[str] | None = None) -> None:
    """Hand ``join`` (the registry's ``register``) the patch of each installed pack, its module
    imported, in :func:`found`'s order. An entry point that cannot be loaded, or whose name is taken
    (``builtin``: the built-in patches' names; or an earlier pack's), is left out with one
    ``ShimWarning``; with ``SHIM_STRICT=1`` it raises :class:`shim.PatchError`.

    A pack's module that is itself being imported (it was imported before the shim, and imported the
    shim at its top, as the pack's own tests do) holds no ``Patch`` yet: it joins once its import has
    finished (``importhooks.when_imported``: a watcher, or at the latest the next ``shim.status()``,
    ``activate()`` or ``enable()``)."""
    entries = found(paths)
    if not entries:  # the usual case: nothing else is imported
        return
    claimed: dict[str, Found] = {}
    for entry in entries:
        problem = _claim(entry, builtin, claimed)
        if problem is not None:
            _left_out(entry, problem)
            continue
        claimed[entry.name] = entry
        module = sys.modules.get(entry.module)
        if module is not None and importhooks.executing(module):
            importhooks.when_imported(entry.module, functools.partial(_join_when_imported, entry, join))
        else:
            _join(entry, join)


def _join_when_imported(entry: Found, join: Callable[[Pack], object], module: object) -> None:
    _join(entry, join)


def _join(entry: Found, join: Callable[[Pack], object]) -> None:
    patch, problem = _patch(entry)
    if patch is None:
        _left_out(entry, problem)
        return
    try:
        join(Pack(patch, entry))
    except OrderError as exc:  # declared after a patch it cannot sit outside of (shim.order)
        _left_out(entry, f"its place in the order cannot hold: {exc}")


def _claim(entry: Found, builtin: Sequence[str], claimed: dict[str, Found]) -> str | None:
    """Why ``entry`` may not have its name, or ``None``: the name is decided before any module is imported."""
    if not settings.PATCH_NAME.match(entry.name):
        return f"{entry.name!r} is not a patch name (kebab-case, e.g. 'my-team-fix'): rename the entry point"
    if entry.name in builtin:
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
    from .patch import Patch  # only here, where a pack is installed: it imports ``packaging``

    module_name, attribute = entry.module, entry.value.partition(":")[2].strip()
    if not module_name or not attribute or "[" in attribute:
        return None, f"its value {entry.value!r} is not 'module:attribute': point it at the module's Patch"
    try:
        value: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except Exception as exc:  # anything a broken pack raises: it must not break ``import shim``
        return None, f"cannot be imported ({exc!r}): fix the pack, or uninstall {entry.distribution}"
    if not isinstance(value, Patch):
        return None, f"is a {type(value).__name__}, not a shim.Patch: point the entry point at the pack's Patch"
    if value.name != entry.name:
        return None, f"names a patch called {value.name!r}: the entry point's name must be the patch's name"
    return value, ""


def _left_out(entry: Found, problem: str) -> None:
    message = (
        f"patch pack {entry.distribution} {entry.version}, entry point {GROUP} '{entry}': {problem}; "
        "this patch is left out, the rest of the shim works"
    )
    if settings.flag("SHIM_STRICT"):
        raise settings.PatchError(f"{message} (SHIM_STRICT=1)")
    settings.warn_once(message)
