"""Deciding whether a patch applies here: its version gate, each target's own requirement, and the
shape probes. Nothing here wraps anything or keeps state: the registry asks and acts on the answer.

One rule serves applying, reporting and logging alike, so ``python -m shim`` and the log show a
pending patch outside its gate as ``skipped`` for the same reason the import would skip it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NamedTuple

from . import versions
from .states import FAILED, PENDING, SKIPPED

if TYPE_CHECKING:
    from .patch import Declared, Patch, Target
    from .versions import GateDecision


class Gate(NamedTuple):
    decision: GateDecision
    skip: str | None  # why the patch must not apply here, or None
    reason: str  # what the status says when it applies


def gate(declared: Declared, forced: bool) -> Gate:
    """The patch's version gate. ``SHIM_FORCE`` lets a patch apply outside it, not where its
    distribution is missing or its version cannot be read."""
    decision = versions.decide(declared.distribution, versions.specifier_set(declared.requires))
    if decision.admitted:
        return Gate(decision, None, decision.reason)
    if forced and decision.gated_as is not None:
        return Gate(decision, None, f"{decision.reason}, applied anyway because of SHIM_FORCE")
    return Gate(decision, decision.reason, decision.reason)


def pending(declared: Declared, reason: str, forced: bool) -> tuple[str, str, str | None]:
    """How a patch still pending shows (state, reason, installed version), in ``shim.status()`` and
    in the log alike: outside its gate it is skipped, even where its target module does not exist
    in that release; its hooks stay, so ``SHIM_FORCE`` set later still applies it."""
    decision = gate(declared, forced)
    if decision.skip is not None:
        return SKIPPED, decision.skip, decision.decision.installed
    return PENDING, f"{reason}; {decision.decision.reason}", decision.decision.installed


class Resolved(NamedTuple):
    target: Target
    module: Any  # the imported module object
    original: object  # what the target path holds now (for an assign target: what the class holds, or wrapt.MISSING)


class Resolution(NamedTuple):
    targets: list[Resolved]  # to wrap
    notes: list[str]  # targets left alone, for the status reason
    problem: tuple[str, str] | None  # (SKIPPED or FAILED, why): the whole patch must not apply


def resolve(patch: Patch, module_names: list[str], decision: Gate) -> Resolution:
    """The targets of ``patch`` in the (imported) ``module_names`` that should be wrapped here."""
    from . import assignment, wrapping

    resolved, notes = [], []
    for target in patch.targets:
        if target.module not in module_names:
            continue
        requirement = target.requirement
        if requirement is not None and not versions.decide(requirement.name, requirement.specifier).admitted:
            notes.append(f"left alone: {target.path} (needs {target.requires})")
            continue
        module = sys.modules[target.module]
        owner: object
        try:
            if target.assign:  # the class must exist; the attribute need not
                owner, original = assignment.resolve_assigned(module, target.path)
            else:
                owner = original = wrapping.resolve(module, target.path)
        except wrapping.PathResolutionError:
            missing = f"target {target.spec} does not exist in {decision.decision.installed}"
            return Resolution([], notes, (SKIPPED, missing))
        problem = _probe(patch, target, owner, decision.decision.reason)
        if problem is not None:
            return Resolution([], notes, problem)
        resolved.append(Resolved(target, module, original))
    return Resolution(resolved, notes, None)


def _probe(patch: Patch, target: Target, original: object, gate_reason: str) -> tuple[str, str] | None:
    if target.probe is None:
        return None
    try:
        problem = target.probe(original)
    except Exception as exc:
        # Not proof that upstream changed: the probe itself could not run here.
        return (
            FAILED,
            f"the shape probe of {target.spec} raised {exc!r}, so the patch is not applied; that is a fault "
            f"of the probe, not a sign that upstream changed: please report it (shim.enable({patch.name!r}) "
            "tries again)",
        )
    return (SKIPPED, f"{problem} ({gate_reason})") if problem else None
