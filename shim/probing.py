"""The bug probes' life (``Patch.bug_probe``), in one room: when a probe is asked, waiting for the
modules it needs, asking it without a trace, and what its answer does to the gate and the targets.

A probe is asked once per process where the release cannot vouch for the code (:func:`why_asked`),
right before its library's targets are wrapped, once what it needs has finished importing (until
then the release decides, or the targets wait with it where the release leaves the patch out:
:class:`Probes`). It is asked with the patch's own parts off and leaves no trace (:func:`ask`); an
exception is an answer too (the release decides). The bug found admits the patch outside its gate
(:meth:`Probes.gate`); no bug, it steps aside in that library (:meth:`Probes.aside`,
:meth:`Probes.step_aside`), unless ``SHIM_FORCE``. A patch's ``shim.entry.Entry`` keeps one
:class:`Probes` and asks it; nothing else keeps a probe's state.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple

from packaging.version import InvalidVersion, Version

from . import gating, runtime
from .ranges import and_
from .settings import PROBE_MODES

if TYPE_CHECKING:
    from .layers import Layers
    from .patch import BugProbe, Evidence, Patch

log = logging.getLogger("shim")

AUTO, ALWAYS, NEVER = PROBE_MODES


class Answer(NamedTuple):
    """What one probe said, once per process: for which library, why it was asked, and its evidence
    (``None`` where it raised: ``error`` says what)."""

    library: str
    why: str
    evidence: Evidence | None
    error: str = ""
    seconds: float = 0.0

    @property
    def present(self) -> bool | None:
        """Whether the bug is there: ``None`` where the probe could not tell (the release decides)."""
        return None if self.evidence is None else self.evidence.present

    def said(self, version: str | None) -> str:
        """The sentence a status shows: ``transformers 5.26.0.dev0 carries the fix: ...``."""
        where = f"{self.library} {version}" if version else self.library
        if self.evidence is None:
            return f"the bug probe for {where} failed ({self.error}), so its release decides"
        verdict = "has the bug" if self.evidence.present else "carries the fix"
        return f"{where} {verdict}: {self.evidence.detail} (asked because {self.why})"

    def as_dict(self) -> dict[str, object]:
        found = {"library": self.library, "why": self.why, "seconds": round(self.seconds, 6)}
        if self.evidence is None:
            return found | {"present": None, "detail": "", "error": self.error}
        return found | {"present": self.evidence.present, "detail": self.evidence.detail, "error": ""}


# -- when a probe is asked -------------------------------------------------------------------------


def why_asked(library: str, mode: str) -> str | None:
    """Why the probe for ``library`` is asked here, or ``None`` where its release decides."""
    if mode == NEVER:
        return None
    if mode == ALWAYS:
        return "SHIM_PROBE=always"
    installed = gating.installed_version(library)
    if installed is None:
        return None
    between = _between_releases(installed)
    if between:
        return f"{library} {installed} is {between}"
    return gating.newer_than_measured(library) or _not_from_a_release(library)


def _between_releases(installed: str) -> str:
    """``"a build between releases"`` where ``installed`` has a local, dev, pre- or post-release part."""
    try:
        version = Version(installed)
    except InvalidVersion:
        return "not a PEP 440 version"
    if version.local or version.is_devrelease or version.is_prerelease or version.is_postrelease:
        return "a build between releases"
    return ""


def _not_from_a_release(library: str) -> str | None:
    """Where ``library`` was installed from its source rather than a release (PEP 610's
    ``direct_url.json``: editable, or from a version-control system), a sentence that says so."""
    kind = _install_kind(library)
    return f"{library} is {kind}" if kind else None


@functools.cache
def _install_kind(library: str) -> str:
    """How ``library`` was installed, where not from a release; read once per process (a tenth of a
    millisecond once transformers has read the metadata at its own import)."""
    import importlib.metadata
    import json

    try:
        text = importlib.metadata.distribution(library).read_text("direct_url.json")
        found = json.loads(text) if text else {}
    except (importlib.metadata.PackageNotFoundError, OSError, ValueError):
        return ""
    if not isinstance(found, dict):
        return ""
    vcs = found.get("vcs_info")
    if isinstance(vcs, dict):
        return f"installed from {vcs.get('vcs', 'version control')} ({found.get('url', '')})"
    directory = found.get("dir_info")
    if isinstance(directory, dict) and directory.get("editable"):
        return "an editable install"
    return ""


# -- one patch's probes ----------------------------------------------------------------------------


#: ``off()``: a block with the patch's own parts off (``shim.entry.Entry``'s).
OffSwitch = Callable[[], AbstractContextManager[None]]


class Waiting(NamedTuple):
    """A probe due whose ``needs`` have not all finished importing."""

    probe: BugProbe
    why: str  # why it is asked (:func:`why_asked`)
    pending: tuple[str, ...]  # the modules it still waits for, at the last look


class Probes:
    """One patch's bug probes in this process: what each answered, by library (asked once, kept across
    ``deactivate()`` and ``enable()``: the installed code does not change), those that wait for a
    module they need, and the libraries the patch stepped aside in."""

    __slots__ = ("answers", "waiting", "stepped_aside")

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
        self.waiting: dict[str, Waiting] = {}
        self.stepped_aside: set[str] = set()

    def ask_due(
        self, patch: Patch, module_names: list[str], ready: Callable[[str], bool], mode: str, off: OffSwitch
    ) -> bool:
        """Ask the probes due before the targets in ``module_names`` are wrapped, and those that waited,
        once the modules each needs are ``ready`` (finished importing); the others wait. ``off``: the
        patch's own parts off around each. Returns whether one was asked."""
        self._schedule(patch, module_names, mode)
        available = _importable(ready)
        askable = {}
        for library, (probe, why, _) in list(self.waiting.items()):
            pending = tuple(name for name in probe.needs if not available(name))
            if pending:
                self.waiting[library] = Waiting(probe, why, pending)
            else:  # out of the waiting ones before any is asked: a probe's code cannot ask it again
                askable[library] = self.waiting.pop(library)
        for library, (probe, why, _) in askable.items():
            with off():
                answer = self.answers[library] = ask(probe, library, why)
            level = logging.WARNING if answer.present is None else logging.INFO
            log.log(level, "%s: %s", patch.name, _said(answer))
        return bool(askable)

    def _schedule(self, patch: Patch, module_names: list[str], mode: str) -> None:
        """Add the probes due before the targets in ``module_names`` are wrapped, and why each is asked
        (:func:`why_asked`), to the waiting ones: those of their libraries not asked yet."""
        libraries = {patch.library_of(target) for target in patch.targets if target.module in module_names}
        for library in sorted(libraries - set(self.answers) - set(self.waiting)):
            probe = patch.probe_for(library)
            why = why_asked(library, mode) if probe is not None else None
            if probe is not None and why is not None:
                self.waiting[library] = Waiting(probe, why, ())

    def needed(self, ready: Callable[[str], bool]) -> list[str]:
        """The modules the waiting probes need that are not ``ready``: the registry hooks them."""
        return [name for waiting in self.waiting.values() for name in waiting.probe.needs if not ready(name)]

    def hold_targets(self, patch: Patch, forced: bool) -> bool:
        """Whether the patch's targets wait with its probe: outside its gate, the probe of its own
        distribution may yet find the bug there."""
        return patch.distribution in self.waiting and gating.gate(patch, forced).skip is not None

    def gate(self, by_release: gating.Gate, patch: Patch) -> gating.Gate:
        """The gate once the probes asked here have answered: the probe of the patch's own
        distribution that found the bug admits the patch where the release is outside the gate (a build
        between releases that lacks upstream's fix). Any other answer leaves the gate as it is: one
        that found no bug makes its library's targets step aside (:meth:`aside`), one that failed
        leaves the decision to the release."""
        answer = self.answers.get(patch.distribution)
        if answer is None or by_release.skip is None:
            return by_release
        said = answer.said(by_release.versions.installed)
        if answer.present:
            return gating.Gate(by_release.versions, None, f"{by_release.versions.reason}, but {said}")
        return by_release._replace(skip=f"{by_release.skip}; {said}")

    def aside(self, forced: bool) -> dict[str, str]:
        """The libraries where a probe found no bug, each with what the status says of it: the patch
        steps aside there (not under ``SHIM_FORCE``)."""
        if forced:
            return {}
        found = {library: answer for library, answer in self.answers.items() if answer.present is False}
        return {library: f"steps aside: {_said(answer)}" for library, answer in found.items()}

    def step_aside(self, patch: Patch, layers: Layers, forced: bool) -> list[str]:
        """Take the patch's parts off the targets of each library whose probe found no bug (they were
        placed while it waited); returns what the status says of each."""
        notes = []
        for library, note in self.aside(forced).items():
            modules = {target.module for target in patch.targets if patch.library_of(target) == library}
            if layers.remove(modules):
                self.stepped_aside.add(library)
                notes.append(note)
        return notes

    def problem(self) -> str | None:
        """What strict mode raises for: a probe that could not run."""
        return "; ".join(_said(answer) for answer in self.answers.values() if answer.present is None) or None

    def said(self, forced: bool) -> list[str]:
        """What each probe answered here, a sentence each (:meth:`Answer.said`), and where one still
        waits for a module it needs."""
        said = []
        for answer in self.answers.values():
            sentence = _said(answer)
            if answer.present is False and forced:
                sentence += "; applied anyway because of SHIM_FORCE"
            said.append(sentence)
        for library, (_, why, pending) in self.waiting.items():
            verb = "finishes" if len(pending) == 1 else "finish"
            said.append(f"its bug probe for {library} is asked once {and_(list(pending))} {verb} importing ({why})")
        return said

    @property
    def decided(self) -> bool:
        """Whether an answer decided: it found the bug, or the patch stepped aside on what it found."""
        return bool(self.stepped_aside) or any(answer.present for answer in self.answers.values())


def _said(answer: Answer) -> str:
    return answer.said(gating.installed_version(answer.library))


def _importable(ready: Callable[[str], bool]) -> Callable[[str], bool]:
    """Whether a module a probe needs is ready for it: finished importing, or not there at all in this
    release (the probe then takes the release's other way, and says so)."""

    def ready_or_absent(name: str) -> bool:
        if ready(name):
            return True
        parent_name = name.rpartition(".")[0]
        parent = sys.modules.get(parent_name) if parent_name else None
        if parent_name and (parent is None or getattr(getattr(parent, "__spec__", None), "_initializing", False)):
            return False  # looking it up would import (and lock) its package: wait for it instead
        import importlib.util

        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True

    return ready_or_absent


# -- asking one probe ------------------------------------------------------------------------------


def ask(probe: BugProbe, library: str, why: str) -> Answer:
    """Ask ``probe`` about ``library``, without a trace; an exception becomes the answer's error."""
    start = time.perf_counter()
    try:
        with _traceless():
            evidence = probe.ask()
        if not (isinstance(evidence, tuple) and len(evidence) == 2 and isinstance(evidence[0], bool)):
            raise TypeError(f"a bug probe returns shim.Evidence(present, detail), not {evidence!r}")
    except Exception as exc:
        return Answer(library, why, None, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
    return Answer(library, why, evidence, "", time.perf_counter() - start)


@contextlib.contextmanager
def _traceless() -> Iterator[None]:
    """What a probe may change is put back or kept to itself, and what the caller set does not reach
    it: the random states of torch's CPU generator, Python's and NumPy's (if imported); the grad and
    inference modes, the default device and dtype, deterministic algorithms and anomaly detection
    (gradients on, the CPU, float32, both off, whatever the caller's: a script that sets a bf16
    default dtype before importing transformers gets the probes' answers of one that does not); the
    warnings it raises, and the effects the shim's other patches record inside it. CUDA is never
    touched: a probe works on the CPU."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_warnings_ignored())
        stack.enter_context(runtime.muted())
        if torch is not None:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.device("cpu"))
            stack.enter_context(_torch_defaults(torch))
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def _torch_defaults(torch: Any) -> Iterator[None]:
    """float32 as the default dtype, deterministic algorithms and anomaly detection off inside, as the
    caller had them after; each changed only where the caller changed it. All three are the
    process's, not the thread's (as the warnings filters are): another thread that builds a tensor
    during a probe gets float32 too."""
    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    anomaly = torch.is_anomaly_enabled()
    check_nan = torch.is_anomaly_check_nan_enabled()
    if dtype is not torch.float32:
        torch.set_default_dtype(torch.float32)
    if deterministic:
        # Not torch.use_deterministic_algorithms: it imports inductor's config (800 modules) and sets it.
        torch._C._set_deterministic_algorithms(False)
    if anomaly:
        torch.set_anomaly_enabled(False)
    try:
        yield
    finally:
        if anomaly:
            torch.set_anomaly_enabled(True, check_nan)
        if deterministic:
            torch._C._set_deterministic_algorithms(True, warn_only=warn_only)
        torch.set_default_dtype(dtype)


_IGNORE_ALL = ("ignore", None, Warning, None, 0)


@contextlib.contextmanager
def _warnings_ignored() -> Iterator[None]:
    """A probe's warnings neither show nor register (a warning shown once per place must still show
    when the user's code gets there). Not ``warnings.catch_warnings()``: changing the filters through
    it marks every module's record of the warnings already shown as stale, so that each shows again;
    a filter put at the front of the list and taken out again changes nothing else. (Another thread's
    warning inside the block is not shown either: the filters are the process's.)"""
    import warnings

    filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time (typeshed: a Sequence)
    mine = tuple(list(_IGNORE_ALL))  # a tuple of its own (not the constant), found again by identity
    filters.insert(0, mine)
    try:
        yield
    finally:
        for index, item in enumerate(filters):
            if item is mine:
                del filters[index]
                break
