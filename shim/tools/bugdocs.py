"""The story of each patch's bug, from ``docs/bugs.md``, which the wheel ships as ``shim/docs/bugs.md``.

``python -m shim explain <patch>`` prints a patch's section, fitted to the terminal's 100 columns.
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
from pathlib import Path

from ..packs import GROUP
from ..ranges import version_range
from ..registry import Registry
from ..statuses import links

_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_ITEM = re.compile(r"^(\s*)([-*]|\d+\.) ")
_HEADING = re.compile(r"^#{1,6} ")
_CODE = re.compile(r"(`+)(.+?)\1")
_STRONG = re.compile(r"\*\*(.+?)\*\*")
_EMPHASIS = re.compile(r"(?<![\w*])\*(?=\S)(.+?)(?<=\S)\*(?![\w*])")


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


def of_pack(registry: Registry, name: str) -> str | None:
    """A patch pack's patch told from its own text, as ``explain`` shows a built-in's section: its
    summary, where it comes from and its gate, the docstring of the module that declares it, and
    its references. ``None`` for a patch that is not a pack's."""
    declared = registry.declared(name)
    if not declared.foreign:
        return None
    try:
        patch = registry.patch(name)  # its module imported, where it was not (switched off, say)
    except Exception as exc:
        return f"## {name}\n\n{exc}"  # which pack, and why its module cannot be imported
    module = sys.modules.get(declared.module)
    story = inspect.getdoc(module) if module is not None else None
    lines = [
        f"## {name}",
        "",
        patch.summary,
        "",
        f"From the patch pack {declared.provider} {declared.version} (entry point {GROUP}: "
        f"{declared.entry_point}); it applies to {patch.distribution}{version_range(patch.requires)}.",
        "",
        story or f"{declared.module} has no docstring: the pack's author writes the story there.",
    ]
    if patch.references:
        lines += ["", "References: " + ", ".join(links(patch.references))]
    return "\n".join(lines)


def reflow(markdown: str, width: int, plain: bool = False) -> str:
    """``markdown`` for a terminal: paragraphs and list items wrapped to ``width``, links as
    ``text (address)``; code blocks and tables are left as they are (quoted error text stays whole).
    ``plain``: as text rather than Markdown, the way ``explain`` prints it: no heading marks, no
    emphasis marks or backticks, code blocks indented instead of fenced."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if block:
            item = _ITEM.match(block[0])
            first = item.group(0) if item else ""
            text = " ".join(line.strip() for line in block)[len(first.strip()) :].strip()
            if plain:
                text = unmarked(text)
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
        if plain and line.startswith("```"):
            flush()
            fenced = not fenced
        elif plain and fenced:
            out.append(f"    {line}".rstrip())
        elif line.startswith("```") or fenced or line.startswith("|"):
            flush()
            fenced = fenced != line.startswith("```")
            out.append(line)
        elif plain and _HEADING.match(line):
            flush()
            out.append(unmarked(_HEADING.sub("", line)))
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


def unmarked(text: str) -> str:
    """``text`` without Markdown's inline marks: ``**bold**``, ``*emphasis*`` and code spans' backticks
    (what a code span holds is kept as it is, ``*args`` too)."""
    parts = _CODE.split(text)  # [text, ticks, code, text, ticks, code, ..., text]
    out = []
    for index in range(0, len(parts), 3):
        out.append(_EMPHASIS.sub(r"\1", _STRONG.sub(r"\1", parts[index])))
        if index + 2 < len(parts):
            out.append(parts[index + 2].strip() if len(parts[index + 1]) > 1 else parts[index + 2])
    return "".join(out)
