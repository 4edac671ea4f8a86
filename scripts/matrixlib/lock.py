"""Locking a cell: its top-level pins re-resolved in a throwaway venv, the full pins written below them."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from .cells import ROOT, Cell, build_env, normalized, say

LOCK_MARKER = "# --- locked"


def top_pins(cell: Cell) -> tuple[str, set]:
    """The constraints file above the lock marker, and the names it pins."""
    top = cell.constraints.read_text().split(LOCK_MARKER)[0].rstrip("\n") + "\n"
    pinned = {
        normalized(re.split(r"[=<>!~ ]", line, maxsplit=1)[0])
        for line in top.splitlines()
        if line.strip() and not line.startswith("#")
    }
    return top, pinned


def lock(cell: Cell) -> None:
    """Resolve the cell's top-level pins in a throwaway venv and write its full ``pip freeze``."""
    top, pinned = top_pins(cell)
    with tempfile.TemporaryDirectory(dir=ROOT / ".venvs" if (ROOT / ".venvs").exists() else None) as tmp:
        constraints = Path(tmp) / "top.txt"
        constraints.write_text(top)
        env = build_env(cell) | {"SHIM_VENV": str(Path(tmp) / "venv"), "SHIM_COMPILE": "0"}
        subprocess.run(["bash", "scripts/setup.sh", str(constraints)], cwd=ROOT, env=env, check=True)
        freeze = subprocess.run(
            [str(Path(tmp) / "venv" / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    write_lock(cell, top, pinned, freeze)


def write_lock(cell: Cell, top: str, pinned: set, freeze: str) -> None:
    locked = sorted(
        (line for line in freeze.splitlines() if "==" in line and normalized(line.split("==")[0]) not in pinned),
        key=str.lower,
    )
    cell.constraints.write_text(
        top
        + f"{LOCK_MARKER}: the rest of the cell, written by `python3 scripts/matrix.py --lock {cell.name}` ---\n"
        + "\n".join(locked)
        + "\n"
    )
    say(f"{cell.constraints.relative_to(ROOT)}: {len(locked)} transitive pins written")
