"""The first-step audit's findings, and how they are said (``shim.audit`` is the watch that makes them).

A finding names one cause (:data:`CAUSES`) of trainable parameters that got no gradient at an
optimizer's first step, or of checkpointing asked for that no layer ran, with the patches that fix
that cause (:data:`FIXES`) and those of them switched off here. This room keeps what the audits of
this process found (:data:`found`, :data:`notes`, :func:`findings_of`) and says it: a warning line
for the family's evidence, INFO for data only (a dead-end branch), the exit line, what
``shim.in_effect(model)`` says. The tools read it through ``shim.audit``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import ranges, settings

NAME = settings.AUDIT
#: The patches that fix each cause the audit can tell, for its pointer and "switched off" note.
FIXES = {
    "frozen-inputs": ("reentrant-frozen-input-grads",),
    "keyword-inputs": ("reentrant-keyword-grads",),
    "not-checkpointed": ("replaced-forward-keeps-checkpointing",),
}
CAUSES = {
    "frozen-inputs": "their layers ran under reentrant checkpointing with no input that requires grad",
    "keyword-inputs": "their layers ran under reentrant checkpointing, the input that requires grad passed by keyword",
    "reentrant": "their layers ran under reentrant checkpointing",
    "cut": "their modules ran before modules that got a gradient, and the gradient stopped before it reached them "
    "(a detach, a computation under no_grad?)",
    "dead-end": "their modules ran after every module that got a gradient, and nothing the loss depends on used "
    "their output (a pooler or head this loss leaves out?)",
    "not-checkpointed": "gradient checkpointing is on, but no layer ran checkpointed in the first training step "
    "(a forward replaced after import, a checkpoint function that does not checkpoint?)",
}
#: The causes of a reentrant checkpoint's forward, which runs its layer under no_grad.
REENTRANT = ("frozen-inputs", "keyword-inputs", "reentrant")
#: Causes said as data only, never warned: a dead-end branch is how models are built, not the family's evidence.
DATA_ONLY = frozenset({"dead-end"})
SHOWN_GROUPS = 6  # groups of parameter names one line shows; more are counted
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")
_log = logging.getLogger("shim")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the audit names: trainable parameters that got no gradient (``kind`` ``"no-gradient"``),
    or checkpointing asked for that no layer ran (``"not-checkpointed"``); one cause each."""

    kind: str
    model: str  # the class of the model audited
    watched: tuple[str, ...]  # every trainable parameter the audit watched (for the grouping)
    parameters: tuple[str, ...]  # the parameters named (no-gradient), or the checkpointing layers
    sizes: tuple[int, ...]  # how many numbers each of those parameters holds (0s for not-checkpointed)
    cause: str  # a key of CAUSES: what the audit saw of the parameters' modules
    patches: tuple[str, ...]  # the patches that fix that cause
    switched_off: tuple[str, ...]  # those of them switched off here (SHIM_DISABLE, shim.disable, ...)

    @property
    def warns(self) -> bool:
        """Whether it is the family's evidence (a ``ShimWarning``), not data only (a dead-end branch)."""
        return self.cause not in DATA_ONLY

    def line(self) -> str:
        """The warning line: what, grouped, why, and where to read more."""
        if self.kind == "no-gradient":
            what = (
                f"{len(self.parameters)} trainable tensor(s) of {self.model} got no gradient in the first "
                f"training step: {grouped(self.parameters, dict(zip(self.parameters, self.sizes)), self.watched)}"
            )
        else:
            what = f"{self.model} checkpoints {len(self.parameters)} layer(s) ({grouped(self.parameters)})"
        why = CAUSES[self.cause]
        pointers = self.switched_off or self.patches  # a patch switched off is the likelier cause
        if self.switched_off:
            why += f"; {', '.join(self.switched_off)} fixes this and is switched off here"
        elif self.patches:
            why += f"; {', '.join(self.patches)} is on and did not cover it (python -m shim bug-report)"
        more = "".join(f"; python -m shim explain {name}" for name in pointers)
        return f"hf-train-shim first-step audit: {what}; {why}{more} (SHIM_DISABLE={NAME} for no audit)"

    def as_dict(self) -> dict[str, Any]:
        """The finding as plain data (``json.dumps`` takes it), its line and whether it warns included."""
        return {**dataclasses.asdict(self), "warns": self.warns, "line": self.line()}

    @classmethod
    def of(
        cls,
        kind: str,
        model: str,
        watched: tuple[str, ...],
        names: tuple[str, ...],
        sizes: tuple[int, ...],
        cause: str,
        is_on: Callable[[str], bool],
    ) -> Finding:
        """A finding of ``cause``, with the patches that fix it and those of them not on (``is_on``:
        the registry's)."""
        patches = FIXES.get(cause, ())
        return cls(kind, model, watched, names, sizes, cause, patches, tuple(n for n in patches if not is_on(n)))


def grouped(names: Iterable[str], sizes: Mapping[str, int] | None = None, watched: Iterable[str] = ()) -> str:
    """``model.layers.{0..31}.mlp.down_proj.lora_A.weight: 32 tensors, 1.0 M parameters``: names alike
    but for their numbers as one group (the first :data:`SHOWN_GROUPS`, the rest counted). A module
    none of whose ``watched`` parameters got a gradient is named once, ``model.layers.{1..2}.*``."""
    names = list(names)
    whole = _whole_modules(names, list(watched))
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name in names:
        shown_as = whole.get(name, name)
        groups.setdefault(_NUMBER.sub("#", shown_as), []).append(
            (name, tuple(int(n) for n in _NUMBER.findall(shown_as)))
        )
    shown = []
    for pattern, members in list(groups.items())[:SHOWN_GROUPS]:
        text = pattern
        for column in zip(*(numbers for _, numbers in members)):
            text = text.replace("#", _span(sorted(set(column))), 1)
        if sizes is not None:
            count = sum(sizes.get(name, 0) for name, _ in members)
            text += f": {len(members)} tensor(s), {_amount(count)} parameters"
        shown.append(text)
    rest = len(groups) - len(shown)
    return "; ".join(shown) + (f"; and {rest} more group(s)" if rest > 0 else "")


def _whole_modules(names: list[str], watched: list[str]) -> dict[str, str]:
    """name -> ``prefix.*`` for the outermost numbered module (a layer of a list) whose watched
    parameters are all in ``names``."""
    if not watched:
        return {}
    lost = set(names)
    out = {}
    for name in names:
        parts = name.split(".")
        for cut in range(1, len(parts) - 1):
            if not parts[cut - 1].isdigit():
                continue
            prefix = ".".join(parts[:cut]) + "."
            if all(other in lost for other in watched if other.startswith(prefix)):
                out[name] = prefix + "*"
                break
    return out


def _span(numbers: list[int]) -> str:
    """``3``, ``{0..3}``, ``{1,3}``, ``{0..2,5}``: braces (with ``..`` for a run, :func:`shim.ranges.runs`)
    where a name stands for several, since the numbers sit inside a dotted name."""
    written = ranges.runs(numbers, to="..")
    return written[0] if len(numbers) == 1 else "{" + ",".join(written) + "}"


def _amount(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return str(count)


def natural(name: str) -> list[Any]:
    """The key that sorts parameter names as people count (``layers.2`` before ``layers.10``)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


# -- what the audits found -------------------------------------------------------------------------

#: Every finding of this process's audits, in order (the exit line, the report table, bug-report).
found: list[Finding] = []
#: Notes on audits that could not run (DeepSpeed ZeRO, torch.compile), said once each.
notes: list[str] = []
_audited: weakref.WeakKeyDictionary[Any, tuple[Finding, ...]] = weakref.WeakKeyDictionary()
_compiled: weakref.WeakSet[Any] = weakref.WeakSet()  # modules whose watch torch.compile ended
COMPILED = f"hf-train-shim {NAME}: not run on a model whose first step torch.compile compiles"
ZERO = f"hf-train-shim {NAME}: not run under DeepSpeed ZeRO, whose gradients are partitioned"
REPLACED = (
    f"hf-train-shim {NAME}: not run on an optimizer whose parameters were replaced after it was made "
    "(DeepSpeed's or FSDP's flat parameters)"
)


def _related(model: Any, other: Any) -> bool:
    """Whether ``model`` is ``other``, or one of them is inside the other."""
    return model is other or any(m is model for m in other.modules()) or any(m is other for m in model.modules())


def findings_of(model: Any) -> tuple[Finding, ...] | None:
    """The automatic audit's findings on ``model`` (or on the model it was run on, inside which
    ``model`` is, or which is inside ``model``); ``None`` where no audit ran on it yet."""
    for audited, findings in list(_audited.items()):
        if _related(model, audited):
            return findings
    return None


def said_of(model: Any) -> tuple[str, ...]:
    """What ``shim.in_effect(model)`` says of the audit: its findings' lines, or whether it ran."""
    if settings.audit_switched_off():
        return (f"first-step audit: switched off (SHIM_DISABLE names {NAME} or all)",)
    findings = findings_of(model)
    if findings is None:
        if any(_related(model, compiled) for compiled in list(_compiled)):
            return ("first-step audit: not run on it: torch.compile compiles it (compiled code is not audited)",)
        return ("first-step audit: not run on it yet (it runs at its optimizer's first step)",)
    return tuple(f.line() for f in findings) or ("first-step audit: nothing named at its first step",)


def exit_line() -> str:
    """One line for the exit report where an audit warned; ``""`` where none did (data only is not said)."""
    warned = [f for f in found if f.warns]
    if not warned:
        return ""
    said = [
        f"{f.model}: {len(f.parameters)} trainable tensor(s) got no gradient"
        if f.kind == "no-gradient"
        else f"{f.model}: checkpointing on, no layer ran checkpointed"
        for f in warned
    ]
    return f"hf-train-shim first-step audit: {'; '.join(said)} (the warning says which and why)"


def note(said: str) -> None:
    """An audit could not run (:data:`COMPILED`, :data:`ZERO`, :data:`REPLACED`): said once, at INFO."""
    if said not in notes:
        notes.append(said)
        _log.info(said)


def ended_by_compile(module: Any) -> None:
    """torch.compile ended the watch of ``module``: :func:`said_of` says so."""
    _compiled.add(module)


def publish(audits: list[tuple[Any, tuple[Finding, ...]]]) -> None:
    """Keep what an audit found, and say it: a warning for the family's evidence, INFO for data only;
    a line said already (another optimizer over the same model) is not said again."""
    for root, findings in audits:
        _audited[root] = (*_audited.get(root, ()), *findings)
        for finding in findings:
            line = finding.line()
            if any(f.line() == line for f in found):
                continue
            found.append(finding)
            if finding.warns:
                _warn(line)
            else:
                _log.info(line)


#: Frames a finding's warning is not attributed to (beside the shim's): the libraries between the
#: user's step and the audit.
_BETWEEN = ("torch", "accelerate", "transformers", "trl", "peft")


def _warn(message: str) -> None:
    """``message`` as a ShimWarning (and to the ``shim`` logger), pointed at the user's step line; where
    a filter makes it an error (``-W error``), on the logger alone: never raised into the step."""
    import warnings

    _log.warning(message)
    try:
        warnings.warn(message, settings.ShimWarning, stacklevel=settings.user_stacklevel(_BETWEEN))
    except Warning:
        pass  # said on the logger above, and in the exit line
