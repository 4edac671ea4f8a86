"""Asking a patch's bug probe (``Patch.bug_probe``): where it is asked, and asking it without a trace.

A version gate says where a bug started; the version matrix says where it was measured. Where the
installed release of a target's library is one the matrix measured, the gate decides and no probe
runs. Where it is not (``SHIM_PROBE=auto``, the default): a build between releases (a local, dev,
pre- or post-release part, an editable or VCS install) or a release newer than any measured, the
library's probe is asked once per process, before the patch is applied there, and decides: the bug
found, the patch applies (even where the gate would leave that build out); not found, the patch
steps aside in that library. ``SHIM_PROBE=always`` asks every probe (the version matrix does, to
check that each probe agrees with its gate), ``SHIM_PROBE=never`` none.

A probe runs with the patch's own parts off (it is asked before they are placed, or inside
``shim.disabled(name)``) and leaves no trace (:func:`_traceless`): torch's CPU random state, Python's
and NumPy's are put back, gradients are on and the default device is the CPU whatever the caller's
mode, warnings are not shown, and effects the shim's other patches record inside it are not counted.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import random
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from . import runtime
from .gating import installed_version, newer_than_measured
from .settings import PROBE_MODES

if TYPE_CHECKING:
    from .patch import BugProbe, Evidence

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


def why_asked(library: str, mode: str) -> str | None:
    """Why the probe for ``library`` is asked here, or ``None`` where its release decides."""
    if mode == NEVER:
        return None
    if mode == ALWAYS:
        return "SHIM_PROBE=always"
    installed = installed_version(library)
    if installed is None:
        return None
    between = _between_releases(installed)
    if between:
        return f"{library} {installed} is {between}"
    newer = newer_than_measured(library)
    if newer:
        return newer
    return _not_from_a_release(library)


def _between_releases(installed: str) -> str:
    """``"a build between releases"`` where ``installed`` has a local, dev, pre- or post-release part."""
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(installed)
    except InvalidVersion:
        return "not a PEP 440 version"
    if version.local or version.is_devrelease or version.is_prerelease or version.is_postrelease:
        return "a build between releases"
    return ""


_install_kind: dict[str, str] = {}


def _not_from_a_release(library: str) -> str | None:
    """Where ``library`` was installed from its source rather than a release (PEP 610's
    ``direct_url.json``: editable, or from a version-control system), a sentence that says so."""
    kind = _install_kind.get(library)
    if kind is None:
        kind = _install_kind[library] = _read_install_kind(library)
    return f"{library} is {kind}" if kind else None


def _read_install_kind(library: str) -> str:
    try:
        text = importlib.metadata.distribution(library).read_text("direct_url.json")
        found = json.loads(text) if text else {}
    except (importlib.metadata.PackageNotFoundError, OSError, ValueError):
        return ""
    if not isinstance(found, dict):
        return ""
    if "vcs_info" in found:
        return f"installed from {found['vcs_info'].get('vcs', 'version control')} ({found.get('url', '')})"
    if isinstance(found.get("dir_info"), dict) and found["dir_info"].get("editable"):
        return "an editable install"
    return ""


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
    """What a probe may change is put back or kept to itself: the random states of torch's CPU
    generator, Python's and NumPy's (if imported), the grad and inference modes and the default device
    (gradients on, the CPU, whatever the caller's), shown warnings, and the effects the shim's other
    patches record while it runs. CUDA is never touched: a probe works on the CPU."""
    import warnings

    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        stack.enter_context(runtime.muted())
        if torch is not None:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.device("cpu"))
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)

