"""The built-in patches, known from ``shim.patches.INDEX`` until one of their targets is imported.

``import shim`` reads the index only: it names each patch's target modules and gate, which is
all the registry needs to hook the imports. The patch module itself (and ``packaging``, and
whatever the patch needs) is imported when a target is, or when a status is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .settings import warn_once

if TYPE_CHECKING:
    from .patch import Patch


class Listing:
    """One built-in patch as the index declares it; :meth:`load` imports its module."""

    __slots__ = ("name", "module", "distribution", "requires", "modules")

    def __init__(self, name: str, module: str, distribution: str, requires: str, modules: tuple[str, ...]) -> None:
        self.name = name
        self.module = f"{__package__}.patches.{module}"
        self.distribution = distribution
        self.requires = requires
        self.modules = modules

    def load(self) -> Patch:
        patch: Patch = importlib.import_module(self.module).PATCH
        if patch.name != self.name:
            raise ImportError(f"{self.module} declares {patch.name!r}, the index says {self.name!r}")
        return patch

    def __repr__(self) -> str:
        return f"<Listing {self.name} ({self.module})>"


def builtin() -> list[Listing]:
    """Every built-in patch, in the index's order; none (with a warning) if the catalogue is missing."""
    try:
        patches = importlib.import_module(f"{__package__}.patches")
    except ImportError as exc:
        warn_once(
            f"hf-train-shim's catalogue shim.patches cannot be imported ({exc}), so no built-in patch is "
            "active; install the shim (pip install hf-train-shim, or pip install -e . in a clone) instead "
            "of putting its folder on sys.path"
        )
        return []
    return [Listing(*row) for row in patches.INDEX]
