"""Imports hf-train-shim when an interpreter starts, then the ``sitecustomize`` this one stands in front of.

``shim-run`` (``shim/run.py``) puts this directory first on ``PYTHONPATH``, so Python's ``site`` runs
this module at start-up in every interpreter the command starts. It is not a package module and is
never imported otherwise.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
#: Every shim-run start-up file holds this text; the chain below never runs a file that holds it.
MARKER = "hf-train-shim: the start-up file of shim-run"
#: Set in ``sys.modules`` once an interpreter has chained: the chain never runs twice, whatever runs this file again.
_GUARD = "_hf_train_shim_sitecustomize_chained"


def _import_shim() -> None:
    try:
        import shim  # noqa: F401  -- first: its import hooks then see every later import
    except ModuleNotFoundError as exc:
        if exc.name != "shim":
            _say(f"hf-train-shim could not be imported ({exc!r}); running without it")
        else:  # another environment's Python (a venv not activated): it runs, but the user should know
            _say(
                "hf-train-shim is not installed for this Python, which runs without it;\n"
                "  name the Python that has it (shim-run .venv/bin/python train.py) or install it there"
            )
    except Exception as exc:  # a broken install must not stop the user's program
        _say(f"hf-train-shim could not be imported ({exc!r}); running without it")


def _say(message: str) -> None:
    print(f"shim-run: {sys.executable}: {message}", file=sys.stderr, flush=True)


def _is_a_shim_run_file(origin: str | None) -> bool:
    """Whether ``origin`` is a shim-run start-up file: this one, or another install's."""
    if not origin or not origin.endswith(".py"):
        return False
    try:
        with open(origin, "rb") as file:
            return MARKER.encode() in file.read()
    except OSError:
        return False


def _is_shim_run() -> bool:
    """Whether this interpreter is a ``shim-run`` (or ``python -m shim run``) started under another
    one: it only becomes its command, which runs the user's ``sitecustomize`` itself."""
    argv = list(getattr(sys, "orig_argv", ()))[1:]  # the interpreter's own options too (Python 3.10+)
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c", "-"):
        argv = argv[2:] if argv[0] in ("-X", "-W", "--check-hash-based-pycs") else argv[1:]
    if argv[:1] == ["-m"]:
        return argv[1:3] == ["shim", "run"] or argv[1:2] == ["shim.tools.run"]
    return bool(argv) and os.path.basename(argv[0]) == "shim-run"


def _run_the_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` that Python would have run without shim-run, if there is one.

    That is the first one on ``sys.path`` that is no shim-run start-up file: another install's
    directory on ``PYTHONPATH`` (a global ``shim-run`` around a virtual environment's) is passed
    over like this one, so each interpreter runs the user's module exactly once; a nested
    ``shim-run`` runs it not at all, its command does.
    """
    import importlib.machinery
    import importlib.util

    if _GUARD in sys.modules:  # run again from a chain already under way (a start-up file without MARKER)
        return
    if _is_shim_run():
        return
    sys.modules[_GUARD] = sys.modules[__name__]
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == _HERE:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is None or spec.loader is None or _is_a_shim_run_file(spec.origin):
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module  # ``import sitecustomize`` elsewhere finds the user's module
        spec.loader.exec_module(module)
        return


_import_shim()
_run_the_next_sitecustomize()
