"""ray-workers-get-the-shim with a stand-in Ray: what ``ray.init`` gives the job, the setup hook a worker
runs, and the counts a worker hands to its driver's exit line.

Ray is not in the default set-up: the stand-in is a package ``ray`` (``ray._private.worker``'s ``init``
and ``shutdown``, which record what they were given, the modes, and ``ray.experimental.internal_kv``
as a dict) with a ``ray-2.60.0`` distribution beside it, imported through the shim's import hooks in a
fresh interpreter, as Ray is. Each test shows the bug with the patch off where there is one. The real
Ray (a ``TorchTrainer`` on a local Ray and on a cluster of two nodes) is tests/e2e/test_ray.py's.
"""

import json
import textwrap

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.any_version  # Ray stands in; the outcome does not depend on transformers

NAME = "ray-workers-get-the-shim"
WORKER = """
SCRIPT_MODE, WORKER_MODE = 0, 1


class _Worker:
    mode = None


global_worker = _Worker()
calls = []


def init(address=None, *, runtime_env=None, job_config=None, local_mode=False, **kwargs):
    calls.append(dict(address=address, runtime_env=runtime_env, job_config=job_config, local_mode=local_mode))
    global_worker.mode = SCRIPT_MODE


def shutdown():
    calls.append("shutdown")
    global_worker.mode = None


def is_initialized():
    return global_worker.mode is not None
"""
INTERNAL_KV = """
store = {}


def _b(text):
    return text.encode() if isinstance(text, str) else text


def _internal_kv_initialized():
    from ray._private import worker

    return worker.global_worker.mode is not None


def _internal_kv_put(key, value, overwrite=True, *, namespace=None):
    store[_b(namespace), _b(key)] = _b(value)
    return True


def _internal_kv_get(key, *, namespace=None):
    return store.get((_b(namespace), _b(key)))


def _internal_kv_list(prefix, *, namespace=None):
    return [key for space, key in store if space == _b(namespace) and key.startswith(_b(prefix))]


def _internal_kv_del(key, *, del_by_prefix=False, namespace=None):
    return int(store.pop((_b(namespace), _b(key)), None) is not None)
"""
FILES = {
    "ray/__init__.py": "from ray._private.worker import init, is_initialized, shutdown\n",
    "ray/_private/__init__.py": "",
    "ray/_private/worker.py": WORKER,
    "ray/experimental/__init__.py": "",
    "ray/experimental/internal_kv.py": INTERNAL_KV,
    "ray-2.60.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: ray\nVersion: 2.60.0\n",
    "users_hooks.py": "ran = []\n\n\ndef setup():\n    ran.append('by name')\n",
}


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stand-in-ray")
    for name, text in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def run(stand_in, code: str, env: dict | None = None):
    """``code`` in a fresh interpreter whose ``ray`` is the stand-in; its last line of output, as JSON."""
    head = f"import sys\nsys.path.insert(0, {str(stand_in)!r})\n"
    result = run_python(head + textwrap.dedent(code), env=env)
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


DRIVER = """
import json, logging, os
import shim
import ray
from ray._private import worker
from ray.experimental import internal_kv

ran = []


def users():
    ran.append("callable")
"""


def test_ray_init_gives_the_job_a_setup_hook_that_imports_the_shim_then_runs_the_users(stand_in):
    out, _ = run(
        stand_in,
        DRIVER
        + """
given = {"env_vars": {"MINE": "1", "SHIM_PROBE": "always"}, "worker_process_setup_hook": users, "pip": ["x"]}
ray.init(runtime_env=given)
env = worker.calls[0]["runtime_env"]
hook = env["worker_process_setup_hook"]
logging.getLogger("shim").setLevel(logging.NOTSET)
hook()  # as a worker runs it
print(json.dumps({
    "given": given["env_vars"] == {"MINE": "1", "SHIM_PROBE": "always"} and given["worker_process_setup_hook"] is users,
    "env_vars": env["env_vars"], "pip": env["pip"], "name": hook.__name__, "by_value": "<locals>" in hook.__qualname__,
    "ran": ran, "level": logging.getLogger("shim").level,
    "status": next(s.state for s in shim.status() if s.name == "ray-workers-get-the-shim"),
}))
""",
        env={"SHIM_PROBE": "never", "SHIM_FORCE": "checkpointing-restore"},
    )
    assert out["given"], "the user's runtime_env is left as it was"
    out["env_vars"].pop("SHIM_TEST_DEVICE", None)  # the suite's own, a SHIM_* variable too
    job = out["env_vars"].pop("HF_TRAIN_SHIM_RAY_JOB")
    assert job.count("-") >= 2  # host, pid, time: one job per ray.init
    # The driver's SHIM_* variables go along; the user's own value of one wins, their other variables stay.
    assert out["env_vars"] == {"SHIM_PROBE": "always", "SHIM_FORCE": "checkpointing-restore", "MINE": "1"}
    assert out["pip"] == ["x"]
    assert out["name"] == "hf_train_shim_worker_setup" and out["by_value"], "cloudpickle ships a closure by value"
    assert out["ran"] == ["callable"], "the user's own hook runs after the shim's"
    assert out["level"] == 30, "Ray sets its workers' root logger to INFO: the shim's INFO lines are held back"
    assert out["status"] == "applied"


def test_without_the_patch_ray_init_gets_the_runtime_env_as_given(stand_in):
    out, _ = run(
        stand_in,
        DRIVER
        + """
given = {"worker_process_setup_hook": users}
ray.init(runtime_env=given)
print(json.dumps({"same": worker.calls[0]["runtime_env"] is given}))
""",
        env={"SHIM_DISABLE": NAME},
    )
    assert out["same"], "the bug: the job's workers get nothing of the driver's import shim"


def test_a_users_hook_by_name_a_job_configs_runtime_env_and_no_runtime_env(stand_in):
    out, _ = run(
        stand_in,
        DRIVER
        + """
import types
ray.init(job_config=types.SimpleNamespace(runtime_env={"worker_process_setup_hook": "users_hooks.setup"}))
ray.shutdown()
ray.init()
first, second = worker.calls[0]["runtime_env"], worker.calls[2]["runtime_env"]
first["worker_process_setup_hook"]()
import users_hooks
print(json.dumps({
    "ran": users_hooks.ran, "second": sorted(second), "jobs": first["env_vars"]["HF_TRAIN_SHIM_RAY_JOB"] !=
    second["env_vars"]["HF_TRAIN_SHIM_RAY_JOB"],
}))
""",
    )
    assert out["ran"] == ["by name"]
    assert out["second"] == ["env_vars", "worker_process_setup_hook"]
    assert out["jobs"], "each ray.init starts a job of its own"


def test_where_ray_init_starts_no_job_of_workers_it_is_left_as_called(stand_in):
    """Ray initialized already, local mode, Ray Client (said once, with what to do), and a submitted job
    whose runtime environment has a setup hook of its own (said once): nothing added."""
    out, stderr = run(
        stand_in,
        DRIVER
        + """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    ray.init(local_mode=True)
    ray.init(runtime_env={"env_vars": {"A": "1"}})  # initialized already: Ray ignores it, so does the shim
    ray.shutdown()
    ray.init("ray://head:10001")
    ray.shutdown()
    os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"worker_process_setup_hook": "x.y"}})
    ray.init()
    ray.shutdown()
    os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"env_vars": {"SHIM_PROBE": "auto"}}})
    ray.init()
calls = [call for call in worker.calls if call != "shutdown"]
print(json.dumps({
    "runtime_envs": [call["runtime_env"] for call in calls[:4]],
    "submitted": sorted(set(calls[4]["runtime_env"]["env_vars"]) - {"SHIM_TEST_DEVICE"}),
    "warnings": [str(w.message) for w in caught],
}))
""",
        env={"SHIM_PROBE": "never"},
    )
    assert out["runtime_envs"] == [None, {"env_vars": {"A": "1"}}, None, None]
    # A submitted job's own variables cannot be set again by ray.init (Ray refuses the conflict).
    assert out["submitted"] == ["HF_TRAIN_SHIM_RAY_JOB"]
    client, submitted = out["warnings"]
    assert "Ray Client" in client and "make import shim the first line inside the functions you ship" in client
    assert "submitted with a worker_process_setup_hook of its own" in submitted and "import shim" in submitted


def test_import_shim_after_ray_init_says_the_job_goes_without(stand_in):
    out, _ = run(
        stand_in,
        """
import json, warnings
import ray
ray.init()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import shim
print(json.dumps([str(w.message) for w in caught]))
""",
    )
    assert out == [
        "Ray was initialized before import shim: this job's workers run without hf-train-shim; "
        "import shim before ray.init() (or before the first Ray call)"
    ]


def test_the_workers_counts_reach_the_drivers_one_line(stand_in):
    """What two Ray Train workers hand over (ranks 0 and 1, ``reentrant-keyword-grads`` in both, another
    fix in one) and the driver's own effect: one line at the driver's exit, the places each fix acted
    where not in every worker."""
    out, stderr = run(
        stand_in,
        DRIVER
        + """
from shim.patches import _ray_jobs
ray.init()
job = worker.calls[0]["runtime_env"]["env_vars"]["HF_TRAIN_SHIM_RAY_JOB"]
for rank, effects in ((0, {"reentrant-keyword-grads": 2, "input-grad-hook-dedupe": 1}), (1, {"reentrant-keyword-grads": 2})):
    record = {"pid": 100 + rank, "node": "n", "rank": rank, "effects": effects, "last": {k: "did" for k in effects}}
    assert _ray_jobs.put(job, f"worker-n-{100 + rank}", record)
print(json.dumps({"ok": True}))
""",  # no ray.shutdown(): collected at exit, ahead of the report
    )
    (line,) = [line for line in stderr.splitlines() if "hf-train-shim" in line]
    assert line == (
        "hf-train-shim (ray workers 0-1): 3 fixes acted: input-grad-hook-dedupe ×1 (ray worker 0), "
        "ray-workers-get-the-shim ×1 (driver), reentrant-keyword-grads ×4 (SHIM_REPORT=1 for the table)"
    )


def test_a_worker_hands_its_counts_over_while_it_runs_and_says_only_what_came_too_late(stand_in):
    """A worker of a job (``HF_TRAIN_SHIM_RAY_JOB`` set, Ray in worker mode) hands its counts over from its
    first effect on, without an exit; what it counts after its driver collected the job it says in its own
    line, if it exits at all."""
    out, stderr = run(
        stand_in,
        """
import json, time
import ray
from ray._private import worker
from ray.experimental import internal_kv
worker.global_worker.mode = worker.WORKER_MODE
import shim
shim.record_effect("input-grad-hook-dedupe", "removed %d hook(s)", 1)
shim.record_effect("input-grad-hook-dedupe", "removed %d hook(s)", 1)
deadline, handed = time.monotonic() + 10, {"effects": {}}
while time.monotonic() < deadline and handed["effects"] != {"input-grad-hook-dedupe": 2}:
    time.sleep(0.05)
    for key in internal_kv._internal_kv_list("job1/", namespace="hf-train-shim"):
        handed = json.loads(internal_kv._internal_kv_get(key, namespace="hf-train-shim"))
internal_kv._internal_kv_put("job1/claimed", "1", namespace="hf-train-shim")  # the driver collected the job
shim.record_effect("input-grad-hook-dedupe", "removed %d hook(s)", 1)
print(json.dumps({"handed": handed["effects"], "rank": handed["rank"]}))
""",
        env={"HF_TRAIN_SHIM_RAY_JOB": "job1", "RANK": "1"},
    )
    assert out == {"handed": {"input-grad-hook-dedupe": 2}, "rank": 1}
    (line,) = [line for line in stderr.splitlines() if "hf-train-shim" in line]
    assert line.startswith("hf-train-shim (ray worker 1, pid ")
    assert line.endswith(
        ", after its driver's report): 1 fix acted: input-grad-hook-dedupe ×1 (SHIM_REPORT=1 for the table)"
    )


def test_a_workers_first_effect_goes_over_at_once(stand_in):
    """Ray Train kills a worker as soon as its training function returned: a short job's worker must be
    named in its driver's line even if it ends within the handing-over period of its first effect."""
    out, _ = run(
        stand_in,
        """
import json, time
from ray._private import worker
from ray.experimental import internal_kv
worker.global_worker.mode = worker.WORKER_MODE
import shim
from shim.tools import rayjobs
rayjobs.PERIOD = 600  # a worker killed before its thread's first period ends
shim.record_effect("input-grad-hook-dedupe", "removed %d hook(s)", 1)
deadline, keys = time.monotonic() + 10, []
while time.monotonic() < deadline and not keys:
    time.sleep(0.05)
    keys = internal_kv._internal_kv_list("job1/", namespace="hf-train-shim")
print(json.dumps({"handed": [json.loads(internal_kv._internal_kv_get(key, namespace="hf-train-shim"))["effects"] for key in keys]}))
""",
        env={"HF_TRAIN_SHIM_RAY_JOB": "job1", "RANK": "0"},
    )
    assert out == {"handed": [{"input-grad-hook-dedupe": 1}]}


def test_a_worker_without_the_shim_tells_the_driver_which_says_it_once(stand_in):
    """On a node without hf-train-shim the hook cannot import it: the worker runs on (the user's hook
    too) and the driver says once, naming the node, what to do."""
    out, _ = run(
        stand_in,
        DRIVER
        + """
import warnings
from shim.patches import _ray_jobs
ray.init(runtime_env={"worker_process_setup_hook": users})
hook = worker.calls[0]["runtime_env"]["worker_process_setup_hook"]
installed = sys.modules["shim"]
sys.modules["shim"] = None  # as on a node where it is not installed
try:
    hook()
    hook()
finally:
    sys.modules["shim"] = installed
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ray.shutdown()
print(json.dumps({"ran": ran, "warnings": [str(w.message) for w in caught], "collected": _ray_jobs.collected}))
""",
    )
    assert out["ran"] == ["callable", "callable"]
    (said,) = out["warnings"]
    assert said.startswith("hf-train-shim could not be imported in the Ray workers on ")
    assert "which ran without it; install hf-train-shim on every node of the cluster" in said
    assert out["collected"] == []


def test_doctor_asks_the_bug_probe_with_the_patch_off_and_on(stand_in):
    out, _ = run(
        stand_in,
        """
import json, subprocess
done = subprocess.run(
    [sys.executable, "-m", "shim", "doctor", "ray-workers-get-the-shim", "--json"],
    capture_output=True, text=True, env={**__import__("os").environ, "PYTHONPATH": sys.path[0]}, timeout=120,
)
print(done.stdout.replace("\\n", " "))
""",
    )
    (finding,) = out
    assert (finding["bug_upstream"], finding["bug_with_shim"], finding["verdict"]) == ("yes", "no", "fixed")
