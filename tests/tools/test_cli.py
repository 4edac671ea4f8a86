"""``python -m shim`` as a stranger meets it: help, a table that fits, doctor without the libraries."""

import json
import os
import subprocess
import sys

import pytest

import shim
from shim import patches as catalogue
from shim.tools.render import WIDTH, status_table
from tests.conftest import ROOT, clean_environment, run_python

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


ENVIRONMENT = ("SHIM_DISABLE", "SHIM_FORCE", "SHIM_STRICT", "SHIM_LOG_LEVEL", "SHIM_REPORT")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shim", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("args", [("--help",), ("status", "--help"), ("doctor", "--help")])
def test_help_describes_commands_environment_and_exit_codes(args):
    result = cli(*args)
    assert result.returncode == 0
    for text in (*ENVIRONMENT, "exit codes:", "NOT FIXED"):
        assert text in result.stdout, f"{text!r} missing from python -m shim {' '.join(args)}"
    if args == ("--help",):
        assert "status" in result.stdout and "doctor" in result.stdout and "tiny model built in code" in result.stdout
    if args[0] == "doctor":
        for verdict in ("fixed", "not affected", "not reproduced", "opted out", "not installed", "check error"):
            assert verdict in result.stdout


def test_a_bad_command_line_exits_2():
    assert cli("frobnicate").returncode == 2


def test_the_status_table_fits_100_columns_and_shows_every_summary():
    records = shim.status()
    text = status_table(records)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    flat = " ".join(text.split())
    for record in records:
        assert " ".join(record.summary.split()) in flat
        assert " ".join(f"reason: {record.reason}".split()) in flat
    wide = status_table(records, wide=True).splitlines()
    for record in records:
        assert f"    reason: {record.reason}" in wide


def test_status_json_carries_effects():
    records = json.loads(cli("--json").stdout)
    assert {"effects", "last_effect"} <= set(records[0])
    assert all(record["effects"] == 0 and record["last_effect"] == "" for record in records)


BLOCKED = """
import sys
for name in ("transformers", "trl", "peft", "accelerate", "deepspeed"):
    sys.modules[name] = None  # Python's way to make a module unimportable
from shim.tools.cli import main
raise SystemExit(main({args}))
"""


@pytest.mark.parametrize("args", [["doctor"], ["status", "--import-targets"]])
def test_without_the_libraries_the_patches_are_for_the_cli_shows_not_installed_and_exits_0(args):
    result = run_python(BLOCKED.format(args=args), torch_first=True)  # asserts exit status 0
    names = [row["name"] for row in catalogue.INDEX]
    lines = result.stdout.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("patch ")) :]  # below the summary
    rows = [line for line in table if line.split() and line.split()[0] in names]
    assert len(rows) == len(names)
    if args == ["doctor"]:
        assert all(row.split()[-2:] == ["not", "installed"] and " skipped " in row for row in rows)
    else:
        assert all(row.split()[1:3] == ["skipped", "-"] for row in rows)
        assert "\n".join(table).count("is not installed") == len(rows)
        assert lines[0].startswith(f"0 of {len(names)} patches apply to the installed releases; {len(names)} need a")


def test_doctor_json_file_holds_the_records_of_doctor_json_beside_the_printed_table(tmp_path):
    path = tmp_path / "findings.json"
    table = run_python(BLOCKED.format(args=["doctor", "--json-file", str(path)]), torch_first=True).stdout
    printed = run_python(BLOCKED.format(args=["doctor", "--json"]), torch_first=True).stdout
    assert json.loads(path.read_text()) == json.loads(printed)
    assert [record["name"] for record in json.loads(printed)] == sorted(row["name"] for row in catalogue.INDEX)
    header = table.splitlines()[0].split()
    assert header[:2] == ["patch", "installed"] and header[-1] == "verdict"
    assert table == run_python(BLOCKED.format(args=["doctor"]), torch_first=True).stdout  # as doctor prints it


def test_a_release_newer_than_any_measured_is_said_in_the_reasons_and_below_the_table(tmp_path):
    """transformers' metadata says 99.0.0 (a dist-info ahead of the installed one on sys.path: the version
    the gates read before transformers is imported): every patch on transformers says so in its reason,
    and ``python -m shim`` once below its table, with what to run. Nothing fails: exit 0."""
    newest = json.loads((ROOT / "shim" / "measured.json").read_text())["newest"]["transformers"]
    dist_info = tmp_path / "transformers-99.0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 99.0.0\n")
    env = clean_environment({"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "SHIM_STRICT": "1"})
    note = f"transformers 99.0.0 is newer than the newest release measured ({newest}): run `python -m shim doctor`"

    def shim_cli(*args):
        done = subprocess.run(
            [sys.executable, "-m", "shim", *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    shown = shim_cli("--json")
    records = {record["name"]: record for record in json.loads(shown)}

    def gated_on(name):  # the patch's distribution and those its targets require
        patch = shim.registry.patch(name)
        return {patch.distribution} | {t.requirement.name for t in patch.targets if t.requirement is not None}

    said = {name for name, record in records.items() if note in record["reason"]}
    assert said == {name for name in records if "transformers" in gated_on(name)}
    assert len(said) >= 10

    table = shim_cli()
    assert " ".join(table.split()).endswith(f"note: {note}")
    assert all(len(line) <= WIDTH for line in table.splitlines())


def test_the_shipped_measured_ranges_cover_every_patched_distribution():
    """``shim/measured.json`` (written by ``python3 scripts/matrix.py --write-readme``) ships with the package
    and names the newest release measured of every distribution a patch is gated on."""
    measured = json.loads((ROOT / "shim" / "measured.json").read_text())
    assert {row["distribution"] for row in catalogue.INDEX} | {"torch"} <= set(measured["newest"])
    from shim import gating

    assert gating.newest_measured() == measured["newest"]


def test_import_shim_does_not_read_the_measured_ranges_a_status_does():
    code = """
    import json, sys
    opened = []
    sys.addaudithook(lambda event, args: event == "open" and str(args[0]).endswith("measured.json") and opened.append(1))
    import shim
    at_import = len(opened)
    shim.status()
    print(json.dumps([at_import, len(opened)]))
    """
    assert json.loads(run_python(code).stdout.strip().splitlines()[-1]) == [0, 1]
