"""The declaration of one patch: what it fixes, where, for which versions.

A :class:`Patch` is plain data. The registry (``shim.registry``) decides when and whether to
apply it; nothing in this module touches the target libraries.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from .order import PLACES
from .settings import PATCH_NAME

#: A wrapt wrapper: ``wrapper(wrapped, instance, args, kwargs) -> result``.
Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
#: An assign target's wrapper: ``wrapper(instance, value) -> the value to store``.
Assigned = Callable[[Any, Any], Any]

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*$")
# A PEP 508 name and a specifier set; no extras, markers or URLs (a target gate has no use for them).
# Parsed here rather than with packaging.requirements, whose import (markers, tags, sysconfig) would
# cost ``import shim`` several milliseconds.
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*([^\[\];@]*)$")


class TargetRequirement:
    """A distribution name and the versions of it a target needs, e.g. ``trl>=0.26``."""

    __slots__ = ("name", "specifier")

    def __init__(self, text: str) -> None:
        match = _REQUIREMENT.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not a distribution name followed by a PEP 440 specifier")
        self.name = match.group(1)
        self.specifier = SpecifierSet(match.group(2))  # InvalidSpecifier is a ValueError

    def __str__(self) -> str:
        return f"{self.name}{self.specifier}"

    def __repr__(self) -> str:
        return f"<TargetRequirement({str(self)!r})>"


class _Spec:
    """A ``spec`` written ``"package.module:attribute.path"``, and its two halves."""

    spec: str

    @property
    def module(self) -> str:
        return self.spec.partition(":")[0]

    @property
    def path(self) -> str:
        return self.spec.partition(":")[2]


@dataclass(frozen=True)
class Target(_Spec):
    """One attribute to wrap, written ``"package.module:attribute.path"``.

    ``requires`` narrows where this target is needed, as a requirement such as
    ``"transformers>=5.23"`` or ``"trl>=0.26"``; outside it the target is left alone (that is not an
    error). ``probe(original)`` returns ``None`` when the object to wrap still has the shape the
    wrapper expects, or a short reason; a reason skips the whole patch.

    ``assign=True``: the target, ``"package.module:Class.attribute"``, is an attribute that
    instances of the class are assigned (it need not exist on the class). The wrapper is then
    ``wrapper(instance, value)``: it sees every value assigned to the attribute on an instance and
    returns the value to store; reads return what was stored, as without the shim. The probe is
    given the class.

    Several patches with a target on one attribute share one layer there, owned by the engine, which
    runs their wrappers in the catalogue's one order (``Patch.after``, ``Patch.place``).
    """

    spec: str
    wrapper: Wrapper | Assigned
    requires: str = ""
    probe: Callable[[object], str | None] | None = None
    assign: bool = False
    requirement: TargetRequirement | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if not _TARGET.match(self.spec):
            raise ValueError(f"target {self.spec!r} is not of the form 'package.module:attribute.path'")
        if not callable(self.wrapper):
            raise TypeError(f"target {self.spec!r}: the wrapper must be a callable (wrapped, instance, args, kwargs)")
        if self.probe is not None and not callable(self.probe):
            raise TypeError(f"target {self.spec!r}: the probe must be a callable (original) -> reason or None")
        if self.assign and "." not in self.path:
            raise ValueError(f"target {self.spec!r}: assign=True needs 'package.module:Class.attribute'")
        if self.requires:
            try:
                object.__setattr__(self, "requirement", TargetRequirement(self.requires))
            except ValueError as exc:
                raise ValueError(
                    f"target {self.spec!r}: {self.requires!r} is not a requirement like 'trl>=0.26'"
                ) from exc


@dataclass(frozen=True)
class SameFix(_Spec):
    """Another patcher known to fix the same bug its own way, told by the mark it leaves.

    ``spec`` (``"package.module:Class.attribute"``) is where it puts its code; it is named once
    ``Class`` has a true attribute ``mark`` and ``spec`` holds code that is not upstream's.
    ``covers`` says for what its fix holds (the shim's may cover more). Looked at wherever the shim
    looks for other patchers (``shim.others``: when a status, doctor or the exit report asks), never
    imported: a module nobody imported has nobody's fix in it.
    """

    spec: str
    mark: str
    covers: str

    def __post_init__(self) -> None:
        if not _TARGET.match(self.spec) or "." not in self.path:
            raise ValueError(f"same fix {self.spec!r} is not of the form 'package.module:Class.attribute'")


@dataclass(frozen=True)
class Patch:
    """A fix for one upstream bug.

    ``distribution`` and ``requires`` are the patch's version gate. Targets are applied module by
    module, each right after its module is imported; if one fails, those already applied are
    removed again. ``self_check`` is used by ``python -m shim doctor``: it builds a tiny case in code and returns
    ``True`` when the bug shows. ``consumers`` are ``fnmatch`` patterns of module names whose
    module-level references to a target are rebound to the wrapper while the patch is applied
    (for modules that did ``from target import name`` before the shim could wrap it).
    ``after`` and ``place`` put the patch's parts in the one order of the catalogue (``shim.order``):
    on a target several patches wrap, the engine's one layer runs the outermost part first and the
    innermost last, next to upstream. ``after`` names the patches whose parts this one's sit outside
    of; ``place`` is ``"innermost"`` or ``"outermost"`` for a part that must sit there whoever else
    is on the target (``""``: in between), without naming them.
    ``same_fix`` lists other patchers known to fix the same bug (:class:`SameFix`): status names
    them where they are on. ``upstream_fix()`` looks for upstream's own fix in the installed code
    and returns what shows it is there, or ``None``; it decides for a build between releases that
    the gate leaves out (``0.19.3+6a8f0e2`` is gated as 0.19.3, the first release with the fix, but a
    git build from before the fix merged lacks it): without the fix found the patch applies. It runs
    when a target module is imported and reads only what is imported.
    ``in_effect(model)`` says what the patch does on one model now, a short sentence each, ``[]``
    where it does nothing there: ``shim.in_effect(model)`` collects them (it must not change the model).
    """

    name: str
    summary: str
    distribution: str
    requires: str
    targets: tuple[Target, ...]
    references: tuple[str, ...] = ()
    self_check: Callable[[], bool] | None = None
    consumers: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    place: str = ""
    same_fix: tuple[SameFix, ...] = ()
    upstream_fix: Callable[[], str | None] | None = None
    in_effect: Callable[[Any], list[str]] | None = None
    specifier: SpecifierSet = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not PATCH_NAME.match(self.name):
            raise ValueError(f"patch name {self.name!r} must be kebab-case, e.g. 'load-keeps-requires-grad'")
        if not self.targets:
            raise ValueError(f"patch {self.name!r} has no targets")
        if isinstance(self.after, str) or not all(PATCH_NAME.match(name) for name in self.after):
            raise ValueError(f"patch {self.name!r}: after= must be a tuple of patch names, not {self.after!r}")
        if self.place not in PLACES:
            raise ValueError(f"patch {self.name!r}: place= must be one of {PLACES}, not {self.place!r}")
        if not all(isinstance(same, SameFix) for same in self.same_fix):
            raise TypeError(f"patch {self.name!r}: same_fix= must be a tuple of shim.SameFix")
        if self.in_effect is not None and not callable(self.in_effect):
            raise TypeError(f"patch {self.name!r}: in_effect= must be a callable (model) -> sentences")
        if self.upstream_fix is not None and not callable(self.upstream_fix):
            raise TypeError(f"patch {self.name!r}: upstream_fix= must be a callable () -> what shows the fix, or None")
        try:
            object.__setattr__(self, "specifier", SpecifierSet(self.requires))
        except InvalidSpecifier as exc:
            raise ValueError(f"patch {self.name!r}: {self.requires!r} is not a PEP 440 specifier") from exc

    @property
    def modules(self) -> tuple[str, ...]:
        """The target modules, in declaration order, without repeats."""
        return tuple(dict.fromkeys(target.module for target in self.targets))

    @property
    def requirement(self) -> str:
        return f"{self.distribution}{self.requires}"

    @property
    def distributions(self) -> tuple[str, ...]:
        """The distributions the patch is gated on: its gate's, then those its targets require."""
        required = (t.requirement.name for t in self.targets if t.requirement is not None)
        return tuple(dict.fromkeys([self.distribution, *required]))

    def load(self) -> Patch:
        """A patch is its own declaration (the catalogue's listings load theirs from a module)."""
        return self


class Declared(Protocol):
    """What a registry needs of a patch before applying it: a :class:`Patch`, a catalogue listing
    (``shim.catalogue.Listing``) or a patch pack's (``shim.packs.Pack``), which import the patch's
    module on :meth:`load`."""

    @property
    def name(self) -> str: ...

    @property
    def distribution(self) -> str: ...

    @property
    def requires(self) -> str: ...

    @property
    def place(self) -> str: ...

    @property
    def modules(self) -> tuple[str, ...]: ...

    def load(self) -> Patch: ...
