"""Which kind of process this is, for the exit report: a training process, or a helper of one.

The exit report (one line where a fix acted; the table with ``SHIM_REPORT=1``) can come from every
Python process a run starts (under ``shim-run`` each imports the shim), but a user wants one report
per training job: the script, or its ranks together (``shim.tools.ranks``). A *helper* reports only
when a patch changed something in it, on its own:

* a process started by ``multiprocessing`` (or ``multiprocess``) that does not hand its counts to
  the process that started it (``shim.tools.workers``; that process had not imported the shim), the
  resource tracker, the fork server. Ranks started by ``torch.multiprocessing.spawn`` count as
  workers too: nothing tells them from a pool's worker;
* a launcher: ``torchrun``, ``accelerate launch``, ``deepspeed`` (a process without ``RANK`` that
  imported a launcher module; the ranks it starts have ``RANK``);
* a process that imported no module a patch targets (an inductor compile worker, a launcher of
  another kind): no patch could act there.

Only the standard library is used, and only modules the process already imported are looked at.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

#: Modules that only a launcher imports: torchrun, accelerate launch, deepspeed (runner and launch).
LAUNCHERS = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "torch.distributed.launcher.api",
    "accelerate.commands.launch",
    "deepspeed.launcher.runner",
    "deepspeed.launcher.launch",
)


def rank() -> str | None:
    """The process's rank under torchrun, accelerate or deepspeed (``RANK``), if any."""
    return os.environ.get("RANK") or None


def helper(target_modules: Iterable[str]) -> str | None:
    """What kind of helper this process is (a few words), or ``None`` for a training process.

    ``target_modules`` are the modules the patches target: a process that imported none of them is a
    helper.
    """
    for name in ("multiprocessing", "multiprocess"):  # multiprocess: the dill-based fork datasets uses
        module = sys.modules.get(name)
        if module is not None and getattr(module, "parent_process", lambda: None)() is not None:
            return "multiprocessing worker"
    argv = list(getattr(sys, "orig_argv", ()))
    if "-c" in argv[:-1] and argv[argv.index("-c") + 1].lstrip().startswith("from multiprocess"):
        return "multiprocessing helper"  # the resource tracker, the fork server
    if rank() is None and any(name in sys.modules for name in LAUNCHERS):
        return "launcher"
    if not any(name in sys.modules for name in target_modules):
        return "no target module imported"
    return None
