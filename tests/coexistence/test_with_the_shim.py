"""Another patcher on the shim's targets, in both orders: the status names it and says what it
means (bypassed: the fix does not run there; above / below: both run, in that order), and where
the fix is not bypassed it still holds (the patch's own bug probe, as doctor asks it, finds no bug).

"Before the shim" is ``shim.deactivate()``, the patcher, ``shim.activate()``: the shim then wraps
whatever the target holds, as ``import shim`` after the patcher does (one case runs the literal
import order in a fresh interpreter). "After" is the patcher applied while the shim is active."""

import contextlib
import json

import pytest

import shim
from shim.tools.targets import quiet_transformers
from tests.coexistence import patchers
from tests.conftest import run_python
from tests.probes import bug_found

quiet_transformers()
ENABLE_INPUT_GRADS = "transformers.modeling_utils:PreTrainedModel.enable_input_require_grads"
DISABLE = "trl.models.utils:disable_gradient_checkpointing"
KBIT = "peft.utils.other:prepare_model_for_kbit_training"
INPUT_GRADS = ("input-grad-hook-dedupe", "frozen-tower-input-grads")  # both wrap enable_input_require_grads


def unsloth_unwrap():
    import trl.trainer.grpo_trainer  # noqa: F401  (a trainer module holding the name)

    return patchers.unsloth_unwrap_model_for_generation(("grpo_trainer",))


def trl_at_least(version: str) -> bool:
    import trl
    from packaging.version import Version

    return Version(trl.__version__) >= Version(version)


BOTH = {"input-grad-hook-dedupe": "below", "frozen-tower-input-grads": "bypassed"}  # the second's probe refuses it
# case: (patcher, {patch: relation after the shim}, {patch: relation before it})
CASES = {
    "unsloth enable_input_require_grads": (
        patchers.unsloth_enable_input_require_grads,
        dict.fromkeys(INPUT_GRADS, "bypassed"),
        dict.fromkeys(INPUT_GRADS, "below"),  # it keeps transformers' loop, which the probe looks for
    ),
    "unsloth no-op disable_gradient_checkpointing": (
        patchers.unsloth_trl_disable_gradient_checkpointing_noop,
        {"checkpointing-call-signature": "bypassed"},
        {"checkpointing-call-signature": "below"},
    ),
    "axolotl prepare_model_for_kbit_training": (
        patchers.axolotl_prepare_model_for_kbit_training,
        {"kbit-prepare-keeps-checkpointing": "bypassed"},
        # below in peft.utils.other; peft's re-export keeps upstream's function, which skips both
        {"kbit-prepare-keeps-checkpointing": ("below", "bypassed")},
    ),
    "your own functools.wraps wrapper": (
        lambda: patchers.own_wrap(ENABLE_INPUT_GRADS, wraps=True),
        dict.fromkeys(INPUT_GRADS, "above"),
        BOTH,
    ),
    "your own plain wrapper": (
        lambda: patchers.own_wrap(DISABLE, wraps=False),
        {"checkpointing-call-signature": "above"},
        {"checkpointing-call-signature": "below"},
    ),
    "your own no-op": (lambda: patchers.own_noop(ENABLE_INPUT_GRADS), dict.fromkeys(INPUT_GRADS, "bypassed"), BOTH),
}
if not trl_at_least("0.29"):  # trl-restore-on-error wraps the public name, which unsloth rebinds in the trainers
    CASES["unsloth unwrap_model_for_generation in trl's trainers"] = (
        unsloth_unwrap,
        {"trl-restore-on-error": "above"},
        {"trl-restore-on-error": "bypassed"},
    )


@contextlib.contextmanager
def applied(patcher, before_the_shim: bool):
    if before_the_shim:
        shim.deactivate()
    handle = patcher()
    if before_the_shim:
        shim.activate()
    try:
        yield handle
    finally:
        if before_the_shim:
            shim.deactivate()
        handle.undo()
        if before_the_shim:
            shim.activate()


def named(record, relation: str) -> list[dict]:
    return [other for other in record.others if other["relation"] == relation]


@pytest.mark.parametrize("order", ["after the shim", "before the shim"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_status_names_the_other_patcher_and_the_fix_holds_where_it_is_not_bypassed(case, order):
    patcher, after, before = CASES[case]
    expected = before if order == "before the shim" else after
    with applied(patcher, order == "before the shim") as handle:
        if not handle.applied:
            pytest.skip(f"version rule: the patcher's guard does not match the installed release ({case})")
        records = {record.name: record for record in shim.status()}
        for name, relations in expected.items():
            record = records[name]
            for relation in (relations,) if isinstance(relations, str) else relations:
                found = named(record, relation)
                assert found, f"{name}: {relation} not said: {record.state} {record.reason} {record.others}"
                for other in found:  # the stand-ins' module, axolotl's way (peft's source run again), upstream's copy
                    assert other["by"].startswith(("tests.coexistence.patchers:", "peft.")), other
                    assert other["file"].endswith("patchers.py") or other["file"].startswith(
                        ("<string>", "upstream's")
                    ), other
            in_place = [o for o in named(record, "bypassed") if o["target"] in record.targets]
            if in_place:  # the target itself holds the other patcher's function
                assert record.state in ("failed", "skipped") and in_place[0]["by"] in record.reason, record.reason
            else:
                assert record.state == "applied", (record.state, record.reason)
            if not named(record, "bypassed"):  # both run: the fix holds
                assert not bug_found(name), f"{name}: the bug shows with the shim and {case}"
        blamed = {r.name for r in records.values() if r.others}
        assert blamed == set(expected), blamed  # nothing else is blamed on it


@pytest.mark.parametrize(
    "patcher",
    [
        patchers.unsloth_decoder_layer_forward,
        patchers.unsloth_zoo_checkpoint,
        patchers.axolotl_layer_call,
        patchers.axolotl_modeling_utils_checkpoint,
        patchers.axolotl_checkpoint_wrapper_setattr,
    ],
    ids=lambda patcher: patcher.__name__,
)
@pytest.mark.parametrize("order", ["after the shim", "before the shim"])
def test_a_patcher_beside_the_shims_targets_is_not_named(patcher, order):
    """They patch the same classes and functions the layers run through, not a target of the shim:
    nothing to name, and no patch fails beside them (docs/coexistence.md says what each does to the
    fixes). Where DeepSpeed has the bug, axolotl's ``CheckpointWrapper`` fix is named as the same
    fix (tests/e2e/test_coexistence.py trains with it)."""
    with applied(patcher, before_the_shim=order == "before the shim"):
        records = shim.status()
        named = [(record.name, other["relation"]) for record in records for other in record.others]
        zero3 = next(record for record in records if record.name == "zero3-delegating-wrapper-hooks")
        same_fix = patcher is patchers.axolotl_checkpoint_wrapper_setattr and zero3.state == "applied"
        assert named == ([(zero3.name, "same fix")] if same_fix else [])
        assert [record.name for record in records if record.state == "failed"] == []


def test_the_effect_names_the_patcher_that_replaced_a_decoder_layers_forward():
    from shim import runtime as effects
    from tests.tinymodels import tiny_llama

    name = "replaced-forward-keeps-checkpointing"
    with applied(patchers.unsloth_decoder_layer_forward, before_the_shim=False):
        before = effects.count(name)
        tiny_llama(layers=2).train().gradient_checkpointing_enable()
        assert effects.count(name) == before + 1
        by = "tests.coexistence.patchers:unsloth_decoder_layer_forward.<locals>.LlamaDecoderLayer_fast_forward"
        assert f"LlamaDecoderLayer.forward was replaced by {by} ({patchers.__file__})" in effects.last(name)


def test_axolotls_offloading_checkpoint_runs_with_the_shim():
    """Beside the targets, and helped: axolotl's checkpoint function looks for the layer as
    ``func.__self__``, which transformers 5.23+ no longer hands over (``test_patchers.py`` shows the
    AttributeError without the shim); ``checkpoint-function-finds-layer`` hands it over again."""
    import torch

    from tests.tinymodels import tiny_llama

    def forward():
        model = tiny_llama(layers=2).train()
        model.gradient_checkpointing_enable()
        model(torch.randint(0, 60, (1, 6)))

    with applied(patchers.axolotl_modeling_utils_checkpoint, before_the_shim=False) as handle:
        with shim.disabled("checkpoint-function-finds-layer"), pytest.raises(AttributeError, match="__self__"):
            forward()
        calls = handle.calls
        forward()
    assert handle.calls - calls == 2  # once per layer, each finding its layer


def test_the_other_patcher_is_logged_once_and_shown_by_the_command_line(caplog):
    from shim.tools.render import status_table

    with applied(lambda: patchers.own_noop(DISABLE), before_the_shim=False):  # seen by no other test
        with caplog.at_level("INFO", logger="shim"):
            shim.status()
            shim.status()
        said = [r for r in caplog.records if "tests.coexistence.patchers:" in r.getMessage()]
        table = status_table(shim.status(), wide=True)
    assert [r.levelname for r in said] == ["WARNING"], [r.getMessage() for r in said]  # once
    assert "    other patcher: trl.models.utils:disable_gradient_checkpointing was replaced by" in table


def test_a_bypass_is_named_when_asked_not_while_a_model_sets_up(caplog, monkeypatch):
    """Other patchers are named when asked (a status, doctor, the exit report, DEBUG logging): a
    model's checkpointing enables say nothing of them; the first status warns of the bypass, once."""
    from shim import others
    from tests.tinymodels import tiny_llama

    monkeypatch.setattr(others, "_seen", set())  # what earlier tests had logged
    with applied(lambda: patchers.own_noop(DISABLE), before_the_shim=False):
        with caplog.at_level("INFO", logger="shim"):
            model = tiny_llama(layers=2)
            model.gradient_checkpointing_enable()
            model.gradient_checkpointing_enable()
            assert not [r for r in caplog.records if "was replaced by" in r.getMessage()]
            shim.status()
            shim.status()
    said = [r for r in caplog.records if "was replaced by tests.coexistence.patchers:" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], [r.getMessage() for r in said]
    assert said[0].getMessage().startswith(f"checkpointing-call-signature: {DISABLE} was replaced by ")


def test_doctor_says_bypassed_by_the_patcher_not_not_affected():
    from shim.tools import doctor

    with applied(patchers.unsloth_trl_disable_gradient_checkpointing_noop, before_the_shim=False) as handle:
        assert handle.applied
        finding = doctor.examine(shim.registry, "checkpointing-call-signature")
    assert finding.verdict == "bypassed by tests", finding
    assert "was replaced by tests.coexistence.patchers:" in finding.detail
    assert doctor.explained(finding.verdict) and finding.verdict not in doctor.FAILING


def test_doctor_keeps_a_stacked_patcher_beside_a_bypassed_verdict():
    from shim.tools import doctor

    enable = "transformers.modeling_utils:PreTrainedModel.activation_checkpointing_enable"
    with applied(lambda: patchers.own_wrap(enable, wraps=True), before_the_shim=False):
        with applied(patchers.unsloth_trl_disable_gradient_checkpointing_noop, before_the_shim=False):
            finding = doctor.examine(shim.registry, "checkpointing-call-signature")
    assert finding.verdict == "bypassed by tests", finding
    lines = doctor.below_table(finding)
    assert lines[0].startswith("checkpointing-call-signature: bypassed by tests: ")
    assert [line for line in lines if f"other patcher: {enable} is wrapped again by" in line], lines


def test_doctor_names_a_patcher_stacked_on_the_fix_below_its_verdict():
    from shim.tools import doctor

    with applied(lambda: patchers.own_wrap(ENABLE_INPUT_GRADS, wraps=True), before_the_shim=False):
        finding = doctor.examine(shim.registry, "input-grad-hook-dedupe")
    assert finding.verdict == "fixed", finding  # both run: the fix holds
    [line] = doctor.below_table(finding)
    assert line.startswith(f"input-grad-hook-dedupe: other patcher: {ENABLE_INPUT_GRADS} is wrapped again by tests.")
    assert line.endswith("it runs first, then the fix")


def test_the_shim_leaves_a_replacement_alone_until_activate_is_called():
    """Never fight: a ``shim.disabled()`` block's switch and a later target import do not wrap the
    other patcher's function again; ``shim.activate()`` does, as asked."""
    import transformers.trainer  # noqa: F401  (a target module of the same patch, imported after)
    import trl.models.utils

    with applied(patchers.unsloth_trl_disable_gradient_checkpointing_noop, before_the_shim=False) as handle:
        with shim.disabled("checkpointing-call-signature"):
            pass
        assert trl.models.utils.disable_gradient_checkpointing is handle.replacement
        shim.activate()
        assert shim.wrappers(trl.models.utils.disable_gradient_checkpointing)[0][0] == "checkpointing-call-signature"
        shim.deactivate()  # the shim's layers come off, the patcher's object stays
        assert trl.models.utils.disable_gradient_checkpointing is handle.replacement
        handle.undo()
        shim.activate()
    assert [name for name, _ in shim.wrappers(DISABLE)] == ["checkpointing-call-signature"]
    assert not [record for record in shim.status() if record.others]


IMPORT_ORDER = """
import json
import trl.models.utils
if {before}:
    from tests.coexistence import patchers
    patchers.unsloth_trl_disable_gradient_checkpointing_noop()
import shim
if not {before}:
    from tests.coexistence import patchers
    patchers.unsloth_trl_disable_gradient_checkpointing_noop()
record = next(s for s in shim.status() if s.name == "checkpointing-call-signature")
print(json.dumps({{"state": record.state, "others": sorted({{o["relation"] for o in record.others}})}}))
"""


@pytest.mark.parametrize("before", [True, False], ids=["patcher, then import shim", "import shim, then patcher"])
def test_the_literal_import_orders_say_the_same(before):
    out = json.loads(run_python(IMPORT_ORDER.format(before=before), torch_first=True).stdout.splitlines()[-1])
    assert out == ({"state": "applied", "others": ["below"]} if before else {"state": "failed", "others": ["bypassed"]})
