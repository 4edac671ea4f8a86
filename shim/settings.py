"""Environment variables, parsed with a warning (and the default) for every bad value.

They are read each time a patch is applied, so a variable set before the target library is
imported still takes effect.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Iterable

from .errors import ShimWarning

ALL = frozenset({"all", "1", "true", "*"})
NONE = frozenset({"", "0", "false", "none"})
TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"", "0", "false", "no", "off"})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_NAME = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")

_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Warn about a configuration problem once per process."""
    if message in _warned:
        return
    _warned.add(message)
    logging.getLogger("shim").warning(message)
    warnings.warn(message, ShimWarning, stacklevel=3)


@dataclass(frozen=True)
class Settings:
    disable_all: bool
    disabled: frozenset[str]
    forced: frozenset[str]
    strict: bool


def _names(variable: str, known: Iterable[str], *, allow_all: bool) -> tuple[bool, frozenset[str]]:
    raw = os.environ.get(variable, "").strip()
    if raw.lower() in NONE:
        return False, frozenset()
    if allow_all and raw.lower() in ALL:
        return True, frozenset()
    known = sorted(known)
    names = [part.strip().lower() for part in raw.split(",") if part.strip()]
    bad = [name for name in names if not _NAME.match(name)]
    if bad:
        valid = "'all', " if allow_all else ""
        warn_once(
            f"{variable}={raw!r} is not valid ({', '.join(map(repr, bad))}); expected {valid}"
            f"a comma-separated list of patch names ({', '.join(known)}); ignoring it"
        )
        return False, frozenset()
    for name in names:
        if name not in known:
            import difflib  # only for the warning: it would cost every ``import shim`` half a millisecond

            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else f"known patches: {', '.join(known)}"
            warn_once(f"{variable} names an unknown patch {name!r}; {hint}")
    return False, frozenset(names)


def _flag(variable: str) -> bool:
    raw = os.environ.get(variable, "").strip().lower()
    if raw in TRUE:
        return True
    if raw not in FALSE:
        warn_once(f"{variable}={raw!r} is not valid; use one of {sorted(TRUE | FALSE - {''})}; using off")
    return False


def read(known: Iterable[str]) -> Settings:
    """Read ``SHIM_DISABLE``, ``SHIM_FORCE`` and ``SHIM_STRICT`` against the known patch names."""
    known = tuple(known)
    disable_all, disabled = _names("SHIM_DISABLE", known, allow_all=True)
    _, forced = _names("SHIM_FORCE", known, allow_all=False)
    return Settings(disable_all, disabled, forced, _flag("SHIM_STRICT"))


def configure_logging() -> None:
    """Apply ``SHIM_LOG_LEVEL`` to the ``shim`` logger, with a stderr handler if it has none."""
    logger = logging.getLogger("shim")
    raw = os.environ.get("SHIM_LOG_LEVEL", "").strip()
    if not raw:
        return
    if raw.upper() not in LOG_LEVELS:
        warn_once(f"SHIM_LOG_LEVEL={raw!r} is not valid; use one of {', '.join(LOG_LEVELS)}; leaving it unset")
        return
    logger.setLevel(raw.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
