"""The project documents itself: every patch has its section in docs/bugs.md, references are public,
and no file of the project points outside the repository."""

import re
import subprocess

import pytest

import shim
from shim import patches as catalogue
from tests.conftest import ROOT

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version

BUGS = ROOT / "docs" / "bugs.md"
PUBLIC = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+#\d+$")  # owner/repo#N
NAMES = [row[0] for row in catalogue.INDEX]


def sections() -> dict[str, str]:
    text = BUGS.read_text()
    parts = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    return {part.splitlines()[0].strip(): part for part in parts}


@pytest.mark.parametrize("name", NAMES)
def test_each_patch_has_a_section_with_every_part(name):
    section = sections()[name]
    for part in ("**Symptom.**", "**Upstream mechanism.**", "**Versions measured.**", "**The fix.**", "**Limits.**"):
        assert part in section, f"{name}: {part} missing"
    assert "**References.**" in section


@pytest.mark.parametrize("name", NAMES)
def test_references_are_public_or_the_projects_own_document(name):
    references = shim.registry.patch(name).references
    assert f"docs/bugs.md#{name}" in references
    section = sections()[name]
    for reference in references:
        if reference.startswith("docs/bugs.md#"):
            assert reference.partition("#")[2] in sections()
        else:
            assert PUBLIC.match(reference), reference
            assert reference in section, f"{reference} is cited by the patch but not explained in docs/bugs.md"


def test_no_file_of_the_project_names_a_path_outside_it():
    outside = ["../" + "shared", "upstream" + "-bugs.md", "/" + "work/"]
    offenders = []
    for name in project_files():
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{name}: {needle}" for needle in outside if needle in text]
    assert offenders == []


def project_files() -> list[str]:
    """The tracked files; without git, every file outside hidden, build and environment folders."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
        return listed.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        skip = {"build", "dist", "doctor-reports", "__pycache__"}
        return [
            str(path.relative_to(ROOT))
            for path in ROOT.rglob("*")
            if path.is_file()
            and not any(
                part.startswith(".") or part in skip or part.endswith(".egg-info")
                for part in path.relative_to(ROOT).parts
            )
        ]
