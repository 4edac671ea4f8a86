"""Which version of a distribution is installed, and whether a version gate admits it.

Rule for pre-release, development, post and local builds: a version is gated as its release
(``Version.base_version``). ``5.25.0.dev0``, ``5.25.0rc1`` and ``5.25.0+local`` are all gated as
``5.25.0``: a build of the next release already carries that release's code, and gates are written
against releases. The status record shows both the installed and the gated version.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
from typing import NamedTuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


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


class GateDecision(NamedTuple):
    admitted: bool
    installed: str | None
    gated_as: str | None
    reason: str


def decide(distribution: str, specifier: SpecifierSet) -> GateDecision:
    """Whether the installed ``distribution`` falls inside ``specifier`` (see the module docstring)."""
    installed = installed_version(distribution)
    if installed is None:
        return GateDecision(False, None, None, f"{distribution} is not installed")
    try:
        gated_as = Version(installed).base_version
    except InvalidVersion:
        return GateDecision(False, installed, None, f"{distribution} {installed} is not a PEP 440 version")
    shown = installed if gated_as == installed else f"{installed} (gated as {gated_as})"
    admitted = specifier.contains(gated_as, prereleases=True)
    verdict = "inside" if admitted else "outside"
    return GateDecision(admitted, installed, gated_as, f"{distribution} {shown} is {verdict} {specifier}")
