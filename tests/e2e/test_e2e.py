"""End to end: real trl trainers, and DeepSpeed ZeRO-3 on two ranks, with and without the shim.

Run in the e2e environment (``bash scripts/e2e.sh``: deepspeed 0.19.2, trl 1.15.0, transformers 5.24.0,
``constraints/e2e.txt``). Each training run is a subprocess whose script imports the shim as a user does: the
GKD example on two ranks, a launch of its own; GRPO and DPO on one rank, four cases one after the other in
one process (tests/e2e/launch.py), each shown with every patch switched off (``shim.disabled()`` around the
case: the bug) and on (the fix).
The scripts record, after the Trainer set checkpointing up and after every optimizer step, what the
model's checkpointing modules hold (the keywords of the ``functools.partial(checkpoint, **kwargs)`` on
each layer, and which layers checkpoint); the tests assert on those records and on the ranks' logs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.launch import ROOT, ZERO3_TIMEOUT, Case, Launches, Run, environment, launch, torchrun
from tests.e2e.launch import applies as _applies

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "gkd_zero3.py"
SINGLE_RANK_SCRIPT = Path(__file__).resolve().parent / "single_rank.py"
PATCH = "checkpointing-restore"
STEPS = 2
SINGLE_RANK_TIMEOUT = 180  # ~10 s a case, after the import of the stack
# Keys transformers' Trainer takes out of the checkpointing kwargs before torch.utils.checkpoint sees them.
TRAINER_KEYS = ("every_n_layers", "offload")


def run_gkd_zero3(tmp_path: Path, shim_disabled: bool) -> Run:
    """The example, two ranks, DeepSpeed ZeRO-3 over gloo on CPU."""
    log_dir = tmp_path / ("shim-off" if shim_disabled else "shim-on")
    log_dir.mkdir()

    def command(directory: Path) -> list[str]:
        arguments = ("--output-dir", str(directory / "output"), "--max-steps", str(STEPS))
        return torchrun(EXAMPLE, directory, *arguments, "--checkpointing-log", str(directory))

    return launch(command, log_dir, environment(shim_disabled), ZERO3_TIMEOUT)


def single_rank_case(trainer: str, shim_on: bool) -> Case:
    switch = () if shim_on else ("--shim-off", "all")
    return Case(f"{trainer}-{'shim-on' if shim_on else 'shim-off'}", (trainer, "--max-steps", str(STEPS), *switch))


# One process runs the four cases: on one rank an error is recorded and the next case goes on.
SINGLE_RANK = Launches(
    SINGLE_RANK_SCRIPT,
    [[single_rank_case(trainer, shim_on) for trainer in ("grpo", "dpo") for shim_on in (False, True)]],
    records="checkpointing-rank",
    timeout=SINGLE_RANK_TIMEOUT,
    per_case=SINGLE_RANK_TIMEOUT // 2,
    ranks=1,
)


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    return SINGLE_RANK.runs(tmp_path_factory.mktemp("single-rank"))


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


# ---------------------------------------------------------------------------------------------------------
# GKD under DeepSpeed ZeRO-3, two ranks: the report this project was created for (trl #6827).


def test_gkd_zero3_completes_with_the_shim(tmp_path):
    """Without the shim this run crashes in the first backward (ZeRO-3's CheckpointError): shown on the same
    example by tests/e2e/test_distributed.py::test_unmodified_gkd_zero3_crashes_without_shim_run. A launch of
    its own: the example is run as a user runs it, one training per process."""
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
def test_single_rank_loses_checkpointing_without_the_shim(single_rank, trainer):
    run = single_rank[f"{trainer}-shim-off"]

    assert run.reports, f"the run never reached training\n{run.describe()}"
    report = run.reports[0]
    assert report["configured"] == {"use_reentrant": True, "every_n_layers": 2}
    # Every patch switched off through the case.
    assert report["shim"].get(PATCH) == "suspended" and "applied" not in report["shim"].values(), report["shim"]
    # The Trainer set it up right; trl's re-enable loses it (every_n_layers: checkpointing-restore and checkpoint-kwargs-clean).
    setup = report["records"][0]
    assert observed_state(setup) == expected_state(report["configured"], setup["layers"]), run.describe()
    assert _lost(run), f"bug: expected {trainer} to lose the configured checkpointing\n{run.describe()}"


@pytest.mark.parametrize("trainer", ["grpo", "dpo"])
def test_single_rank_keeps_checkpointing_with_the_shim(single_rank, trainer):
    run = single_rank[f"{trainer}-shim-on"]

    assert _lost(run) is None, f"{trainer}: {_lost(run)}\n{run.describe()}"
    assert run.returncode == 0, run.describe()
    assert f"done: {STEPS} optimizer steps" in run.text, run.describe()
    assert_checkpointing_intact(run, ranks=1)
    assert run.reports[0]["shim"].get(PATCH) == "applied"
