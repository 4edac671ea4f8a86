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

import os
import sys
from collections.abc import Sequence

#: The directory whose ``sitecustomize`` imports the shim in every interpreter of the command.
SITECUSTOMIZE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sitecustomize")

USAGE = """\
usage: shim-run <command> [arguments ...]
       python -m shim run [--] <command> [arguments ...]

Run <command> with hf-train-shim imported first in every Python process it starts: the command,
every rank of torchrun / accelerate launch / deepspeed, spawned workers. A sitecustomize directory
goes first on PYTHONPATH and runs any sitecustomize that was already there. The exit status and the
signals are the command's. SHIM_* environment variables pass through unchanged.

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


def main(argv: Sequence[str] | None = None) -> int:
    """Replace this process with the command; returns only when the command cannot be started."""
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or command[0] in ("-h", "--help"):
        try:
            print(USAGE, file=sys.stdout if command else sys.stderr, flush=True)
        except BrokenPipeError:  # shim-run --help | head
            return reader_gone()
        return 0 if command else 2
    env = environment()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"shim-run: command not found: {command[0]}", file=sys.stderr)
        return 127  # as a shell says it
    except PermissionError:
        print(f"shim-run: permission denied: {command[0]}", file=sys.stderr)
        return 126
    except OSError as exc:
        print(f"shim-run: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 126
    return 0  # pragma: no cover - execvpe does not return


if __name__ == "__main__":
    sys.exit(main())
