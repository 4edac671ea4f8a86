"""End to end, two CPU ranks over gloo: FSDP2 activation checkpointing keeps the RNG state
(``fsdp2-checkpoint-rng-state``).

Each case is a run of ``tests/e2e/fsdp2_lora.py`` on two ranks: a PEFT LoRA Llama with dropout active, prepared
by accelerate's own ``Accelerator.prepare`` for FSDP2 (``fsdp2_apply_ac``, then ``fully_shard``), trained three
steps. With activation checkpointing and the shim, every step's loss and gradient norm equal, rank by rank,
those of the same run without checkpointing; with the patch switched off
(``shim.disabled("fsdp2-checkpoint-rng-state")`` around the case) the first step's gradients already differ.
The three cases run one after the other in one launch of ``torchrun --nproc_per_node 2`` (tests/e2e/launch.py):
the patch acts when ``fsdp2_apply_ac`` is called, and none of them crashes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e.launch import Case, Launches, Run, applies

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not applies("accelerate", ">=1.8"), reason="version rule: fsdp2_apply_ac exists from accelerate 1.8"
    ),
]

SCRIPT = Path(__file__).resolve().parent / "fsdp2_lora.py"
PATCH = "fsdp2-checkpoint-rng-state"
STEPS = 3
TIMEOUT = 180  # ~20 s on 2 shared cores
PER_CASE = 60  # ~3 s each further case

LAUNCHES = Launches(
    SCRIPT,
    [
        [
            Case("no-checkpointing", ("--checkpointing", "off", "--steps", str(STEPS))),
            Case("checkpointing-shim-on", ("--checkpointing", "on", "--steps", str(STEPS))),
            Case("checkpointing-patch-off", ("--checkpointing", "on", "--steps", str(STEPS), "--shim-off", PATCH)),
        ]
    ],
    records="fsdp2-rank",
    timeout=TIMEOUT,
    per_case=PER_CASE,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LAUNCHES.runs(tmp_path_factory.mktemp("fsdp2"))


def assert_completed(run: Run) -> None:
    assert run.returncode == 0, run.describe()
    assert f"done: {STEPS} optimizer steps" in run.text, run.describe()
    assert sorted(run.reports) == [0, 1], run.describe()
    for rank, report in run.reports.items():
        values = report["losses"] + report["grad_norms"]
        assert len(values) == 2 * STEPS and all(math.isfinite(x) for x in values), (rank, report)


def same(first: list[float], second: list[float]) -> bool:
    return first == pytest.approx(second, rel=1e-5)


@pytest.fixture(scope="module")
def reference(runs) -> Run:
    """The same training without activation checkpointing."""
    run = runs["no-checkpointing"]
    assert_completed(run)
    assert all(report["preserve_rng_state"] == [] for report in run.reports.values())
    return run


def test_fsdp2_checkpointing_with_dropout_trains_like_no_checkpointing(runs, reference):
    checkpointed = runs["checkpointing-shim-on"]

    assert_completed(checkpointed)
    for rank, report in checkpointed.reports.items():
        assert report["shim"][PATCH] == "applied", report["shim"]
        assert report["effects"].get(PATCH) == 1, report["effects"]  # one fsdp2_apply_ac call, its layers fixed
        assert report["preserve_rng_state"] and all(value is True for value in report["preserve_rng_state"])
        expected = reference.reports[rank]
        assert same(report["grad_norms"], expected["grad_norms"]), (rank, report, expected)
        assert same(report["losses"], expected["losses"]), (rank, report, expected)


def test_fsdp2_checkpointing_with_dropout_gets_other_gradients_without_the_patch(runs, reference):
    upstream = runs["checkpointing-patch-off"]

    assert_completed(upstream)
    for rank, report in upstream.reports.items():
        assert report["shim"][PATCH] == "suspended", report["shim"]
        assert report["preserve_rng_state"] and all(value is False for value in report["preserve_rng_state"])
        expected = reference.reports[rank]
        # The first forward is the same; its backward recomputes the layers with other dropout masks.
        assert report["losses"][0] == pytest.approx(expected["losses"][0], rel=1e-6)
        assert not same(report["grad_norms"][:1], expected["grad_norms"][:1]), f"bug: rank {rank} {report}"
        assert not same(report["losses"][1:], expected["losses"][1:]), f"bug: rank {rank} {report}"
