"""Bad input, tried as a new user would: an odd command for ``shim-run``, a ``--json-file`` that
cannot be written, an encoding that cannot print, a closed stdout, huge or odd ``SHIM_*`` values,
a nested ``shim-run``. Each ends in a one-line message and its documented exit code, never a
traceback."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from shim import settings
from shim.settings import ShimWarning
from shim.tools import cli, run
from shim.tools.run import SITECUSTOMIZE_DIR
from tests.conftest import ROOT, clean_environment
from tests.tools.test_cli_edges import PYTHON_M_SHIM, SHIM_RUN, WITHOUT_LIBRARIES
from tests.tools.test_cli_edges import run as run_command

pytestmark = pytest.mark.any_version  # the code as it is, whatever is installed

LAUNCHERS = {"shim-run": [SHIM_RUN], "python -m shim run --": [*PYTHON_M_SHIM, "run", "--"]}
#: doctor without a library to check: the table of "not installed" rows in a second.
QUICK_DOCTOR = WITHOUT_LIBRARIES.replace('"peft"', '"peft", "accelerate", "deepspeed"')


def one_line(done: subprocess.CompletedProcess) -> str:
    """The one line the command said on stderr (after argparse's usage, where it prints one)."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, done.stderr
    return lines[0]


# -- shim-run: a command that cannot run ---------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize(
    ("command", "status", "message"),
    [
        ("", 127, "shim-run: command not found: '' (the command's name is empty)"),
        ("no\x01such", 127, "shim-run: command not found: 'no\\x01such'"),
        ("{tmp}", 126, "shim-run: {tmp}: is a directory"),
        ("x" * 300, 126, f"shim-run: cannot run {'x' * 80!r}... (300 characters): File name too long"),
    ],
    ids=["empty", "control character", "a directory", "too long"],
)
def test_a_command_that_cannot_run_is_one_line_with_a_shells_status(launcher, command, status, message, tmp_path):
    done = run_command([*LAUNCHERS[launcher], command.format(tmp=tmp_path)], capture_output=True)
    assert (done.returncode, one_line(done)) == (status, message.format(tmp=tmp_path))


def test_an_option_shim_run_does_not_have_exits_2_and_says_how_to_run_such_a_command():
    done = run_command([SHIM_RUN, "--version"], capture_output=True)
    assert done.returncode == 2
    assert one_line(done) == (
        "shim-run: unknown option --version; it takes only --help (shim-run -- --version runs a command so named)"
    )


@pytest.mark.parametrize("command", [["a\0b"], ["true", "a\0b"]], ids=["in the name", "in an argument"])
def test_a_nul_byte_given_to_main_is_one_line(command, capsys):
    """The operating system passes no NUL in a command line; a caller of ``main()`` can."""
    assert run.main(command) == 126
    assert capsys.readouterr().err.count("\n") == 1


# -- doctor --json-file --------------------------------------------------------------------------


def unwritable(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Paths that cannot be written -> the reason doctor gives."""
    read_only = tmp_path / "read-only.json"
    read_only.write_text("")
    read_only.chmod(0o444)
    paths = {
        "a directory": (str(tmp_path), "Is a directory"),
        "a missing folder": (str(tmp_path / "missing" / "doctor.json"), "No such file or directory"),
        "an empty path": ("", "No such file or directory"),
    }
    if os.geteuid() != 0:  # root writes a read-only file
        paths["a read-only file"] = (str(read_only), "Permission denied")
    if os.path.exists("/proc/version"):  # opens for writing (as root), and refuses the write
        paths["/proc/version"] = ("/proc/version", "Input/output error")
    if os.path.exists("/dev/full"):
        paths["/dev/full"] = ("/dev/full", "No space left on device")
    return paths


def test_a_json_file_that_cannot_be_written_fails_before_doctor_runs_with_exit_2(tmp_path):
    for name, (path, reason) in unwritable(tmp_path).items():
        done = run_command([*PYTHON_M_SHIM, "doctor", "--json-file", path], capture_output=True)
        assert (done.returncode, done.stdout) == (2, ""), f"{name}: {done.stderr}"
        shown = path if path else "''"
        assert one_line(done) == f"python -m shim doctor: error: --json-file {shown}: {reason}", name


def test_a_json_file_whose_write_fails_after_the_run_still_prints_the_table_and_exits_2(tmp_path):
    """The disk fills up during the run (here a file size limit of 2 bytes): the table, then why."""
    target = tmp_path / "doctor.json"
    code = (
        "import resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        f"from shim.tools.cli import main; raise SystemExit(main(['doctor', '--json-file', {str(target)!r}]))"
    )
    done = run_command([sys.executable, "-c", QUICK_DOCTOR.format(code=code)], capture_output=True)
    assert done.returncode == 2
    assert "not installed" in done.stdout  # the table
    assert one_line(done) == f"python -m shim doctor: error: --json-file {target}: File too large"


def test_a_json_file_with_a_nul_byte_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["doctor", "--json-file", "a\0b"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m shim doctor: error: --json-file 'a\\x00b': embedded null byte"
    )


def test_a_long_or_odd_patch_name_for_explain_is_quoted_and_cut():
    done = run_command([*PYTHON_M_SHIM, "explain", "x" * 3000 + "\x1b"], capture_output=True)
    assert done.returncode == 2
    assert one_line(done) == (
        f"python -m shim explain: error: no patch named {'x' * 40!r}... (3001 characters); python -m shim lists them"
    )


# -- an encoding that cannot print ---------------------------------------------------------------

ASCII = {
    "explain": [*PYTHON_M_SHIM, "explain", "frozen-tower-input-grads"],  # en dash, micro sign, times sign
    "status": [*PYTHON_M_SHIM],
    "status --json": [*PYTHON_M_SHIM, "--json"],
    "--help": [*PYTHON_M_SHIM, "--help"],
    "an unknown patch": [*PYTHON_M_SHIM, "explain", "frozen-tówer"],
    "doctor": [sys.executable, "-c", QUICK_DOCTOR.format(code="from shim.tools.cli import main; main(['doctor'])")],
    "shim-run --help": [SHIM_RUN, "--help"],
}


@pytest.mark.parametrize("name", ASCII)
def test_every_command_prints_under_an_encoding_that_cannot_write_its_characters(name, monkeypatch):
    monkeypatch.setenv("PYTHONIOENCODING", "ascii")
    done = run_command(ASCII[name], capture_output=True)
    assert done.returncode in (0, 2) and "Traceback" not in done.stderr, done.stderr
    if name == "explain":  # escaped as stderr escapes them
        assert "\\u2013" in done.stdout and "\\xb5" in done.stdout and "\\xd7" in done.stdout


def test_a_utf8_stdout_prints_the_characters_themselves(monkeypatch):
    monkeypatch.setenv("PYTHONIOENCODING", "utf-8")
    done = run_command(ASCII["explain"], capture_output=True, encoding="utf-8")
    assert done.returncode == 0 and "–" in done.stdout and "\\u2013" not in done.stdout


# -- a closed stdout -----------------------------------------------------------------------------


CLOSED_STDOUT = {
    "status": [*PYTHON_M_SHIM],
    "--help": [*PYTHON_M_SHIM, "--help"],
    "doctor": [*PYTHON_M_SHIM, "doctor"],
    "explain": [*PYTHON_M_SHIM, "explain", "checkpointing-restore"],
    "shim-run --help": [SHIM_RUN, "--help"],
}


def close_stdout() -> None:
    os.close(1)


@pytest.mark.parametrize("name", CLOSED_STDOUT)
def test_a_closed_stdout_is_one_line_and_exit_2_before_any_work(name):
    done = run_command(CLOSED_STDOUT[name], stderr=subprocess.PIPE, preexec_fn=close_stdout)
    program = "shim-run" if name.startswith("shim-run") else "python -m shim"
    assert done.returncode == 2
    assert one_line(done).startswith(f"{program}: cannot write to stdout: it is closed")


def test_a_stdout_that_refuses_writes_is_one_line_and_exit_2():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        done = run_command(PYTHON_M_SHIM, stdout=full, stderr=subprocess.PIPE)
    assert done.returncode == 2
    assert one_line(done).startswith("python -m shim: cannot write to stdout: No space left on device; ")


def test_closed_stdout_and_stderr_exit_2_quietly():
    def close_both():
        os.close(1)
        os.close(2)

    assert run_command(PYTHON_M_SHIM, preexec_fn=close_both).returncode == 2


def test_shim_run_leaves_a_closed_stdout_to_its_command():
    done = run_command([SHIM_RUN, "sh", "-c", "exit 3"], stderr=subprocess.PIPE, preexec_fn=close_stdout)
    assert (done.returncode, done.stderr) == (3, "")


# -- huge and odd SHIM_* values --------------------------------------------------------------------

KNOWN = ("first-patch", "second-patch")


@pytest.fixture
def caught(monkeypatch):
    """The ShimWarnings that ``settings.read(KNOWN)`` and ``configure_logging()`` give, as text."""
    monkeypatch.setattr(settings, "_warned", set())
    for variable in ("SHIM_DISABLE", "SHIM_FORCE", "SHIM_STRICT", "SHIM_REPORT", "SHIM_LOG_LEVEL"):
        monkeypatch.delenv(variable, raising=False)

    def read() -> list[str]:
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            settings.read(KNOWN)
            settings.configure_logging()
            settings.flag("SHIM_REPORT")
        return [str(w.message) for w in found if w.category is ShimWarning]

    return read


@pytest.mark.parametrize("variable", ["SHIM_DISABLE", "SHIM_FORCE"])
def test_many_unknown_names_are_one_warning_that_counts_them_and_lists_the_known(variable, monkeypatch, caught):
    monkeypatch.setenv(variable, ",".join(f"x{i}" for i in range(2000)))
    assert caught() == [
        f"{variable} names unknown patches 'x0', 'x1', 'x2' and 1997 more, ignored; "
        "known patches: first-patch, second-patch"
    ]


@pytest.mark.parametrize("variable", ["SHIM_DISABLE", "SHIM_FORCE"])
def test_many_items_that_are_no_names_are_one_warning_too(variable, monkeypatch, caught):
    monkeypatch.setenv(variable, ",".join(f"x;{i}" for i in range(2000)) + ",ALL,All,aLL,TRUE,*")
    messages = caught()
    assert messages[-1].startswith(f"{variable}: 'x;0', 'x;1', 'x;2' and 1997 more are not patch names, ignored;")
    assert "first-patch, second-patch" in messages[-1]
    if variable == "SHIM_FORCE":  # 'all' is no name it takes
        assert messages[0].startswith("SHIM_FORCE: 'ALL', 'All', 'aLL' and 2 more are not accepted, ignored;")
    assert len(messages) == (2 if variable == "SHIM_FORCE" else 1)


def test_a_few_unknown_names_each_get_their_did_you_mean(monkeypatch, caught):
    monkeypatch.setenv("SHIM_DISABLE", "first-pach,secnd-patch,first-pach")
    assert caught() == [
        "SHIM_DISABLE names an unknown patch 'first-pach', ignored; did you mean first-patch, second-patch?",
        "SHIM_DISABLE names an unknown patch 'secnd-patch', ignored; did you mean second-patch, first-patch?",
    ]


ODD = {
    "huge": "y" * 100_000,
    "control characters": "\x1b[31mred\tand\rback\x07",
    "not ASCII": "été-ünï",
}


@pytest.mark.parametrize("value", ODD.values(), ids=ODD)
@pytest.mark.parametrize("variable", ["SHIM_DISABLE", "SHIM_FORCE", "SHIM_STRICT", "SHIM_REPORT", "SHIM_LOG_LEVEL"])
def test_odd_values_warn_in_one_bounded_line_with_the_valid_values(variable, value, monkeypatch, caught):
    monkeypatch.setenv(variable, value)
    (message,) = caught()
    assert len(message) < 300 and message.isprintable(), message
    assert repr(value[:8])[:-1] in message  # quoted, control characters escaped
    valid = {"SHIM_LOG_LEVEL": "DEBUG, INFO", "SHIM_STRICT": "0, 1, false", "SHIM_REPORT": "0, 1, false"}
    assert valid.get(variable, "first-patch, second-patch") in message


def test_import_shim_with_2000_unknown_names_warns_in_one_short_line():
    """The issue's own case: 1.27 MB of warnings before."""
    env = clean_environment({"SHIM_DISABLE": ",".join(f"x{i}" for i in range(2000))})
    done = subprocess.run(
        [sys.executable, "-c", "import shim"], env=env, capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0
    assert done.stderr.count("ShimWarning") == 1 and len(done.stderr) < 1500, done.stderr[:3000]


# -- the user's sitecustomize and a nested shim-run ----------------------------------------------

USER_SITECUSTOMIZE = "import os\nprint(f'user sitecustomize in pid {os.getpid()}', flush=True)\n"


@pytest.mark.parametrize(
    "inner",
    [
        [SHIM_RUN],
        [*PYTHON_M_SHIM, "run", "--"],
        [sys.executable, "-X", "utf8", "-W", "ignore", "-m", "shim", "run"],
        [sys.executable, "-m", "shim.tools.run"],
    ],
    ids=["shim-run", "python -m shim run", "with interpreter options", "python -m shim.tools.run"],
)
def test_a_shim_run_started_under_shim_run_leaves_the_users_sitecustomize_to_its_command(inner, tmp_path):
    """``shim-run bash -c 'shim-run python train.py'``: the inner shim-run's Python starts with the
    shim's start-up file first on ``PYTHONPATH``; it only becomes its command, so the user's module
    runs in that command alone, not in the shim-run on the way there."""
    user = tmp_path / "user-site"
    user.mkdir()
    (user / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    # PYTHONPATH as the outer shim-run leaves it
    env = clean_environment({"PYTHONPATH": os.pathsep.join([SITECUSTOMIZE_DIR, str(user)])})
    done = subprocess.run(
        [*inner, sys.executable, "-c", "import os, sys; print('command', os.getpid(), 'shim' in sys.modules)"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    pid = done.stdout.split()[-2]  # exec: the command has the launcher's pid
    assert done.stdout.splitlines() == [f"user sitecustomize in pid {pid}", f"command {pid} True"]
