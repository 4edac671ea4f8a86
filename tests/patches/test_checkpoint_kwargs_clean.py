"""checkpoint-kwargs-clean: every_n_layers/offload/selective inside the kwargs never reach torch.utils.checkpoint."""

import importlib.util
import logging

import pytest
import torch

import shim
from tests.patches.checkpointing_cases import ENABLE, checkpoint_kwargs, configure, layer_flags, supports, tiny_llama

HAS_TRL = importlib.util.find_spec("trl") is not None


def training_step(model):
    model.train()
    ids = torch.arange(1, 9).reshape(2, 4)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
@pytest.mark.skipif(not supports("every_n_layers"), reason="version rule: every_n_layers exists from transformers 5.16")
def test_reentrant_step_after_trl_passed_every_n_layers_back():
    from trl.models.utils import disable_gradient_checkpointing

    if disable_gradient_checkpointing is None:  # pragma: no cover
        pytest.skip("version rule: disable_gradient_checkpointing exists from trl 0.26")
    # What TrainingArguments still holds after the Trainer popped the keys from a copy.
    training_args_kwargs = {"use_reentrant": True, "every_n_layers": 2}

    def run():
        model = tiny_llama()
        configure(model, {"use_reentrant": True}, every_n_layers=2)
        with disable_gradient_checkpointing(model, training_args_kwargs):
            pass
        return model

    with shim.disabled():
        model = run()
        with pytest.raises(ValueError, match="Unexpected keyword arguments: every_n_layers"):
            training_step(model)

    model = run()
    training_step(model)
    assert layer_flags(model) == [True, False, True, False]
    assert checkpoint_kwargs(model) == {"use_reentrant": True}


def test_selective_key_never_reaches_checkpoint():
    def enable():
        model = tiny_llama()
        getattr(model, ENABLE)({"use_reentrant": True, "selective": False})
        return model

    with shim.disabled():
        assert "selective" in checkpoint_kwargs(enable()), "bug: upstream forwards it"
    model = enable()
    assert checkpoint_kwargs(model) == {"use_reentrant": True}
    training_step(model)


@pytest.mark.skipif(not supports("offload"), reason="version rule: offload exists from transformers 5.17")
def test_offload_in_the_kwargs_becomes_the_parameter():
    def enable():
        model = tiny_llama()
        getattr(model, ENABLE)({"use_reentrant": False, "offload": True})
        return model

    with shim.disabled():
        assert checkpoint_kwargs(enable()) == {"use_reentrant": False, "offload": True}
    model = enable()
    layer = model.model.layers[0]
    assert checkpoint_kwargs(model) == {"use_reentrant": False}
    assert layer._gradient_checkpointing_func.func.__name__ == "checkpoint_func", "the offload closure is installed"


@pytest.mark.skipif(not supports("every_n_layers"), reason="version rule: every_n_layers exists from transformers 5.16")
def test_an_explicit_parameter_wins_over_the_dict():
    model = tiny_llama()
    getattr(model, ENABLE)({"use_reentrant": True, "every_n_layers": 2}, every_n_layers=4)
    assert layer_flags(model) == [True, False, False, False]


def test_kwargs_clean_counts_configurations_it_cleaned(ledger):
    model = tiny_llama()
    configure(model, {"use_reentrant": True})
    assert ledger("checkpoint-kwargs-clean") == (0, "")
    configure(model, {"use_reentrant": True, "selective": False})
    assert ledger("checkpoint-kwargs-clean") == (
        1,
        "took selective out of the checkpointing kwargs of LlamaForCausalLM, which transformers would pass "
        "to torch.utils.checkpoint; every_n_layers/offload became the parameters they are",
    )


def test_selective_set_is_dropped_with_a_warning_unset_without(caplog):
    """``"selective": True`` reaching an enable means trl's wrapper did not run: not silent any more."""
    with caplog.at_level(logging.WARNING, logger="shim"):
        configure(tiny_llama(), {"use_reentrant": False, "selective": False})
        assert caplog.text == ""
        model = tiny_llama()
        configure(model, {"use_reentrant": False, "selective": True})
    assert checkpoint_kwargs(model) == {"use_reentrant": False}
    assert "'selective': True reached the checkpointing enable of LlamaForCausalLM" in caplog.text
    assert "docs/bugs.md#trl-selective-reaches-peft" in caplog.text
