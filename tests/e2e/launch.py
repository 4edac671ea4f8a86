"""Running the end-to-end training scripts: one process group per run, hard timeouts, logs and per-rank
records collected afterwards. Shared by the e2e test modules."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
ZERO3_TIMEOUT = 300  # ~15 s warm; a cold run first JIT-compiles DeepSpeed's CPU shared-memory comm op (40-110 s)
# A rank of a DeepSpeed ZeRO-3 run on CPU now and then aborts after training has finished, while the process
# tears down (SIGABRT): with DeepSpeed 0.19.3 and no shim patch for it as with 0.19.2 and the shim's backports
# of 0.19.3 (measured: 2 of 24 GKD runs on 0.19.3). :func:`launch` starts such a run once more.
TEARDOWN_ABORT = "terminate called without an active exception"
DONE = re.compile(r"done: \d+ optimizer steps")


@dataclass
class Run:
    returncode: int
    log_dir: Path
    logs: dict[str, str] = field(default_factory=dict)  # name -> text (torchrun's own and one per rank)
    reports: dict[int, dict] = field(default_factory=dict)  # rank -> JSON record written by the script

    @property
    def text(self) -> str:
        return "\n".join(self.logs.values())

    def describe(self, tail: int = 60) -> str:
        parts = [f"return code {self.returncode}, logs in {self.log_dir}"]
        for rank, report in self.reports.items():
            parts.append(f"rank {rank}: shim patches {report.get('shim')}")
        for name, text in self.logs.items():
            lines = text.splitlines()[-tail:]
            parts.append(f"----- {name} (last {len(lines)} lines) -----\n" + "\n".join(lines))
        return "\n".join(parts)


def environment(shim_disabled: bool | str = False) -> dict:
    """The runs' environment: no SHIM_* of the developer's; ``shim_disabled`` True switches every patch
    off, a string names the patches to switch off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_")}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",  # models and tokenizers are built in code: nothing may be downloaded
        HF_DATASETS_OFFLINE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if shim_disabled:
        env["SHIM_DISABLE"] = "all" if shim_disabled is True else shim_disabled
    return env


def torchrun(script: Path, log_dir: Path, *arguments: str, ranks: int = 2) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``) with one log file per rank under ``log_dir/ranks``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc_per_node", str(ranks),
        "--log-dir", str(log_dir / "ranks"), "--redirects", "3",
        str(script), *arguments,
    ]  # fmt: skip


def run(command: list[str], log_dir: Path, env: dict, timeout: int) -> int:
    """Run ``command`` in its own process group; on timeout (or any interruption) end the whole group:
    torchrun's ranks must not outlive the test."""
    with open(log_dir / "launcher.log", "w") as output:
        process = subprocess.Popen(
            command,
            cwd=log_dir,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"timed out after {timeout} s: {' '.join(command)} (logs in {log_dir})")
        finally:
            if process.poll() is None:
                _kill_group(process)


def launch(command_for: Callable[[Path], list[str]], log_dir: Path, env: dict, timeout: int, **collecting) -> Run:
    """Run ``command_for(log_dir)`` and collect it; a run that finished training and then aborted in
    teardown (:data:`TEARDOWN_ABORT`) is started again once, in ``log_dir/retry``, with a warning."""
    result = collect(run(command_for(log_dir), log_dir, env, timeout), log_dir, **collecting)
    if result.returncode != 0 and TEARDOWN_ABORT in result.text and DONE.search(result.text):
        warnings.warn(f"teardown abort after training, run started again (first run's logs in {log_dir})", stacklevel=2)
        retry = log_dir / "retry"
        retry.mkdir()
        result = collect(run(command_for(retry), retry, env, timeout), retry, **collecting)
    return result


def _die_with_parent() -> None:
    """Linux: the launcher gets SIGTERM if pytest itself is killed (torchrun then stops its ranks)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _kill_group(process: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def collect(returncode: int, log_dir: Path, records: str = "checkpointing-rank") -> Run:
    """The launcher's log, each rank's logs and the per-rank JSON records ``<records><rank>.json``."""
    result = Run(returncode, log_dir)
    result.logs["launcher"] = (log_dir / "launcher.log").read_text(errors="replace")
    # torchrun --log-dir D --redirects 3 writes D/<run id>/attempt_<n>/<rank>/{stdout,stderr}.log
    for path in sorted((log_dir / "ranks").glob("*/attempt_*/*/std*.log")):
        result.logs[f"rank {path.parent.name} {path.stem}"] = path.read_text(errors="replace")
    for path in sorted(log_dir.glob(f"{records}*.json")):
        result.reports[int(path.stem.removeprefix(records))] = json.loads(path.read_text())
    return result


def applies(distribution: str, rule: str) -> bool:
    """Whether the installed ``distribution`` is inside ``rule``; ``False`` when it is not installed
    (the modules are collected, and deselected, in environments without deepspeed too)."""
    try:
        installed = version(distribution)
    except PackageNotFoundError:
        return False
    return Version(Version(installed).base_version) in SpecifierSet(rule)
