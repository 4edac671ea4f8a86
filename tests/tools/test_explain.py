"""``python -m shim explain <patch>`` prints the bug's story from docs/bugs.md (shipped in the wheel), and
the references in ``shim.status()`` / ``--json`` are ones a user outside the repository can follow."""

import re
import subprocess
import sys

import pytest

import shim
from shim import records
from shim.tools import bugdocs
from tests.conftest import ROOT

pytestmark = pytest.mark.any_version  # the code as it is, whatever is installed

NAMES = list(shim.registry.names)


def prose(text: str) -> list[str]:
    """The lines of ``text`` outside code blocks (quoted error text is printed whole)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


@pytest.mark.parametrize("name", NAMES)
def test_each_section_reads_in_100_columns_word_for_word(name):
    section = bugdocs.section(name)
    assert section is not None and section.startswith(f"## {name}\n")
    shown = bugdocs.reflow(section, 100)
    assert [line for line in prose(shown) if len(line) > 100] == []
    links = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", lambda m: m[1] if "://" not in m[2] else f"{m[1]} ({m[2]})", section)
    assert shown.split() == links.split()


def test_explain_takes_the_names_the_environment_takes():
    done = subprocess.run(
        [sys.executable, "-m", "shim", "explain", "Load_Keeps_Requires_Grad"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("## load-keeps-requires-grad\n\n**Symptom.**")
    unknown = subprocess.run(
        [sys.executable, "-m", "shim", "explain", "no-such-patch"], capture_output=True, text=True, timeout=120
    )
    assert unknown.returncode == 2 and "no patch named 'no-such-patch'; python -m shim lists them" in unknown.stderr
    typo = subprocess.run(
        [sys.executable, "-m", "shim", "explain", "load-keep-requires-grad"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert typo.returncode == 2 and "did you mean load-keeps-requires-grad?" in typo.stderr


def test_status_references_are_addresses_and_the_explain_command():
    for record in (record for record in shim.status() if record.name in NAMES):  # the built-in patches
        assert record.references[0] == f"python -m shim explain {record.name}"
        assert all(re.match(r"^https://github\.com/[\w.-]+/[\w.-]+/issues/\d+$", r) for r in record.references[1:])
    assert records.links(["huggingface/trl#6827", "docs/bugs.md#x"]) == (
        "https://github.com/huggingface/trl/issues/6827",
        "python -m shim explain x",
    )
