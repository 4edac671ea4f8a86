"""Environment variables, parsed with a warning (and the default) for every bad value.

They are read each time a patch is applied, so a variable set before the target library is
imported still takes effect. Patch names are matched without regard to case, ``_`` or ``-``
(``LOAD_KEEPS_REQUIRES_GRAD`` and ``load_keeps_requires_grad`` name ``load-keeps-requires-grad``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Hashable, Iterable
from types import FrameType


class PatchError(RuntimeError):
    """A patch could not be applied and the user asked for strict mode (``SHIM_STRICT=1``).

    Outside strict mode the same problem is only logged and shown by ``python -m shim``.
    """


class PackError(ImportError):
    """A patch pack's patch that cannot be loaded (``shim.packs``): the message names the pack, the
    entry point and why; it was warned about once."""


class ShimWarning(UserWarning):
    """A configuration problem the shim worked around (bad environment value, shadowed package)."""


ALL = frozenset({"all", "1", "true", "*"})
NONE = frozenset({"", "0", "false", "none"})
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"", "0", "false", "no", "off"})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: What ``SHIM_PROBE`` takes, the default first: when a patch's bug probe is asked (``shim.probing``).
PROBE_MODES = ("auto", "always", "never")
#: The first-step audit's name (``shim.audit``). It lives here because ``SHIM_DISABLE``, read here
#: alone, takes it beside the patches' names: the one name it takes that no patch has.
AUDIT = "first-step-audit"
#: How a patch is named: lower-case words joined by ``-`` (``checkpointing-restore``).
PATCH_NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
# Frames a warning must not be attributed to: the shim's own (a patch is applied from inside the
# user's ``import transformers``, through the shim's import hooks), wrapt's and importlib's.
_OWN_DIRECTORY = os.path.dirname(os.path.abspath(__file__))
_NOT_THE_CALLER = (_OWN_DIRECTORY + os.sep, os.sep + "wrapt" + os.sep, os.sep + "importlib" + os.sep)

_warned: set[Hashable] = set()  # what warn_once said: the messages, or the keys it was given


def user_stacklevel(libraries: Iterable[str] = ()) -> int:
    """The ``stacklevel`` that points a warning issued by the caller of this function at the first
    frame outside the shim, wrapt, importlib and the ``libraries`` named (top-level packages: the
    first-step audit skips those between a user's training step and itself, ``torch``,
    ``transformers``, ...): the user's ``import shim``, ``import transformers``,
    ``shim.enable(...)`` or ``optimizer.step()`` line.

    Frames are counted the way :func:`warnings.warn` counts them: it skips importlib's
    ``_bootstrap`` frames by itself.
    """
    skipped = (*_NOT_THE_CALLER, *(f"{os.sep}{name}{os.sep}" for name in libraries))
    frame: FrameType | None = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):
            if not any(part in filename for part in skipped):
                return level
            level += 1
        frame = frame.f_back
    return level


def warn_once(message: str, once: Hashable = None) -> None:
    """Warn about a configuration problem once per process, pointing at the user's code: once per
    ``message``, or per ``once`` where given (a problem whose message names a changing detail)."""
    key = message if once is None else once
    if key in _warned:
        return
    _warned.add(key)
    logging.getLogger("shim").warning(message)
    warnings.warn(message, ShimWarning, stacklevel=user_stacklevel())


def strict_or_warn(message: str, cause: BaseException | None = None, once: Hashable = None) -> None:
    """A problem the shim works around (a patch pack left out, a step or the audit that failed): under
    ``SHIM_STRICT=1`` a :class:`PatchError` (``message (SHIM_STRICT=1)``, raised from ``cause``), else
    one warning (:func:`warn_once`, per ``once`` where given)."""
    if flag("SHIM_STRICT"):
        error = PatchError(f"{message} (SHIM_STRICT=1)")
        if cause is None:
            raise error
        raise error from cause
    warn_once(message, once)


def canonical(name: str) -> str:
    """``name`` as the patch names are written: lower case, words joined by ``-``."""
    return name.strip().lower().replace("_", "-")


class Settings:
    """The switches read from the environment (a plain class: ``import shim`` builds no namedtuple)."""

    __slots__ = ("disable_all", "disabled", "forced", "strict", "probe")

    def __init__(
        self, disable_all: bool, disabled: frozenset[str], forced: frozenset[str], strict: bool, probe: str = "auto"
    ) -> None:
        self.disable_all = disable_all
        self.disabled = disabled
        self.forced = forced
        self.strict = strict
        self.probe = probe


def did_you_mean(name: str, known: Iterable[str], otherwise: str = "python -m shim lists them", width: int = 0) -> str:
    """``did you mean a, b?`` with the known names closest to ``name`` (as many of three as keep
    the hint within ``width`` characters, when given), or ``otherwise``."""
    import difflib  # only on this error: it would cost every ``import shim`` half a millisecond

    close = difflib.get_close_matches(canonical(name), list(known), n=3, cutoff=0.5)
    while width and close and len(f"did you mean {', '.join(close)}?") > width:
        close.pop()
    return f"did you mean {', '.join(close)}?" if close else otherwise


#: How many bad items of one kind get a warning each; more get one warning together, which quotes
#: this many and counts the rest (a SHIM_DISABLE of 2 000 unknown names: one line, not 1.3 MB).
QUOTED = 3


def shown(value: str, limit: int = 40) -> str:
    """``value`` for a one-line message: quoted as ``repr`` quotes it (control characters escaped),
    cut after ``limit`` characters with its length said, so that no value makes a warning long."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def _warn_each(items: list[str], one: Callable[[str], str], many: Callable[[str], str]) -> None:
    """``one(item)`` for each item, or for more than :data:`QUOTED` different ones a single
    ``many(summary)``, the summary quoting a few items and counting the rest."""
    items = list(dict.fromkeys(items))
    if len(items) <= QUOTED:
        for item in items:
            warn_once(one(item))
    else:
        quoted = ", ".join(shown(item) for item in items[:QUOTED])
        warn_once(many(f"{quoted} and {len(items) - QUOTED} more"))


def _items(variable: str) -> list[tuple[str, str]]:
    """The items of the comma-separated list in ``variable``, each as written and as read (a patch's
    name as :func:`canonical` writes it, or a word of :data:`ALL`); empty items and the words of
    :data:`NONE` are nothing. The one reading of ``SHIM_DISABLE`` and ``SHIM_FORCE``."""
    raw = os.environ.get(variable, "")
    if not raw.strip():  # the usual case, asked once per patch at each decision: no list to build
        return []
    items = ((part.strip(), canonical(part)) for part in raw.split(","))
    return [(item, name) for item, name in items if name not in NONE]


def _names(
    variable: str, known: Iterable[str], *, allow_all: bool, also: Iterable[str] = ()
) -> tuple[bool, frozenset[str]]:
    """Whether ``variable`` names every patch, and the known patch names it lists.

    The value is a comma-separated list, read item by item: an empty item (``name,,``, ``all,``) and
    ``0``/``false``/``none`` are nothing; ``all`` (also ``1``, ``true``, ``*``) means every patch,
    alone or inside a list, where ``allow_all``; every other item is a patch name. An item that is
    not a known name gets a warning; more than :data:`QUOTED` of a kind get one warning together.
    ``also``: names it takes besides the patches' (the audit's), not listed among the patches.
    """
    items = _items(variable)
    if not items:
        return False, frozenset()
    known = sorted(known)
    names = ", ".join(known)
    accepted = sorted({*known, *also})
    everything, found = False, set()
    refused: list[str] = []  # 'all' where it is not accepted
    unknown: list[str] = []  # patch names that no patch has
    malformed: list[str] = []  # no patch names at all
    for item, name in items:
        if name in ALL:
            if allow_all:
                everything = True
            else:
                refused.append(item)
            continue
        if name in accepted:
            found.add(name)
        else:
            (unknown if PATCH_NAME.match(name) else malformed).append(item)
    _warn_each(
        refused,
        lambda item: f"{variable}: {shown(item)} is not accepted, ignored; {variable} takes patch names only",
        lambda items: f"{variable}: {items} are not accepted, ignored; {variable} takes patch names only",
    )
    _warn_each(
        unknown,
        lambda item: (
            f"{variable} names an unknown patch {shown(item)}, ignored; "
            + did_you_mean(item, known, otherwise=f"known patches: {names}")
        ),
        lambda items: f"{variable} names unknown patches {items}, ignored; known patches: {names}",
    )
    valid = "'all' or " if allow_all else ""
    takes = f"{variable} takes {valid}a comma-separated list of patch names ({names})"
    _warn_each(
        malformed,
        lambda item: f"{variable}: {shown(item)} is not a patch name, ignored; {takes}",
        lambda items: f"{variable}: {items} are not patch names, ignored; {takes}",
    )
    return everything, frozenset(found)


def all_disabled() -> bool:
    """Whether ``SHIM_DISABLE`` switches every patch off (``all``, alone or in a list), read as
    :func:`read` reads it but without a warning: the shim is off, and says nothing."""
    return any(name in ALL for _, name in _items("SHIM_DISABLE"))


def audit_switched_off() -> bool:
    """Whether ``SHIM_DISABLE`` switches the first-step audit off (names :data:`AUDIT`, or all), read
    as :func:`read` reads it. A bad value is warned about by :func:`read`, at ``import shim`` (the
    registry reads the settings as it activates each patch), not again each time the audit asks."""
    return any(name in ALL or name == AUDIT for _, name in _items("SHIM_DISABLE"))


def not_a_patch(name: str) -> str | None:
    """What is said where a name that ``SHIM_DISABLE`` takes but no patch has is given as a patch's
    (``shim.disable``, ``python -m shim explain``): the audit's; ``None`` for any other name."""
    if canonical(name) == AUDIT:
        return f"the first-step audit is no patch: SHIM_DISABLE={AUDIT} switches it off"
    return None


def flag(variable: str) -> bool:
    """A boolean variable; unset, or a value that is neither true nor false (which warns), reads as off."""
    return switch(variable) is True


def switch(variable: str, default: str = "off") -> bool | None:
    """A boolean variable that can also be left unset: ``True``, ``False``, or ``None`` where it is
    unset or empty. A value that is neither true nor false warns, naming ``default`` (what unset
    means), and reads as unset."""
    raw = os.environ.get(variable, "").strip().lower()
    if not raw:
        return None
    if raw in TRUE:
        return True
    if raw in FALSE:
        return False
    warn_once(
        f"{variable}={shown(raw)} is not valid; use one of {', '.join(sorted(TRUE | FALSE - {''}))}; using {default}"
    )
    return None


def probe_mode() -> str:
    """``SHIM_PROBE``: one of :data:`PROBE_MODES`; unset or empty is ``auto``, another value warns once
    (naming the valid ones) and reads as ``auto``."""
    raw = os.environ.get("SHIM_PROBE", "").strip().lower()
    if not raw:
        return PROBE_MODES[0]
    if raw in PROBE_MODES:
        return raw
    warn_once(f"SHIM_PROBE={shown(raw)} is not valid; use one of {', '.join(PROBE_MODES)}; using {PROBE_MODES[0]}")
    return PROBE_MODES[0]


def read(known: Iterable[str]) -> Settings:
    """Read ``SHIM_DISABLE``, ``SHIM_FORCE``, ``SHIM_STRICT`` and ``SHIM_PROBE`` against the known patch
    names (``SHIM_DISABLE`` also takes the audit's, :data:`AUDIT`)."""
    known = tuple(known)
    disable_all, disabled = _names("SHIM_DISABLE", known, allow_all=True, also=(AUDIT,))
    _, forced = _names("SHIM_FORCE", known, allow_all=False)
    return Settings(disable_all, disabled, forced, flag("SHIM_STRICT"), probe_mode())


def configure_logging() -> None:
    """Apply ``SHIM_LOG_LEVEL`` to the ``shim`` logger and show its records on stderr.

    The stderr handler is added unless the application already gave the ``shim`` logger a
    handler of its own (the library's ``NullHandler`` does not count).
    """
    logger = logging.getLogger("shim")
    raw = os.environ.get("SHIM_LOG_LEVEL", "").strip()
    if not raw:
        return
    if raw.upper() not in LOG_LEVELS:
        warn_once(f"SHIM_LOG_LEVEL={shown(raw)} is not valid; use one of {', '.join(LOG_LEVELS)}; leaving it unset")
        return
    logger.setLevel(raw.upper())
    if all(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
