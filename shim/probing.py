"""Asking a patch's bug probe (``Patch.bug_probe``) without a trace, and what it answered.

Where a probe is asked is the gate's business (``shim.gating.why_asked``: a build between releases,
a release newer than any measured, ``SHIM_PROBE``); what its answer decides, the entry's
(``shim.entry``: the bug found, the patch applies; not found, it steps aside in that library). Here:
one probe asked, once, the patch's own parts off (it is asked before they are placed, or inside
``shim.disabled(name)``), so that it leaves no trace (:func:`_traceless`): torch's CPU random state,
Python's and NumPy's are put back; gradients are on, the default device is the CPU and the default
dtype float32, deterministic algorithms and anomaly detection are off, whatever the caller set;
warnings are not shown, and effects the shim's other patches record inside it are not counted. An
exception is an answer too: the probe failed, and the release decides.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from . import runtime

if TYPE_CHECKING:
    from .patch import BugProbe, Evidence


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
