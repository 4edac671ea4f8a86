"""End to end, Ray Train: ``import shim`` in the driver only reaches the ``TorchTrainer``'s workers
(``ray-workers-get-the-shim``), on a local Ray and on a cluster of two Ray nodes, and the driver says one
line for the job.

Each run is ``tests/e2e/ray_job.py`` (two CPU workers, each a 2-layer Llama with reentrant checkpointing
called with ``hidden_states=`` by keyword: ``reentrant-keyword-grads``' case) in a fresh driver process,
with a hard timeout. Ray is bounded for the 2-core machine (two CPUs, an 80 MB object store, no
dashboard) and every run has a temporary directory of its own (``RAY_TMPDIR``): what is left of it after
the run (a raylet, a worker) fails the test and is ended, by process id, never by name. Ray is in the e2e
environment only (``constraints/e2e.txt``); the default suite tests the runtime environment and the
hand-over with a stand-in Ray (tests/tools/test_ray_jobs.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.launch import environment

pytestmark = pytest.mark.e2e

JOB = Path(__file__).resolve().parent / "ray_job.py"
RAY = Path(sys.executable).with_name("ray")
PATCH = "ray-workers-get-the-shim"
FIX = "reentrant-keyword-grads"
TIMEOUT = 420  # a run takes about a minute on the 2-core machine: Ray's start, two workers importing torch
OBJECT_STORE = str(80 * 1024 * 1024)


@pytest.fixture
def ray_tmp():
    """A short temporary directory for Ray's sessions (its socket paths must stay short), named in every
    process of the run; afterwards, no process of it may be left (those left are ended, by pid)."""
    folder = tempfile.mkdtemp(prefix="shim-ray-", dir="/tmp")
    try:
        yield folder
    finally:
        left = _left(folder)
        _end(folder)
        shutil.rmtree(folder, ignore_errors=True)
        assert left == [], f"Ray processes left behind by the run: {left}"


def _processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, command line)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry)] = (parent, command)
    return found


def _ours(folder: str) -> list[str]:
    """The processes of the Ray run in ``folder``: those that name it (GCS, raylet, monitors) and their
    descendants (workers and agents, which rename themselves ``ray::...``)."""
    table = _processes()
    ours = {pid for pid, (_, command) in table.items() if folder in command and pid != os.getpid()}
    while True:
        more = {pid for pid, (parent, _) in table.items() if parent in ours} - ours
        if not more:
            break
        ours |= more
    return [f"{pid} {table[pid][1][:120]}" for pid in sorted(ours)]


def _left(folder: str, grace: float = 15.0) -> list[str]:
    """The run's processes still there after up to ``grace`` seconds (a driver's ``ray.shutdown()`` ends
    its local Ray's processes within a few)."""
    deadline = time.monotonic() + grace
    while (left := _ours(folder)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _end(folder: str) -> None:
    """End the run's processes by their pids, as ``ray stop --force`` would, but only this run's (other
    Ray clusters on the machine are left alone): ``SIGTERM``, then ``SIGKILL`` after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for line in _ours(folder):
            try:
                os.kill(int(line.split()[0]), sig)
            except ProcessLookupError:
                pass
        if not _left(folder, wait):
            return


def _env(folder: str, shim_disabled: bool = False) -> dict[str, str]:
    env = environment(shim_disabled)
    # No usage statistics, no authentication token written to ~/.ray (a local cluster of the test's own),
    # and every worker's line as printed (Ray would fold lines repeated across workers into one).
    env.update(RAY_TMPDIR=folder, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", RAY_DEDUP_LOGS="0")
    return env


def run_job(folder: str, out: Path, *arguments: str, shim_disabled: bool = False) -> tuple[list[dict], str]:
    """The job in a fresh driver: each worker's record, by rank, and what the driver printed."""
    out.mkdir()
    command = [sys.executable, str(JOB), str(out), *arguments]
    done = subprocess.run(
        command, env=_env(folder, shim_disabled), capture_output=True, text=True, timeout=TIMEOUT, cwd=out
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-6000:]
    assert "e2e ray job: done" in printed
    records = [json.loads(path.read_text()) for path in sorted(out.glob("worker-*.json"))]
    assert [record["rank"] for record in records] == [0, 1], printed[-6000:]
    return records, printed


def shim_lines(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if "hf-train-shim" in line]


def test_import_shim_in_the_driver_fixes_both_workers_and_the_driver_says_one_line(ray_tmp, tmp_path):
    records, printed = run_job(ray_tmp, tmp_path / "job", "--shim")
    for record in records:
        assert record["shim"] is True, record
        assert (record["wrong"], record["tensors"]) == (0, 21), f"worker {record['rank']}: {record}"
    (line,) = shim_lines(printed)  # one line for the job, none from the workers
    assert line.startswith("hf-train-shim (ray workers 0-1): ")
    assert f"{FIX} ×" in line and f"{PATCH} ×1 (driver)" in line
    # Ray sets its workers' root logger to INFO: the shim adds no line there (its INFO lines held back).
    assert not [row for row in printed.splitlines() if FIX in row and row != line]
    assert "ShimWarning" not in printed


def test_without_the_shim_the_workers_lose_the_gradients(ray_tmp, tmp_path):
    """The same job with ``SHIM_DISABLE=all`` on the driver: the workers run without the shim and lose
    every gradient reentrant checkpointing drops (the test above tests something)."""
    records, printed = run_job(ray_tmp, tmp_path / "job", "--shim", shim_disabled=True)
    for record in records:
        assert record["shim"] is False, record
        assert record["without_grad"] == 19 and record["wrong"] == 19, record
    assert shim_lines(printed) == []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ray_start(folder: str, *arguments: str) -> None:
    common = ("--num-cpus=1", f"--object-store-memory={OBJECT_STORE}", "--disable-usage-stats")
    agent = ("--dashboard-agent-listen-port", str(_free_port()))  # two nodes on one machine: one each
    done = subprocess.run(
        [str(RAY), "start", *arguments, *common, *agent],
        env=_env(folder),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.fixture
def two_nodes(ray_tmp):
    """A cluster of two Ray nodes on this machine, one CPU each, started without the shim: ``ray start
    --head`` and ``ray start --address``; its address. Ended afterwards (every process of it, by pid)."""
    address = f"127.0.0.1:{_free_port()}"
    try:
        _ray_start(ray_tmp, "--head", f"--port={address.rpartition(':')[2]}", "--include-dashboard=false")
        _ray_start(ray_tmp, f"--address={address}")
        yield address
    finally:
        _end(ray_tmp)


def test_a_cluster_of_two_nodes_gets_the_shim_on_both_and_keeps_the_users_setup_hook(ray_tmp, two_nodes, tmp_path):
    """The job joins the cluster with ``ray.init(address=...)`` and gives a ``worker_process_setup_hook``
    of its own: one training worker lands on each node, and each gets the shim and runs the user's hook."""
    records, printed = run_job(ray_tmp, tmp_path / "job", "--shim", "--address", two_nodes, "--users-hook")
    assert len({record["node"] for record in records}) == 2, records
    for record in records:
        assert record["shim"] is True and record["users_hook"] is True, record
        assert (record["wrong"], record["tensors"]) == (0, 21), f"worker {record['rank']}: {record}"
    (line,) = shim_lines(printed)
    assert line.startswith("hf-train-shim (ray workers 0-1): ") and f"{FIX} ×" in line


def test_doctor_says_the_ray_patch_fixes_its_bug():
    done = subprocess.run(
        [sys.executable, "-m", "shim", "doctor", PATCH, "--json"],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    (finding,) = json.loads(done.stdout)
    assert finding["verdict"] == "fixed", finding
    assert done.returncode == 0, done.stderr
