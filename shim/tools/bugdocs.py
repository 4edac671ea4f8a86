"""The story of each patch's bug, from ``docs/bugs.md``, which the wheel ships as ``shim/docs/bugs.md``.

``python -m shim explain <patch>`` prints a patch's section, fitted to the terminal's 100 columns.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_ITEM = re.compile(r"^(\s*)([-*]|\d+\.) ")


def path() -> Path | None:
    """``bugs.md`` of this install: in the package (a wheel), or in the checkout (an editable install)."""
    package = Path(__file__).resolve().parents[1]  # shim/
    for candidate in (package / "docs" / "bugs.md", package.parent / "docs" / "bugs.md"):
        if candidate.is_file():
            return candidate
    return None


def section(name: str) -> str | None:
    """The section of ``bugs.md`` whose heading is ``name``, heading included; ``None`` without one."""
    found = path()
    if found is None:
        return None
    for part in re.split(r"^## ", found.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
        if part.splitlines()[0].strip() == name:
            return ("## " + part).rstrip()
    return None


def reflow(markdown: str, width: int) -> str:
    """``markdown`` for a terminal: paragraphs and list items wrapped to ``width``, links as
    ``text (address)``; code blocks and tables are left as they are (quoted error text stays whole)."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if block:
            item = _ITEM.match(block[0])
            first = item.group(0) if item else ""
            text = " ".join(line.strip() for line in block)[len(first.strip()) :].strip()
            more = " " * len(first)
            wrapped = textwrap.wrap(
                text,
                width,
                initial_indent=first,
                subsequent_indent=more,
                break_long_words=False,
                break_on_hyphens=False,
            )
            out.extend(wrapped)
            block.clear()

    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```") or fenced or line.startswith("|"):
            flush()
            fenced = fenced != line.startswith("```")
            out.append(line)
        elif not line.strip():
            flush()
            out.append("")
        else:
            if _ITEM.match(line):
                flush()
            block.append(
                _LINK.sub(lambda m: m.group(1) if "://" not in m.group(2) else f"{m.group(1)} ({m.group(2)})", line)
            )
    flush()
    return "\n".join(out)
