"""``shim-run <command ...>``: run a command with the shim imported first in every Python process it starts.

For launchers (``torchrun``, ``accelerate launch``, ``deepspeed``) and scripts that cannot be edited. The
command runs with ``shim/tools/_sitecustomize`` first on ``PYTHONPATH``: every Python interpreter it starts,
the command itself, each rank, each spawned worker, runs that directory's ``sitecustomize`` at start-up,
which imports ``shim`` and then the ``sitecustomize`` that would have run without it. The shim process
then *becomes* the command (``exec``): the exit status and the signals are the command's own. Nothing
else in the environment changes (``SHIM_*`` switches pass through). ``python -m shim run -- <command>``
does the same.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from ..settings import shown

#: The directory whose ``sitecustomize`` imports the shim in every interpreter of the command.
SITECUSTOMIZE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sitecustomize")

USAGE = """\
usage: shim-run <command> [arguments ...]
       python -m shim run [--] <command> [arguments ...]

Run <command> with hf-train-shim imported first in every Python process it starts: the command,
every rank of torchrun / accelerate launch / deepspeed, spawned workers. A sitecustomize directory
goes first on PYTHONPATH and runs any sitecustomize that was already there. The exit status and the
signals are the command's; shim-run's own: 127 command not found, 126 found but cannot run (a
directory, no permission), 2 a bad shim-run command line. SHIM_* variables pass through unchanged.

examples:
  shim-run torchrun --nproc_per_node 2 train.py
  SHIM_REPORT=1 shim-run accelerate launch train.py
  python -m shim run -- deepspeed --num_gpus 2 train.py"""


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the sitecustomize directory first on
    ``PYTHONPATH``, once, and every other entry kept in its order: an empty entry too, which Python
    reads as the current directory (``PYTHONPATH=:``, ``/x::``)."""
    env = dict(os.environ if base is None else base)
    raw = env.get("PYTHONPATH", "")
    rest = raw.split(os.pathsep) if raw else []  # an empty PYTHONPATH has no entries, not one empty one
    rest = [entry for entry in rest if not entry or os.path.abspath(entry) != SITECUSTOMIZE_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SITECUSTOMIZE_DIR, *rest])
    return env


def reader_gone() -> int:
    """After ``BrokenPipeError`` on stdout (``python -m shim doctor --json | head``): point stdout at
    the null device, so that the flush at exit cannot fail again, and return the status of a Unix
    tool ended by ``SIGPIPE``, without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # SIGPIPE


def say(message: str) -> None:
    """``message`` on stderr, or nowhere where stderr is closed (``2>&-``; ``print`` would then write
    it to stdout)."""
    if sys.stderr is not None:
        print(message, file=sys.stderr, flush=True)


def cannot_write(stream: TextIO | None) -> str | None:
    """Why nothing can be written to ``stream``, or ``None``: it is closed (``>&-`` makes
    ``sys.stdout`` ``None``), or its file refuses writes (``/dev/full``, ``/proc/version``, a
    read-only descriptor). A write of no bytes reaches the file's own write and says so at once,
    before any work; a pipe takes it whether or not its reader is there (that is :func:`reader_gone`)."""
    if stream is None:
        return "it is closed"
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a captured stream): its writes will say
        return None
    try:
        os.write(fd, b"")
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def lenient(stream: TextIO | None) -> None:
    """Let ``stream`` print what its encoding cannot (``PYTHONIOENCODING=ascii``, a latin-1 terminal)
    as ``\\u2013`` escapes instead of raising ``UnicodeEncodeError`` (the default for stdout):
    stderr's own way. Text the encoding can write comes out as before."""
    if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
        stream.reconfigure(errors="backslashreplace")


def as_given(text: str, limit: int = 80) -> str:
    """A name or path in a message: as given, or quoted and cut where it holds control characters or
    is long."""
    return text if text and text.isprintable() and len(text) <= limit else shown(text, limit)


def main(argv: Sequence[str] | None = None) -> int:
    """Replace this process with the command; returns only when the command cannot be started:
    127 (not found) or 126 (found, cannot run) as a shell says it, 2 for a command line or an
    output that is not usable."""
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    elif command and command[0].startswith("-") and command[0] not in ("-h", "--help"):
        option = as_given(command[0])
        say(f"shim-run: unknown option {option}; it takes only --help (shim-run -- {option} runs a command so named)")
        return 2
    if not command:
        say(USAGE)
        return 2
    if command[0] in ("-h", "--help"):
        problem = cannot_write(sys.stdout)
        if problem:  # shim-run --help >&-
            say(f"shim-run: cannot write to stdout: {problem}")
            return 2
        try:
            print(USAGE, flush=True)
        except BrokenPipeError:  # shim-run --help | head
            return reader_gone()
        return 0
    name = command[0]
    if not name:  # shim-run "$LAUNCHER" train.py with LAUNCHER unset
        say("shim-run: command not found: '' (the command's name is empty)")
        return 127  # as a shell says it
    env = environment()
    for stream in (sys.stdout, sys.stderr):  # a closed one (>&-) is the command's to meet
        if stream is not None:
            stream.flush()
    try:
        os.execvpe(name, command, env)
    except FileNotFoundError:
        say(f"shim-run: command not found: {as_given(name)}")
        return 127
    except PermissionError:
        reason = "is a directory" if os.path.isdir(name) else "permission denied"
        say(f"shim-run: {as_given(name)}: {reason}")
        return 126
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in an argument given to main()
        say(f"shim-run: cannot run {as_given(name)}: {getattr(exc, 'strerror', None) or exc}")
        return 126
    return 0  # pragma: no cover - execvpe does not return


if __name__ == "__main__":
    sys.exit(main())
