"""End to end: real trl trainers, and DeepSpeed ZeRO-3 on two ranks, with and without the shim.

Run in the e2e environment (``bash scripts/e2e.sh``: deepspeed 0.19.2, trl 1.15.0, transformers 5.24.0,
``constraints/e2e.txt``). Each training run is a subprocess whose script has ``import shim`` as its first
line; ``SHIM_DISABLE=all`` switches every patch off, so the same script shows the bug and then the fix.
The scripts record, after the Trainer set checkpointing up and after every optimizer step, what the
model's checkpointing modules hold (the keywords of the ``functools.partial(checkpoint, **kwargs)`` on
each layer, and which layers checkpoint); the tests assert on those records and on the ranks' logs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gkd_zero3.py"
SINGLE_RANK = Path(__file__).resolve().parent / "single_rank.py"
PATCH = "checkpointing-restore"
STEPS = 2
ZERO3_TIMEOUT = 300  # ~15 s warm; a cold run first JIT-compiles DeepSpeed's CPU shared-memory comm op (40-110 s)
SINGLE_RANK_TIMEOUT = 180  # ~10 s
# Keys transformers' Trainer takes out of the checkpointing kwargs before torch.utils.checkpoint sees them.
TRAINER_KEYS = ("every_n_layers", "offload")


@dataclass
class Run:
    returncode: int
    log_dir: Path
    logs: dict[str, str] = field(default_factory=dict)  # name -> text (torchrun's own and one per rank)
    reports: dict[int, dict] = field(default_factory=dict)  # rank -> checkpointing JSON written by the script

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


def _environment(shim_disabled: bool) -> dict:
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
        env["SHIM_DISABLE"] = "all"
    return env


def _run(command: list[str], log_dir: Path, env: dict, timeout: int) -> int:
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


def _collect(returncode: int, log_dir: Path) -> Run:
    run = Run(returncode, log_dir)
    run.logs["launcher"] = (log_dir / "launcher.log").read_text(errors="replace")
    # torchrun --log-dir D --redirects 3 writes D/<run id>/attempt_<n>/<rank>/{stdout,stderr}.log
    for path in sorted((log_dir / "ranks").glob("*/attempt_*/*/std*.log")):
        run.logs[f"rank {path.parent.name} {path.stem}"] = path.read_text(errors="replace")
    for path in sorted(log_dir.glob("checkpointing-rank*.json")):
        run.reports[int(path.stem.removeprefix("checkpointing-rank"))] = json.loads(path.read_text())
    return run


def run_gkd_zero3(tmp_path: Path, shim_disabled: bool) -> Run:
    """The example, two ranks, DeepSpeed ZeRO-3 over gloo on CPU."""
    log_dir = tmp_path / ("shim-off" if shim_disabled else "shim-on")
    log_dir.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc_per_node", "2",
        "--log-dir", str(log_dir / "ranks"), "--redirects", "3",
        str(EXAMPLE),
        "--output-dir", str(log_dir / "output"),
        "--max-steps", str(STEPS),
        "--checkpointing-log", str(log_dir),
    ]  # fmt: skip
    return _collect(_run(command, log_dir, _environment(shim_disabled), ZERO3_TIMEOUT), log_dir)


def run_single_rank(tmp_path: Path, trainer: str, shim_disabled: bool) -> Run:
    """GRPO or DPO on one process, no DeepSpeed."""
    log_dir = tmp_path / f"{trainer}-{'shim-off' if shim_disabled else 'shim-on'}"
    log_dir.mkdir()
    command = [sys.executable, str(SINGLE_RANK), trainer, str(log_dir), "--max-steps", str(STEPS)]
    return _collect(_run(command, log_dir, _environment(shim_disabled), SINGLE_RANK_TIMEOUT), log_dir)


def expected_state(configured: dict, layers: list[dict]) -> list[dict]:
    """What every checkpointing module must hold for ``configured`` (the Trainer's
    ``gradient_checkpointing_kwargs``): the checkpoint keywords without the Trainer's own keys, and, with
    ``every_n_layers=n``, checkpointing on decoder layer i exactly when ``i % n == 0``."""
    kwargs = {k: v for k, v in configured.items() if k not in TRAINER_KEYS}
    every = configured.get("every_n_layers", 1)
    expected = []
    for layer in layers:
        index = layer["name"].rsplit(".", 1)[-1]
        enabled = int(index) % every == 0 if ".layers." in layer["name"] and index.isdigit() else True
        expected.append({"name": layer["name"], "enabled": enabled, "kwargs": kwargs})
    return expected


def observed_state(record: dict) -> list[dict]:
    return [{k: layer[k] for k in ("name", "enabled", "kwargs")} for layer in record["layers"]]


def assert_checkpointing_intact(run: Run, ranks: int) -> None:
    """Every rank: the Trainer's setup matches the configuration, and so does the state after each step."""
    assert sorted(run.reports) == list(range(ranks)), f"missing per-rank records\n{run.describe()}"
    for rank, report in run.reports.items():
        records = report["records"]
        assert records[0]["when"] == "train_begin" and records[0]["layers"], f"rank {rank}: no setup record"
        expected = expected_state(report["configured"], records[0]["layers"])
        for record in records:
            assert observed_state(record) == expected, (
                f"rank {rank}, {record['when']} step {record['step']}: configured {report['configured']}, "
                f"shim patches {report['shim']}"
            )
        assert [r["step"] for r in records if r["when"] == "step_end"] == list(range(1, STEPS + 1))


def _applies(distribution: str, rule: str) -> bool:
    """Whether the installed ``distribution`` is inside ``rule``; ``False`` when it is not installed
    (the module is collected, and deselected, in environments without deepspeed too)."""
    from importlib.metadata import PackageNotFoundError

    from packaging.specifiers import SpecifierSet

    try:
        installed = version(distribution)
    except PackageNotFoundError:
        return False
    return Version(Version(installed).base_version) in SpecifierSet(rule)


# ---------------------------------------------------------------------------------------------------------
# GKD under DeepSpeed ZeRO-3, two ranks: the report this project was created for (trl #6827).


@pytest.mark.skipif(
    not (_applies("trl", "<1.16") and _applies("deepspeed", "<=0.19.2")),
    reason="version rule: the ZeRO-3 CheckpointError shows with trl <= 1.15 (1.16 passes the kwargs on GKD's "
    "re-enable) and deepspeed <= 0.19.2 (PR #8148 in 0.19.3 removes the symptom)",
)
def test_gkd_zero3_crashes_without_the_shim(tmp_path):
    run = run_gkd_zero3(tmp_path, shim_disabled=True)

    assert run.returncode != 0, f"bug: expected the ZeRO-3 run to crash without the shim\n{run.describe()}"
    assert "torch.utils.checkpoint.CheckpointError" in run.text, run.describe()
    assert "Recomputed values for the following tensors have different metadata" in run.text, run.describe()
    assert "'shape': torch.Size([0])" in run.text, run.describe()  # the partitioned ZeRO-3 parameters
    # Before trl's generation re-enabled checkpointing, the Trainer had set it up as configured on both
    # ranks; the crash comes in the first step's backward, so no step completed.
    for rank, report in run.reports.items():
        setup = report["records"][0]
        assert setup["when"] == "train_begin"
        assert observed_state(setup) == expected_state(report["configured"], setup["layers"])
        assert [r for r in report["records"] if r["when"] == "step_end"] == [], f"rank {rank} completed a step"
    assert sorted(run.reports) == [0, 1]


def test_gkd_zero3_completes_with_the_shim(tmp_path):
    run = run_gkd_zero3(tmp_path, shim_disabled=False)

    assert run.returncode == 0, f"the ZeRO-3 run failed with the shim on\n{run.describe()}"
    assert f"done: {STEPS} optimizer steps" in run.text, run.describe()
    assert "CheckpointError" not in run.text, run.describe()
    assert_checkpointing_intact(run, ranks=2)
    assert all(report["shim"].get(PATCH) == "applied" for report in run.reports.values())


# ---------------------------------------------------------------------------------------------------------
# GRPO and DPO on one rank, no DeepSpeed.


def _lost(run: Run) -> str | None:
    """How the configured checkpointing was lost in ``run``, or None when it was kept through every step."""
    for marker in ("Unexpected keyword arguments: every_n_layers", "CheckpointError"):
        if run.returncode != 0 and marker in run.text:
            return f"crashed: {marker}"
    for rank, report in run.reports.items():
        expected = None
        for record in report["records"]:
            expected = expected or expected_state(report["configured"], record["layers"])
            if observed_state(record) != expected:
                return f"rank {rank} {record['when']} step {record['step']}: {observed_state(record)}"
    return None


@pytest.mark.skipif(
    not _applies("transformers", ">=5.16"),
    reason="version rule: trl's disable_gradient_checkpointing(model, args.gradient_checkpointing_kwargs) puts "
    "{'use_reentrant': True} back before each GRPO/DPO step ends; the loss shows through every_n_layers, which "
    "transformers has from 5.16",
)
@pytest.mark.parametrize("trainer", ["grpo", "dpo"])
def test_single_rank_loses_checkpointing_without_the_shim(tmp_path, trainer):
    run = run_single_rank(tmp_path, trainer, shim_disabled=True)

    assert run.reports, f"the run never reached training\n{run.describe()}"
    report = run.reports[0]
    assert report["configured"] == {"use_reentrant": True, "every_n_layers": 2}
    # The Trainer set it up right; trl's re-enable loses it (every_n_layers: checkpointing-restore and checkpoint-kwargs-clean).
    setup = report["records"][0]
    assert observed_state(setup) == expected_state(report["configured"], setup["layers"]), run.describe()
    assert _lost(run), f"bug: expected {trainer} to lose the configured checkpointing\n{run.describe()}"


@pytest.mark.parametrize("trainer", ["grpo", "dpo"])
def test_single_rank_keeps_checkpointing_with_the_shim(tmp_path, trainer):
    run = run_single_rank(tmp_path, trainer, shim_disabled=False)

    assert _lost(run) is None, f"{trainer}: {_lost(run)}\n{run.describe()}"
    assert run.returncode == 0, run.describe()
    assert f"done: {STEPS} optimizer steps" in run.text, run.describe()
    assert_checkpointing_intact(run, ranks=1)
    assert run.reports[0]["shim"].get(PATCH) == "applied"
