"""scripts/device-check.sh on this machine's CPU (``--smoke``): the steps a CUDA machine runs, on a small
subset, ending in one report. CI runs it here, within the suite; the CUDA run is by hand
(docs/testing.md)."""

import re
import shutil
import subprocess
import sys

import pytest

import shim
from tests import devices
from tests.conftest import ROOT, clean_environment

pytestmark = pytest.mark.any_version  # the script's own steps, whatever stack is installed

SCRIPT = ROOT / "scripts" / "device-check.sh"


def test_the_smoke_run_installs_tests_measures_and_reports(tmp_path):
    env = clean_environment({"PYTHON": sys.executable, "WHEELS": str(tmp_path / "no-wheels")})
    env.pop(devices.VARIABLE, None)  # the script names the device itself
    done = subprocess.run(
        ["bash", str(SCRIPT), "--smoke", "report"],  # relative: to the folder it is started in
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # the script finds the checkout from its own place
        timeout=300,
    )
    assert not (ROOT / "report").exists(), "the report folder was taken relative to the checkout"
    report = (tmp_path / "report" / "report.md").read_text()
    assert done.returncode == 0, report + done.stderr[-3000:]
    assert report.startswith("# hf-train-shim device check (smoke, --device cpu)")
    assert "verdict: passed" in report
    for step in ("install", "tests", "memory"):
        assert re.search(rf"^\| {step} \| 0 \| \d+ s \|$", report, re.M), step
    assert re.search(r"^2 passed", report, re.M), "the subset: the two tests on the device fixture in one file"
    assert f"hf-train-shim {shim.__version__}" in report and re.search(r"^torch \S+, CUDA ", report, re.M)
    assert "keyword reentrant" in report and "verdict: quick: not judged" in report
    assert {path.name for path in (tmp_path / "report").iterdir()} == {
        "report.md",
        "install.log",
        "pytest.log",
        "junit.xml",
        "memory.log",
        "memory.json",
    }


def test_the_smoke_run_on_a_clean_clone_names_the_set_up_to_run(tmp_path):
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, clone / "scripts")  # a checkout before bash scripts/setup.sh: no .venv
    env = clean_environment()
    env.pop("PYTHON", None)
    done = subprocess.run(
        ["bash", "scripts/device-check.sh", "--smoke", "report"], capture_output=True, text=True, env=env, cwd=clone
    )
    assert done.returncode == 2
    assert done.stderr.startswith("device-check: --smoke runs on .venv/bin/python, which is not there: ")
    assert "run bash scripts/setup.sh first" in done.stderr
    assert not (clone / "report").exists()


def normal(name: str) -> str:
    """A distribution's name as pip compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_wheel_a_cuda_machine_is_brought_is_pinned_by_the_default_cell():
    listed = re.search(r"^DEVICE_WHEELS=\(([^)]*)\)", SCRIPT.read_text(), re.M | re.S).group(1).split()
    pinned = {
        normal(line.split("==")[0])
        for line in (ROOT / "constraints" / "default.txt").read_text().splitlines()
        if "==" in line
    }
    assert "transformers" in listed and "trl" in listed
    assert [name for name in listed if normal(name) not in pinned] == []


def test_fetch_downloads_the_default_cells_pins_for_the_machines_python(tmp_path):
    """``--fetch`` asks pip (``python3 -m pip download``, here a stand-in that prints its arguments) for
    Python 3.12 x86-64 wheels, no dependencies, at the pins of constraints/default.txt."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = clean_environment({"PATH": f"{bin_dir}:/usr/bin:/bin"})
    done = subprocess.run(
        ["bash", str(SCRIPT), "--fetch", "wheels"],  # relative: to the folder it is started in
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[:5] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert "--python-version" in words and words[words.index("--python-version") + 1] == "3.12"
    assert words[words.index("-d") + 1] == str(tmp_path / "wheels")
    pins = dict(
        line.split("==") for line in (ROOT / "constraints" / "default.txt").read_text().splitlines() if "==" in line
    )
    assert f"transformers=={pins['transformers']}" in words and f"trl=={pins['trl']}" in words
