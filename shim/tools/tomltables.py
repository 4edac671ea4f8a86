"""The tables of a TOML file (a ``pyproject.toml``), found as TOML finds them and rewritten in place.

A tool that writes a table of a pack's ``pyproject.toml`` (``python -m shim index``) replaces
that table's lines and leaves every other byte as it was: the comments, the quoting, the line endings
(CRLF stays CRLF). A table is found by its parsed key, as TOML reads a header, not by its text:
``[project.entry-points."hf_train_shim.targets"]``, ``[ project . entry-points . 'hf_train_shim.targets' ]``
and ``["project"."entry-points"."hf_train_shim.targets"]`` are one table, and
``[project.entry-points.hf_train_shim.targets]`` (a bare dotted key: four keys) is another. A line inside
a multi-line string or array is no header. Python 3.10 has no TOML reader, so this reads headers only;
where ``tomllib`` is there (3.11) the result is parsed before it is handed back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", "e": "\x1b", '"': '"', "\\": "\\"}
_HEX = {"x": 2, "u": 4, "U": 8}  # \xHH (TOML 1.1), \uHHHH, \UHHHHHHHH: how many digits follow
_HEX_DIGITS = re.compile(r"[0-9A-Fa-f]+")


class TableError(ValueError):
    """The table cannot be rewritten in place: the message says why and what to do."""


def header_key(line: str) -> tuple[tuple[str, ...], bool] | None:
    """The key of the table header on ``line`` and whether it is an array of tables (``[[...]]``),
    or ``None`` where the line is no header: ``'[a . "b.c"]  # note'`` -> ``(("a", "b.c"), False)``."""
    text = line.strip(" \t\r\n")
    array = text.startswith("[[")
    if not text.startswith("["):
        return None
    key: list[str] = []
    at = 2 if array else 1
    while True:
        at = _skip_blanks(text, at)
        found = _simple_key(text, at)
        if found is None:
            return None
        part, at = found
        key.append(part)
        at = _skip_blanks(text, at)
        if not text.startswith(".", at):
            break
        at += 1
    close = "]]" if array else "]"
    if not text.startswith(close, at):
        return None
    rest = text[at + len(close) :].lstrip(" \t")
    return (tuple(key), array) if not rest or rest.startswith("#") else None


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t":
        at += 1
    return at


def _simple_key(text: str, at: int) -> tuple[str, int] | None:
    """The bare, 'literal' or "basic" key at ``text[at]``, and where it ends."""
    if text.startswith("'", at):
        end = text.find("'", at + 1)
        return None if end < 0 else (text[at + 1 : end], end + 1)
    if text.startswith('"', at):
        return _basic_string(text, at + 1)
    bare = _BARE.match(text, at)
    return None if bare is None else (bare.group(), bare.end())


def _basic_string(text: str, at: int) -> tuple[str, int] | None:
    """The "basic string" whose text starts at ``text[at]``, its escapes read, and where it ends."""
    out: list[str] = []
    while at < len(text):
        char = text[at]
        if char == '"':
            return "".join(out), at + 1
        if char != "\\":
            out.append(char)
            at += 1
            continue
        code = text[at + 1 : at + 2]
        if code in _ESCAPES:
            out.append(_ESCAPES[code])
            at += 2
        elif code in _HEX:
            digits = text[at + 2 : at + 2 + _HEX[code]]
            if len(digits) != _HEX[code] or not _HEX_DIGITS.fullmatch(digits) or int(digits, 16) > 0x10FFFF:
                return None
            out.append(chr(int(digits, 16)))
            at += 2 + _HEX[code]
        else:
            return None
    return None


def headers(lines: Sequence[str]) -> list[tuple[int, tuple[str, ...], bool]]:
    """Every table header among ``lines``: its index, key, and whether it is an array of tables. A line
    that starts inside a multi-line string or a multi-line array (or inline table) is no header."""
    found = []
    string, depth = "", 0  # the multi-line string open (its three quotes), the brackets open
    for index, line in enumerate(lines):
        if not string and not depth:
            header = header_key(line)
            if header is not None:
                found.append((index, *header))
                continue
        string, depth = _scan(line, string, depth)
    return found


def _scan(line: str, string: str, depth: int) -> tuple[str, int]:
    """The multi-line string and the bracket depth still open after ``line`` (a value's line)."""
    at = 0
    while at < len(line):
        if string:
            if line[at] == "\\" and string == '"""':
                at += 2
            elif line.startswith(string, at):
                at, string = at + 3, ""
            else:
                at += 1
            continue
        char = line[at]
        if char == "#":
            break
        if line.startswith(('"""', "'''"), at):
            at, string = at + 3, line[at : at + 3]
            continue
        if char in "\"'":
            end = at + 1
            while end < len(line) and line[end] != char:
                end += 2 if char == '"' and line[end] == "\\" else 1
            at = end + 1
            continue
        depth = depth + 1 if char in "[{" else max(depth - 1, 0) if char in "]}" else depth
        at += 1
    return string, depth


def lines_of(text: str) -> list[str]:
    """``text``'s lines, each with its own line ending (``\\n`` or ``\\r\\n``; nothing else splits)."""
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def span(lines: Sequence[str], key: Sequence[str]) -> tuple[int, int] | None:
    """Where the table ``key`` is among ``lines``: its header's index, and the index after its last
    line that is not blank (``None`` where it has no header)."""
    found = headers(lines)
    for number, (start, header, array) in enumerate(found):
        if header == tuple(key) and not array:
            end = found[number + 1][0] if number + 1 < len(found) else len(lines)
            while end > start + 1 and not lines[end - 1].strip():  # the blank lines before the next table stay
                end -= 1
            return start, end
    return None


def header_line(key: Sequence[str]) -> str:
    """The header of the table ``key``, each part bare where TOML allows it, else "quoted"."""
    return "[" + ".".join(part if _BARE.fullmatch(part) else _quoted(part) for part in key) + "]"


def _quoted(part: str) -> str:
    escaped = part.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped) + '"'


def with_table(text: str, key: Sequence[str], body: Sequence[str], after: Sequence[str] = ()) -> str:
    """``text`` with the lines of the table ``key`` (its header kept as written) replaced by ``body``
    (lines without their ending); where there is no such table, a new one after the table ``after``,
    or at the end. The new lines end as ``text``'s first line does. Raises :class:`TableError`
    where ``text`` (or the result, where ``tomllib`` can tell) is no TOML that this can edit."""
    newline = "\r\n" if text.partition("\n")[0].endswith("\r") else "\n"
    lines = lines_of(text)
    new = [line + newline for line in body]
    mine = span(lines, key)
    if mine is not None:  # below its header, in place of its lines
        head, tail = lines[: mine[0] + 1], lines[mine[1] :]
    else:  # after the table ``after`` (its blank lines stay below), or at the end
        place = span(lines, after) if after else None
        at = len(lines) if place is None else place[1]
        head, tail = lines[:at], lines[at:]
    if head and not head[-1].endswith("\n"):  # the file's last line
        head[-1] += newline
    if mine is None:
        new = [*([newline] if head and head[-1].strip() else []), header_line(key) + newline, *new]
    result = "".join([*head, *new, *tail])
    _check(text, result, key, found=mine is not None)
    return result


def _check(text: str, result: str, key: Sequence[str], found: bool) -> None:
    """Where ``tomllib`` is there: ``text`` parses, ``key`` is no table written another way
    (dotted keys, an inline table) where it has no header, and ``result`` parses."""
    try:
        import tomllib  # type: ignore[import-not-found, unused-ignore]  # Python 3.11 and later
    except ImportError:
        return
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TableError(f"it is not valid TOML ({exc})") from None
    for part in key:
        data = data.get(part) if isinstance(data, dict) else None
    if data is not None and not found:
        raise TableError(f"{header_line(key)} is written without its own header: write it as that table")
    try:
        tomllib.loads(result)
    except tomllib.TOMLDecodeError as exc:
        raise TableError(f"the table {header_line(key)} cannot be written in it ({exc})") from None
