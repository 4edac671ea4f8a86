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
from collections.abc import Iterable
from types import FrameType


class PatchError(RuntimeError):
    """A patch could not be applied and the user asked for strict mode (``SHIM_STRICT=1``).

    Outside strict mode the same problem is only logged and shown by ``python -m shim``.
    """


class ShimWarning(UserWarning):
    """A configuration problem the shim worked around (bad environment value, shadowed package)."""


ALL = frozenset({"all", "1", "true", "*"})
NONE = frozenset({"", "0", "false", "none"})
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"", "0", "false", "no", "off"})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: How a patch is named: lower-case words joined by ``-`` (``checkpointing-restore``).
PATCH_NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
# Frames a warning must not be attributed to: the shim's own (a patch is applied from inside the
# user's ``import transformers``, through the shim's import hooks), wrapt's and importlib's.
_OWN_DIRECTORY = os.path.dirname(os.path.abspath(__file__))
_NOT_THE_CALLER = (_OWN_DIRECTORY + os.sep, os.sep + "wrapt" + os.sep, os.sep + "importlib" + os.sep)

_warned: set[str] = set()


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning issued by the caller of this function at the first
    frame outside the shim, wrapt and importlib: the user's ``import shim``, ``import transformers``
    or ``shim.enable(...)`` line.

    Frames are counted the way :func:`warnings.warn` counts them: it skips importlib's
    ``_bootstrap`` frames by itself.
    """
    frame: FrameType | None = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):
            if not any(part in filename for part in _NOT_THE_CALLER):
                return level
            level += 1
        frame = frame.f_back
    return level


def warn_once(message: str) -> None:
    """Warn about a configuration problem once per process, pointing at the user's code."""
    if message in _warned:
        return
    _warned.add(message)
    logging.getLogger("shim").warning(message)
    warnings.warn(message, ShimWarning, stacklevel=_user_stacklevel())


def canonical(name: str) -> str:
    """``name`` as the patch names are written: lower case, words joined by ``-``."""
    return name.strip().lower().replace("_", "-")


class Settings:
    """The switches read from the environment (a plain class: ``import shim`` builds no namedtuple)."""

    __slots__ = ("disable_all", "disabled", "forced", "strict")

    def __init__(self, disable_all: bool, disabled: frozenset[str], forced: frozenset[str], strict: bool) -> None:
        self.disable_all = disable_all
        self.disabled = disabled
        self.forced = forced
        self.strict = strict


def did_you_mean(name: str, known: Iterable[str], otherwise: str = "python -m shim lists them", width: int = 0) -> str:
    """``did you mean a, b?`` with the known names closest to ``name`` (as many of three as keep
    the hint within ``width`` characters, when given), or ``otherwise``."""
    import difflib  # only on this error: it would cost every ``import shim`` half a millisecond

    close = difflib.get_close_matches(canonical(name), list(known), n=3, cutoff=0.5)
    while width and close and len(f"did you mean {', '.join(close)}?") > width:
        close.pop()
    return f"did you mean {', '.join(close)}?" if close else otherwise


def _names(variable: str, known: Iterable[str], *, allow_all: bool) -> tuple[bool, frozenset[str]]:
    """Whether ``variable`` names every patch, and the known patch names it lists.

    The value is a comma-separated list, read item by item: an empty item (``name,,``, ``all,``) and
    ``0``/``false``/``none`` are nothing; ``all`` (also ``1``, ``true``, ``*``) means every patch,
    alone or inside a list, where ``allow_all``; every other item is a patch name. Each item that is
    not a known name gets its own warning.
    """
    known = sorted(known)
    everything, found = False, set()
    for part in os.environ.get(variable, "").split(","):
        item = part.strip()
        if item.lower() in NONE:
            continue
        if item.lower() in ALL:
            if allow_all:
                everything = True
            else:
                warn_once(f"{variable}: {item!r} is not accepted, ignored; {variable} takes patch names only")
            continue
        name = canonical(item)
        if name in known:
            found.add(name)
        elif PATCH_NAME.match(name):
            hint = did_you_mean(name, known, otherwise="known patches: " + ", ".join(known))
            warn_once(f"{variable} names an unknown patch {item!r}, ignored; {hint}")
        else:
            valid = "'all' or " if allow_all else ""
            warn_once(
                f"{variable}: {item!r} is not a patch name, ignored; {variable} takes {valid}"
                f"a comma-separated list of patch names ({', '.join(known)})"
            )
    return everything, frozenset(found)


def flag(variable: str) -> bool:
    """A boolean variable; a value that is neither true nor false warns and reads as off."""
    raw = os.environ.get(variable, "").strip().lower()
    if raw in TRUE:
        return True
    if raw not in FALSE:
        warn_once(f"{variable}={raw!r} is not valid; use one of {', '.join(sorted(TRUE | FALSE - {''}))}; using off")
    return False


def read(known: Iterable[str]) -> Settings:
    """Read ``SHIM_DISABLE``, ``SHIM_FORCE`` and ``SHIM_STRICT`` against the known patch names."""
    known = tuple(known)
    disable_all, disabled = _names("SHIM_DISABLE", known, allow_all=True)
    _, forced = _names("SHIM_FORCE", known, allow_all=False)
    return Settings(disable_all, disabled, forced, flag("SHIM_STRICT"))


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
        warn_once(f"SHIM_LOG_LEVEL={raw!r} is not valid; use one of {', '.join(LOG_LEVELS)}; leaving it unset")
        return
    logger.setLevel(raw.upper())
    if all(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
