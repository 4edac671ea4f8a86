"""Imports hf-train-shim when an interpreter starts, then the ``sitecustomize`` this one stands in front of.

``shim-run`` (``shim/run.py``) puts this directory first on ``PYTHONPATH``, so Python's ``site`` runs
this module at start-up in every interpreter the command starts. It is not a package module and is
never imported otherwise.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _import_shim() -> None:
    try:
        import shim  # noqa: F401  -- first: its import hooks then see every later import
    except ModuleNotFoundError as exc:
        if exc.name != "shim":
            _say(f"hf-train-shim could not be imported ({exc!r}); running without it")
        # an interpreter that has no shim installed (another environment's python): left as it is
    except Exception as exc:  # a broken install must not stop the user's program
        _say(f"hf-train-shim could not be imported ({exc!r}); running without it")


def _say(message: str) -> None:
    print(f"shim-run: {sys.executable}: {message}", file=sys.stderr, flush=True)


def _run_the_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` that Python would have run without this directory, if there is one."""
    import importlib.machinery
    import importlib.util

    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # ``import sitecustomize`` elsewhere finds the user's module
    spec.loader.exec_module(module)


_import_shim()
_run_the_next_sitecustomize()
