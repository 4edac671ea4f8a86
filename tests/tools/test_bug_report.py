"""``python -m shim bug-report`` as a user runs it: one Markdown document with the versions, the status,
doctor's table for the patches that apply and the SHIM_* variables set, escaped."""

import importlib.metadata
import platform

import pytest

from shim import Registry, catalogue, gating
from shim.patches import INDEX
from shim.tools import bugreport
from tests.conftest import python_m_shim

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


def test_it_lists_the_shim_variables_escaped_as_the_warnings_escape_them(shown, env):
    variables = shown.split("### `SHIM_*` variables\n", 1)[1]
    assert "SHIM_LOG_LEVEL='\\x1b[31mloud\\x07'" in variables
    assert "\x1b" not in shown and "\x07" not in shown
    assert variables.count("SHIM_DISABLE='") == 1  # cut after 40 characters, its length said
    assert "characters)" in variables.split("SHIM_DISABLE=", 1)[1].splitlines()[0]
