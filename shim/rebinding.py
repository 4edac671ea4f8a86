"""Consumers' copies of a target: module-level names bound by ``from x import f`` before the shim
wrapped ``f`` (``Patch.consumers``), pointed at the shim's layer and given back on removal."""

from __future__ import annotations

import fnmatch
import sys
from typing import Any


def rebind(
    patterns: tuple[str, ...], original: object, replacement: object
) -> tuple[list[tuple[Any, str]], list[tuple[str, str]]]:
    """Point module-level names equal to ``original`` in modules matching ``patterns`` at ``replacement``.

    Returns ``(rebound, failed)``: ``(module, attribute)`` pairs, so the rebinding can be undone.
    """
    rebound: list[tuple[Any, str]] = []
    failed: list[tuple[str, str]] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not any(fnmatch.fnmatchcase(module_name, p) for p in patterns):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attribute, value in list(namespace.items()):
            if value is not original:
                continue
            try:
                setattr(module, attribute, replacement)
            except Exception:  # a module that refuses assignment: reported in the status reason
                failed.append((module_name, attribute))
            else:
                rebound.append((module, attribute))
    return rebound, failed


def unbind(rebound: list[tuple[Any, str]], replacement: object, original: object) -> None:
    """Undo :func:`rebind` where the name still points at our replacement."""
    for module, attribute in rebound:
        if getattr(module, attribute, None) is replacement:
            setattr(module, attribute, original)
