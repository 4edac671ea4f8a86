"""``python -m shim pack-index [DIR] [--check]``: write a patch pack's list of target modules.

A pack's ``pyproject.toml`` declares its patches in ``[project.entry-points."hf_train_shim.patches"]``.
This imports each patch's module (``DIR/src`` and ``DIR`` first on ``sys.path``, so it works before the
pack is installed) and writes, from each ``Patch``'s targets, the table the shim reads to import a
patch's module only when one of its target modules is (``shim.packs``)::

    [project.entry-points."hf_train_shim.targets"]
    "my-fix.transformers.trainer_utils" = "transformers.trainer_utils"

Each entry point's name is the patch's name, a dot, and the module (entry-point names must be
unique); its value is the module. ``--check`` changes nothing and exits 1 where the table is stale
(a pack's own test runs it). A development tool: nothing of it runs at ``import shim``.
"""

from __future__ import annotations

import importlib
import os
import sys

from ..packs import GROUP, TARGETS
from .run import say
from .tomltables import TableError, header_line, lines_of, span, with_table

#: The keys of the tables of ``pyproject.toml`` this reads and writes.
PATCHES_KEY = ("project", "entry-points", GROUP)
TARGETS_KEY = ("project", "entry-points", TARGETS)
PATCHES = header_line(PATCHES_KEY)
NOTE = [
    "# Written by `python -m shim pack-index` from each patch's targets: the shim imports a patch's",
    "# module only once one of these modules is imported. Run it again when a target changes.",
]


class CannotIndex(Exception):
    """The pack cannot be indexed: the message says why and what to do."""


def declared_patches(text: str) -> dict[str, str]:
    """``{patch name: "module:attribute"}`` of the ``hf_train_shim.patches`` table of a
    ``pyproject.toml``'s text, written as the guide and ``new-pack`` write it: its header (quoted
    any way TOML allows), then one ``name = "module:attribute"`` a line (read line by line, as
    :func:`~shim.tools.tomltables.with_table` edits the file: Python 3.10 has no TOML reader)."""
    lines = lines_of(text)
    found = span(lines, PATCHES_KEY)
    if found is None:
        raise CannotIndex(f'no {PATCHES} table: declare each patch there, one my-fix = "my_pack.fixes:PATCH" a line')
    patches = {}
    for line in (line.strip() for line in lines[found[0] + 1 : found[1]]):
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            patches[name.strip().strip("\"'")] = value.partition("#")[0].strip().strip("\"'")
    if not patches:
        raise CannotIndex(f"the {PATCHES} table declares no patch")
    return patches


def targets(folder: str, patches: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """``{patch name: its target modules}`` for ``patches``, their modules imported from ``folder``."""
    from ..patch import Patch

    sys.path[:0] = [os.path.join(folder, "src"), folder]
    out = {}
    for name, value in patches.items():
        module_name, _, attribute = value.partition(":")
        try:
            found: object = importlib.import_module(module_name.strip())
            for part in attribute.strip().split("."):
                found = getattr(found, part)
        except Exception as exc:
            raise CannotIndex(f"{name} = {value!r} cannot be imported: {exc!r}") from None
        if not isinstance(found, Patch) or found.name != name:
            raise CannotIndex(f"{name} = {value!r} is not the shim.Patch named {name!r}")
        out[name] = found.modules
    return out


def entries(modules: dict[str, tuple[str, ...]]) -> list[str]:
    """The lines of the ``hf_train_shim.targets`` table listing ``{patch name: its target modules}``."""
    lines = list(NOTE)
    for name, names in modules.items():
        lines += [f'"{name}.{module}" = "{module}"' for module in names]
    return lines


def block(modules: dict[str, tuple[str, ...]]) -> str:
    """The ``hf_train_shim.targets`` table listing ``{patch name: its target modules}``, header first."""
    return "\n".join([header_line(TARGETS_KEY), *entries(modules)]) + "\n"


def rewritten(text: str, modules: dict[str, tuple[str, ...]]) -> str:
    """``text`` with its ``hf_train_shim.targets`` table listing ``modules``; where there is none, one
    added after the patches table (or at the end)."""
    try:
        return with_table(text, TARGETS_KEY, entries(modules), after=PATCHES_KEY)
    except TableError as exc:
        raise CannotIndex(str(exc)) from None


def index(folder: str, check: bool = False) -> int:
    """Write (or ``check``) the target modules of the pack in ``folder``: 0 done or current, 1 stale
    (``check``), 2 it cannot be indexed (said on stderr)."""
    path = os.path.join(os.path.abspath(folder), "pyproject.toml")
    try:
        with open(path, encoding="utf-8", newline="") as file:  # its line endings as they are
            text = file.read()
        new = rewritten(text, targets(os.path.dirname(path), declared_patches(text)))
    except (OSError, UnicodeDecodeError, CannotIndex) as exc:
        say(f"python -m shim pack-index: {path}: {exc}")
        return 2
    if new == text:
        print(f"{path}: the target modules are listed")
        return 0
    if check:
        say(f"{path}: the target modules listed are not the patches' own: run python -m shim pack-index")
        return 1
    with open(path, "w", encoding="utf-8", newline="") as file:
        file.write(new)
    print(f"{path}: target modules listed in {TARGETS}")
    return 0
