"""hf-train-shim: ``import shim`` fixes known bugs of the installed transformers / trl / peft.

Each fix is a version-gated wrapt patch from the ``shim.patches`` catalogue. Importing ``shim``
activates all of them: a patch whose target module is already imported is applied at once, the
others right after their module is first imported. ``shim`` itself imports neither torch nor
transformers, nor any patch module before one of its targets is imported.

Public API::

    shim.status()                     # one PatchStatus per patch: state, reason, effects
    shim.report()                     # the effects table (printed at exit with SHIM_REPORT=1; by default
                                      # one line there where a fix acted, SHIM_REPORT=0 for none)
    shim.activate(); shim.deactivate()
    shim.enable(*names); shim.disable(*names)
    with shim.disabled(*names): ...   # no names = all
    shim.register(patch)              # your own Patch, same registry
                                      # (or a patch pack: an entry point in hf_train_shim.patches)
    shim.PatchError                   # raised only in strict mode (SHIM_STRICT=1)
    shim.wrappers("transformers.modeling_utils:PreTrainedModel.gradient_checkpointing_enable")
                                      # the shim's layers on a target: [(patch name, layer)], outermost first
    print(shim.in_effect(model))      # is the fix in effect on my model? its checkpointing, the
                                      # patches acting on it and how, its adapters (.as_dict() too)
    shim.audit_first_step(model, batch)  # the first-step audit on one forward and backward, as data:
                                      # trainable parameters that got no gradient, checkpointing that did
                                      # not run (automatic at a model's first optimizer step: shim.audit)

For patch modules (``shim.patches`` and your own): ``shim.Patch``, ``shim.Target``, ``shim.SameFix``,
``shim.record_effect(name, message, *args)`` on the branch where a wrapper changes something, and
``shim.switch_of(name)``, the live on/off switch of a patch, for a hook it installs outside its
wrappers; ``shim.written_by(obj)``, where another patcher's object was written. Several patches
on one target share the engine's one layer there, which runs their parts in one declared order
(``Patch.after``, ``Patch.place``: ``shim.order``). Other patchers on the shim's targets are named
when asked: a status, doctor, the exit report, or ``SHIM_LOG_LEVEL=DEBUG``.
``shim.BugProbe`` and ``shim.Evidence`` declare a patch's bug probe (``Patch.bug_probe``); ``shim.selfcheck.bare``
builds the bare models and layers they ask their question of.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import time
from types import ModuleType

from . import catalogue, forks, importhooks, packs, runtime, settings
from .entry import APPLIED, DISABLED, FAILED, PENDING, SKIPPED, State
from .registry import Registry
from .runtime import record as record_effect
from .settings import PatchError, ShimWarning

__version__ = "0.7.0"
__all__ = [
    "APPLIED",
    "BugProbe",
    "DISABLED",
    "FAILED",
    "PENDING",
    "SKIPPED",
    "State",
    "Evidence",
    "Patch",
    "PatchError",
    "PatchStatus",
    "Registry",
    "SameFix",
    "ShimWarning",
    "Target",
    "activate",
    "audit_first_step",
    "deactivate",
    "disable",
    "disabled",
    "enable",
    "in_effect",
    "record_effect",
    "register",
    "registry",
    "report",
    "status",
    "switch_of",
    "wrappers",
    "written_by",
]

# Imported on first use: they need ``packaging`` (Patch, Target) or dataclasses (PatchStatus),
# which only a patch that applies, or a status, has to pay for.
_LAZY = {
    "Patch": "patch",
    "Target": "patch",
    "SameFix": "patch",
    "BugProbe": "patch",
    "Evidence": "patch",
    "PatchStatus": "statuses",
    "written_by": "others",
    "audit_first_step": "audit",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with forks.lazy_imports:  # no child is forked in the middle of it
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def _report_at_exit(table: bool) -> None:
    with forks.lazy_imports:
        from .tools.report import at_exit

    at_exit(table)


_handing_over_in = 0  # the pid of the worker whose end hands its counts over (a fork child starts over)


def _workers_report_here(process: ModuleType) -> None:
    """Once ``multiprocessing.process`` is imported: the workers this process starts hand their
    counts to its exit report (a worker's own copy of the config names its starter's key)."""
    process.current_process()._config.setdefault(runtime.WORKERS_KEY, f"{os.getpid()}-{time.time_ns()}")


def _hand_over_at_worker_end() -> None:
    """At a ``multiprocessing`` worker's first effect: its report runs when multiprocessing ends it,
    where a ``fork`` worker ends by ``os._exit`` without ``atexit`` (``shim.tools.workers``)."""
    global _handing_over_in
    process = sys.modules.get("multiprocessing.process")
    if _handing_over_in == os.getpid() or process is None or process.parent_process() is None:
        return
    _handing_over_in = os.getpid()
    from multiprocessing.util import Finalize

    Finalize(None, _report_at_exit, args=(_report is True,), exitpriority=-100)  # after it joined its own


#: ``runtime.RAY_JOB``, for the Ray patch's helper (``shim.patches._ray_jobs``), which sets it: a patch
#: module imports only the public modules (the tools import it from ``shim.runtime``).
_RAY_JOB = runtime.RAY_JOB


def _hand_over_to_ray_driver() -> None:
    """At a Ray worker's first effect: its counts go to its driver's exit report while it runs, since
    Ray ends its workers without an interpreter exit (``shim.tools.rayjobs``)."""
    process = sys.modules.get("multiprocessing.process")
    if process is not None and process.parent_process() is not None:
        return  # a multiprocessing worker hands its counts to its starter
    with forks.lazy_imports:
        from .tools import rayjobs

    rayjobs.hand_over_while_running()


def report() -> str:
    """The effects table: which patches changed something in this process, how often, the last what."""
    with forks.lazy_imports:
        from .tools.report import report as effects_table

    return effects_table(registry.status())


def in_effect(model: object) -> object:
    """What the shim does on ``model`` now: how its modules checkpoint, which patches act on it and
    how, its adapters. Print it, or read ``.as_dict()``; it changes nothing on the model."""
    with forks.lazy_imports:
        from .tools.model_view import in_effect as view

    return view(model, registry)


def wrappers(target: object) -> list[tuple[str, object]]:
    """The shim's layers on ``target`` (an object, or a ``"module:Class.attribute"`` spec of a
    module already imported), outermost first, as ``(patch name, layer)``; ``[]`` when none."""
    with forks.lazy_imports:
        from .wrapping import wrappers_on  # wrapt waits for the first use

    return wrappers_on(target)


logging.getLogger("shim").addHandler(logging.NullHandler())
settings.configure_logging()

#: The process's registry of built-in patches (a reload of ``shim`` builds a new one, which adopts
#: the layers already in the targets instead of adding more).
registry = Registry(catalogue.builtin())

status = registry.status
enable = registry.enable
disable = registry.disable
disabled = registry.disabled
register = registry.register
switch_of = registry.switch_of

# What the shim did, said on stderr at exit: one line where a fix acted, the effects table with
# SHIM_REPORT=1, nothing with SHIM_REPORT=0. Registered here, imported only at exit (shim.tools.report).
_report = settings.switch("SHIM_REPORT", default="one line at exit where a fix acted")
if _report is not False:
    atexit.register(_report_at_exit, _report is True)
    importhooks.when_imported("multiprocessing.process", _workers_report_here)
    runtime.first_effect_hooks.append(_hand_over_at_worker_end)
    if os.environ.get(runtime.RAY_JOB):
        runtime.first_effect_hooks.append(_hand_over_to_ray_driver)


# The first-step audit (shim.audit): optimizers are watched from when torch.optim.optimizer is
# imported (activate() below asks for it).
def _audit_optimizers(module: ModuleType) -> None:
    with forks.lazy_imports:
        from . import audit

    audit.install(registry.is_on)


def activate() -> None:
    """Apply every enabled patch now, or right after its target modules are imported, and watch the
    optimizers made from now on for the first-step audit (``Registry.activate``)."""
    registry.activate()
    importhooks.when_imported("torch.optim.optimizer", _audit_optimizers)


def deactivate() -> None:
    """Remove every layer this shim installed, the first-step audit's watch of optimizers included,
    leaving other libraries' wrappers working (``Registry.deactivate``)."""
    registry.deactivate()
    audit = sys.modules.get(f"{__name__}.audit")
    if audit is not None:
        audit.uninstall()


# Patch packs (other distributions' patches, entry points of ``hf_train_shim.patches``) join last,
# after the built-ins: a pack's module imports ``shim`` and finds the whole API, its parts sit
# outside the built-ins' of the same place on a target, and it never takes a built-in's name. Their
# modules wait for their targets, as the built-ins' do (``shim.packs``).
packs.load(registry)

activate()
