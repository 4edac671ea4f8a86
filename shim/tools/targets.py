"""The tools' own imports of the patches' target modules (doctor, ``--import-targets``, bug-report),
without the notices those modules give a user who imports them: the user did not.

Only the notices named in :data:`OWN_IMPORT_NOTICES` are hidden, by their category, and only around
the tools' import; a notice the module gives later, or any other warning, shows as it would.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..registry import Registry

#: ``(module prefix, module that defines the category, category)``: trl warns on every import of
#: ``trl.experimental`` (``TRLExperimentalWarning``), which the shim imports for
#: ``kbit-prepare-keeps-checkpointing``'s target ``trl.experimental.utils``.
OWN_IMPORT_NOTICES = (("trl.experimental", "trl.import_utils", "TRLExperimentalWarning"),)


def quiet_transformers() -> None:
    """Silence transformers' progress bars and info logs for a readable report (if it is there)."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def import_quietly(name: str) -> ModuleType:
    """``importlib.import_module(name)``, without the notices of :data:`OWN_IMPORT_NOTICES` it gives."""
    with warnings.catch_warnings():
        for prefix, home, category in OWN_IMPORT_NOTICES:
            if name != prefix and not name.startswith(prefix + "."):
                continue
            try:
                notice = getattr(importlib.import_module(home), category)
            except Exception:  # a release without it gives no such notice
                continue
            if isinstance(notice, type) and issubclass(notice, Warning):
                warnings.filterwarnings("ignore", category=notice)
        return importlib.import_module(name)


def import_targets(registry: Registry, names: Iterable[str]) -> list[str]:
    """Import the target modules of the patches ``names`` and those their bug probes need, so that
    each applies or is skipped now; returns what could not be imported (``"<module> cannot be
    imported (<why>)"``), which the status and doctor tell."""
    missing = []
    for name in names:
        patch = registry.patch(name)
        needed = [module for probe in patch.probes for module in probe.needs]
        for module_name in dict.fromkeys([*patch.modules, *needed]):
            try:
                import_quietly(module_name)
            except Exception as exc:  # ImportError; OSError from a library that cannot load (a CUDA-only torch)
                missing.append(f"{module_name} cannot be imported ({exc})")
    return missing
