"""Running the end-to-end training scripts: one process group per launch, hard timeouts, logs and per-rank
records collected afterwards. Shared by the e2e test modules.

Importing the stack costs each rank 13-18 CPU-s, more than most training runs here: a launch of a rank
script (tests/e2e/ranks.py) runs several cases one after the other, each with the patches its
``--shim-off`` names switched off around it, and :class:`Launches` starts a launch the first time a
test asks for one of its cases. What a test sees of a case (:meth:`Run.case`) reads as a run of its own.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
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
# A two-rank ZeRO-3 GKD run on CPU now and then computes other numbers than the same run usually does, more often
# under load, from DeepSpeed or trl, not the shim (measured 2026-12-06, the first step's loss: with two busy loops on
# the two cores it differed in 1 of 12 runs on DeepSpeed 0.19.2 with the shim, 1 of 12 on 0.19.3 with the shim and
# 1 of 14 on 0.19.3 with SHIM_DISABLE=all; alone in 1 of 10 on 0.19.2); rarely so much that the student samples
# from nan (1 of 20 runs under load). :func:`launch` starts such a run once more.
SAMPLING_NAN = "probability tensor contains either `inf`, `nan` or element < 0"
DONE = re.compile(r"done: \d+ optimizer steps")
CASE_MARK = "----- e2e case: "  # a rank prints it and the case's name as the case starts (ranks.py)


@dataclass
class Run:
    returncode: int
    log_dir: Path
    logs: dict[str, str] = field(default_factory=dict)  # name -> text (torchrun's own and one per rank)
    reports: dict[int, dict] = field(default_factory=dict)  # rank -> JSON record written by the script
    cases: tuple[str, ...] = ()  # a launch of several cases: their names, in order (records under log_dir/<name>)
    records: str = "checkpointing-rank"
    ranks: int = 2

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

    def started(self) -> list[str]:
        """The cases that started, in order (a case that ends the launch is the last)."""
        return [name for name in self.cases if (self.log_dir / name).is_dir()]

    def finished(self, name: str) -> bool:
        """Whether every rank got past case ``name`` without an error."""
        statuses = [json.loads(path.read_text()) for path in (self.log_dir / name).glob("case-rank*.json")]
        return len(statuses) == self.ranks and all(s["finished"] and s["error"] is None for s in statuses)

    def case(self, name: str) -> Run:
        """Case ``name`` as a run of its own: its per-rank records, the part of every rank's log it wrote
        (torchrun's own log goes with the last case that started), and a return code: the launch's where
        the case ended it, else 0 when every rank got past it and 1 when it raised (on a lone rank, which
        goes on to the next case)."""
        started = self.started()
        if name not in started:
            ended = f"in case {started[-1]}" if started else "before its first case"
            pytest.fail(f"case {name} never started: the launch ended {ended}\n{self.describe()}")
        last = name == started[-1]
        returncode = 0 if self.finished(name) else 1
        if last and self.returncode != 0:
            returncode = self.returncode
        logs = {}
        for log, text in self.logs.items():
            part = _part_of(text, name)
            if part is not None or (last and log == "launcher"):
                logs[log] = text if part is None else part
        return collect_records(Run(returncode, self.log_dir / name, logs), self.records)


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


def _part_of(text: str, case: str) -> str | None:
    """The lines a log holds from the start of ``case`` to the start of another (None: no such case). A rank
    marks a case's start on stdout and on stderr, which may share the log."""
    lines, current = [], None
    for line in text.splitlines(keepends=True):
        if line.startswith(CASE_MARK):
            current = line[len(CASE_MARK) :].rstrip("\n")
        if current == case:
            lines.append(line)
    return "".join(lines) if lines else None


def trained(result: Run) -> bool:
    """Whether training finished: every case of a launch of several, else the run's ``done`` line."""
    if result.cases:
        return all(result.finished(name) for name in result.cases)
    return DONE.search(result.text) is not None


def launch(command_for: Callable[[Path], list[str]], log_dir: Path, env: dict, timeout: int, **collecting) -> Run:
    """Run ``command_for(log_dir)`` and collect it; a run that finished training and then aborted in
    teardown (:data:`TEARDOWN_ABORT`), or that sampled from nan (:data:`SAMPLING_NAN`), is started
    again once, in ``log_dir/retry``, with a warning."""
    result = collect(run(command_for(log_dir), log_dir, env, timeout), log_dir, **collecting)
    if result.returncode != 0 and ((TEARDOWN_ABORT in result.text and trained(result)) or SAMPLING_NAN in result.text):
        why = "sampling from nan" if SAMPLING_NAN in result.text else "teardown abort after training"
        warnings.warn(f"{why}, run started again (first run's logs in {log_dir})", stacklevel=2)
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


def collect(
    returncode: int, log_dir: Path, records: str = "checkpointing-rank", cases: Sequence[str] = (), ranks: int = 2
) -> Run:
    """The launcher's log, each rank's logs and the per-rank JSON records ``<records><rank>.json`` (those of
    a launch of several ``cases`` in each case's folder: :meth:`Run.case`)."""
    result = Run(returncode, log_dir, cases=tuple(cases), records=records, ranks=ranks)
    result.logs["launcher"] = (log_dir / "launcher.log").read_text(errors="replace")
    # torchrun --log-dir D --redirects 3 writes D/<run id>/attempt_<n>/<rank>/{stdout,stderr}.log
    for path in sorted((log_dir / "ranks").glob("*/attempt_*/*/std*.log")):
        result.logs[f"rank {path.parent.name} {path.stem}"] = path.read_text(errors="replace")
    return collect_records(result, records)


def collect_records(result: Run, records: str) -> Run:
    for path in sorted(result.log_dir.glob(f"{records}*.json")):
        result.reports[int(path.stem.removeprefix(records))] = json.loads(path.read_text())
    return result


@dataclass(frozen=True)
class Case:
    """One training run in a launch: ``options`` are the rank script's options for it (``--shim-off
    PATCH`` switches a patch off around it). ``crashes``: the bug under test ends the process, so the case
    must come last in its launch."""

    name: str
    options: tuple[str, ...] = ()
    crashes: bool = False

    def argument(self) -> str:
        return f"{self.name}: {shlex.join(self.options)}"


class Launches:
    """A test module's cases of one rank script, grouped into launches. :meth:`runs` gives the cases of a
    session: a launch starts the first time a test asks for one of its cases, and once.

    ``timeout``: one launch's limit for its first case, ``per_case`` added for each further one;
    ``ranks``: 2 under torchrun, 1 for one plain process."""

    def __init__(
        self,
        script: Path,
        groups: Sequence[Sequence[Case]],
        records: str,
        timeout: int,
        per_case: int,
        ranks: int = 2,
    ) -> None:
        self.script, self.records, self.timeout, self.per_case, self.ranks = script, records, timeout, per_case, ranks
        self.groups = [tuple(group) for group in groups]
        for group in self.groups:
            crashing = [case.name for case in group if case.crashes]
            assert crashing in ([], [group[-1].name]), f"a case that crashes ends its launch: {crashing} in {group}"
        names = [case.name for group in self.groups for case in group]
        assert len(names) == len(set(names)), f"case names must be unique: {names}"

    def case(self, name: str) -> Case:
        return next(case for group in self.groups for case in group if case.name == name)

    def runs(self, directory: Path) -> CaseRuns:
        return CaseRuns(self, directory)

    def command(self, directory: Path, cases: Sequence[Case]) -> list[str]:
        arguments = (str(directory), *(case.argument() for case in cases))
        if self.ranks == 1:
            return [sys.executable, str(self.script), *arguments]
        return torchrun(self.script, directory, *arguments, ranks=self.ranks)


class CaseRuns:
    """The cases of :class:`Launches` in one session, under ``directory``: ``runs[name]`` is case ``name``
    as a :class:`Run` of its own (its launch started on first use)."""

    def __init__(self, launches: Launches, directory: Path) -> None:
        self.launches = launches
        self.directory = directory
        self.done: dict[int, Run] = {}

    def __getitem__(self, name: str) -> Run:
        index = next((i for i, group in enumerate(self.launches.groups) if name in {c.name for c in group}), None)
        assert index is not None, f"no case named {name}"
        if index not in self.done:
            self.done[index] = self.launch(self.launches.groups[index])
        return self.done[index].case(name)

    def launch(self, cases: Sequence[Case]) -> Run:
        """A launch of ``cases`` (also of cases run already, to run them again: a new folder each time)."""
        launches = self.launches
        log_dir = self.directory / f"launch-{len(list(self.directory.glob('launch-*'))) + 1}"
        log_dir.mkdir(parents=True)
        timeout = launches.timeout + launches.per_case * (len(cases) - 1)
        names = [case.name for case in cases]
        collecting = dict(records=launches.records, cases=names, ranks=launches.ranks)
        return launch(
            lambda directory: launches.command(directory, cases), log_dir, environment(), timeout, **collecting
        )


def applies(distribution: str, rule: str) -> bool:
    """Whether the installed ``distribution`` is inside ``rule``; ``False`` when it is not installed
    (the modules are collected, and deselected, in environments without deepspeed too)."""
    try:
        installed = version(distribution)
    except PackageNotFoundError:
        return False
    return Version(Version(installed).base_version) in SpecifierSet(rule)
