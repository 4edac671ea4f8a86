"""Everything the command line shows fits 100 columns; its edges behave as Unix tools do: the
usage of the command that was given, ``--version``, a reader that goes away (``| head``)."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, clean_environment

WIDTH = 100
SHIM_RUN = str(Path(sys.executable).with_name("shim-run"))
PYTHON_M_SHIM = [sys.executable, "-m", "shim"]
# transformers, trl and peft made unimportable (Python's way: None in sys.modules), as in an
# environment without them: the longest lists of skipped patches.
WITHOUT_LIBRARIES = """
import sys
for name in ("transformers", "trl", "peft"):
    sys.modules[name] = None
{code}
"""

COMMANDS = {
    "status": [*PYTHON_M_SHIM],
    "status --import-targets": [*PYTHON_M_SHIM, "--import-targets"],
    "--help": [*PYTHON_M_SHIM, "--help"],
    "status --help": [*PYTHON_M_SHIM, "status", "--help"],
    "doctor --help": [*PYTHON_M_SHIM, "doctor", "--help"],
    "run --help": [*PYTHON_M_SHIM, "run", "--help"],
    "explain --help": [*PYTHON_M_SHIM, "explain", "--help"],
    "explain, an unknown patch": [*PYTHON_M_SHIM, "explain", "no-such-patch"],
    "explain (every patch)": [*PYTHON_M_SHIM, "explain"],
    "bug-report --help": [*PYTHON_M_SHIM, "bug-report", "--help"],
    "run (no command)": [*PYTHON_M_SHIM, "run"],
    "--version": [*PYTHON_M_SHIM, "--version"],
    "status --bogus": [*PYTHON_M_SHIM, "status", "--bogus"],
    "an unknown command": [*PYTHON_M_SHIM, "frobnicate"],
    "shim-run --help": [SHIM_RUN, "--help"],
    "shim-run (no command)": [SHIM_RUN],
    "doctor": [*PYTHON_M_SHIM, "doctor"],
    "status, no libraries": [
        sys.executable,
        "-c",
        WITHOUT_LIBRARIES.format(code="from shim.tools.cli import main; main(['--import-targets'])"),
    ],
    "doctor, no libraries": [
        sys.executable,
        "-c",
        WITHOUT_LIBRARIES.format(code="from shim.tools.cli import main; raise SystemExit(main(['doctor']))"),
    ],
    "shim.report(), no libraries": [
        sys.executable,
        "-c",
        WITHOUT_LIBRARIES.format(code="import shim\nprint(shim.report())"),
    ],
    "SHIM_REPORT=1 at exit": [
        sys.executable,
        "-c",
        "import atexit, shim, shim.tools.report\natexit.register(shim.tools.report.at_exit, True)\n"
        "shim.record_effect('load-keeps-requires-grad', 'kept %d parameter(s) of %s frozen that transformers "
        "%s made trainable while loading, and a long tail to wrap: ' + 'word ' * 40, 10, 'FrozenBaseLlama', '5.24.0')",
    ],
}


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    # warnings are Python's; the longest rank prefix
    env = clean_environment({"PYTHONWARNINGS": "ignore", "RANK": "12345"})
    return subprocess.run(command, env=env, cwd=ROOT, text=True, timeout=600, **kwargs)


@pytest.mark.parametrize("name", COMMANDS)
def test_everything_the_command_line_shows_fits_100_columns(name):
    """``--json`` (records to parse, not to read) and ``--wide`` (asked for) are not fitted."""
    done = run(COMMANDS[name], capture_output=True)
    assert done.returncode in (0, 1, 2), done.stderr
    shown = (done.stdout + done.stderr).splitlines()
    assert shown, f"{name} printed nothing"
    wide = [line for line in shown if len(line) > WIDTH]
    assert wide == [], f"{name}: {len(wide)} line(s) over {WIDTH} columns, the widest {max(map(len, wide))}"


BROKEN_PIPE = {
    "--json": ([*PYTHON_M_SHIM, "--json"], 141),
    "doctor --json": (  # no library a self-check runs on: what is written does not matter here
        [
            sys.executable,
            "-c",
            WITHOUT_LIBRARIES.replace('"peft"', '"peft", "accelerate", "deepspeed"').format(
                code="from shim.tools.cli import main; raise SystemExit(main(['doctor', '--json']))"
            ),
        ],
        141,
    ),
    "shim-run --help": ([SHIM_RUN, "--help"], 141),
    "--help": ([*PYTHON_M_SHIM, "--help"], 0),  # argparse ignores the failed write of its help itself
}


@pytest.mark.parametrize("name", BROKEN_PIPE)
def test_a_reader_that_goes_away_ends_the_command_quietly(name):
    """``python -m shim doctor --json | head``: no BrokenPipeError traceback, and the status of a
    tool ended by SIGPIPE (141), as the shell reports it for ``yes | head``."""
    command, status = BROKEN_PIPE[name]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        done = run(command, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (status, "")


def test_an_unknown_argument_is_shown_with_the_usage_of_its_command():
    done = run([*PYTHON_M_SHIM, "status", "--bogus"], capture_output=True)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m shim status ")
    assert done.stderr.splitlines()[-1] == "python -m shim status: error: unrecognized arguments: --bogus"
    done = run([*PYTHON_M_SHIM, "doctor", "--bogus"], capture_output=True)
    assert (done.returncode, done.stderr.split()[:4]) == (2, ["usage:", "python", "-m", "shim"])
    assert "python -m shim doctor: error: unrecognized arguments: --bogus" in done.stderr
    done = run([*PYTHON_M_SHIM, "frobnicate"], capture_output=True)
    assert done.returncode == 2
    assert "no command 'frobnicate'; python -m shim --help lists them" in done.stderr
    done = run([*PYTHON_M_SHIM, "new_pak"], capture_output=True)
    assert "no command 'new_pak'; did you mean new-pack?" in done.stderr


def test_the_usage_names_every_command_and_version_prints_the_installed_one():
    usage = run([*PYTHON_M_SHIM, "--help"], capture_output=True).stdout.splitlines()[0]
    assert usage == "usage: python -m shim [-h] [--version] {status,doctor,explain,bug-report,new-pack,index,run} ..."
    done = run([*PYTHON_M_SHIM, "--version"], capture_output=True)
    assert (done.returncode, done.stdout) == (0, f"hf-train-shim {importlib.metadata.version('hf-train-shim')}\n")
