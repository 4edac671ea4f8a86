"""The version and the releases: one number in ``pyproject.toml`` and ``shim.__version__``, and a
CHANGELOG.md cut into dated versions, the newest of them that number, ``[Unreleased]`` above them
(docs/testing.md, "Cutting a release")."""

import re

import shim
from tests.conftest import ROOT

HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$", re.M)
SECTIONS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")


def versions() -> list[tuple[str, str | None]]:
    text = (ROOT / "CHANGELOG.md").read_text()
    return [(found["version"], found["date"]) for found in HEADING.finditer(text)]


def test_the_version_is_one_number_and_the_newest_release():
    project = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert shim.__version__ == project
    released = [version for version, _ in versions() if version != "Unreleased"]
    assert released[0] == project, "pyproject.toml's version is the newest version CHANGELOG.md describes"


def test_the_changelog_is_cut_into_dated_versions_newest_first():
    found = versions()
    assert found[0] == ("Unreleased", None)
    released = found[1:]
    assert released and all(date for _, date in released), "each release has its date"
    numbers = [tuple(int(part) for part in version.split(".")) for version, _ in released]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)
    dates = [date for _, date in released]
    assert dates == sorted(dates, reverse=True)


def test_each_version_says_what_changed_under_keep_a_changelogs_headings():
    text = (ROOT / "CHANGELOG.md").read_text()
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        headings = re.findall(r"^### (.+)$", block, re.M)
        assert all(heading in SECTIONS for heading in headings), headings
        assert headings == sorted(headings, key=SECTIONS.index), f"sections out of order: {headings}"
