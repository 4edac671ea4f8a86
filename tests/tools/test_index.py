"""``python -m shim index`` edits a pack's ``pyproject.toml`` as TOML reads it: the targets table
is found by its parsed key however its header is quoted, the file still parses, and its line endings
stay (``shim.tools.tomltables``, which any table of ``pyproject.toml`` is written through)."""

import pytest

from shim.tools.index import TARGETS_KEY, CannotIndex, rewritten
from shim.tools.tomltables import header_key, with_table
from tests.tools.test_new_pack import NAME, shim_command

pytestmark = pytest.mark.any_version  # text in, text out: whatever is installed

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later reads what was written

PATCHES = '[project.entry-points."hf_train_shim.patches"]\nmy-fix = "my_pack.fixes:PATCH"\n'
START = f'[project]\nname = "my-pack"\nversion = "0.1"\n\n{PATCHES}\n'
END = '\n[tool.setuptools.packages.find]\nwhere = ["src"]\n'
STALE = '"my-fix.transformers.trainer_utils" = "transformers.trainer_utils"\n'
#: Every way TOML lets the targets table's header be written: one key, however quoted and spaced.
SPELLINGS = [
    '[project.entry-points."hf_train_shim.targets"]',
    "[project.entry-points.'hf_train_shim.targets']",
    '[ project . entry-points . "hf_train_shim.targets" ]',
    '[\tproject.entry-points."hf_train_shim.targets"\t]',
    '["project".\'entry-points\'."hf_train_shim.targets"]',
    '[project.entry-points."hf_train_shim\\u002etargets"]',
    '  [project.entry-points."hf_train_shim.targets"]  # listed by index',
]
NOW = {"my-fix": ("transformers.trainer",)}


def targets_of(text: str) -> dict:
    return tomllib.loads(text)["project"]["entry-points"]["hf_train_shim.targets"]


@pytest.mark.parametrize("header", SPELLINGS)
def test_the_targets_table_is_found_by_its_key_however_its_header_is_quoted(header):
    assert header_key(header) == (TARGETS_KEY, False)
    text = f"{START}{header}\n{STALE}{END}"
    assert targets_of(text) == {"my-fix.transformers.trainer_utils": "transformers.trainer_utils"}
    new = rewritten(text, NOW)
    assert targets_of(new) == {"my-fix.transformers.trainer": "transformers.trainer"}, "one table, rewritten"
    assert new.count("hf_train_shim\\u002etargets" if "u002e" in header else "hf_train_shim.targets") == 1
    assert new.startswith(f"{START}{header}\n") and new.endswith(END), "the rest of the file as it was"
    assert rewritten(new, NOW) == new


def test_a_bare_dotted_header_is_another_table_and_stays():
    """``[project.entry-points.hf_train_shim.targets]`` is four keys (a table ``targets`` inside a
    group ``hf_train_shim``), not the group ``hf_train_shim.targets``: TOML says so, and so does this."""
    bare = "[project.entry-points.hf_train_shim.targets]"
    assert header_key(bare) == (("project", "entry-points", "hf_train_shim", "targets"), False)
    new = rewritten(f"{START}{bare}\n{STALE}{END}", NOW)
    groups = tomllib.loads(new)["project"]["entry-points"]
    assert groups["hf_train_shim.targets"] == {"my-fix.transformers.trainer": "transformers.trainer"}
    assert groups["hf_train_shim"] == {"targets": {"my-fix.transformers.trainer_utils": "transformers.trainer_utils"}}


def test_crlf_line_endings_stay_crlf():
    replaced, added = f"{START}{SPELLINGS[1]}\n{STALE}{END}", START + END
    for text in (replaced.replace("\n", "\r\n"), added.replace("\n", "\r\n")):
        new = rewritten(text, NOW)
        assert "\n" not in new.replace("\r\n", ""), "no bare LF written"
        assert targets_of(new) == {"my-fix.transformers.trainer": "transformers.trainer"}


def test_a_missing_table_goes_after_the_patches_table_or_at_the_end():
    new = rewritten(START + END, NOW)
    assert new.startswith(f"{START.rstrip()}\n\n{SPELLINGS[0]}\n# Written by") and new.endswith(END)
    assert with_table("[tool.z]", ("tool", "z"), ["a = 1"]) == "[tool.z]\na = 1\n", "a header without its newline"
    plain = with_table("[tool.x]\ny = 1", ("tool", "z"), ["a = 1"])  # no final newline, no table to follow
    assert plain == "[tool.x]\ny = 1\n\n[tool.z]\na = 1\n" and tomllib.loads(plain)["tool"] == {
        "x": {"y": 1},
        "z": {"a": 1},
    }


@pytest.mark.parametrize(
    "value",
    [
        'text = """\n{header}\n"""',  # a multi-line string's line: no table of ours to edit in there
        "text = '''\n{header}\n'''",
        'lists = [\n  "a",\n["x"]\n]',  # an array's line: read as a header, the patches table would end there
    ],
)
def test_a_header_inside_a_multiline_string_or_array_is_no_header(value):
    """The line in the patches table (where the targets table goes after) is a value's, not a header."""
    text = f"{START.rstrip()}\n{value.format(header=SPELLINGS[0])}\n{END}"
    new = rewritten(text, NOW)
    patches = tomllib.loads(text)["project"]["entry-points"]["hf_train_shim.patches"]
    assert tomllib.loads(new)["project"]["entry-points"]["hf_train_shim.patches"] == patches
    assert targets_of(new) == {"my-fix.transformers.trainer": "transformers.trainer"}


def test_a_table_written_without_its_header_or_a_broken_file_is_refused():
    dotted = START.replace("[project]\n", '[project]\nentry-points."hf_train_shim.targets".x = "y"\n')
    with pytest.raises(CannotIndex, match="without its own header"):
        rewritten(dotted, NOW)
    with pytest.raises(CannotIndex, match="not valid TOML"):
        rewritten(START + "[project]\n", NOW)


def test_pack_index_keeps_a_crlf_pyproject_with_single_quotes_parsing(tmp_path):
    """The command, as a pack's author runs it: the table is rewritten in place, the file's CRLF
    kept, and ``--check`` passes on the result."""
    assert shim_command("-m", "shim", "new-pack", NAME, str(tmp_path / "p")).returncode == 0
    pyproject = tmp_path / "p" / "pyproject.toml"
    text = pyproject.read_text().replace('."hf_train_shim.targets"]', ".'hf_train_shim.targets']")
    text = text.replace('"my-team-fixes.transformers.trainer_utils"', '"my-team-fixes.transformers.old"')
    pyproject.write_bytes(text.replace("\n", "\r\n").encode())
    done = shim_command("-m", "shim", "index", str(tmp_path / "p"))
    assert done.returncode == 0, done.stderr
    written = pyproject.read_bytes().decode()
    assert "\n" not in written.replace("\r\n", "") and written.count("hf_train_shim.targets") == 1
    assert tomllib.loads(written)["project"]["entry-points"]["hf_train_shim.targets"] == {
        "my-team-fixes.transformers.trainer_utils": "transformers.trainer_utils"
    }
    assert shim_command("-m", "shim", "index", "--check", str(tmp_path / "p")).returncode == 0


def test_index_writes_a_patchs_place_and_after_and_the_shim_reads_them_back(tmp_path):
    """The record a pack ships, written from its Patch: the order table appears once a patch has a
    place or an after=, every name and value passes setuptools' validation, and --check reports the
    record stale until it is written (tests/engine/test_packs.py reads such records back)."""
    assert shim_command("-m", "shim", "new-pack", NAME, str(tmp_path / "p")).returncode == 0
    fixes = next((tmp_path / "p" / "src").glob("*/fixes.py"))
    fixes.write_text(
        fixes.read_text().replace(
            "    summary=", '    place="outermost",\n    after=("checkpointing-restore",),\n    summary=', 1
        )
    )
    assert shim_command("-m", "shim", "index", "--check", str(tmp_path / "p")).returncode == 1, "stale"
    done = shim_command("-m", "shim", "index", str(tmp_path / "p"))
    assert done.returncode == 0, done.stderr
    order = tomllib.loads((tmp_path / "p" / "pyproject.toml").read_text())["project"]["entry-points"][
        "hf_train_shim.order"
    ]
    assert order == {
        "my-team-fixes.place.outermost": "my_team_fixes.fixes",
        "my-team-fixes.after.checkpointing-restore": "my_team_fixes.fixes",
    }
    formats = pytest.importorskip("setuptools.config._validate_pyproject.formats")
    assert all(
        formats.python_entrypoint_name(name) and formats.python_entrypoint_reference(value)
        for name, value in order.items()
    )
    assert shim_command("-m", "shim", "index", "--check", str(tmp_path / "p")).returncode == 0
