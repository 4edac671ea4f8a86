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

HEADER = f'[project.entry-points."{TARGETS}"]'
PATCHES = f'[project.entry-points."{GROUP}"]'
NOTE = (
    "# Written by `python -m shim pack-index` from each patch's targets: the shim imports a patch's\n"
    "# module only once one of these modules is imported. Run it again when a target changes."
)


class CannotIndex(Exception):
    """The pack cannot be indexed: the message says why and what to do."""


def declared_patches(text: str) -> dict[str, str]:
    """``{patch name: "module:attribute"}`` of the ``hf_train_shim.patches`` table of a
    ``pyproject.toml``'s text, written as the guide and ``new-pack`` write it: its header, then one
    ``name = "module:attribute"`` a line (read line by line, as :func:`rewritten` edits the file:
    Python 3.10 has no TOML reader)."""
    lines = [line.strip() for line in text.splitlines()]
    span = table_lines(lines, PATCHES)
    if span is None:
        raise CannotIndex(f'no {PATCHES} table: declare each patch there, one my-fix = "my_pack.fixes:PATCH" a line')
    patches = {}
    for line in lines[span[0] + 1 : span[1]]:
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


def block(modules: dict[str, tuple[str, ...]]) -> str:
    """The ``hf_train_shim.targets`` table listing ``{patch name: its target modules}``."""
    lines = [HEADER, NOTE]
    for name, names in modules.items():
        lines += [f'"{name}.{module}" = "{module}"' for module in names]
    return "\n".join(lines) + "\n"


def rewritten(text: str, new: str) -> str:
    """``text`` with its ``hf_train_shim.targets`` table replaced by ``new``; where there is none,
    ``new`` added after the patches table (or at the end)."""
    lines = text.splitlines(keepends=True)
    stripped = [line.strip() for line in lines]
    mine, after = table_lines(stripped, HEADER), table_lines(stripped, PATCHES)
    if mine is not None:
        return "".join([*lines[: mine[0]], new, *lines[mine[1] :]])
    if after is not None:
        return "".join([*lines[: after[1]], "\n", new, *lines[after[1] :]])
    return text.rstrip("\n") + "\n\n" + new


def table_lines(stripped: list[str], header: str) -> tuple[int, int] | None:
    """Where the table ``header`` is among the ``stripped`` lines of a ``pyproject.toml``: its header's
    index, and the index after its last line that is not blank (``None`` where it is not there)."""
    if header not in stripped:
        return None
    start = stripped.index(header)
    end = next((i for i in range(start + 1, len(stripped)) if stripped[i].startswith("[")), len(stripped))
    while end > start + 1 and not stripped[end - 1]:  # the blank lines before the next table stay
        end -= 1
    return start, end


def index(folder: str, check: bool = False) -> int:
    """Write (or ``check``) the target modules of the pack in ``folder``: 0 done or current, 1 stale
    (``check``), 2 it cannot be indexed (said on stderr)."""
    path = os.path.join(os.path.abspath(folder), "pyproject.toml")
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
        new = rewritten(text, block(targets(os.path.dirname(path), declared_patches(text))))
    except (OSError, UnicodeDecodeError, CannotIndex) as exc:
        say(f"python -m shim pack-index: {path}: {exc}")
        return 2
    if new == text:
        print(f"{path}: the target modules are listed")
        return 0
    if check:
        say(f"{path}: the target modules listed are not the patches' own: run python -m shim pack-index")
        return 1
    with open(path, "w", encoding="utf-8") as file:
        file.write(new)
    print(f"{path}: target modules listed in {TARGETS}")
    return 0
