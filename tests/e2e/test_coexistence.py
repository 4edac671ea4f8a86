"""End to end: another patcher that fixes the same bug as the shim, both on (issue 24).

axolotl forwards DeepSpeed's ``ds_*`` attributes through torch's ``CheckpointWrapper.__setattr__``
(``src/axolotl/monkeypatch/deepspeed_utils.py``, played by ``tests/coexistence/patchers.py``): for that
wrapper alone, the bug ``zero3-delegating-wrapper-hooks`` fixes for every wrapper that forwards attribute
lookups. One ZeRO-3 rank (``tests/e2e/checkpoint_wrapper.py``) trains a Linear inside a CheckpointWrapper:
with neither fix it dies with the AttributeError; with either, or both, it trains to the very weights of
the same model without the wrapper, and the shim's status names axolotl's function as the same fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_python
from tests.e2e.launch import ZERO3_TIMEOUT, Case, Launches, applies

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not applies("deepspeed", "<0.19.3"),
        reason="version rule: the patch's gate is deepspeed < 0.19.3 (0.19.3 has the fix: nothing to coexist with)",
    ),
]

SCRIPT = Path(__file__).resolve().parent / "checkpoint_wrapper.py"
PATCH = "zero3-delegating-wrapper-hooks"
SETATTR = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointWrapper.__setattr__"
AXOLOTL = "tests.coexistence.patchers:axolotl_checkpoint_wrapper_setattr.<locals>.new_setattr"

REFERENCE = Case("plain", ("plain",))
SHIM = Case("wrapper-shim", ("checkpoint-wrapper",))
AXOLOTL_ONLY = Case("wrapper-axolotl-patch-off", ("checkpoint-wrapper", "--axolotl", "--shim-off", PATCH))
BOTH = Case("wrapper-axolotl-shim", ("checkpoint-wrapper", "--axolotl"))
NEITHER = Case("wrapper-patch-off", ("checkpoint-wrapper", "--shim-off", PATCH), crashes=True)
# One process: a case that raised leaves a half-registered ZeRO-3 model behind, so it comes last.
LAUNCHES = Launches(
    SCRIPT,
    [[REFERENCE, SHIM, AXOLOTL_ONLY, BOTH, NEITHER]],
    records="wrapper-rank",
    timeout=ZERO3_TIMEOUT,
    per_case=60,
    ranks=1,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LAUNCHES.runs(tmp_path_factory.mktemp("checkpoint-wrapper"))


def trained(run) -> dict:
    assert run.returncode == 0, run.describe()
    report = run.reports[0]
    assert len(report["losses"]) == 3, run.describe()
    return report


def test_a_checkpoint_wrapper_crashes_with_neither_fix(runs):
    run = runs[NEITHER.name]

    assert run.returncode != 0, f"bug: expected the AttributeError\n{run.describe()}"
    assert "AttributeError: 'Linear' object has no attribute 'ds_grads_remaining'" in run.text, run.describe()
    assert run.reports[0]["shim"][PATCH] == "suspended"


@pytest.mark.parametrize("case", [SHIM, AXOLOTL_ONLY, BOTH], ids=lambda case: case.name)
def test_either_fix_or_both_train_to_the_weights_without_the_wrapper(runs, case):
    reference, report = trained(runs[REFERENCE.name]), trained(runs[case.name])

    assert report["losses"] == reference["losses"]
    assert report["weights"] == reference["weights"]  # every parameter, gathered from its partitions
    assert report["shim"][PATCH] == ("suspended" if "--shim-off" in case.options else "applied")
    if "--axolotl" in case.options:
        assert report["axolotl_setattr_calls"] > 0  # its __setattr__ ran: DeepSpeed's ds_* went through it


def test_the_status_names_axolotls_fix_of_the_same_bug_only_where_it_is_on(runs):
    both, shim_only = trained(runs[BOTH.name]), trained(runs[SHIM.name])

    assert shim_only["others"] == []
    [other] = both["others"]
    assert (other["target"], other["relation"], other["by"]) == (SETATTR, "same fix", AXOLOTL)
    assert other["file"].endswith("tests/coexistence/patchers.py")
    assert "fixes the same bug for modules inside torch's CheckpointWrapper" in other["text"]
    assert other["text"].endswith("both can be on")


IMPORT_ORDER = """
import json
import deepspeed.runtime.zero.parameter_offload  # the patch's target module
from tests.coexistence import patchers
if {axolotl_first}:
    patchers.axolotl_checkpoint_wrapper_setattr()
import shim
if not {axolotl_first}:
    patchers.axolotl_checkpoint_wrapper_setattr()
record = next(s for s in shim.status() if s.name == {patch!r})
print(json.dumps({{"state": record.state, "others": [[o["relation"], o["by"]] for o in record.others]}}))
"""


@pytest.mark.parametrize("axolotl_first", [True, False], ids=["axolotl, then import shim", "import shim, then axolotl"])
def test_either_import_order_names_the_same_fix(axolotl_first):
    code = IMPORT_ORDER.format(axolotl_first=axolotl_first, patch=PATCH)
    out = json.loads(run_python(code).stdout.splitlines()[-1])
    assert out == {"state": "applied", "others": [["same fix", AXOLOTL]]}
