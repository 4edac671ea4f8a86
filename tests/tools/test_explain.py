"""``python -m shim explain <patch>`` prints the bug's story from docs/bugs.md (shipped in the wheel), and
the references in ``shim.status()`` / ``--json`` are ones a user outside the repository can follow."""

import itertools
import os
import re
import subprocess
import sys

import pytest

import shim
from shim import statuses
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


def explain(*args: str, columns: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": columns} if columns else {})
    done = subprocess.run(
        [sys.executable, "-m", "shim", "explain", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


def test_explain_takes_the_names_the_environment_takes():
    done = explain("Load_Keeps_Requires_Grad", "--markdown")
    assert done.stdout.startswith("## load-keeps-requires-grad\n\n**Symptom.**")
    unknown = subprocess.run(
        [sys.executable, "-m", "shim", "explain", "no-such-patch"], capture_output=True, text=True, timeout=120
    )
    assert unknown.returncode == 2 and "no patch named 'no-such-patch'; python -m shim lists them" in unknown.stderr
    audit = subprocess.run(
        [sys.executable, "-m", "shim", "explain", "first_step_audit"], capture_output=True, text=True, timeout=120
    )
    assert audit.returncode == 2 and "SHIM_DISABLE=first-step-audit switches it off" in audit.stderr
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
    assert statuses.links(["huggingface/trl#6827", "docs/bugs.md#x"]) == (
        "https://github.com/huggingface/trl/issues/6827",
        "python -m shim explain x",
    )


@pytest.mark.parametrize("columns", ["60", "132", None])
def test_explain_prints_plain_text_wrapped_to_the_terminal(columns):
    """No heading, emphasis or code marks; prose wrapped to the terminal's columns (100 where the
    output is no terminal); the words those of the Markdown section, quoted error text whole."""
    name = "checkpointing-call-signature"  # its section quotes code and error text in blocks
    shown = explain(name, columns=columns).stdout
    width = int(columns or 100)
    assert shown.startswith(f"{name}\n\nSymptom. ")
    indented = [line for line in shown.splitlines() if line.startswith("    ")]  # the code blocks
    prose = [line for line in shown.splitlines() if not line.startswith("    ")]
    assert [line for line in prose if len(line) > width and len(line.split()) > 1] == []  # a long address: alone
    assert width < 100 or max(map(len, prose)) > 100 - 15, "wide terminals get wide lines"
    bold = re.compile(r"\*\*[A-Z][^*]*\*\*")  # **Symptom.**; a code span's **kwargs stays
    assert not any(line.startswith("#") or bold.search(line) or "`" in line for line in prose)
    assert indented and not any(line.startswith("```") for line in shown.splitlines())
    # Word for word the section: fences and heading marks dropped, links as text (address), no marks.
    prose, code, fenced = [], [], False
    for line in bugdocs.section(name).removeprefix("## ").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        else:
            (code if fenced else prose).append(line)
    linked = re.sub(
        r"\[([^\]]+)\]\(([^)\s]+)\)", lambda m: m[1] if "://" not in m[2] else f"{m[1]} ({m[2]})", "\n".join(prose)
    )
    assert sorted(shown.split()) == sorted(bugdocs.unmarked(linked).split() + " ".join(code).split())


def test_explain_without_a_name_lists_every_patch_and_its_summary():
    shown = explain().stdout.splitlines()
    names = [line for line in shown if line and not line.startswith(" ")][:-1]  # the last line: how to read one
    assert names == sorted(NAMES)
    for name in NAMES:
        below = shown[shown.index(name) + 1 :]
        summary = " ".join(line.strip() for line in itertools.takewhile(lambda line: line.startswith("    "), below))
        assert summary == " ".join(shim.registry.patch(name).summary.split())
    assert shown[-1].startswith("python -m shim explain <patch>: ")
