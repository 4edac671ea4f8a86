"""Deciding whether a patch applies here: the installed versions, its version gate, the releases the
shim was measured on, each target's own requirement, and the targets' shape checks. Nothing here
wraps anything or keeps state: the entry asks and acts on the answer (with what the patch's bug
probes said, ``shim.probing``).

One rule serves applying, reporting and logging alike, so ``python -m shim`` and the log show a
pending patch outside its gate as ``skipped`` for the same reason the import would skip it.

Versions: rule for pre-release, development, post and local builds: a version is gated as its release
(``Version.base_version``). ``5.25.0.dev0``, ``5.25.0rc1`` and ``5.25.0+local`` are all gated as
``5.25.0``: a build of the next release already carries that release's code, and gates are written
against releases. The status shows both the installed and the gated version.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .ranges import version_range

if TYPE_CHECKING:
    from .catalogue import Listing
    from .layers import Resolved
    from .patch import Patch, Target


# -- installed versions and version gates ----------------------------------------------------------


def installed_version(distribution: str) -> str | None:
    """The version of ``distribution``: its imported module's ``__version__``, else its metadata.

    A distribution whose module cannot be found counts as not installed, metadata or not (a
    broken uninstall, or ``sys.modules[name] = None``, Python's way to make a module unimportable).
    """
    name = distribution.replace("-", "_")
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    if module is None:
        try:
            if importlib.util.find_spec(name) is None:
                return None
        except (ImportError, ValueError):
            return None
    return _metadata_version(distribution)


@functools.cache
def _metadata_version(distribution: str) -> str | None:
    """The version in ``distribution``'s metadata, read once per process (each read parses a file)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def specifier_set(text: str) -> SpecifierSet:
    """``text`` parsed as a PEP 440 specifier set, once per text."""
    return SpecifierSet(text)


class VersionCheck(NamedTuple):
    admitted: bool
    installed: str | None
    gated_as: str | None
    reason: str


def check_versions(distribution: str, specifier: SpecifierSet) -> VersionCheck:
    """Whether the installed ``distribution`` falls inside ``specifier`` (see the module docstring)."""
    installed = installed_version(distribution)
    if installed is None:
        return VersionCheck(False, None, None, f"{distribution} is not installed")
    try:
        gated_as = Version(installed).base_version
    except InvalidVersion:
        return VersionCheck(False, installed, None, f"{distribution} {installed} is not a PEP 440 version")
    shown = installed if gated_as == installed else f"{installed} (gated as {gated_as})"
    admitted = specifier.contains(gated_as, prereleases=True)
    verdict = "inside" if admitted else "outside"
    return VersionCheck(
        admitted, installed, gated_as, f"{distribution} {shown} is {verdict} {version_range(specifier)}"
    )


# -- the releases the shim was measured on ---------------------------------------------------------

#: Beside this module: the oldest and newest release of each patched distribution (and torch) that the
#: version matrix measured, written by ``scripts/matrix.py``. Read when a status or doctor asks, never
#: at ``import shim``.
MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured.json")


@functools.cache
def newest_measured() -> dict[str, str]:
    """``{distribution: the newest release measured}``; empty when the file is missing or unreadable
    (a copy of the shim without it says nothing, rather than something wrong)."""
    try:
        with open(MEASURED, encoding="utf-8") as file:
            newest = json.load(file)["newest"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(newest, dict):
        return {}
    return {str(name): str(release) for name, release in newest.items()}


def newer_than_measured(distribution: str) -> str | None:
    """A sentence when the installed ``distribution``, gated as its release (see the module
    docstring), is newer than the newest release the matrix measured it on; else ``None``."""
    newest = newest_measured().get(distribution)
    installed = installed_version(distribution)
    if newest is None or installed is None:
        return None
    try:
        if Version(Version(installed).base_version) <= Version(newest):
            return None
    except InvalidVersion:
        return None
    return f"{distribution} {installed} is newer than the newest release measured ({newest})"


# -- whether a patch applies -----------------------------------------------------------------------


class Gate(NamedTuple):
    versions: VersionCheck
    skip: str | None  # why the patch must not apply here, or None
    reason: str  # what the status says when it applies


def gate(declared: Patch | Listing, forced: bool) -> Gate:
    """The patch's version gate, from its Patch or its record (one that holds it: ``Entry.gated``).
    ``SHIM_FORCE`` lets a patch apply outside it, not where its distribution is missing or its
    version cannot be read."""
    versions = check_versions(declared.distribution or "", specifier_set(declared.requires or ""))
    if versions.admitted:
        return Gate(versions, None, versions.reason)
    if forced and versions.gated_as is not None:
        return Gate(versions, None, f"{versions.reason}, applied anyway because of SHIM_FORCE")
    return Gate(versions, versions.reason, versions.reason)


class Problem(NamedTuple):
    """Why the whole patch must not apply here."""

    why: str
    failed: bool = False  # the check itself could not run (a fault, not a finding): else it is skipped


class Resolution(NamedTuple):
    targets: list[Resolved]  # to wrap
    notes: list[str]  # targets left alone, for the status reason
    problem: Problem | None
    left_alone_in: frozenset[str] = frozenset()  # the libraries of ``left_alone`` where a target was left


def resolve_targets(patch: Patch, module_names: list[str], found: Gate, left_alone: Mapping[str, str]) -> Resolution:
    """The targets of ``patch`` in the (imported) ``module_names`` that should be wrapped here;
    ``left_alone``: libraries whose targets are left alone, where their own requirement admits the
    release, each with what the status says of it (the entry's: a bug probe found no bug there)."""
    from . import assigning, wrapping
    from .layers import Resolved

    resolved, notes, left_alone_in = [], [], set()
    for target in patch.targets:
        if target.module not in module_names:
            continue
        requirement = target.requirement
        if requirement is not None and not check_versions(requirement.name, requirement.specifier).admitted:
            notes.append(f"left alone: {target.path} (needs {target.requires})")
            continue
        library = patch.library_of(target)
        if library in left_alone:
            if left_alone[library] not in notes:
                notes.append(left_alone[library])
            left_alone_in.add(library)
            continue
        module = sys.modules[target.module]
        owner: object
        try:
            if target.assign:  # the class must exist; the attribute need not
                owner, original = assigning.resolve(module, target.path)
            else:
                owner = original = wrapping.object_at(module, target.path)
        except wrapping.PathResolutionError:
            missing = f"target {target.spec} does not exist in {found.versions.installed}"
            return Resolution([], notes, Problem(missing))
        problem = _check_shape(patch, target, owner, found.versions.reason)
        if problem is not None:
            return Resolution([], notes, problem)
        resolved.append(Resolved(target, module, original))
    return Resolution(resolved, notes, None, frozenset(left_alone_in))


def _check_shape(patch: Patch, target: Target, original: object, gate_reason: str) -> Problem | None:
    """What the target's shape check (``Target.check``) finds wrong with the object to wrap, if anything."""
    if target.check is None:
        return None
    try:
        problem = target.check(original)
    except Exception as exc:
        # Not proof that upstream changed: the check itself could not run here.
        return Problem(
            f"the shape check of {target.spec} raised {exc!r}, so the patch is not applied; that is a fault "
            f"of the check, not a sign that upstream changed: please report it (shim.enable({patch.name!r}) "
            "tries again)",
            failed=True,
        )
    return Problem(f"{problem} ({gate_reason})") if problem else None
