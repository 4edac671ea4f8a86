"""How a version range, a run of numbers and a list of names are written for people: one way,
wherever the shim shows one.

A version range: ``packaging`` prints a ``SpecifierSet`` sorted as text (``<5.23,>=5.16``); a person
writes the lower bound first (``>=5.16,<5.23``). The status reasons, ``python -m shim``, doctor, the
exit report and the compatibility tables all print a range through :func:`version_range`, and the
patches declare theirs in that form (``tests/tools/test_ranges.py``), so a range reads the same
everywhere.

A run of numbers: ``0-3`` (:func:`runs`), for the layers ``shim.in_effect`` lists, the ranks and Ray
workers of the exit report, and the first-step audit's parameter names (``model.layers.{0..3}``,
in braces and with ``..`` there, since the run sits inside a dotted name).

A list of names reads ``a``, ``a and b``, ``a, b and c`` (:func:`and_`): the modules a patch waits
for, those a bug probe waits for.

Standard library only: ``import shim`` may load it, and nothing here needs ``packaging``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# Lower bounds and pins first, then upper bounds, then exclusions (``>=5.16,<5.23,!=5.20.1``).
_ORDER = {"===": 0, "==": 0, "~=": 0, ">=": 0, ">": 0, "<=": 1, "<": 1, "!=": 2}
_CLAUSE = re.compile(r"^\s*(===|==|~=|>=|<=|!=|>|<)\s*(\S+?)\s*$")


def version_range(specifier: object) -> str:
    """``specifier`` (a ``SpecifierSet`` or its text, ``"<6,>=5.23"``) written lower bound first,
    without spaces: ``">=5.23,<6"``. Text that is no specifier set comes back stripped, as given."""
    text = str(specifier)
    clauses = [clause for clause in text.split(",") if clause.strip()]
    parsed = [_CLAUSE.match(clause) for clause in clauses]
    if not all(parsed):
        return text.strip()
    ordered = sorted(
        ((match.group(1), match.group(2)) for match in parsed if match is not None),  # all match: for mypy
        key=lambda clause: (_ORDER[clause[0]], _release(clause[1])),
    )
    return ",".join(operator + version for operator, version in ordered)


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of ``version`` for ordering clauses of one kind (``5.23.*`` -> (5, 23))."""
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
    return tuple(numbers)


def runs(numbers: Iterable[int], to: str = "-") -> list[str]:
    """``numbers`` in the order given, each run of consecutive ones written ``first{to}last`` and a
    number alone as itself: ``[0, 1, 2, 3, 5]`` -> ``["0-3", "5"]``. Sort them first for a set."""
    spans: list[list[int]] = []  # [first, last] of each run
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return [str(first) if first == last else f"{first}{to}{last}" for first, last in spans]


def and_(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""
