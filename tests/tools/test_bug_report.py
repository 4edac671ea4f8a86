"""``python -m shim bug-report`` as a user runs it: one Markdown document with the versions, the status,
doctor's table for the patches that apply and the SHIM_* variables set, escaped."""

import importlib.metadata
import json
import platform
import subprocess
import sys

import pytest

from shim import Registry, catalogue, gating
from shim.patches import INDEX
from shim.tools import bugreport
from tests.conftest import clean_environment, python_m_shim

pytestmark = pytest.mark.any_version  # what it prints is read from whatever is installed

BUILTINS = [row["name"] for row in INDEX]
#: Two patches left on (doctor checks them), the rest opted out, and a value with a control character.
KEPT = ("checkpointing-restore", "input-grad-hook-dedupe")


@pytest.fixture(scope="module")
def env():
    opted_out = [name for name in BUILTINS if name not in KEPT]
    return {"SHIM_DISABLE": ",".join(opted_out), "SHIM_LOG_LEVEL": "\x1b[31mloud\x07"}


@pytest.fixture(scope="module")
def shown(env):
    return python_m_shim("bug-report", env=env).stdout


def test_it_names_the_shim_python_torch_and_every_patched_distribution(shown):
    assert shown.startswith("## hf-train-shim bug report\n")
    assert f"| hf-train-shim | {importlib.metadata.version('hf-train-shim')} |" in shown
    assert f"| Python | {platform.python_version()} (" in shown
    names = bugreport.distributions(Registry(catalogue.builtin()))  # the built-ins, as a fresh interpreter has them
    assert names[0] == "torch" and {"transformers", "trl", "peft", "accelerate", "deepspeed"} <= set(names)
    for name in names:
        assert f"| {name} | {gating.installed_version(name) or 'not installed'} |" in shown


def test_it_holds_the_status_as_python_m_shim_opens_it(shown, env):
    first = python_m_shim(env=env).stdout.split("\n\n")[0]  # the summary line, wrapped
    assert f"### Status\n\n{' '.join(first.split())}\n" in shown
    assert "```text\npatch " in shown and "<details><summary>python -m shim</summary>" in shown


def test_it_runs_doctor_on_the_patches_that_apply_and_says_its_total(shown):
    doctor = shown.split("### doctor, for the patches that apply\n", 1)[1].split("### ", 1)[0]
    rows = [line.split()[0] for line in doctor.splitlines() if line.split() and line.split()[0] in BUILTINS]
    applying = sorted(name for name in KEPT if gating.installed_version("transformers"))
    assert rows == applying
    assert f"doctor: {len(applying)} patches checked: " in doctor


def test_it_shows_a_patch_list_whole_and_a_value_of_another_shape_as_set(shown, env):
    variables = shown.split("### `SHIM_*` variables\n", 1)[1]
    assert f"SHIM_DISABLE={env['SHIM_DISABLE']!r}" in variables
    assert "SHIM_LOG_LEVEL=<set>" in variables  # not a level: what else it holds is not shown
    assert "\x1b" not in shown and "\x07" not in shown and "loud" not in shown


def test_only_patch_lists_and_switches_are_shown():
    env = {
        "SHIM_DISABLE": "all",
        "SHIM_FORCE": "/home/someone/notes.txt",
        "SHIM_STRICT": "yes",
        "SHIM_REPORT": "\x1b[2J",
        "SHIM_LOG_LEVEL": "loud",
        "SHIM_API_TOKEN": "hf_secret",
    }
    assert bugreport.variables(env) == [
        "SHIM_API_TOKEN=<set>",
        "SHIM_DISABLE='all'",
        "SHIM_FORCE=<set>",
        "SHIM_LOG_LEVEL='loud'",  # a word: a wrong one is what a report is for
        "SHIM_REPORT=<set>",
        "SHIM_STRICT='yes'",
    ]


def test_paths_are_shown_as_a_module_or_from_the_current_or_home_folder():
    home, cwd = "/home/alice", "/home/alice/project"
    text = (
        "(/home/alice/.venv/lib/python3.12/site-packages/unsloth/models/_utils.py) "
        "(/home/alice/project/patch.py) (/home/alice/tools/fast.py) (/home/alice/.venv/lib/python3.12/"
        "site-packages/pkg/__init__.py) /home/alice /home/alice2/x /srv/data"
    )
    search_path = ["", cwd, "/home/alice/.venv/lib/python3.12/site-packages"]
    assert bugreport.without_private_paths(text, home, cwd, search_path) == (
        "(unsloth.models._utils) (./patch.py) (~/tools/fast.py) (pkg) ~ /home/alice2/x /srv/data"
    )


def test_what_a_report_prints_on_stderr_meanwhile_follows_the_same_path_rules(caplog, monkeypatch):
    import logging
    import warnings

    def hide(text):
        return bugreport.without_private_paths(text, "/home/alice", "/home/alice/project", [])

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, *rest: shown.append(str(message)))
    log = logging.getLogger("shim")
    with caplog.at_level(logging.INFO, logger="shim"), warnings.catch_warnings():
        warnings.simplefilter("always")
        with bugreport.stderr_with(hide):
            log.info("%s: replaced by %s", "demo", "fast (/home/alice/tools/fast.py)")
            warnings.warn("see /home/alice/project/patch.py", UserWarning, stacklevel=1)
        log.info("after: /home/alice/tools/fast.py")
        warnings.warn("after: /home/alice/project/patch.py", UserWarning, stacklevel=1)
    assert [record.getMessage() for record in caplog.records] == [
        "demo: replaced by fast (~/tools/fast.py)",
        "after: /home/alice/tools/fast.py",  # the rules hold inside the report only
    ]
    assert shown == ["see ./patch.py", "after: /home/alice/project/patch.py"]


SITECUSTOMIZE = """
import json, os
import shim
import transformers.modeling_utils as modeling_utils

def from_file(path):  # a patcher's code from a file on no import path
    namespace = {"__name__": "fastpatch"}
    exec(compile(open(path).read(), path, "exec"), namespace)
    return namespace["fast"]

def fast(self, *args, **kwargs):  # another patcher's replacement, in a module on sys.path
    return None

replacements = [
    from_file(os.path.join(os.path.expanduser("~"), "tools", "fast.py")),
    from_file(os.path.abspath("local_fast.py")),
    fast,
]
specs = sorted({target.spec for name in shim.registry.names for target in shim.registry.patch(name).targets
                if target.module == "transformers.modeling_utils" and shim.wrappers(target.spec)})[:3]
for spec, replacement in zip(specs, replacements):
    owner, _, attribute = spec.partition(":")[2].rpartition(".")
    setattr(getattr(modeling_utils, owner), attribute, replacement)
with open(os.environ["REPLACED"], "w") as file:
    json.dump(specs, file)
"""
FAST = "def fast(self, *args, **kwargs):  # another patcher's replacement, which calls nothing of the shim\n    return None\n"


def test_a_report_names_no_users_folder(tmp_path, env):
    """Another patcher's files under a fake user's home: one on no import path, one in the current
    folder, one on ``sys.path``; and a SHIM_* variable of the user's own holding a path. Neither the
    document nor the shim's log lines on stderr name the folder."""
    home = tmp_path / "home" / "alice-private-name"
    for folder in ("project", "tools", "site"):
        (home / folder).mkdir(parents=True)
    (home / "tools" / "fast.py").write_text(FAST)
    (home / "project" / "local_fast.py").write_text(FAST)
    (home / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    extra = {"HOME": str(home), "PYTHONPATH": str(home / "site"), "REPLACED": str(tmp_path / "replaced.json")}
    extra["SHIM_MY_CACHE"] = str(home / "cache")
    extra["SHIM_LOG_LEVEL"] = "INFO"  # the shim's log lines on stderr name the other patchers too
    done = subprocess.run(
        [sys.executable, "-m", "shim", "bug-report"],
        env=clean_environment(env | extra),
        cwd=home / "project",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    replaced = json.loads((tmp_path / "replaced.json").read_text())
    assert replaced, "a target of the shim's in transformers.modeling_utils to replace"
    for printed in (done.stdout, done.stderr):
        assert "alice-private-name" not in printed and str(tmp_path) not in printed
    assert "fastpatch:fast (~/tools/fast.py)" in done.stderr, "logged, with the report's path rules"
    for spec, where in zip(replaced, ["fastpatch:fast (~/tools/fast.py)", "fastpatch:fast (./local_fast.py)"]):
        assert f"{spec} was replaced by {where}" in done.stdout
    if len(replaced) == 3:
        assert f"{replaced[2]} was replaced by sitecustomize:fast (sitecustomize)" in done.stdout
    assert "SHIM_MY_CACHE=<set>" in done.stdout
