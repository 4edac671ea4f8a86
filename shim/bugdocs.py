"""The story of each patch's bug, from ``docs/bugs.md``, which the wheel ships as ``shim/docs/bugs.md``.

``python -m shim explain <patch>`` prints a patch's section, fitted to the terminal's 100 columns;
:func:`links` turns a patch's ``references`` into what works outside the repository (``shim.status()``,
``python -m shim --json``): a public ``owner/repo#N`` becomes its GitHub address, the patch's own
``docs/bugs.md#<patch>`` the command that prints that section.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable
from pathlib import Path

_PUBLIC = re.compile(r"^([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)#(\d+)$")
_OWN = "docs/bugs.md#"
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_ITEM = re.compile(r"^(\s*)([-*]|\d+\.) ")


def path() -> Path | None:
    """``bugs.md`` of this install: in the package (a wheel), or in the checkout (an editable install)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "docs" / "bugs.md", here.parent / "docs" / "bugs.md"):
        if candidate.is_file():
            return candidate
    return None


def links(references: Iterable[str]) -> tuple[str, ...]:
    """``references`` as a user outside the repository can follow them."""
    out = []
    for reference in references:
        public = _PUBLIC.match(reference)
        if public:  # GitHub sends an issue number that is a pull request to the pull request
            out.append(f"https://github.com/{public.group(1)}/issues/{public.group(2)}")
        elif reference.startswith(_OWN):
            out.append(f"python -m shim explain {reference[len(_OWN) :]}")
        else:
            out.append(reference)
    return tuple(out)


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
