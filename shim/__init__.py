"""hf-train-shim: ``import shim`` fixes known bugs of the installed transformers / trl / peft.

Each fix is a version-gated wrapt patch from the ``patches`` package. Importing ``shim`` activates
all of them: a patch whose target module is already imported is applied at once, the others right
after their module is first imported. ``shim`` itself imports neither torch nor transformers.

Public API::

    shim.status()                     # one PatchStatus per patch
    shim.activate(); shim.deactivate()
    shim.enable(*names); shim.disable(*names)
    with shim.disabled(*names): ...   # no names = all
    shim.register(patch)              # your own Patch, same registry
    shim.PatchError                   # raised only in strict mode (SHIM_STRICT=1)
"""

from __future__ import annotations

import logging

from . import catalogue, settings
from .errors import PatchError, ShimWarning
from .patch import Patch, Target
from .registry import APPLIED, DISABLED, FAILED, PENDING, SKIPPED, PatchStatus, Registry

__version__ = "0.1.0"
__all__ = [
    "Patch",
    "PatchError",
    "PatchStatus",
    "Registry",
    "ShimWarning",
    "Target",
    "activate",
    "deactivate",
    "disable",
    "disabled",
    "enable",
    "register",
    "registry",
    "status",
]

logging.getLogger("shim").addHandler(logging.NullHandler())
settings.configure_logging()

#: The process's registry of built-in patches (a reload of ``shim`` builds a new one, which adopts
#: the layers already in the targets instead of adding more).
registry = Registry(catalogue.builtin_patches())

status = registry.status
activate = registry.activate
deactivate = registry.deactivate
enable = registry.enable
disable = registry.disable
disabled = registry.disabled
register = registry.register

activate()
