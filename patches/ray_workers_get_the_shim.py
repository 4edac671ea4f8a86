"""``ray-workers-get-the-shim``: ``import shim`` in a Ray driver reaches every worker of the job.

Symptom (silent): Ray ships a task's or actor's function to its workers by pickling it, so the
driver's imports never run there. ``import shim`` at the top of a Ray Train script fixes nothing in
the ``TorchTrainer``'s workers, where the training runs, and nothing says so.

Fix: ``ray.init`` (also Ray's own, when a Ray API starts Ray) gives the job a runtime environment
whose ``worker_process_setup_hook`` imports the shim in every worker before the user's code, then
runs the user's own hook; the driver's ``SHIM_*`` variables go along. The workers' counts reach the
driver's one exit line (``ray.shutdown()`` or the driver's exit collects them).

Limits: a job started before ``import shim`` (said once), Ray Client, and a submitted job with a
setup hook of its own are not reached. A worker killed right after its last effect may leave it
out of the line.

Full story, versions measured and references: docs/bugs.md#ray-workers-get-the-shim
"""

from __future__ import annotations

import atexit
import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect, switch_of, wrappers

from . import _ray_jobs

NAME = "ray-workers-get-the-shim"
MODULE = "ray._private.worker"
_collect_at_exit = False  # registered with the first job: after Ray's own, so it runs before Ray's shutdown


def _init(wrapped, instance, args, kwargs):
    prepared = _ray_jobs.prepared(args, kwargs)
    if prepared is None:
        return wrapped(*args, **kwargs)
    job, kwargs = prepared
    result = wrapped(*args, **kwargs)
    _ray_jobs.current = job
    global _collect_at_exit
    if not _collect_at_exit:
        _collect_at_exit = True
        atexit.register(_ray_jobs.collect)
    record_effect(NAME, "gave the Ray job's workers a setup hook that imports hf-train-shim (upstream: none)")
    return result


def _shutdown(wrapped, instance, args, kwargs):
    _ray_jobs.collect()  # while the driver is still connected
    return wrapped(*args, **kwargs)


def _check_init(original) -> str | None:
    """Ray's ``init`` takes the job's runtime environment, which knows the setup hook; Ray already
    initialized (``import shim`` after ``ray.init()``) is said once: that job's workers go without."""
    import inspect

    try:
        parameters = inspect.signature(original).parameters
    except (TypeError, ValueError) as exc:
        return f"ray.init has no signature to read ({exc})"
    if not {"runtime_env", "job_config"} <= set(parameters):
        return f"ray.init takes no runtime_env and job_config (its parameters: {', '.join(parameters)})"
    runtime_env = sys.modules.get("ray.runtime_env")
    if runtime_env is not None and "worker_process_setup_hook" not in getattr(
        runtime_env.RuntimeEnv, "known_fields", ()
    ):
        return "ray.runtime_env.RuntimeEnv knows no worker_process_setup_hook"
    if _ray_jobs.driver_connected():
        _ray_jobs.warn_once(
            "Ray was initialized before import shim: this job's workers run without hf-train-shim; "
            "import shim before ray.init() (or before the first Ray call)"
        )
    return None


def _bug_probe() -> Evidence:
    """Whether a job that ``ray.init`` starts gets workers that import the shim. Ray never gives them
    the driver's imports (read in source), and only a running job shows what its workers import: so the
    answer is whether ``ray.init`` runs the patch's part now, and the runtime environment that part
    gives a job (tests/e2e/test_ray.py runs the jobs)."""
    on = switch_of(NAME) and any(name == NAME for name, _ in wrappers(f"{MODULE}:init"))
    if not on:
        return Evidence(True, "ray.init gives a job's workers none of the driver's imports: they run without the shim")
    prepared = _ray_jobs.prepared((), {"runtime_env": {}})
    if prepared is None:
        return Evidence(True, "Ray is initialized already: the running job's workers go without the shim")
    hook = prepared[1]["runtime_env"]["worker_process_setup_hook"]
    return Evidence(False, f"ray.init gives the job's workers the setup hook {hook.__name__}, which imports the shim")


PATCH = Patch(
    name=NAME,
    summary="import shim in a Ray driver reaches every worker of the job; their fixes join its exit line.",
    distribution="ray",
    requires=">=2.60",
    targets=(
        Target(f"{MODULE}:init", _init, check=_check_init),
        Target(f"{MODULE}:shutdown", _shutdown),
    ),
    consumers=("ray",),
    references=("docs/bugs.md#ray-workers-get-the-shim", "ray-project/ray#34738", "ray-project/ray#37247"),
    bug_probe=BugProbe(_bug_probe),
)
