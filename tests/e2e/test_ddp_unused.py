"""End to end, two CPU ranks over gloo, plain DDP: ``ddp-find-unused-for-checkpointing`` never turns a run that
trains into one that fails, and fixes the failure where DDP has a setting that trains.

Each case is a run of ``tests/e2e/ddp_trainer.py`` (transformers' Trainer, reentrant checkpointing, a model that
is no PreTrainedModel, so upstream picks ``find_unused_parameters=True``) on two ranks, with the patch switched
off (``shim.disabled("ddp-find-unused-for-checkpointing")`` around the case, every other patch on) and on. The
cases run in a few launches of ``torchrun --nproc_per_node 2`` (tests/e2e/launch.py), each in a subprocess with a
hard timeout. Where both complete, their losses are equal step by step; where only the shim's completes, its
losses equal those of the same run without checkpointing (``True`` trains that one).
The outcomes asserted are the ones measured on torch 2.13.0, transformers 5.24.0, peft 0.21.2, accelerate 1.15.0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.launch import Case, Launches, Run

pytestmark = pytest.mark.e2e

TRAINER = Path(__file__).resolve().parent / "ddp_trainer.py"
DDP = "ddp-find-unused-for-checkpointing"
STEPS = 3
TIMEOUT = 180  # ~20 s a launch of one case (15 of them importing the stack)
PER_CASE = 60  # ~5 s each further case
READY_ONCE = "RuntimeError: Expected to mark a variable ready only once"
GRAPH_CHANGED = "RuntimeError: Your training graph has changed in this iteration"


def case(name: str, model: str, *options: str, patch_on: bool = True, crashes: bool = False) -> Case:
    switch = () if patch_on else ("--shim-off", DDP)
    return Case(name, (model, "--max-steps", str(STEPS), *options, *switch), crashes)


NO_CHECKPOINTING = ("--checkpointing", "off")
ACCUMULATION = ("--accumulation", "2")

# Four launches: a case where DDP raises in training (crashes=True) ends its launch, last, as in a launch of
# its own; the state DDP's reducer and the process group are in after an error inside backward is no start
# for a further case. The cases that train come first.
LAUNCHES = Launches(
    TRAINER,
    [
        [
            case("lora-unused-shim-on", "lora-unused"),
            case("lora-unused-no-checkpointing", "lora-unused", *NO_CHECKPOINTING),
            case("lora-unused-patch-off", "lora-unused", patch_on=False, crashes=True),
        ],
        [
            case("lora-accumulation-shim-on", "lora", *ACCUMULATION),
            case("lora-accumulation-no-checkpointing", "lora", *ACCUMULATION, *NO_CHECKPOINTING),
            case("lora-accumulation-patch-off", "lora", *ACCUMULATION, patch_on=False, crashes=True),
        ],
        [
            case("frozen-step-patch-off", "frozen-step", patch_on=False),
            case("frozen-step-shim-on", "frozen-step"),
            case("lora-step-patch-off", "lora-step", patch_on=False, crashes=True),
        ],
        [case("lora-step-shim-on", "lora-step", crashes=True)],
    ],
    records="ddp-rank",
    timeout=TIMEOUT,
    per_case=PER_CASE,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LAUNCHES.runs(tmp_path_factory.mktemp("ddp-unused"))


def completed(run_: Run) -> bool:
    return run_.returncode == 0 and f"done: {STEPS} optimizer steps" in run_.text and sorted(run_.reports) == [0, 1]


def losses(run_: Run) -> list[list[float]]:
    return [run_.reports[rank]["losses"] for rank in (0, 1)]


def ddp_built_with(run_: Run) -> set[tuple]:
    return {(report["find_unused_parameters"], report["static_graph"]) for report in run_.reports.values()}


def effects(run_: Run) -> list[int]:
    return [report["effects"].get(DDP, 0) for report in run_.reports.values()]


def assert_patch_off(run_: Run) -> None:
    """The case ran with the patch switched off on every rank (and the other patches on)."""
    for rank, report in run_.reports.items():
        assert report["shim"][DDP] == "suspended", f"rank {rank}: {report['shim']}"
        assert not {"disabled", "suspended"} & {state for name, state in report["shim"].items() if name != DDP}, report[
            "shim"
        ]


def assert_fails_with(run_: Run, message: str, steps_done: int) -> None:
    assert run_.returncode != 0, f"expected DDP to fail\n{run_.describe()}"
    assert message in run_.text, run_.describe()
    assert all(len(report["losses"]) == steps_done for report in run_.reports.values()), run_.describe()


# ---------------------------------------------------------------------------------------------------------
# Trainable parameters in the checkpointed layers: upstream's True fails on every one of these.


def test_lora_and_an_unused_head_train_with_a_static_graph(runs):
    """False would fail here too (the head gets no gradient): only a static graph trains it."""
    crashed = runs["lora-unused-patch-off"]
    trained = runs["lora-unused-shim-on"]
    reference = runs["lora-unused-no-checkpointing"]

    assert_fails_with(crashed, READY_ONCE, steps_done=0)
    assert_patch_off(crashed)
    assert ddp_built_with(crashed) == {(True, False)}
    assert completed(trained), trained.describe()
    assert ddp_built_with(trained) == {(False, True)}
    assert effects(trained) == [1, 1]
    assert completed(reference), reference.describe()
    assert ddp_built_with(reference) == {(True, False)} and effects(reference) == [0, 0]
    assert losses(trained) == losses(reference)


def test_lora_with_gradient_accumulation_trains_with_false(runs):
    """A static graph fails under accelerate's no_sync (torch's expect_autograd_hooks_ assert): False instead."""
    crashed = runs["lora-accumulation-patch-off"]
    trained = runs["lora-accumulation-shim-on"]
    reference = runs["lora-accumulation-no-checkpointing"]

    assert_fails_with(crashed, READY_ONCE, steps_done=0)
    assert_patch_off(crashed)
    assert completed(trained), trained.describe()
    assert ddp_built_with(trained) == {(False, False)}
    assert effects(trained) == [1, 1]
    assert completed(reference), reference.describe()
    assert losses(trained) == losses(reference)


def test_a_head_used_on_some_steps_fails_either_way(runs):
    """No DDP setting trains a trainable parameter used on some steps only inside a reentrant run: upstream fails
    in the first backward, the shim's static graph after the first optimizer step, with DDP's own explanation."""
    crashed = runs["lora-step-patch-off"]
    also_crashed = runs["lora-step-shim-on"]

    assert_fails_with(crashed, READY_ONCE, steps_done=0)
    assert_patch_off(crashed)
    assert_fails_with(also_crashed, GRAPH_CHANGED, steps_done=1)
    assert ddp_built_with(also_crashed) == {(False, True)}


# ---------------------------------------------------------------------------------------------------------
# Nothing trainable in a checkpointed layer: upstream's True trains, and the shim leaves it.


def test_frozen_layers_and_a_head_used_every_other_step_train_as_upstream(runs):
    """False and a static graph would both fail on this head (used every other step); upstream's True
    trains it. (Frozen layers with a head never used, where only False fails, are decided by the same
    rule in tests/patches/test_ddp_find_unused_for_checkpointing.py.)"""
    upstream = runs["frozen-step-patch-off"]
    shimmed = runs["frozen-step-shim-on"]

    for run_ in (upstream, shimmed):
        assert completed(run_), run_.describe()
        assert ddp_built_with(run_) == {(True, False)}
    assert_patch_off(upstream)
    assert effects(shimmed) == [0, 0]
    assert losses(shimmed) == losses(upstream)
