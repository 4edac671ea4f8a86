"""The status of a patch (``shim.status()``): what the registry did with it and what it did since.
The tables made of them are the tools' (``shim.tools.render``).

Imported only when a status is asked for, never by ``import shim`` itself.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import gating, runtime
from .entry import State, unloadable
from .ranges import version_range

if TYPE_CHECKING:
    from .catalogue import Listing
    from .entry import Entry
    from .others import Other
    from .patch import Patch

_PUBLIC = re.compile(r"^([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)#(\d+)$")
_OWN = "docs/bugs.md#"


@dataclass(frozen=True)
class PatchStatus:
    """What the registry did with one patch, and what the patch did since (``shim.status()``).

    ``effects`` counts the times the patch changed something in this process (calls it passed
    through do not count); ``last_effect`` describes the last one (``""`` while there is none).
    ``references`` are GitHub addresses and ``python -m shim explain <name>``, which prints the
    bug's story (``docs/bugs.md``, shipped with the package). ``others``: another patcher's object
    on one of the patch's targets, each as ``target``, ``relation`` (``bypassed``: the fix does not
    run there; ``above``: it runs first, then the fix; ``below``: the fix runs first, then it;
    ``same fix``: beside the targets, a patcher the patch declares fixes the same bug, and
    ``covers`` says for what), ``by`` (``module:qualname``), ``file`` and ``text`` (the line the
    tables show). ``suspended``: inside a ``shim.disabled()`` block, the patch's layers are off
    whatever its state. ``provider``: the distribution that provides the patch, ``hf-train-shim``
    for a built-in, a patch pack's own for a pack's (``""`` for one given to ``shim.register()``).
    ``decided_by``: what decided whether the patch applies, ``"release"`` (its version gate) or
    ``"probe"`` (its bug probe, asked where the release cannot vouch for the code: ``shim.probing``),
    ``""`` while nothing is decided yet. ``probe``: what each bug probe asked in this process found,
    by library (``library``, ``why`` it was asked, ``present``: true, false, or null where it failed,
    ``detail``, ``error``, ``seconds``); ``None`` where none was asked.
    """

    name: str
    state: State
    reason: str
    targets: tuple[str, ...]
    requires: str
    installed: str | None
    summary: str = ""
    references: tuple[str, ...] = ()
    effects: int = 0
    last_effect: str = ""
    others: tuple[dict[str, str], ...] = ()
    suspended: bool = False
    provider: str = ""
    decided_by: str = ""
    probe: tuple[dict[str, object], ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}
        out["state"] = self.state.value
        return out


def status_of(entry: Entry) -> PatchStatus:
    """What ``shim.status()`` says of one patch (refreshed by the registry just before): its
    entry's state and reason, the declaration, other patchers on its targets, and its effects."""
    patch, missing = _declaration(entry)
    gated = _gated(entry, patch)
    distribution = (gated.distribution or "") if gated is not None else ""
    found, blocking = _others(entry)
    return PatchStatus(
        name=entry.name,
        state=entry.state,
        reason=_reason(entry, missing, blocking, distribution, patch),
        targets=tuple(t.spec for t in patch.targets) if patch else (),
        requires=f"{distribution}{version_range(gated.requires)}" if gated is not None else "",
        installed=entry.installed_version or _installed(distribution),
        summary=patch.summary if patch else "",
        references=links(patch.references) if patch else (),
        effects=runtime.count(entry.name),
        last_effect=runtime.last(entry.name),
        others=tuple(other._asdict() | {"text": other.text()} for other in found),
        suspended=entry.suspended > 0,
        provider=entry.declared.provider,
        decided_by=decided_by(entry),
        probe=tuple(answer.as_dict() for answer in entry.probes.answers.values()) or None,
    )


def _gated(entry: Entry, patch: Patch | None) -> Patch | Listing | None:
    """What its gate is read from: the Patch's; where there is none, the catalogue's listing of a
    built-in (a module that failed), and nothing for a pack's patch whose module is not imported."""
    if patch is None and not entry.declared.foreign:
        return entry.declared
    return patch


def _installed(distribution: str) -> str | None:
    return gating.installed_version(distribution) if distribution else None


def _others(entry: Entry) -> tuple[list[Other], list[Other]]:
    """Other patchers on the patch's targets, and those of them that keep it from applying (a shape
    check that refused what it found there: the reason names them, and they are said once)."""
    if entry.layers:
        from . import others

        return others.of_entry(entry), []
    if refused_by_a_check(entry):
        from . import others

        found = others.blocking(entry.load(), [m for m in entry.declared.modules if m in sys.modules])
        others.say(entry.name, found)
        return found, found
    return [], []


def _reason(entry: Entry, missing: str, blocking: list[Other], distribution: str, patch: Patch | None) -> str:
    """The entry's reason, and what the status adds to it: why its declaration is not shown, the
    other patchers that keep it from applying, a release newer than any measured."""
    reason = f"{entry.reason}; {missing}" if missing else entry.reason
    added = [f"{other.target} holds {other.by}, another patcher's" for other in blocking]
    if distribution:
        added += newer_than_measured(distribution, patch)
    return "; ".join([reason, *added])


def decided_by(entry: Entry) -> str:
    """``"probe"`` where a bug probe's answer decided (it found the bug, or the patch stepped aside
    on what it found), ``"release"`` where the version gate and the targets' requirements did (a
    probe that found no bug where they leave the patch out anyway changes nothing), ``""`` while
    neither has (a pending patch, one switched off before)."""
    if entry.gate is not None and entry.gate.skip is not None:
        return "release"
    if entry.probes.decided:
        return "probe"
    if entry.gate is not None or entry.state is State.SKIPPED:
        return "release"
    return ""


def _declaration(entry: Entry) -> tuple[Patch | None, str]:
    """The patch's declaration for its status, or ``None`` and what the reason adds: a pack's patch
    that is switched off is not imported to be shown (``shim.catalogue.Listing.foreign``)."""
    declared = entry.declared
    if declared.foreign and entry.patch is None and entry.state is State.DISABLED:
        return None, "its module is not imported while it is switched off"
    try:
        patch = entry.load()
    except Exception as exc:  # reported, never raised: a status must always come back
        return None, "" if entry.state is State.FAILED else unloadable(exc)  # a failed one's reason says why
    return patch, declared.note  # a pack's: an after= dropped at import shim


def refused_by_a_check(entry: Entry) -> bool:
    """Skipped or failed for good inside its gate, with nothing wrapped: a target missing, or a
    shape check that refused what it found there (another patcher's object, perhaps); not a patch
    that stepped aside because its bug probe found upstream's fix."""
    gate = entry.gate
    return (
        entry.final
        and entry.state in (State.SKIPPED, State.FAILED)
        and gate is not None
        and gate.skip is None
        and not entry.probes.stepped_aside
    )


#: What a status reason adds after the sentence of :func:`shim.gating.newer_than_measured`.
RUN_DOCTOR = "run `python -m shim doctor`"


def newer_than_measured(distribution: str, patch: Patch | None) -> list[str]:
    """For the patch's distribution and those its targets require: where the installed release is
    newer than any the matrix measured, a sentence that says so and what to run."""
    names = patch.distributions if patch is not None else (distribution,)
    notes = (gating.newer_than_measured(name) for name in names)
    return [f"{note}: {RUN_DOCTOR}" for note in notes if note]


def links(references: Iterable[str]) -> tuple[str, ...]:
    """``references`` as a user outside the repository can follow them: a public ``owner/repo#N``
    becomes its GitHub address, the patch's own ``docs/bugs.md#<patch>`` the command that prints
    that section."""
    out = []
    for reference in references:
        public = _PUBLIC.match(reference)
        if public:  # GitHub sends an issue number that is a pull request to the pull request
            out.append(f"https://github.com/{public.group(1)}/issues/{public.group(2)}")
        elif reference.startswith(_OWN):
            out.append(f"python -m shim explain {reference[len(_OWN) :]}")
        else:
            out.append(reference)
    return tuple(out)
