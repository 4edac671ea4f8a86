"""Loading the built-in patches from the ``patches`` package that ships with the shim."""

from __future__ import annotations

import importlib
import logging
import sys

from .patch import Patch
from .settings import warn_once

log = logging.getLogger("shim")

#: Set in ``patches/__init__.py``; a ``patches`` module without it is someone else's.
MARKER = "HF_TRAIN_SHIM_CATALOGUE"


def builtin_patches() -> list[Patch]:
    """Every ``PATCH`` declared by the modules listed in ``patches.MODULES``.

    If another module called ``patches`` (a local file or folder of the user's) shadows ours,
    the shim warns and runs without built-in patches rather than failing obscurely.
    """
    try:
        package = importlib.import_module("patches")
    except ImportError as exc:
        warn_once(f"the shim's 'patches' package could not be imported ({exc}); no built-in patches are active")
        return []
    if not getattr(package, MARKER, False):
        where = getattr(package, "__file__", None) or getattr(package, "__path__", None) or "<unknown>"
        warn_once(
            f"a module named 'patches' at {where} shadows hf-train-shim's own 'patches' package, "
            "so no built-in patches are active; rename your module (or remove its folder from sys.path "
            "before 'import shim')"
        )
        return []
    found = []
    for module_name in package.MODULES:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        found.append(module.PATCH)
    return found
