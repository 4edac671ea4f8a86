"""``shim-run <command>`` / ``python -m shim run -- <command>``: the shim imported first in every Python process
the command starts, the user's own sitecustomize still run, exit status and signals the command's own."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shim.patches import INDEX
from shim.tools.run import SITECUSTOMIZE_DIR, environment
from tests.conftest import ROOT, zygote

#: The built-in patches: what a fresh interpreter registers (a test may have registered more in this one).
BUILTINS = [row["name"] for row in INDEX]

SHIM_RUN = Path(sys.executable).with_name("shim-run")
LAUNCHERS = {"shim-run": [str(SHIM_RUN)], "python -m shim run --": [sys.executable, "-m", "shim", "run", "--"]}

# Printed by a child interpreter before it imports anything itself.
REPORT = """
import json, os, sys
print(json.dumps({"shim": "shim" in sys.modules, "pid": os.getpid(), "tag": TAG,
                  "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None)}), flush=True)
"""


@pytest.fixture(autouse=True)
def installed():
    if not SHIM_RUN.exists():
        pytest.fail(f"{SHIM_RUN} is missing: reinstall the shim (bash scripts/setup.sh) to get its console script")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def launch(launcher: str, command: list, env: dict | None = None, cwd=ROOT, timeout: int = 120):
    return subprocess.run(
        [*LAUNCHERS[launcher], *command],
        env=clean_env() if env is None else env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def reports(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_exit_status_and_signals_are_the_commands(launcher):
    assert launch(launcher, ["sh", "-c", "exit 7"]).returncode == 7
    # The shim process becomes the command (exec): a signal that ends the command ends "shim-run" with it.
    assert launch(launcher, ["sh", "-c", "kill -TERM $$"]).returncode == -signal.SIGTERM
    missing = launch(launcher, ["no-such-command-for-shim-run"])
    assert missing.returncode == 127 and "command not found: no-such-command-for-shim-run" in missing.stderr


def test_without_a_command_it_prints_its_usage():
    assert launch("shim-run", []).returncode == 2
    usage = launch("shim-run", ["--help"])
    assert usage.returncode == 0 and "usage: shim-run <command>" in usage.stdout
    assert max(len(line) for line in usage.stdout.splitlines()) <= 100


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_python_process_of_the_command_has_the_shim_first(launcher, tmp_path):
    """The command, a subprocess it starts, and a multiprocessing 'spawn' worker (a fresh interpreter)."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import multiprocessing, subprocess, sys

            def worker():
                TAG = "spawned worker"
                exec({REPORT!r})

            if __name__ == "__main__":
                TAG = "command"
                exec({REPORT!r})
                subprocess.run([sys.executable, "-c", "TAG = 'subprocess'\\n" + {REPORT!r}], check=True)
                process = multiprocessing.get_context("spawn").Process(target=worker)
                process.start()
                process.join()
            """
        )
    )
    done = launch(launcher, [sys.executable, str(script)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = {report["tag"]: report for report in reports(done.stdout)}
    assert set(seen) == {"command", "subprocess", "spawned worker"}
    assert all(report["shim"] for report in seen.values()), seen
    assert len({report["pid"] for report in seen.values()}) == 3


def test_without_shim_run_the_same_command_has_no_shim(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", f"TAG = 'plain'\n{REPORT}"], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert reports(done.stdout)[0]["shim"] is False


def test_the_users_sitecustomize_still_runs_after_the_shim(tmp_path):
    user = tmp_path / "user-site"
    user.mkdir()
    (user / "sitecustomize.py").write_text(
        "import sys\nprint('user sitecustomize; shim already imported:', 'shim' in sys.modules, flush=True)\n"
    )
    env = clean_env(PYTHONPATH=os.pathsep.join([str(user), str(ROOT)]))
    done = launch("shim-run", [sys.executable, "-c", f"TAG = 'command'\n{REPORT}"], env=env)
    assert done.returncode == 0, done.stderr
    # The last line is the command's; shim-run's own launcher interpreter ran the user's module too, before exec.
    assert done.stdout.splitlines()[-2] == "user sitecustomize; shim already imported: True"
    report = reports(done.stdout)[-1]
    assert report["shim"] and report["sitecustomize"] == str(user / "sitecustomize.py")


USER_SITECUSTOMIZE = """
import os, sys
sys.user_sitecustomize_runs = getattr(sys, "user_sitecustomize_runs", 0) + 1
print(f"user sitecustomize: run {sys.user_sitecustomize_runs} in pid {os.getpid()}", flush=True)
"""


@pytest.mark.parametrize("nesting", ["another install around this one", "this one twice"])
def test_nested_and_duplicate_installs_run_the_users_sitecustomize_once_per_interpreter(tmp_path, nesting):
    user = tmp_path / "user-site"
    user.mkdir()
    (user / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    other = tmp_path / "global" / "_sitecustomize"  # a second hf-train-shim install's start-up directory
    other.mkdir(parents=True)
    (other / "sitecustomize.py").write_text(Path(SITECUSTOMIZE_DIR, "sitecustomize.py").read_text())
    pythonpath = {
        "another install around this one": [str(other), str(user)],
        "this one twice": [str(user), SITECUSTOMIZE_DIR],
    }[nesting]
    command = [sys.executable, "-c", f"TAG = 'command'\n{REPORT}"]
    if nesting == "this one twice":
        command = [str(SHIM_RUN), *command]
    env = clean_env(PYTHONPATH=os.pathsep.join(pythonpath))
    done = launch("shim-run", command, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "Error in sitecustomize" not in done.stderr, done.stderr
    runs = [line for line in done.stdout.splitlines() if line.startswith("user sitecustomize")]
    # Each interpreter of the pid runs it once: the command's, and the outer shim-run's own Python, whose
    # start-up runs the user's module before shim-run is reached; a shim-run started under the start-up
    # file of this or another install does not run it (its command does).
    interpreters = 2 if nesting == "this one twice" else 1
    assert runs == [runs[0]] * interpreters and runs[0].startswith("user sitecustomize: run 1 in pid "), done.stdout
    report = reports(done.stdout)[-1]
    assert report["shim"] and report["sitecustomize"] == str(user / "sitecustomize.py")


# An install from before the marker: it chains to the first other sitecustomize on the path, whatever it is.
NAIVE_CHAIN = """
import importlib.machinery, importlib.util, os, sys
here = os.path.dirname(os.path.abspath(__file__))
path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
if spec is not None and spec.loader is not None:
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)
"""


def test_a_start_up_file_without_the_marker_cannot_make_the_chain_loop(tmp_path):
    older = tmp_path / "older"
    older.mkdir()
    (older / "sitecustomize.py").write_text(NAIVE_CHAIN)
    env = clean_env(PYTHONPATH=str(older))
    done = launch("shim-run", [sys.executable, "-c", f"TAG = 'command'\n{REPORT}"], env=env, cwd=tmp_path)
    assert done.returncode == 0 and "Error in sitecustomize" not in done.stderr, done.stderr
    assert reports(done.stdout)[-1]["shim"]


def test_pythonpath_gets_the_directory_once_first_and_keeps_the_rest():
    base = {"PYTHONPATH": os.pathsep.join(["/a", SITECUSTOMIZE_DIR, "/b"])}
    assert environment(base)["PYTHONPATH"] == os.pathsep.join([SITECUSTOMIZE_DIR, "/a", "/b"])
    assert environment({})["PYTHONPATH"] == SITECUSTOMIZE_DIR
    assert environment(environment({"PYTHONPATH": "/a"})) == environment({"PYTHONPATH": "/a"})  # nested shim-run


def test_empty_pythonpath_entries_are_kept_in_their_place():
    """An empty entry is the current directory to Python; an empty PYTHONPATH has no entry at all."""
    for value in (":", "/x::", ":/x", "/x::/y"):
        assert environment({"PYTHONPATH": value})["PYTHONPATH"] == SITECUSTOMIZE_DIR + os.pathsep + value
    assert environment({"PYTHONPATH": ""})["PYTHONPATH"] == SITECUSTOMIZE_DIR
    assert environment(environment({"PYTHONPATH": ":"})) == environment({"PYTHONPATH": ":"})


@pytest.mark.parametrize("pythonpath", [":", "/x::"])
def test_a_module_in_the_current_directory_imports_as_without_shim_run(tmp_path, pythonpath):
    (tmp_path / "localmod.py").write_text("VALUE = 'local'\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text("import localmod\nprint(localmod.VALUE)\n")
    env = clean_env(PYTHONPATH=pythonpath)
    plain = subprocess.run(
        [sys.executable, "scripts/train.py"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    under = launch("shim-run", [sys.executable, "scripts/train.py"], env=env, cwd=tmp_path)
    assert plain.stdout == "local\n", plain.stderr
    assert (under.returncode, under.stdout) == (0, "local\n"), under.stderr


SCRIPT_WITH_IMPORT_SHIM = """
import json
import shim
import transformers.modeling_utils, transformers.modeling_layers
from shim import wrapping

def layers(obj, name):
    count = 0
    while obj is not None:
        count += name in wrapping.patch_names_of(obj)
        obj = getattr(obj, "__wrapped__", None)
    return count

counts = {}
for status in shim.status():
    for spec in status.targets if status.state == "applied" else ():
        module, _, path = spec.partition(":")
        try:
            target = wrapping.object_at(__import__(module, fromlist=["_"]), path)
        except Exception:
            continue  # a target left alone on this release
        counts[spec] = layers(target, status.name)
print(json.dumps(counts))
"""


def test_a_script_that_imports_the_shim_itself_gets_no_second_layer(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_WITH_IMPORT_SHIM)
    # without shim-run: python train.py, forked after import torch (tests/zygote.py)
    plain = zygote().run(SCRIPT_WITH_IMPORT_SHIM, 300, folder=str(tmp_path), argv=[str(script)])
    under = launch("shim-run", [sys.executable, str(script)], cwd=tmp_path, timeout=300)
    assert plain.returncode == 0 and under.returncode == 0, plain.stderr + under.stderr
    counts = json.loads(under.stdout.splitlines()[-1])
    assert counts and max(counts.values()) == 1, counts  # 0: a target this release leaves alone
    assert counts == json.loads(plain.stdout.splitlines()[-1])


def test_a_python_without_the_shim_runs_and_says_so(tmp_path):
    """A venv not activated: ``shim-run python train.py`` finds another environment's python first."""
    import venv

    venv.create(tmp_path / "other", with_pip=False)  # the base interpreter, none of this environment's packages
    other = tmp_path / "other" / "bin"
    code = "import sys; print('ran', 'shim' in sys.modules)"
    by_path = launch("shim-run", [str(other / "python"), "-c", code], cwd=tmp_path)
    on_path = launch("shim-run", ["python", "-c", code], env=clean_env(PATH=f"{other}{os.pathsep}{os.environ['PATH']}"))
    for done in (by_path, on_path):
        assert (done.returncode, done.stdout) == (0, "ran False\n"), done.stderr
        assert f"shim-run: {other / 'python'}: hf-train-shim is not installed for this Python" in done.stderr
        assert "shim-run .venv/bin/python train.py" in done.stderr
    assert launch("shim-run", [sys.executable, "-c", code]).stderr == ""  # this environment's: quiet


def test_shim_switches_pass_through():
    code = "import json, shim; print(json.dumps(sorted({s.state for s in shim.status()})))"
    done = launch("shim-run", [sys.executable, "-c", code], env=clean_env(SHIM_DISABLE="all"))
    assert json.loads(done.stdout.splitlines()[-1]) == ["disabled"], done.stdout + done.stderr


def test_every_torchrun_rank_has_the_shim(tmp_path):
    script = tmp_path / "ranks.py"
    # Each rank writes its own file: two ranks printing at once can interleave on one stdout line.
    script.write_text(
        "import os, sys\nTAG = 'rank ' + os.environ['RANK']\n"
        "sys.stdout = open(f'report-{os.environ[\"RANK\"]}.json', 'w')\n" + REPORT
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = launch("shim-run", command, env=clean_env(OMP_NUM_THREADS="1"), cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr
    written = "\n".join(path.read_text() for path in sorted(tmp_path.glob("report-*.json")))
    seen = {report["tag"]: report["shim"] for report in reports(written)}
    assert seen == {"rank 0": True, "rank 1": True}


HELPERS = """
import multiprocessing
import shim

def worker(changed):
    if changed:
        shim.record_effect("checkpoint-kwargs-clean", "an effect in a worker")
    else:
        import transformers.modeling_utils  # a target module, as a worker that unpickles a model imports it

if __name__ == "__main__":
    import transformers.modeling_utils
    context = multiprocessing.get_context("spawn")  # starts the resource tracker too
    for changed in (False, True):
        process = context.Process(target=worker, args=(changed,))
        process.start()
        process.join()
"""


def report_headers(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "hf-train-shim report (pid " in line]


def test_shim_report_one_report_per_training_process_helpers_only_when_they_changed_something(tmp_path):
    """The resource tracker and a spawn worker that changed nothing stay quiet; a worker that did hands
    its count to the table of the process that started it (shim.tools.workers): one table."""
    (tmp_path / "train.py").write_text(HELPERS)
    env = clean_env(SHIM_REPORT="1", RANK="1")
    done = launch("shim-run", [sys.executable, "train.py"], env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    headers = report_headers(done.stderr)
    assert len(headers) == 1, done.stderr
    assert headers[0].startswith("[rank 1] hf-train-shim report (pid ")
    assert headers[0].endswith(f" and 1 worker): 1 of {len(BUILTINS)} patches changed something"), headers


def test_shim_report_under_torchrun_one_report_for_the_job_none_from_the_launcher(tmp_path):
    """Each rank hands its counts to the job (shim.tools.ranks); one table comes out, for both ranks,
    and none from the launcher (under shim-run it imports the shim too)."""
    (tmp_path / "train.py").write_text("import transformers.modeling_utils\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py"]
    env = clean_env(SHIM_REPORT="1", OMP_NUM_THREADS="1")
    done = launch("shim-run", command, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    headers = [line for line in done.stderr.splitlines() if "hf-train-shim report (" in line]
    assert headers == [f"hf-train-shim report (ranks 0-1): 0 of {len(BUILTINS)} patches changed something"]
