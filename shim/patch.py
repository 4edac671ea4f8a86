"""The declaration of one patch: what it fixes, where, for which versions.

A :class:`Patch` is plain data. The registry (``shim.registry``) decides when and whether to
apply it; nothing in this module touches the target libraries.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FunctionType, ModuleType
from typing import Any, NamedTuple

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from .order import PLACES
from .settings import PATCH_NAME

#: A wrapt wrapper: ``wrapper(wrapped, instance, args, kwargs) -> result``.
Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
#: An assign target's wrapper: ``wrapper(instance, value) -> the value to store``.
Assigned = Callable[[Any, Any], Any]
#: What an assign target is declared with: ``make(name, switch) -> Assigned``, called by the engine
#: when the patch's part joins the target's layer, with the patch's name and switch (``shim.switch_of``'s).
AssignPart = Callable[[str, Any], Assigned]
#: A target's shape check: ``check(original) -> None`` while the object to wrap has the shape the
#: wrapper expects, else a short reason (the patch is skipped with it).
ShapeCheck = Callable[[object], str | None]

_MODULE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
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


@dataclass(frozen=True, init=False)
class Target(_Spec):
    """One attribute to wrap, written ``"package.module:attribute.path"``.

    ``requires`` narrows where this target is needed, as a requirement such as
    ``"transformers>=5.23"`` or ``"trl>=0.26"``; outside it the target is left alone (that is not an
    error). ``check(original)``, the target's shape check, returns ``None`` when the object to wrap
    still has the shape the wrapper expects, or a short reason; a reason skips the whole patch.
    ``probe=`` is the shape check's old name, still taken (the bug probe is ``Patch.bug_probe``).

    ``assign=True``: the target, ``"package.module:Class.attribute"``, is an attribute that
    instances of the class are assigned (it need not exist on the class). The target is then
    declared with ``make(name, switch)``, which the engine calls as the patch's part joins the
    target's layer (with the patch's name and switch: what it stores may act later, while that
    switch is on) and which returns the wrapper ``wrapper(instance, value)``: it sees every value
    assigned to the attribute on an instance and returns the value to store; reads return what was
    stored, as without the shim. The shape check is given the class.

    Several patches with a target on one attribute share one layer there, owned by the engine, which
    runs their wrappers in the catalogue's one order (``Patch.after``, ``Patch.place``).
    """

    spec: str
    wrapper: Wrapper | AssignPart
    requires: str = ""
    check: ShapeCheck | None = None
    assign: bool = False
    requirement: TargetRequirement | None = field(init=False, default=None, repr=False, compare=False)

    def __init__(
        self,
        spec: str,
        wrapper: Wrapper | AssignPart,
        requires: str = "",
        check: ShapeCheck | None = None,
        assign: bool = False,
        *,
        probe: ShapeCheck | None = None,
    ) -> None:
        if probe is not None and check is not None:
            raise TypeError(f"target {spec!r}: give its shape check as check= (probe= is its old name), not both")
        values = (spec, wrapper, requires, check if check is not None else probe, assign, None)
        for name, value in zip(("spec", "wrapper", "requires", "check", "assign", "requirement"), values):
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        if not _TARGET.match(self.spec):
            raise ValueError(f"target {self.spec!r} is not of the form 'package.module:attribute.path'")
        if not callable(self.wrapper):
            shape = "make(name, switch)" if self.assign else "(wrapped, instance, args, kwargs)"
            raise TypeError(f"target {self.spec!r}: the wrapper must be a callable {shape}")
        if self.check is not None and not callable(self.check):
            raise TypeError(f"target {self.spec!r}: the shape check must be a callable (original) -> reason or None")
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


class Evidence(NamedTuple):
    """A bug probe's answer: whether the installed code has the bug (``present``), and what shows it,
    either way, in a short sentence ("set_param_for_module made a frozen 1-element parameter
    trainable", "enable_input_require_grads removes its old hooks")."""

    present: bool
    detail: str


@dataclass(frozen=True)
class BugProbe:
    """The question "does the installed code have this bug?", asked of the code itself.

    ``ask()`` builds a tiny case in code and returns :class:`Evidence`. It is the one check of a
    patch's bug: ``python -m shim doctor`` asks it with the patch off and on, and where the release
    cannot vouch for the code (a build between releases, one newer than the shim was measured on,
    ``SHIM_PROBE=always``: ``shim.probing``) the engine asks it, with the patch's own parts off,
    before the patch is applied: no bug, and the patch steps aside.

    ``library``: the distribution whose targets the answer decides (a patch with targets in trl and
    in transformers has one probe for each, so that a fix in one library does not silence the patch
    in the other); ``""``, every target of the patch. ``needs``: modules the probe uses, which must
    have finished importing before it runs (it imports nothing itself). Those of the
    ``shim.selfcheck.bare`` builders it calls are added here, read from its code (:func:`needs_of`):
    only the modules it takes from ``sys.modules`` itself are declared.
    A probe must be cheap (a millisecond or two), leave no trace (no file, no hook, no module-level
    state, no once-only warning of upstream's used up) and import nothing: ``shim.probing`` keeps the
    random states, the grad mode and the default device for it.
    """

    ask: Callable[[], Evidence]
    library: str = ""
    needs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not callable(self.ask):
            raise TypeError("BugProbe: ask must be a callable () -> shim.Evidence")
        if isinstance(self.needs, str) or not all(_MODULE.match(name) for name in self.needs):
            raise ValueError(f"BugProbe: needs= must be a tuple of module names, not {self.needs!r}")
        object.__setattr__(self, "needs", tuple(dict.fromkeys([*self.needs, *needs_of(self.ask)])))


def needs_of(function: Callable[..., object]) -> tuple[str, ...]:
    """The modules that the builders ``function`` names take (a builder says so in its ``needs``, as
    ``shim.selfcheck.bare``'s do), read from the names its code uses: a global of its module, and a
    name that is an attribute of a module it names (``bare`` and ``model``: ``bare.model``). Its
    nested functions and classes, and the functions of its own module it names, are read too.
    Nothing is run; a name that only looks like a builder's (``trainer.model`` beside ``bare``)
    makes the probe wait for more, never for less."""
    scope = getattr(function, "__globals__", None)
    code = getattr(function, "__code__", None)
    if not isinstance(scope, dict) or not isinstance(code, CodeType):
        return ()
    found: dict[str, None] = {}
    todo, seen = [code], set()
    while todo:
        code = todo.pop(0)
        if code in seen:
            continue
        seen.add(code)
        todo += [const for const in code.co_consts if isinstance(const, CodeType)]
        for named in _named(scope, code.co_names):
            if isinstance(named, FunctionType) and named.__globals__ is scope:
                todo.append(named.__code__)  # a helper of the probe's module
            found.update(dict.fromkeys(_needs(named)))
    return tuple(found)


def _named(scope: dict[str, Any], names: tuple[str, ...]) -> list[object]:
    """What ``names`` are in the probe's module, and in the modules among those."""
    named = [scope[name] for name in names if name in scope]
    modules = [vars(found) for found in named if isinstance(found, ModuleType)]
    return named + [attributes[name] for attributes in modules for name in names if name in attributes]


def _needs(builder: object) -> tuple[str, ...]:
    """The modules a builder function says it needs (its ``needs``), else none."""
    needs = vars(builder).get("needs", ()) if isinstance(builder, FunctionType) else ()
    return needs if isinstance(needs, tuple) and all(isinstance(name, str) for name in needs) else ()


@dataclass(frozen=True)
class Patch:
    """A fix for one upstream bug.

    ``distribution`` and ``requires`` are the patch's version gate. Targets are applied module by
    module, each right after its module is imported; if one fails, those already applied are
    removed again. ``bug_probe`` asks the installed code whether it has the bug: a :class:`BugProbe`,
    or a tuple of them, one per library its targets live in (a function alone, as packs written
    before may give, is read as ``BugProbe(function)``; :attr:`probes` holds them as a tuple):
    ``python -m shim doctor`` asks it with the patch off and on, and the engine asks it where the
    release cannot vouch for the code (``shim.probing``). ``consumers`` are ``fnmatch`` patterns of module names whose
    module-level references to a target are rebound to the wrapper while the patch is applied
    (for modules that did ``from target import name`` before the shim could wrap it).
    ``after`` and ``place`` put the patch's parts in the one order of the catalogue (``shim.order``):
    on a target several patches wrap, the engine's one layer runs the outermost part first and the
    innermost last, next to upstream. ``after`` names the patches whose parts this one's sit outside
    of; ``place`` is ``"innermost"`` or ``"outermost"`` for a part that must sit there whoever else
    is on the target (``""``: in between), without naming them.
    ``same_fix`` lists other patchers known to fix the same bug (:class:`SameFix`): status names
    them where they are on.
    ``in_effect(model)`` says what the patch does on one model now, a short sentence each, ``[]``
    where it does nothing there: ``shim.in_effect(model)`` collects them (it must not change the model).
    """

    name: str
    summary: str
    distribution: str
    requires: str
    targets: tuple[Target, ...]
    references: tuple[str, ...] = ()
    bug_probe: BugProbe | tuple[BugProbe, ...] | Callable[[], Evidence] | None = None
    consumers: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    place: str = ""
    same_fix: tuple[SameFix, ...] = ()
    in_effect: Callable[[Any], list[str]] | None = None
    specifier: SpecifierSet = field(init=False, repr=False, compare=False)
    probes: tuple[BugProbe, ...] = field(init=False, repr=False, compare=False)

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
        object.__setattr__(self, "probes", self._read_probes())
        self._check_probes()
        try:
            object.__setattr__(self, "specifier", SpecifierSet(self.requires))
        except InvalidSpecifier as exc:
            raise ValueError(f"patch {self.name!r}: {self.requires!r} is not a PEP 440 specifier") from exc

    def _check_probes(self) -> None:
        libraries = [probe.library for probe in self.probes]
        if len(set(libraries)) != len(libraries) or ("" in libraries and len(libraries) > 1):
            raise ValueError(f"patch {self.name!r}: one bug probe per library, or one for every target")
        unknown = [name for name in libraries if name and name not in self.libraries]
        if unknown:
            raise ValueError(
                f"patch {self.name!r}: a bug probe for {unknown[0]!r}, which none of its targets lives in "
                f"(its targets' libraries: {', '.join(self.libraries)})"
            )

    def _read_probes(self) -> tuple[BugProbe, ...]:
        """``bug_probe`` as a tuple of :class:`BugProbe` (``()``: none)."""
        found = self.bug_probe
        if found is None:
            return ()
        if isinstance(found, BugProbe):
            return (found,)
        if isinstance(found, tuple):
            if not all(isinstance(probe, BugProbe) for probe in found):
                raise TypeError(f"patch {self.name!r}: bug_probe= as a tuple holds shim.BugProbe only")
            return found
        if callable(found):  # a function alone, as packs written before BugProbe give it
            return (BugProbe(found),)
        raise TypeError(f"patch {self.name!r}: bug_probe= must be a shim.BugProbe or a callable () -> shim.Evidence")

    def probe_for(self, library: str) -> BugProbe | None:
        """The probe whose answer decides the targets in ``library``, if any."""
        return next((probe for probe in self.probes if probe.library in ("", library)), None)

    def library_of(self, target: Target) -> str:
        """The distribution a target lives in: the one of the patch's distributions its module's top
        package is named after (``trl.models.utils`` -> ``trl``), else the patch's own."""
        top = _normalized(target.module.partition(".")[0])
        return next((name for name in self.distributions if _normalized(name) == top), self.distribution)

    @property
    def libraries(self) -> tuple[str, ...]:
        """The distributions the targets live in, in the targets' order."""
        return tuple(dict.fromkeys(self.library_of(target) for target in self.targets))

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


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()
