"""What each patch does in this environment, said before its targets are imported: the kinds the
summary line that opens ``python -m shim`` counts and the state a pending patch shows there (``will
apply``, ``will skip``); ``shim.tools.render`` writes them.

A pending patch is one whose target modules this process has not imported yet. The gates decide as
the import will: the status reason already holds the patch's own gate (``Entry.shown``);
what is left is each target's own requirement (``Target.requires``) and whether the library a target
lives in is installed, read from the installed metadata and ``importlib.util.find_spec`` of the
top-level package, which imports nothing. A target whose module is missing from an installed release
is still found out only at the import, as the engine finds it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..entry import APPLIED, DISABLED, FAILED, PENDING
from ..gating import check_versions, installed_version, specifier_set

if TYPE_CHECKING:
    from ..patch import Patch
    from ..registry import Registry
    from ..statuses import PatchStatus

#: What a patch does here, the kinds of the summary line.
APPLIES = "applies"
OUTSIDE = "outside its versions"
NOT_INSTALLED = "not installed"
OPTED_OUT = "opted out"
BROKEN = "failed"
FIXED_UPSTREAM = "fixed upstream"
SKIPPED = "skipped"

#: The state column of a pending patch: what its import will do.
WILL_APPLY = "will apply"
WILL_SKIP = "will skip"
WILL_PROBE = "will probe"  # its bug probe decides at the import (shim.probing)


@dataclass(frozen=True)
class Outlook:
    kind: str  # APPLIES, OUTSIDE, NOT_INSTALLED, OPTED_OUT, BROKEN or SKIPPED
    state: str  # the state column: the record's state, or WILL_APPLY / WILL_SKIP for a pending patch
    reason: str  # the reason below the row


def outlook(record: PatchStatus, registry: Registry) -> Outlook:
    """What patch ``record.name`` does here, and how its row says it."""
    state, reason = str(record.state), record.reason
    if record.state is DISABLED:
        return Outlook(OPTED_OUT, state, reason)
    if record.state is FAILED:
        return Outlook(BROKEN, state, reason)
    if record.state is APPLIED:
        return Outlook(APPLIES, state, reason)
    gated = registry.gated(record.name)  # a pack's gate is in its Patch, which the status imported
    distribution, requires = gated.distribution or "", gated.requires or ""
    if installed_version(distribution) is None:
        return Outlook(NOT_INSTALLED, state, reason)
    missed = _targets_missed(registry, record.name)
    if record.state is PENDING:
        if missed is None:
            asked = _probe_asked(registry, record.name)
            if asked:
                return Outlook(APPLIES, WILL_PROBE, f"{reason}; its bug probe decides at the import: {asked}")
            return Outlook(APPLIES, WILL_APPLY, reason)
        kind, why = missed
        return Outlook(kind, WILL_SKIP, f"no target of it is for the installed releases: {why}")
    if record.decided_by == "probe" and not any(answer["present"] for answer in record.probe or ()):
        return Outlook(FIXED_UPSTREAM, state, reason)  # skipped where its release would apply: no bug found
    # Skipped: outside its gate, no target for these releases, or a reason of the import (code changed).
    if not check_versions(distribution, specifier_set(requires)).admitted:
        return Outlook(OUTSIDE, state, reason)
    return Outlook(missed[0] if missed else SKIPPED, state, reason)


def _targets_missed(registry: Registry, name: str) -> tuple[str, str] | None:
    """``None`` when at least one target of the patch is for the installed releases (its own
    requirement admits them and its library is installed), else the kind and what each target needs."""
    try:
        patch: Patch = registry.patch(name)
    except Exception:  # a module that cannot be imported: the status reason says so
        return None
    needs, kinds = [], set()
    for target in patch.targets:
        top = target.module.partition(".")[0]
        if not _installed(top):
            needs.append(f"{target.spec} is in {top}, which is not installed")
            kinds.add(NOT_INSTALLED)
            continue
        requirement = target.requirement
        if requirement is None:
            return None
        check = check_versions(requirement.name, requirement.specifier)
        if check.admitted:
            return None
        needs.append(f"{target.spec}: {check.reason}")
        kinds.add(NOT_INSTALLED if check.installed is None else OUTSIDE)
    return (OUTSIDE if OUTSIDE in kinds else NOT_INSTALLED), "; ".join(needs)


def _probe_asked(registry: Registry, name: str) -> str:
    """Why the patch's bug probes will be asked at its targets' import (``shim.probing``), or ``""``."""
    from ..probing import why_asked
    from ..settings import probe_mode

    try:
        patch: Patch = registry.patch(name)
    except Exception:  # a module that cannot be imported: the status reason says so
        return ""
    mode = probe_mode()
    reasons = (why_asked(library, mode) for library in patch.libraries if patch.probe_for(library) is not None)
    return "; ".join(dict.fromkeys(reason for reason in reasons if reason))


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken one
        return False


def outlooks(records: Iterable[PatchStatus], registry: Registry) -> dict[str, Outlook]:
    return {record.name: outlook(record, registry) for record in records}
