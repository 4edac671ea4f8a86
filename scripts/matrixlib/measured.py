"""The releases measured: for each distribution the shim patches (and torch), the oldest and newest release
the matrix's cells ran, written to ``shim/measured.json``. The shim ships the file and says, in a patch's
status reason, ``python -m shim`` and doctor, when an installed release is newer than any measured.

DeepSpeed and Ray are in no cell: their releases are those the end-to-end environments pin
(``constraints/e2e*.txt``), where doctor's DeepSpeed self-checks and the Ray jobs run (tests/e2e). The latest cell is left out: it measures whatever
was newest on the day it ran.
"""

from __future__ import annotations

import json
import re

from .cells import ROOT
from .gates import version_key

MEASURED = ROOT / "shim" / "measured.json"
ABOUT = (
    "The oldest and newest release of each distribution the shim was measured on: the version matrix's cells "
    "(doctor and tests) and, for deepspeed and ray, the end-to-end environments. Written by `python3 scripts/matrix.py "
    "--write-readme` from doctor-reports/; read by the shim when a status or doctor is asked for, to say when "
    "an installed release is newer than any measured. Do not edit."
)


def release(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: the release a build is gated as (local and dev parts dropped)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return match.group(0) if match else version


def distributions(reports: dict) -> list[str]:
    """Every distribution a patch or one of its targets is gated on, and torch."""
    found = {"torch"}
    for report in reports.values():
        for patch in report["patches"]:
            found.add(patch["distribution"])
            found.update(t["distribution"] for t in patch.get("targets", ()) if t.get("distribution"))
    return sorted(found)


def end_to_end_pins(name: str) -> list[str]:
    pins = []
    for path in sorted((ROOT / "constraints").glob("e2e*.txt")):
        for line in path.read_text().splitlines():
            if re.match(rf"\s*{re.escape(name)}\s*==", line):
                pins.append(line.split("==", 1)[1].strip())
    return pins


def ranges(reports: dict) -> dict:
    oldest, newest = {}, {}
    for name in distributions(reports):
        seen = [release(v) for report in reports.values() if (v := report["versions"].get(name))]
        seen += [release(v) for v in end_to_end_pins(name)]
        if seen:
            seen.sort(key=version_key)
            oldest[name], newest[name] = seen[0], seen[-1]
    return {"about": ABOUT, "oldest": oldest, "newest": newest}


def render(reports: dict) -> str:
    return json.dumps(ranges(reports), indent=2, sort_keys=True) + "\n"


def current() -> str | None:
    try:
        return MEASURED.read_text()
    except OSError:
        return None


def write(text: str) -> None:
    MEASURED.write_text(text)
