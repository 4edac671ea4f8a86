"""A Ray job's workers and its driver: the runtime environment that gives every worker the shim, and the
channel through which the workers' counts reach the driver's exit report (``ray-workers-get-the-shim``).

Ray ships a task's or an actor's function to its workers by pickling it, so the driver's ``import shim``
never runs there. Ray's own way to run code in every worker of a job before the user's is the job's
runtime environment: ``worker_process_setup_hook``. :func:`prepared` gives ``ray.init`` a runtime
environment whose setup hook is :func:`setup_hook`'s: it runs the user's own hook after its own, the
driver's ``SHIM_*`` variables go along as ``env_vars`` (the user's own values for them kept), and
:data:`VARIABLE` names the job, so that the workers' exit reports go to the driver's.

The hook is a closure, which Ray's cloudpickle ships by value: a worker on a node without hf-train-shim
unpickles and runs it, fails to import the shim, tells the driver (a key in the job's part of Ray's
internal key-value store) and runs the user's hook; the worker itself runs on, as without the shim.

The channel is the same store, reachable from every node: a worker writes what it counted under its own
key (``shim.tools.rayjobs``, a few times a second while its counts change, since Ray ends its workers
without an interpreter exit); the driver reads them all in :func:`collect` before Ray disconnects it (its
``ray.shutdown()``, or at exit, ahead of Ray's own shutdown), marks the job claimed and keeps the
records for its exit report (``shim.tools.report``). Only Ray's public-by-use helpers are used, imported
when a job starts; nothing here runs at ``import shim``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from shim import _RAY_JOB as VARIABLE
from shim import ShimWarning

#: The internal key-value store's namespace of the shim's keys, each ``<job>/<what>``.
NAMESPACE = "hf-train-shim"
CLAIMED = "claimed"
#: What Ray calls the environment variable that carries a job's setup hook (set inside ``ray.init``).
HOOK_VARIABLE = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
#: Where a job submitted with ``ray job submit`` finds the runtime environment it was given.
SUBMITTED = "RAY_JOB_CONFIG_JSON_ENV_VAR"
#: What to do where a worker cannot import the shim.
INSTALL = (
    "install hf-train-shim on every node of the cluster (pip install hf-train-shim), or add it to the "
    "job's runtime_env pip list"
)

log = logging.getLogger("shim")
#: The job this driver started last and has not collected yet (its key), or ``""``: set once its
#: ``ray.init`` has returned.
current = ""
#: What the workers of this driver's jobs counted, collected before Ray disconnected: one record each
#: (``pid``, ``node``, ``rank`` or ``None``, ``effects``, ``last``), for the exit report.
collected: list[dict[str, Any]] = []
_said: set[str] = set()


def warn_once(message: str) -> None:
    """Say a problem once per process: on the ``shim`` logger and as a ``ShimWarning``."""
    if message in _said:
        return
    _said.add(message)
    log.warning(message)
    warnings.warn(message, ShimWarning, stacklevel=3)


def prepared(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """A new job's key and the keyword arguments for ``ray.init(*args, **kwargs)`` that start it with
    workers that import the shim, or ``None`` where this ``init`` starts no such job: Ray is initialized
    already (the call returns or raises as it would), Ray Client (``ray://``) or local mode (no worker
    process), or a submitted job whose runtime environment has a setup hook already (said once)."""
    ray = _ray()
    address = args[0] if args else kwargs.get("address")
    address = address or os.environ.get("RAY_ADDRESS", "")
    if ray.is_initialized() or kwargs.get("local_mode"):
        return None
    if "://" in str(address):
        warn_once(
            f"ray.init({address!r}) connects through Ray Client, where hf-train-shim leaves the job as it "
            "is: its workers run without the shim; make import shim the first line inside the functions "
            "you ship"
        )
        return None
    given = kwargs.get("runtime_env")
    if given is None and kwargs.get("job_config") is not None:
        given = getattr(kwargs["job_config"], "runtime_env", None)
    env = dict(given or {})
    submitted = _submitted()
    if "worker_process_setup_hook" in submitted or HOOK_VARIABLE in submitted.get("env_vars", {}):
        warn_once(
            "this Ray job was submitted with a worker_process_setup_hook of its own, which ray.init cannot "
            "add to: its workers run without hf-train-shim; put import shim at the top of that hook"
        )
        return None
    job = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    env_vars = {name: value for name, value in os.environ.items() if name.startswith("SHIM_")}
    env_vars.update(env.get("env_vars") or {})  # the user's own values win
    env_vars[VARIABLE] = job
    taken = set(submitted.get("env_vars", {}))  # a submitted job's variables cannot be set again
    env["env_vars"] = {name: value for name, value in env_vars.items() if name not in taken}
    env["worker_process_setup_hook"] = setup_hook(job, env.get("worker_process_setup_hook"))
    return job, {**kwargs, "runtime_env": env}


def setup_hook(job: str, users: Callable[[], object] | str | None) -> Callable[[], None]:
    """The job's ``worker_process_setup_hook``: in each worker, ``import shim`` (its ``INFO`` lines held
    back where no ``SHIM_LOG_LEVEL`` asks for them: Ray sets its workers' root logger to ``INFO``), then the
    user's own hook (a callable, or ``"module.function"`` as Ray takes it). A closure, so that Ray's
    cloudpickle ships it by value: a node without hf-train-shim runs it too."""
    missing_key = f"{job}/missing-{{}}-{{}}"

    def hf_train_shim_worker_setup() -> None:
        import logging
        import os

        if not os.environ.get("SHIM_LOG_LEVEL"):
            logging.getLogger("shim").setLevel(logging.WARNING)
        try:
            import shim  # noqa: F401  -- activates it in this worker
        except Exception as exc:  # not installed on this node: tell the driver, and run as without it
            try:
                import socket

                from ray.experimental import internal_kv

                key = missing_key.format(socket.gethostname(), os.getpid())
                internal_kv._internal_kv_put(key, f"{type(exc).__name__}: {exc}", namespace=NAMESPACE)
            except Exception:
                pass
        if callable(users):
            users()
        elif users:
            import importlib

            module, _, name = users.rpartition(".")
            getattr(importlib.import_module(module), name)()

    return hf_train_shim_worker_setup


def put(job: str, name: str, record: dict[str, Any]) -> bool:
    """Write ``record`` as ``<job>/<name>`` for the driver; ``False`` where the driver has collected the
    job already, or the store cannot be reached (this process then says its own line)."""
    try:
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            return False
        if internal_kv._internal_kv_get(f"{job}/{CLAIMED}", namespace=NAMESPACE) is not None:
            return False
        internal_kv._internal_kv_put(f"{job}/{name}", json.dumps(record), namespace=NAMESPACE)
    except Exception:  # Ray gone, or going: never the user's training
        log.debug("a Ray worker's counts could not be handed to its driver", exc_info=True)
        return False
    return True


def collect() -> None:
    """In the driver, before Ray disconnects it: the records of the current job's workers, kept in
    :data:`collected`, the job claimed and its keys removed; the workers that could not import the shim
    said once. Nothing where no job is current (collected already, or none started)."""
    global current
    job, current = current, ""
    if not job:
        return
    try:
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            return
        internal_kv._internal_kv_put(f"{job}/{CLAIMED}", "1", namespace=NAMESPACE)
        keys = internal_kv._internal_kv_list(f"{job}/", namespace=NAMESPACE)
        values = {key.decode(): internal_kv._internal_kv_get(key, namespace=NAMESPACE) for key in keys}
        for key in keys:
            if not key.decode().endswith(CLAIMED):
                internal_kv._internal_kv_del(key, namespace=NAMESPACE)
    except Exception:  # the exit report says what it has; the user's shutdown goes on
        log.debug("the Ray workers' counts could not be collected", exc_info=True)
        return
    missing = {}
    for key, value in sorted(values.items()):
        what = key.rpartition("/")[2]
        if what.startswith("worker-") and value:
            collected.append(json.loads(value))
        elif what.startswith("missing-") and value:
            host = what.removeprefix("missing-").rpartition("-")[0]
            missing.setdefault(value.decode(), set()).add(host)
    for error, hosts in missing.items():
        warn_once(
            f"hf-train-shim could not be imported in the Ray workers on {', '.join(sorted(hosts))} ({error}), "
            f"which ran without it; {INSTALL}"
        )


def driver_connected() -> bool:
    """Whether this process is a Ray driver connected to its job (a worker is connected too, to the
    job of its driver)."""
    worker = sys.modules.get("ray._private.worker")  # ``ray`` itself may still be importing it
    if worker is None:
        return False
    return getattr(worker.global_worker, "mode", None) == worker.SCRIPT_MODE and worker.is_initialized()


def _submitted() -> dict[str, Any]:
    """The runtime environment ``ray job submit`` gave this driver's job (``{}`` where none)."""
    try:
        return dict(json.loads(os.environ.get(SUBMITTED) or "{}").get("runtime_env") or {})
    except (ValueError, AttributeError, TypeError):
        return {}


def _ray() -> Any:
    return sys.modules["ray"]
