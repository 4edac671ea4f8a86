"""Which kind of process this is, for the exit report: a training process, or a helper of one.

``SHIM_REPORT=1`` reaches every Python process a run starts (the variable is inherited, and under
``shim-run`` so is the shim), but a user wants one report per training process: the script, or each
rank under a launcher. A *helper* prints its report only when a patch changed something in it:

* a process started by ``multiprocessing`` (or ``multiprocess``): spawn and forkserver workers
  (DataLoader workers among them), the resource tracker, the fork server (a ``fork`` child ends
  without exit handlers). Ranks started by ``torch.multiprocessing.spawn`` count as workers too:
  nothing tells them from a pool's worker, so they report only what changed;
* a launcher: ``torchrun``, ``accelerate launch``, ``deepspeed`` (a process without ``RANK`` that
  imported a launcher module; the ranks it starts have ``RANK``);
* a process that imported no module a patch targets (an inductor compile worker, a launcher of
  another kind): no patch could act there.

Only the standard library is used, and only modules the process already imported are looked at.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Protocol

#: Modules that only a launcher imports: torchrun, accelerate launch, deepspeed (runner and launch).
LAUNCHERS = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "torch.distributed.launcher.api",
    "accelerate.commands.launch",
    "deepspeed.launcher.runner",
    "deepspeed.launcher.launch",
)


class Record(Protocol):
    """What this module reads of a :class:`shim.records.PatchStatus`."""

    @property
    def effects(self) -> int: ...

    @property
    def targets(self) -> tuple[str, ...]: ...


def rank() -> str | None:
    """The process's rank under torchrun, accelerate or deepspeed (``RANK``), if any."""
    return os.environ.get("RANK") or None


def helper(target_specs: Iterable[str]) -> str | None:
    """What kind of helper this process is (a few words), or ``None`` for a training process.

    ``target_specs`` are the patches' targets (``"module:attribute"``): a process that imported none
    of their modules is a helper.
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
    if not any(spec.partition(":")[0] in sys.modules for spec in target_specs):
        return "no target module imported"
    return None


def quiet_at_exit(records: Sequence[Record]) -> bool:
    """Whether ``SHIM_REPORT=1`` leaves out the exit report: a helper in which no patch changed anything."""
    if any(record.effects for record in records):
        return False
    return helper(spec for record in records for spec in record.targets) is not None
