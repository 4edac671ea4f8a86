"""``python -m shim doctor``: does each bug reproduce on the installed versions, and is it fixed?

Every patch's bug probe (``Patch.bug_probe``: a tiny case built in code, the same question the
engine asks where the release cannot vouch for the code) is asked twice: with the patch switched
off (does the bug show upstream?) and on (is it gone?).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import gating, probing
from ..catalogue import PROVIDER as BUILTIN
from ..entry import APPLIED, DISABLED, FAILED, SKIPPED
from ..registry import Registry
from .targets import import_quietly, import_targets

if TYPE_CHECKING:
    from ..patch import Patch
    from ..probing import Answer
    from ..statuses import PatchStatus

FIXED = "fixed"
NOT_FIXED = "NOT FIXED"
NOT_AFFECTED = "not affected"
NOT_REPRODUCED = "not reproduced"
OPTED_OUT = "opted out"
NO_CHECK = "no bug probe"
NOT_INSTALLED = "not installed"
FIXED_UPSTREAM = "fixed upstream"  # its probe found upstream's fix: the patch steps aside
ERROR = "check error"
CANNOT_CHECK = "cannot check here"  # for a reason outside the patch (torch cannot be imported)
BYPASSED = "bypassed by {}"  # another patcher replaced the shim's layer: the fix cannot run

#: Verdicts that make ``doctor`` exit non-zero.
FAILING = frozenset({NOT_FIXED, ERROR})
#: Verdicts whose reason doctor prints below its table (and every "bypassed by ...").
EXPLAINED = FAILING | {NOT_REPRODUCED, CANNOT_CHECK}


def explained(verdict: str) -> bool:
    return verdict in EXPLAINED or verdict.startswith(BYPASSED.format(""))


def below_table(finding: Finding) -> list[str]:
    """What doctor prints below its table for ``finding``: the reason of a verdict that needs one,
    then every other patcher on the patch's targets."""
    lines = [f"{finding.verdict}: {finding.detail}"] if explained(finding.verdict) else []
    return [f"{finding.name}: {line}" for line in lines + [f"other patcher: {text}" for text in finding.others]]


@dataclass(frozen=True)
class Finding:
    name: str
    installed: str
    state: str
    bug_upstream: str  # "yes" | "no" | "-"
    bug_with_shim: str
    verdict: str
    detail: str
    others: tuple[str, ...] = ()  # other patchers that run beside the fix, or fix the same bug (status' text)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def blocker() -> str | None:
    """Why no bug probe can run in this environment, or ``None``. Every built-in's probe builds a bare
    model, so torch must import: a CUDA-only wheel on a CPU machine or a broken install cannot, and
    that is no bug the shim failed to fix."""
    try:
        importlib.import_module("torch")
    except Exception as exc:  # ImportError, or OSError for a missing CUDA library
        return f"torch cannot be imported: {exc!r}"
    return None


def examine(registry: Registry, name: str, blocked: str | None = None) -> Finding:
    """One patch's finding; ``blocked``: why no bug probe can run here (:func:`blocker`)."""
    try:
        patch = registry.patch(name)
    except Exception as exc:  # a pack's module that cannot be imported: its status says why
        return _unanswered(_status(registry, name), ERROR, str(exc))
    status, installed = _with_targets(registry, patch, name)
    if not installed:
        return _unanswered(status, NOT_INSTALLED, status.reason)
    if not patch.probes:
        return _unanswered(status, NO_CHECK, status.reason)
    if blocked is not None:
        return _unanswered(status, CANNOT_CHECK, blocked)
    off, on = _asked(registry, patch, name, status.state)
    return _judged(status, off, on)


def _status(registry: Registry, name: str) -> PatchStatus:
    return next(status for status in registry.status() if status.name == name)


def _unanswered(status: PatchStatus, verdict: str, detail: str) -> Finding:
    """A finding that shows no bug probe's answer: ``-`` for the bug, upstream and with the shim."""
    return Finding(status.name, status.installed or "-", status.state, "-", "-", verdict, detail)


def _with_targets(registry: Registry, patch: Patch, name: str) -> tuple[PatchStatus, bool]:
    """The status of patch ``name`` once its target modules are imported (which lets it apply, or
    skip), and whether its distribution is installed (where a target module is missing)."""
    missing = import_targets(registry, [name])
    status = _status(registry, name)
    if not missing:
        return status, True
    if gating.installed_version(patch.distribution) is None:
        return status, False
    # The distribution is there but a target module is not (e.g. an older release): the
    # patch cannot apply, so the check below measures whether the bug is there without it.
    return replace(status, reason=f"{status.reason}; {'; '.join(missing)}"), True


def _asked(registry: Registry, patch: Patch, name: str, state: str) -> tuple[list[Answer], list[Answer]]:
    """The answers of the bug probes of ``patch`` with the patch switched off, and on (the same
    answers where it is not applied: off or on, it does not act)."""
    if state != APPLIED:
        answers = ask(patch)
        return answers, answers
    with registry.disabled(name):
        off = ask(patch)
    return off, ask(patch)


def _judged(status: PatchStatus, off: list[Answer], on: list[Answer]) -> Finding:
    """The finding from the bug probes' answers with the patch off and on."""
    failed = [answer for answer in off + on if answer.present is None]
    if failed:  # a broken probe is a finding, not a crash of the whole report
        return _unanswered(status, ERROR, "; ".join(answer.error for answer in failed))
    upstream = any(answer.present for answer in off)
    fixed = not any(answer.present for answer in on)
    bypassed = [other for other in status.others if other["relation"] == "bypassed"]
    others = tuple(other["text"] for other in status.others if other not in bypassed)
    if bypassed:  # checked as it runs here; the other patcher's code is what ran
        verdict, detail = _bypassed(bypassed, upstream), "; ".join(other["text"] for other in bypassed)
    else:
        verdict, detail = _verdict(status, upstream, fixed), status.reason
    bugs = _yes_no(upstream), _yes_no(not fixed)
    return Finding(status.name, status.installed or "-", status.state, *bugs, verdict, detail, others)


def _bypassed(bypassed: list[dict[str, Any]], upstream: bool) -> str:
    """The verdict where other patchers bypass the shim's layer: what ran was their code."""
    if upstream:
        return NOT_FIXED
    patchers = sorted({other["by"].partition(":")[0].partition(".")[0] for other in bypassed})
    return BYPASSED.format(", ".join(patchers))


def _verdict(status: PatchStatus, upstream: bool, fixed: bool) -> str:
    """The verdict from the patch's state and whether the bug shows upstream, and with the shim."""
    if status.state == APPLIED:
        return FIXED if upstream and fixed else NOT_FIXED if not fixed else NOT_REPRODUCED
    if status.state == DISABLED:
        return OPTED_OUT
    if status.state == SKIPPED and status.decided_by == "probe" and not upstream:
        return FIXED_UPSTREAM
    return NOT_FIXED if upstream else NOT_AFFECTED


def ask(patch: Patch) -> list[Answer]:
    """Every bug probe of ``patch`` whose library is installed, asked now, the modules it needs
    imported first (doctor imports; the engine waits for them)."""
    answers = []
    for probe in patch.probes:
        library = probe.library or patch.distribution
        if gating.installed_version(library) is None:
            continue
        for module in probe.needs:
            try:
                import_quietly(module)
            except Exception:  # a module this release lacks: the probe takes its other way, or says so
                pass
        answers.append(probing.ask(probe, library, "python -m shim doctor"))
    return answers


def each(registry: Registry, names: Sequence[str] = ()) -> Iterator[Finding]:
    """The finding of each patch of ``names`` (default: every patch of ``registry``), by name, each
    as soon as its check has run."""
    chosen = sorted(name for name in registry.names if not names or name in names)
    # Every built-in's bug probe builds a bare model, so torch must import for them; a patch pack's
    # check needs what its author says, and runs (a check that fails to import torch is its error).
    builtin = {name for name in chosen if _is_builtin(registry, name)}
    blocked = blocker() if builtin else None
    for name in chosen:
        yield examine(registry, name, blocked if name in builtin else None)


def run(registry: Registry, names: Sequence[str] = ()) -> list[Finding]:
    """The findings of ``names`` (default: every patch of ``registry``), by name."""
    return list(each(registry, names))


def _is_builtin(registry: Registry, name: str) -> bool:
    return registry.declared(name).provider == BUILTIN


#: The order doctor's total counts the verdicts in (a "bypassed by ..." comes last).
VERDICTS = (
    FIXED, NOT_FIXED, ERROR, NOT_REPRODUCED, FIXED_UPSTREAM, NOT_AFFECTED, OPTED_OUT, NOT_INSTALLED, NO_CHECK, CANNOT_CHECK,
)  # fmt: skip


def total(findings: Sequence[Finding]) -> str:
    """The line below doctor's table: how many patches it checked and how many got each verdict."""
    counts = Counter(finding.verdict for finding in findings)
    order = sorted(counts, key=lambda verdict: VERDICTS.index(verdict) if verdict in VERDICTS else len(VERDICTS))
    checked = f"{len(findings)} {'patch' if len(findings) == 1 else 'patches'} checked"
    return f"doctor: {checked}: " + ", ".join(f"{counts[verdict]} {verdict}" for verdict in order)


def concerned(registry: Registry, names: Iterable[str]) -> set[str]:
    """The distributions the patches ``names`` are about: each one's gate, its targets' requirements and
    the libraries its targets live in, and torch for a built-in (its bug probe builds on it). A note
    of doctor's about a distribution is printed only with the patches it concerns."""
    found = set()
    for name in names:
        if _is_builtin(registry, name):
            found.add("torch")
        try:
            patch = registry.patch(name)
        except Exception:  # a pack's module that cannot be imported: its finding says so
            continue
        found.update(patch.distributions)
        found.update(target.module.partition(".")[0] for target in patch.targets)
    return found


#: What transformers raises when the installed peft is older than it needs (``check_peft_version``).
PEFT_TOO_OLD = "The version of PEFT you are using is not compatible, please use a version >= {minimum}"


def peft_note(transformers: str | None, peft: str | None, minimum: str | None) -> str | None:
    """A line for doctor when transformers needs a newer peft (``MIN_PEFT_VERSION``) than is installed:
    an incompatibility of the two releases that no patch fixes, but whose error a user should be
    able to place (transformers 5.24 asks for peft >= 0.22.0 while the newest peft is 0.21.2)."""
    from packaging.version import InvalidVersion, Version

    if not (transformers and peft and minimum):
        return None
    try:
        if Version(peft) >= Version(minimum):
            return None
    except InvalidVersion:
        return None
    return (
        f"transformers {transformers} needs peft >= {minimum} for the adapter methods of its models, and "
        f"peft {peft} is installed: model.add_adapter(), set_adapter(), enable_adapters(), disable_adapters(), "
        f"active_adapters(), delete_adapter() and save_pretrained() of a model holding an adapter raise "
        f"'ValueError: {PEFT_TOO_OLD.format(minimum=minimum)}'. That is an incompatibility of the two releases, "
        f"not a bug the shim fixes: peft's own API (get_peft_model, PeftModel.from_pretrained, "
        f"PeftModel.load_adapter) works with them, or install a peft that meets the minimum."
    )


def newer_notes(about: Collection[str] | None = None) -> list[str]:
    """A line for each installed distribution newer than the newest release the shim was measured on
    (``shim/measured.json``, written by the version matrix): doctor's table is then the first
    measurement of it. ``about``: only for these distributions (default: every one measured)."""
    names = [name for name in gating.newest_measured() if about is None or name in about]
    notes = (gating.newer_than_measured(name) for name in names)
    return [
        f"{note}: the verdicts above are the first measurement of it; a NOT FIXED or check error there is "
        "worth a bug report (python -m shim --version, python -m shim doctor)"
        for note in notes
        if note
    ]


def notes(about: Collection[str] | None = None) -> list[str]:
    """What doctor points out below its table: releases newer than any the shim was measured on, and
    incompatibilities between the installed releases; ``about``: only those that concern these
    distributions (:func:`concerned`; default: all of them)."""
    if about is not None and "peft" not in about:
        return newer_notes(about)
    try:
        from transformers.integrations import peft as integration

        minimum = str(integration.MIN_PEFT_VERSION)
    except Exception:  # not installed, or a release without the constant: nothing to say
        minimum = None
    note = peft_note(gating.installed_version("transformers"), gating.installed_version("peft"), minimum)
    return newer_notes(about) + ([note] if note else [])


def left_out(registry: Registry, names: Sequence[str] = ()) -> list[str]:
    """The patch packs' patches ``registry`` left out at ``import shim`` (they have no row), as they
    were said, where doctor checks every patch (no ``names``)."""
    return [] if names else list(registry.left_out)


#: doctor's columns; ``bug upstream`` and ``bug with shim`` hold yes, no or -.
COLUMNS = ["patch", "installed", "state", "bug upstream", "bug with shim", "verdict"]


def print_table(registry: Registry, names: Sequence[str], wide: bool, write: Callable[[str], None]) -> list[Finding]:
    """doctor's table, written through ``write``: the header at once, each row as its check finishes,
    then the total, the reasons of the verdicts that need one and the notes that concern these
    patches, each fitted to :data:`~shim.tools.render.WIDTH` columns unless ``wide``."""
    from .render import column_widths, fitted, rule, table_line

    chosen = sorted(names or registry.names)
    before = {record.name: record for record in registry.status()}
    # After its import a pending patch is applied, skipped or failed; a disabled one stays so: the
    # columns are sized for what can come, before it does.
    states = {str(APPLIED), str(SKIPPED), str(FAILED)} | {str(before[name].state) for name in chosen}
    widest = [[name, before[name].installed or "-", max(states, key=len), "", "", ""] for name in chosen]
    widths = column_widths([COLUMNS, *widest])  # the verdict, last, needs no padding
    write(f"{table_line(COLUMNS, widths)}\n{rule(widths)}")
    findings = []
    for finding in each(registry, names):
        findings.append(finding)
        row = [finding.name, finding.installed, finding.state, finding.bug_upstream, finding.bug_with_shim]
        write(table_line([*row, finding.verdict], widths))
    write("\n" + "\n".join(fitted(total(findings), wide)))
    for finding in findings:
        for detail in below_table(finding):
            write("\n" + "\n".join(fitted(detail, wide)))
    for note in [*notes(concerned(registry, chosen)), *left_out(registry, names)]:
        write("\n" + "\n".join(fitted(f"note: {note}")))
    return findings
