"""ddp-find-unused-for-checkpointing: the Trainer hands DDP find_unused_parameters=False for a PEFT (or any
wrapped) model whose checkpointing is reentrant, and leaves every other decision as upstream takes it.

What DDP then does with the value (``Expected to mark a variable ready only once`` with ``True`` under
reentrant checkpointing) needs two processes: tests/e2e/test_distributed.py trains on two gloo ranks.
"""

import importlib.util
import tempfile
import warnings

import pytest
import transformers

import shim
from shim import effects
from shim.patches.ddp_find_unused_for_checkpointing import NAME, ddp_decision, model_wrapper_class
from tests.checkpointing_cases import TRANSFORMERS, configure, quietly, tiny_llama

HAS_PEFT = importlib.util.find_spec("peft") is not None
# transformers' enable without kwargs: reentrant on 4.x, non-reentrant from 5.0
DEFAULT_REENTRANT = TRANSFORMERS.major < 5
# From 5.3 the Trainer decides in __init__ (_build_accelerator_args), before train() enables checkpointing.
TRAINER_DECIDES_IN_INIT = TRANSFORMERS.release >= (5, 3)


@pytest.fixture(autouse=True)
def empty_ledger():
    effects.clear()
    yield
    effects.clear()


def decision(model, **training_arguments) -> bool:
    """The find_unused_parameters a Trainer for ``model`` hands DDP on a multi-process run."""
    with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_* names from 5.23
        args = transformers.TrainingArguments(
            output_dir=directory, use_cpu=True, report_to="none", **training_arguments
        )
        trainer = transformers.Trainer(model=model, args=args)
        return ddp_decision(trainer)


def upstream_and_shim(make_model, **training_arguments) -> tuple[bool, bool]:
    with shim.disabled(NAME):
        upstream = decision(make_model(), **training_arguments)
    return upstream, decision(make_model(), **training_arguments)


def peft_model():
    from peft import LoraConfig, get_peft_model

    # peft reads the deprecated is_gradient_checkpointing on transformers >= 5.23
    return quietly(get_peft_model, tiny_llama(layers=2), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))


def count() -> tuple[int, str]:
    record = next(s for s in shim.status() if s.name == NAME)
    return record.effects, record.last_effect


def test_self_check_shows_the_bug_upstream_and_not_with_the_patch():
    patch = shim.registry.patch(NAME)
    with shim.disabled(NAME):
        assert patch.self_check() is True
    assert patch.self_check() is False


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed")
def test_peft_model_with_reentrant_checkpointing_gets_false():
    upstream, fixed = upstream_and_shim(
        peft_model, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    assert upstream is True, "bug: a PeftModel is no PreTrainedModel, so upstream chooses True"
    assert fixed is False
    assert count()[0] == 1
    expected = "the checkpointing the Trainer will enable" if TRAINER_DECIDES_IN_INIT else "its checkpointing"
    assert count()[1] == (
        f"the Trainer chose find_unused_parameters=True for PeftModel (not a PreTrainedModel) although {expected} "
        "is reentrant, which DDP fails on ('Expected to mark a variable ready only once'); the shim chose False"
    )


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed")
@pytest.mark.parametrize(
    "checkpoint_kwargs, reentrant",
    [
        (None, DEFAULT_REENTRANT),
        ({"use_reentrant": False}, False),
        ({"preserve_rng_state": False}, True),  # no use_reentrant bound: torch's default, reentrant
    ],
    ids=["transformers default", "non-reentrant", "torch default"],
)
def test_peft_model_follows_the_reentrancy_training_runs_with(checkpoint_kwargs, reentrant):
    upstream, fixed = upstream_and_shim(
        peft_model, gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpoint_kwargs
    )
    assert upstream is True
    assert fixed is (not reentrant)
    assert count()[0] == (1 if reentrant else 0)


def test_a_wrapped_model_checkpointing_before_the_trainer_is_read_through_the_wrapper():
    def wrapped_reentrant():
        model = tiny_llama(layers=2)
        quietly(configure, model, {"use_reentrant": True})
        return model_wrapper_class()(model)

    assert upstream_and_shim(wrapped_reentrant) == (True, False)


def test_a_model_without_checkpointing_keeps_true():
    assert upstream_and_shim(lambda: model_wrapper_class()(tiny_llama(layers=2))) == (True, True)
    assert count() == (0, "")


def test_the_users_setting_wins():
    def wrapped_reentrant():
        model = tiny_llama(layers=2)
        quietly(configure, model, {"use_reentrant": True})
        return model_wrapper_class()(model)

    assert upstream_and_shim(wrapped_reentrant, ddp_find_unused_parameters=True) == (True, True)
    assert count() == (0, "")


def test_a_pretrained_model_keeps_upstreams_false():
    assert upstream_and_shim(
        lambda: tiny_llama(layers=2), gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
    ) == (False, False)
    assert count() == (0, "")
