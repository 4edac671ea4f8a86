"""The gate check: every patch's doctor verdict in every cell against the patch's version gate.

doctor runs with ``SHIM_PROBE=always``: its "bug upstream" is each patch's bug probe with the patch off,
and the probe decided whether the patch applied, so a probe that disagrees with its gate shows here
as a wrong verdict (``fixed upstream`` inside the gate, ``fixed`` outside it).

The rules are in ``scripts/matrix.py``'s docstring and docs/testing.md ("The version matrix").
"""

from __future__ import annotations

import json
import re

from .cells import CELLS, REPORTS, ROOT

KNOWN_UNFIXED = ROOT / "constraints" / "known-unfixed.txt"


def version_key(text):
    parts = []
    for piece in re.split(r"[.+]", text or ""):
        parts.append((0, int(piece), "") if piece.isdigit() else (1, 0, piece))
    return tuple(parts)


def load_reports(cells) -> dict:
    reports = {}
    for cell in cells:
        folder = REPORTS / cell.name
        try:
            info = json.loads((folder / "cell.json").read_text())
            findings = {f["name"]: f for f in json.loads((folder / "doctor.json").read_text())}
        except (OSError, ValueError):
            continue
        reports[cell.name] = dict(info, findings=findings)
    return reports


def known_unfixed() -> dict:
    """``patch cell reason``: the bug shows in that cell and the patch is skipped there on purpose."""
    known = {}
    if KNOWN_UNFIXED.exists():
        for line in KNOWN_UNFIXED.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                patch, cell, reason = (line.split(None, 2) + ["", ""])[:3]
                known[(patch, cell)] = reason.strip()
    return known


def release(text: str) -> tuple:
    """``"5.16"`` and ``"5.16.0"`` alike: the first three numbers, zero-padded."""
    numbers = [int(n) for n in re.findall(r"\d+", text)][:3]
    return tuple(numbers + [0] * (3 - len(numbers)))


def missing_edges(requires: str, measured: list[str]) -> list[str]:
    """The release lines (``major.minor``) at the edges of ``requires`` that no measured version is on.

    A lower bound ``>=X`` (also ``~=X``, ``==X``) needs a cell on X's line at or above X, unless X
    is at or below the oldest cell. An upper bound ``<Y`` needs a cell on the line just before Y
    (Y's own line when Y is a patch release), ``<=Y`` one on Y's line, unless Y is above the newest
    cell. An upper bound ``<A.0`` has no known last line: it is not checked.
    """
    versions = [release(v) for v in measured]
    if not versions:
        return []
    lines = {v[:2] for v in versions}
    lowest, highest = min(versions), max(versions)
    wanted = []
    for clause in requires.split(","):
        match = re.match(r"\s*(>=|~=|==|<=|<)\s*([0-9][0-9.]*)\s*$", clause)
        if not match:
            continue
        operator, bound = match.group(1), release(match.group(2))
        if operator in (">=", "~=", "==") and bound > lowest:
            if not any(v[:2] == bound[:2] and v >= bound for v in versions):
                wanted.append(f"{bound[0]}.{bound[1]}.x (>= {match.group(2)}), the first line inside")
        elif operator == "<" and bound <= highest:
            line = bound[:2] if bound[2] else (bound[0], bound[1] - 1) if bound[1] else None
            if line is not None and line not in lines:
                wanted.append(f"{line[0]}.{line[1]}.x, the last line inside < {match.group(2)}")
        elif operator == "<=" and bound < highest and bound[:2] not in lines:
            wanted.append(f"{bound[0]}.{bound[1]}.x, the last line inside <= {match.group(2)}")
    return wanted


def gates_of(gate: dict) -> list[tuple[str, str, str]]:
    """(distribution, specifier, whose) for the patch's gate and each target's own requirement."""
    found = [(gate["distribution"], gate["requires"], "patch")]
    for target in gate.get("targets", ()):
        if target["requires"]:
            found.append((target["distribution"], target["requires"], f"target {target['target']}"))
    return found


def measured_version(gate: dict, distribution: str):
    if distribution == gate["distribution"]:
        return gate["gated_as"]
    return next((t["gated_as"] for t in gate.get("targets", ()) if t["distribution"] == distribution), None)


class Problems(list):
    """``(cell or None, text)`` pairs; ``add`` keeps call sites short."""

    def add(self, cell, text):
        self.append((cell, text))


def check(reports: dict) -> tuple[Problems, list[str]]:
    """Every patch × cell against its gate. Returns (problems, notes)."""
    problems, notes = Problems(), []
    known = known_unfixed()
    used = set()
    names = list(dict.fromkeys(p["name"] for report in reports.values() for p in report["patches"]))
    for name in names:
        cells_seen = check_cells(name, reports, known, used, problems)
        # Edges: the first and last release line inside every gate must be measured, where the
        # matrix reaches past them.
        if cells_seen:
            check_edges(name, cells_seen, problems, notes)
    for patch, cell in sorted(set(known) - used):
        if cell in reports:
            problems.add(cell, f"{KNOWN_UNFIXED.name}: '{patch} {cell}' names no measured patch in that cell")
    check_workflows(reports, problems)
    return problems, notes


def check_cells(name: str, reports: dict, known: dict, used: set, problems: Problems) -> list:
    """Patch ``name``'s verdict in each cell against its gate (a cell ``known`` unfixed marked
    ``used``); the ``(cell, gate, verdict)`` of the cells that measured it with a bug probe."""
    cells_seen = []
    for cell_name, report in reports.items():
        gate = next((p for p in report["patches"] if p["name"] == name), None)
        finding = report["findings"].get(name)
        where = f"{name} in {cell_name}"
        if gate is None or finding is None:
            problems.add(cell_name, f"{where}: no doctor result (stale report? rerun the cell)")
            continue
        if not gate["has_probe"]:
            problems.add(
                cell_name, f"{where}: the patch has no bug probe, so the matrix cannot prove its gate {spec_of(gate)}"
            )
            continue
        cells_seen.append((cell_name, gate, finding["verdict"]))
        if (name, cell_name) in known:
            used.add((name, cell_name))
            text = known_unfixed_problem(where, gate, finding)
        else:
            text = verdict_problem(name, cell_name, gate, finding)
        if text:
            problems.add(cell_name, text)
    return cells_seen


def spec_of(gate: dict) -> str:
    """``transformers>=5.0 (targets: peft>=0.18)``: the patch's gate and its targets' own requirements."""
    spec = f"{gate['distribution']}{gate['requires']}"
    own = sorted({f"{t['distribution']}{t['requires']}" for t in gate.get("targets", ()) if t["requires"]})
    if own:
        spec += f" (targets: {', '.join(own)})"
    return spec


def known_unfixed_problem(where: str, gate: dict, finding: dict) -> str | None:
    """What is wrong with a cell listed in ``constraints/known-unfixed.txt`` for the patch, if anything."""
    verdict, shown = finding["verdict"], f"{gate['distribution']} {gate['installed']}"
    if gate["admitted"]:
        return f"{where}: listed in {KNOWN_UNFIXED.name} but {shown} is inside {spec_of(gate)}"
    if verdict != "NOT FIXED":
        return f"{where}: listed in {KNOWN_UNFIXED.name} but doctor says {verdict!r}: remove the line"
    return None


#: Why each verdict but ``fixed`` fails inside the gate.
WRONG_INSIDE = {
    "not reproduced": "the gate is too wide: the bug does not reproduce here with the patch off",
    "not affected": "the gate is too wide or the patch cannot apply: the bug does not reproduce here",
    "NOT FIXED": "the patch does not fix the bug here",
    "fixed upstream": "its bug probe (SHIM_PROBE=always) found no bug here: the probe and the gate disagree",
}


def verdict_problem(name: str, cell_name: str, gate: dict, finding: dict) -> str | None:
    """What is wrong with doctor's verdict on patch ``name`` in a cell, inside or outside its gate."""
    verdict, spec, shown = finding["verdict"], spec_of(gate), f"{gate['distribution']} {gate['installed']}"
    where = f"{name} in {cell_name}"
    if gate["admitted"]:
        if verdict == "fixed":
            return None
        why = WRONG_INSIDE.get(verdict, "doctor could not prove the fix")
        return f"{where}: {shown} is inside {spec} but doctor says {verdict!r}: {why} ({finding['detail']})"
    if verdict == "NOT FIXED":
        return (
            f"{where}: {shown} is outside {spec} but the bug reproduces: widen the gate, or list "
            f"'{name} {cell_name} <why the patch is skipped here>' in constraints/{KNOWN_UNFIXED.name}"
        )
    if verdict not in ("not affected", "not installed"):
        return f"{where}: {shown} is outside {spec}; doctor says {verdict!r} ({finding['detail']})"
    return None


def check_edges(name: str, cells_seen: list, problems: Problems, notes: list[str]) -> None:
    """The cells' reports of patch ``name`` agree on its gate, and a cell sits on each edge of it
    the matrix reaches past; the note of its first and last cell inside."""
    gates = sorted({json.dumps(gates_of(g)) for _, g, _ in cells_seen})
    if len(gates) > 1:
        problems.add(
            None,
            f"{name}: the cells' reports disagree on the gate ({' / '.join(gates)}): stale reports, rerun every cell",
        )
        return
    for gate_distribution, specifier, whose in gates_of(cells_seen[0][1]):
        measured = sorted(
            {v for _, g, _ in cells_seen if (v := measured_version(g, gate_distribution))}, key=version_key
        )
        for wanted in missing_edges(specifier, measured):
            problems.add(
                None,
                f"{name}: {whose} gate {gate_distribution}{specifier} needs a cell on {gate_distribution} {wanted}; "
                f"cells have {', '.join(measured)}: add an edge cell to scripts/matrixlib/cells.py",
            )
    notes.append(inside_note(name, cells_seen))


def inside_note(name: str, cells_seen: list) -> str:
    """``demo (transformers>=5.0): first cell inside 5.0.0 (tf5.0-trl0.29), last 5.25.0 (default)``."""
    distribution, requires = cells_seen[0][1]["distribution"], cells_seen[0][1]["requires"]
    inside = sorted(((g["gated_as"], c) for c, g, _ in cells_seen if g["admitted"]), key=lambda x: version_key(x[0]))
    if inside:
        return (
            f"{name} ({distribution}{requires}): first cell inside {inside[0][0]} ({inside[0][1]}), "
            f"last {inside[-1][0]} ({inside[-1][1]})"
        )
    return f"{name} ({distribution}{requires}): no cell inside the gate"


def check_workflows(reports: dict, problems: Problems) -> None:
    """A cell that leaves its everyday workflows to another must apply the same patches."""
    for cell in CELLS:
        other = cell.workflows_in
        if other and cell.name in reports and other in reports:
            mine, theirs = applied(reports[cell.name]), applied(reports[other])
            if mine != theirs:
                problems.add(
                    cell.name,
                    f"{cell.name} leaves its everyday workflows to {other}, but the patches applied differ "
                    f"({', '.join(sorted(mine ^ theirs))}): run them there (cells.py, workflows_in)",
                )


def applied(report: dict) -> set:
    """The patches doctor found applied in a cell."""
    return {name for name, finding in report["findings"].items() if finding.get("state") == "applied"}
