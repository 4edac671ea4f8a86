"""The project documents itself: every patch has its section in docs/bugs.md, a README row and a test
file; its module docstring is short and points at its section; references are public; links between
the documents resolve; and no file of the project points outside the repository."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

import shim
from tests.conftest import ROOT

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version

BUGS = ROOT / "docs" / "bugs.md"
README = ROOT / "README.md"
PUBLIC = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+#\d+$")  # owner/repo#N
NAMES = list(shim.registry.names)


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


def module_name(name: str) -> str:
    return name.replace("-", "_")


def missing_pieces(name: str, root: Path = ROOT) -> list[str]:
    """What patch ``name`` lacks of its documentation and tests: a docs/bugs.md section, a row in the
    README's patch table (the row links to the section) and ``tests/patches/test_<module>.py``."""
    missing = []
    bugs = (root / "docs" / "bugs.md").read_text()
    if not re.search(rf"^## {re.escape(name)}$", bugs, flags=re.MULTILINE):
        missing.append(f"a section '## {name}' in docs/bugs.md")
    row = re.compile(rf"^\| `{re.escape(name)}` \|.*\(docs/bugs\.md#{re.escape(name)}\)", flags=re.MULTILINE)
    if not row.search((root / "README.md").read_text()):
        missing.append(f"a row in the README's patch table linking docs/bugs.md#{name}")
    own_file = (root / "tests" / "patches" / f"test_{module_name(name)}.py").is_file()
    # A patch that needs a distributed engine (DeepSpeed) is tested end to end, in its environment.
    end_to_end = any(name in path.read_text() for path in (root / "tests" / "e2e").glob("test_*.py"))
    if not (own_file or end_to_end):
        missing.append(f"tests/patches/test_{module_name(name)}.py (or an end-to-end test in tests/e2e/)")
    return missing


@pytest.mark.parametrize("name", NAMES)
def test_each_patch_has_its_section_readme_row_and_tests(name):
    assert missing_pieces(name) == []


def test_a_missing_section_row_or_test_file_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests" / "patches").mkdir(parents=True)
    (tmp_path / "docs" / "bugs.md").write_text("## other-patch\n")
    (tmp_path / "README.md").write_text("| `other-patch` | fixes | [bugs.md](docs/bugs.md#other-patch) |\n")
    (tmp_path / "tests" / "patches" / "test_other_patch.py").write_text("")
    assert missing_pieces("other-patch", tmp_path) == []
    assert len(missing_pieces("new-patch", tmp_path)) == 3
    # A row of the generated compatibility table names the patch but is not its row in the patch table.
    (tmp_path / "README.md").write_text("| `new-patch` | `transformers>=5.0` | applied, fixed |\n")
    assert "a row in the README's patch table linking docs/bugs.md#new-patch" in missing_pieces("new-patch", tmp_path)


def public_references(name: str) -> list[str]:
    return [reference for reference in shim.registry.patch(name).references if PUBLIC.match(reference)]


@pytest.mark.parametrize("name", [name for name in NAMES if public_references(name)])
def test_the_readme_row_names_a_public_reference_of_the_patch(name):
    public = public_references(name)
    row = next(line for line in README.read_text().splitlines() if line.startswith(f"| `{name}` |"))
    assert any(reference in row for reference in public), f"the README row of {name} cites none of {public}"


VERSION = re.compile(r"(?<![\w.])\d+\.(?:\d+|x)(?:\.\d+)*(?![\w.×])")  # 5.23, 0.19.3, 5.x; not 3.4×


@pytest.mark.parametrize("name", NAMES)
def test_each_patch_docstring_is_short_points_at_its_section_and_names_no_version(name):
    """Versions live in docs/bugs.md and the generated compatibility table, nowhere else."""
    source = (ROOT / "patches" / f"{module_name(name)}.py").read_text()
    docstring = ast.get_docstring(ast.parse(source)) or ""
    assert f"docs/bugs.md#{name}" in docstring
    assert len(docstring.splitlines()) <= 20, "about 15 lines: the full story belongs in docs/bugs.md"
    assert VERSION.findall(docstring) == []


def documents() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6} (.+)$", without_code_blocks(path.read_text()), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def test_the_anchor_rule_matches_github():
    assert "shim-run-the-shim-on-every-process-no-code-change" in anchors(README)
    assert "compatibility" in anchors(README)


@pytest.mark.parametrize("document", documents(), ids=lambda path: str(path.relative_to(ROOT)))
def test_links_between_the_documents_resolve(document):
    broken = []
    text = without_code_blocks(document.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        if not path.exists() or ROOT not in (path, *path.parents):
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert broken == []


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


def test_the_pack_guide_holds_the_example_pack_to_copy_verbatim():
    """docs/adding-a-patch.md stands on its own for an author outside the repository: the example
    pack's pyproject.toml, module and test are in it as they are in examples/patch-pack/, gated on a
    real library (not on the pack itself)."""
    guide = (ROOT / "docs" / "adding-a-patch.md").read_text().split("## A patch of your own: a patch pack", 1)[1]
    pack = ROOT / "examples" / "patch-pack"
    files = ("pyproject.toml", "src/shim_example_pack/fixes.py", "src/shim_example_pack/dropout_masks.py")
    for path in (*files, "tests/test_example_pack.py"):
        text = (pack / path).read_text().rstrip()
        assert f"```{'toml' if path.endswith('.toml') else 'python'}\n{text}\n```" in guide, path
    fixes = (pack / "src" / "shim_example_pack" / "fixes.py").read_text()
    assert 'distribution="transformers"' in fixes and "shim-example-pack" not in fixes.split("PATCH = ", 1)[1]
    for said in ("check error", "doctor exits 1", "shim.disabled(<name>)", "record_effect", "bug probe", "new-pack"):
        assert said in guide, said


def test_the_index_of_docs_bugs_lists_every_patch_by_name():
    """One row order everywhere: the index at the top of docs/bugs.md too."""
    rows = re.findall(r"^\| \[`([a-z0-9-]+)`\]\(#", BUGS.read_text(), flags=re.MULTILINE)
    assert rows == sorted(NAMES)


def test_the_one_order_section_lists_the_targets_several_patches_wrap():
    """docs/how-it-works.md's "One order" counts them and names each in its table."""
    from shim.tools.index import declared

    wrapped_by: dict[str, int] = {}
    for patch in declared():
        for target in patch.targets:
            wrapped_by[target.spec] = wrapped_by.get(target.spec, 0) + 1
    shared = [spec for spec, patches in wrapped_by.items() if patches > 1]
    section = (ROOT / "docs" / "how-it-works.md").read_text().split("\n## One order\n", 1)[1].split("\n## ", 1)[0]
    counted = section.split()[0].lower()
    numbers = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]
    assert counted in numbers and numbers.index(counted) == len(shared), (counted, shared)
    assert [spec for spec in shared if f"{spec.partition(':')[2]}`" not in section] == []


def test_the_modules_of_the_shims_packages_that_the_project_names_exist():
    """A module moved or removed (the self-checks' tiny models went to ``tests/tinymodels.py``) leaves
    no mention behind in the docs, tests and benchmarks; the CHANGELOG's history says what was."""
    import importlib

    named = re.compile(r"\bshim[./](selfcheck|tools|checkpointing)[./]([A-Za-z_]\w*)")
    offenders = set()
    for name in project_files():
        path = ROOT / name
        if name == "CHANGELOG.md" or path.suffix not in {".md", ".py", ".toml", ".sh"} or not path.is_file():
            continue
        for package, module in named.findall(path.read_text(errors="replace")):
            folder = ROOT / "shim" / package
            found = (folder / f"{module}.py").is_file() or (folder / module).is_dir()
            if not found and not hasattr(importlib.import_module(f"shim.{package}"), module):
                offenders.add(f"{name}: shim.{package}.{module}")
    assert sorted(offenders) == []
