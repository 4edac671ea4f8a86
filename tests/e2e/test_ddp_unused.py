"""End to end, two CPU ranks over gloo, plain DDP: ``ddp-find-unused-for-checkpointing`` never turns a run that
trains into one that fails, and fixes the failure where DDP has a setting that trains.

Each run is ``torchrun --nproc_per_node 2`` of ``tests/e2e/ddp_trainer.py`` (transformers' Trainer, reentrant
checkpointing, a model that is no PreTrainedModel, so upstream picks ``find_unused_parameters=True``), in a
subprocess with a hard timeout, with the patch switched off (``SHIM_DISABLE=ddp-find-unused-for-checkpointing``,
every other patch on) and on. Where both complete, their losses are equal step by step; where only the shim's
completes, its losses equal those of the same run without checkpointing (``True`` trains that one).
The outcomes asserted are the ones measured on torch 2.13.0, transformers 5.24.0, peft 0.21.2, accelerate 1.15.0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.launch import Run, environment, launch, torchrun

pytestmark = pytest.mark.e2e

TRAINER = Path(__file__).resolve().parent / "ddp_trainer.py"
DDP = "ddp-find-unused-for-checkpointing"
STEPS = 3
TIMEOUT = 180  # ~20 s a run
READY_ONCE = "RuntimeError: Expected to mark a variable ready only once"
GRAPH_CHANGED = "RuntimeError: Your training graph has changed in this iteration"


def run(tmp_path: Path, case: str, patch_on: bool, *extra: str) -> Run:
    name = f"{case}-{'-'.join(extra).replace('--', '') or 'plain'}-{'shim-on' if patch_on else 'patch-off'}"
    log_dir = tmp_path / name
    log_dir.mkdir()

    def command(directory: Path) -> list[str]:
        return torchrun(TRAINER, directory, case, str(directory), "--max-steps", str(STEPS), *extra)

    return launch(command, log_dir, environment("" if patch_on else DDP), TIMEOUT, records="ddp-rank")


def completed(run_: Run) -> bool:
    return run_.returncode == 0 and f"done: {STEPS} optimizer steps" in run_.text and sorted(run_.reports) == [0, 1]


def losses(run_: Run) -> list[list[float]]:
    return [run_.reports[rank]["losses"] for rank in (0, 1)]


def ddp_built_with(run_: Run) -> set[tuple]:
    return {(report["find_unused_parameters"], report["static_graph"]) for report in run_.reports.values()}


def effects(run_: Run) -> list[int]:
    return [report["effects"].get(DDP, 0) for report in run_.reports.values()]


def assert_fails_with(run_: Run, message: str, steps_done: int) -> None:
    assert run_.returncode != 0, f"expected DDP to fail\n{run_.describe()}"
    assert message in run_.text, run_.describe()
    assert all(len(report["losses"]) == steps_done for report in run_.reports.values()), run_.describe()


# ---------------------------------------------------------------------------------------------------------
# Trainable parameters in the checkpointed layers: upstream's True fails on every one of these.


def test_lora_and_an_unused_head_train_with_a_static_graph(tmp_path):
    """False would fail here too (the head gets no gradient): only a static graph trains it."""
    crashed = run(tmp_path, "lora-unused", False)
    trained = run(tmp_path, "lora-unused", True)
    reference = run(tmp_path, "lora-unused", True, "--checkpointing", "off")

    assert_fails_with(crashed, READY_ONCE, steps_done=0)
    assert ddp_built_with(crashed) == {(True, False)}
    assert completed(trained), trained.describe()
    assert ddp_built_with(trained) == {(False, True)}
    assert effects(trained) == [1, 1]
    assert completed(reference), reference.describe()
    assert ddp_built_with(reference) == {(True, False)} and effects(reference) == [0, 0]
    assert losses(trained) == losses(reference)


def test_lora_with_gradient_accumulation_trains_with_false(tmp_path):
    """A static graph fails under accelerate's no_sync (torch's expect_autograd_hooks_ assert): False instead."""
    crashed = run(tmp_path, "lora", False, "--accumulation", "2")
    trained = run(tmp_path, "lora", True, "--accumulation", "2")
    reference = run(tmp_path, "lora", True, "--accumulation", "2", "--checkpointing", "off")

    assert_fails_with(crashed, READY_ONCE, steps_done=0)
    assert completed(trained), trained.describe()
    assert ddp_built_with(trained) == {(False, False)}
    assert effects(trained) == [1, 1]
    assert completed(reference), reference.describe()
    assert losses(trained) == losses(reference)


def test_a_head_used_on_some_steps_fails_either_way(tmp_path):
    """No DDP setting trains a trainable parameter used on some steps only inside a reentrant run: upstream fails
    in the first backward, the shim's static graph after the first optimizer step, with DDP's own explanation."""
    crashed = run(tmp_path, "lora-step", False)
    also_crashed = run(tmp_path, "lora-step", True)

    assert_fails_with(crashed, READY_ONCE, steps_done=0)
    assert_fails_with(also_crashed, GRAPH_CHANGED, steps_done=1)
    assert ddp_built_with(also_crashed) == {(False, True)}


# ---------------------------------------------------------------------------------------------------------
# Nothing trainable in a checkpointed layer: upstream's True trains, and the shim leaves it.


def test_frozen_layers_and_a_head_used_every_other_step_train_as_upstream(tmp_path):
    """False and a static graph would both fail on this head (used every other step); upstream's True
    trains it. (Frozen layers with a head never used, where only False fails, are decided by the same
    rule in tests/test_ddp_find_unused_for_checkpointing.py.)"""
    case = "frozen-step"
    upstream = run(tmp_path, case, False)
    shimmed = run(tmp_path, case, True)

    for run_ in (upstream, shimmed):
        assert completed(run_), run_.describe()
        assert ddp_built_with(run_) == {(True, False)}
    assert effects(shimmed) == [0, 0]
    assert losses(shimmed) == losses(upstream)
