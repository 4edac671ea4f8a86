"""Every patch's record: what the registry knows of a patch before its module is imported.

A built-in's record is a row of the generated ``shim.patches.INDEX``; a patch pack's comes from
its distribution's metadata (``shim.packs``). Both are a :class:`Listing`, the same plain data:
name, module, provider, target modules, place and ``after`` (``shim.order``), and the gate where
the record holds it. ``import shim`` reads the records only, which is all the registry needs to
order the patches and hook the imports; :meth:`Listing.load` is the one step that imports a patch's
module (when a target is imported, or a status asks), and it refuses a ``Patch`` that its record
no longer describes, naming the command that rewrites the record.

Both kinds of record are written from the patches' own ``Patch`` declarations by one generator,
``python -m shim index`` (``shim.tools.index``): in this repository it rewrites the built-ins'
index, in a pack's folder the pack's entry-point tables; ``--check`` says whether they are current.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import importhooks
from .settings import PackError, warn_once

if TYPE_CHECKING:
    from .patch import Patch

PACKAGE = f"{__package__}.patches"
#: What ``PatchStatus.provider`` says of a built-in patch: this distribution (a pack's names its own).
PROVIDER = "hf-train-shim"
#: What to do where a record is stale, a built-in's and a pack's.
BUILTIN_REWRITE = "run python -m shim index in hf-train-shim's checkout"
PACK_REWRITE = "run python -m shim index in the pack and reinstall it"


class Unfinished(Exception):
    """A patch's module that is still executing (it imported one of its own targets at its top):
    its ``Patch`` can be had once its import has finished."""

    def __init__(self, module: str) -> None:
        super().__init__(f"{module} is still being imported")
        self.module = module


class Listing:
    """One patch's record, read before its module is imported: what a registry holds of every patch.

    ``distribution`` and ``requires``, its gate, are ``None`` where the record does not hold them
    (a pack's: an entry point cannot carry a version range, so its gate is read from its ``Patch``
    once :meth:`load` has imported it). ``note``: what its status adds (a pack's ``after`` that
    was dropped at ``import shim``)."""

    __slots__ = (
        "name", "module", "attribute", "provider", "version", "distribution", "requires", "place", "after",
        "modules", "note", "_given",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        module: str,
        modules: tuple[str, ...],
        *,
        attribute: str = "PATCH",
        provider: str = PROVIDER,
        version: str = "",
        distribution: str | None = None,
        requires: str | None = None,
        place: str = "",
        after: tuple[str, ...] = (),
    ) -> None:
        self.name, self.module, self.attribute = name, module, attribute
        self.provider, self.version = provider, version
        self.distribution, self.requires = distribution, requires
        self.place, self.after, self.modules = place, after, modules
        self.note = ""
        self._given: Patch | None = None

    @classmethod
    def of(cls, patch: Patch) -> Listing:
        """The record of a ``Patch`` given to ``shim.register()``: it is its own declaration."""
        record = cls(
            patch.name,
            "",
            patch.modules,
            attribute="",
            provider="",
            distribution=patch.distribution,
            requires=patch.requires,
            place=patch.place,
            after=tuple(patch.after),
        )
        record._given = patch
        return record

    @property
    def foreign(self) -> bool:
        """A patch pack's (its module is another distribution's): not imported to be shown while it
        is switched off."""
        return self.provider not in (PROVIDER, "")

    @property
    def entry_point(self) -> str:
        return f"{self.name} = {self.module}:{self.attribute}"

    def load(self) -> Patch:
        """The record's ``Patch``, its module imported the first time. Raises :class:`Unfinished`
        while that module is still executing, and, where the ``Patch`` cannot be had or its record
        is stale, an ``ImportError`` (for a pack a :class:`shim.settings.PackError`, warned about
        once) that says why and what to do."""
        if self._given is not None:
            return self._given
        found = sys.modules.get(self.module)
        if found is not None and importhooks.executing(found):
            raise Unfinished(self.module)
        from .patch import Patch  # only here, where a patch's module is imported: it imports ``packaging``

        try:
            value: object = importlib.import_module(self.module)
            for part in self.attribute.split("."):
                value = getattr(value, part)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a broken pack (an argparse at its top exits): never the user's import
            if not self.foreign:
                raise ImportError(f"the patch module cannot be imported: {exc!r}") from exc
            raise self.refused(f"cannot be imported ({exc!r}): fix the pack, or uninstall {self.provider}") from None
        if not isinstance(value, Patch):
            raise self.refused(f"is a {type(value).__name__}, not a shim.Patch: point the entry point at its Patch")
        problem = self.stale(value)
        if problem:
            raise self.refused(problem)
        return value

    def stale(self, patch: Patch) -> str:
        """Where the record no longer describes ``patch``, why, and the command that rewrites it."""
        said = []
        if patch.name != self.name:
            said.append(f"its record names the patch {self.name!r}, its module's Patch is {patch.name!r}")
        if set(patch.modules) != set(self.modules):
            said.append(
                f"its record lists the target modules {', '.join(self.modules)}, its Patch targets "
                f"{', '.join(patch.modules)}"
            )
        if (patch.place, tuple(patch.after)) != (self.place, tuple(self.after)):
            said.append(
                f"its record places it {_order_words(self.place, self.after)}, its Patch "
                f"{_order_words(patch.place, patch.after)}"
            )
        if not said:
            return ""
        return f"{'; '.join(said)}: {PACK_REWRITE if self.foreign else BUILTIN_REWRITE}"

    def refused(self, problem: str) -> ImportError:
        """The error that :meth:`load` raises: for a pack's record, warned about once (strict mode
        raises where the patch applies)."""
        if not self.foreign:
            return ImportError(f"{self.module}: {problem}")
        message = pack_message(self, problem)
        warn_once(message)
        return PackError(message)

    def __repr__(self) -> str:
        return f"<Listing {self.name} ({self.module}) of {self.provider}>"


def pack_message(record: Listing, problem: str) -> str:
    """A pack's problem as its warning and status say it: which pack, which entry point, why."""
    return (
        f"patch pack {record.provider} {record.version}, entry point hf_train_shim.patches "
        f"'{record.entry_point}': {problem}; this patch is left out, the rest of the shim works"
    )


def _order_words(place: str, after: Sequence[str]) -> str:
    where = repr(place) if place else "in between"
    return f"{where}, after {', '.join(after)}" if after else where


def builtin() -> list[Listing]:
    """Every built-in patch, in the index's order; none (with a warning) if the catalogue is missing."""
    try:
        patches = importlib.import_module(PACKAGE)
    except ImportError as exc:
        warn_once(
            f"hf-train-shim's catalogue shim.patches cannot be imported ({exc}), so no built-in patch is "
            "active; install the shim (pip install hf-train-shim, or pip install -e . in a clone) instead "
            "of putting its folder on sys.path"
        )
        return []
    return [
        Listing(
            row["name"],
            f"{PACKAGE}.{row['module']}",
            row["modules"],
            distribution=row["distribution"],
            requires=row["requires"],
            place=row.get("place", ""),
            after=row.get("after", ()),
        )
        for row in patches.INDEX
    ]
