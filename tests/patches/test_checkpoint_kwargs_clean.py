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


# -- option values that are not what the parameter takes ---------------------------------------------


def enabled_with(kwargs):
    """A 4-layer tiny Llama enabled with ``kwargs`` as the checkpointing kwargs, and one training step."""
    model = tiny_llama()
    getattr(model, ENABLE)(kwargs)
    training_step(model)
    return model


def warnings_naming(caplog, key, value) -> list:
    """The shim's warnings that name ``key``, ``repr(value)`` and the patch."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "shim"
        and record.levelno == logging.WARNING
        and all(part in record.getMessage() for part in (key, repr(value), "checkpoint-kwargs-clean"))
    ]


def offloads(model) -> bool:
    """Whether the layers checkpoint through transformers' offload closure (``checkpoint_func``)."""
    function = model.model.layers[0]._gradient_checkpointing_func
    return getattr(function, "func", function).__name__ == "checkpoint_func"


@pytest.mark.skipif(not supports("offload"), reason="version rule: offload exists from transformers 5.17")
def test_an_offload_value_that_is_not_a_boolean_is_ignored_with_a_warning(caplog):
    """``{"use_reentrant": False, "offload": "no"}``: upstream passes the key on to the layer's
    forward, which ignores it, and trains without offload. Today's shim makes it the parameter, and
    ``"no"`` is true: offload on, and on CPU the first step fails (``RuntimeError: pin_memory=True
    requires a CUDA or other accelerator backend``). With the fix: no offload, the step trains, and a
    warning on the ``shim`` logger names the value, the patch and what to pass (``True`` or ``False``)."""
    kwargs = {"use_reentrant": False, "offload": "no"}
    with shim.disabled():
        assert not offloads(enabled_with(kwargs)), "upstream ignores it"
    with caplog.at_level(logging.WARNING, logger="shim"):
        model = enabled_with(kwargs)
    assert not offloads(model)
    assert checkpoint_kwargs(model).get("use_reentrant") is False
    warned = warnings_naming(caplog, "offload", "no")
    assert warned and all("True" in message for message in warned), caplog.text


@pytest.mark.skipif(not supports("every_n_layers"), reason="version rule: every_n_layers exists from transformers 5.16")
@pytest.mark.parametrize("value", ["2", 2.0, True, 0], ids=["str", "float", "bool", "zero"])
def test_an_every_n_layers_value_that_is_not_a_positive_int_is_ignored_with_a_warning(caplog, value):
    """``{"use_reentrant": False, "every_n_layers": value}`` with a value that is no int >= 1: upstream
    passes the key on to the layer's forward, which ignores it, and checkpoints every layer. Today's
    shim makes it the parameter: ``"2"`` raises ``TypeError: unsupported operand type(s) for %: 'int'
    and 'str'``, ``0`` ``ZeroDivisionError``, ``2.0`` checkpoints every other layer, ``True`` every
    layer, all without a word. With the fix: every layer checkpointed, as upstream, the step trains,
    and a warning on the ``shim`` logger names the value, the patch and what to pass (an ``int``)."""
    kwargs = {"use_reentrant": False, "every_n_layers": value}
    with shim.disabled():
        assert layer_flags(enabled_with(kwargs)) == [True] * 4, "upstream ignores it"
    with caplog.at_level(logging.WARNING, logger="shim"):
        model = enabled_with(kwargs)
    assert layer_flags(model) == [True] * 4
    warned = warnings_naming(caplog, "every_n_layers", value)
    assert warned and all("int" in message for message in warned), caplog.text


@pytest.mark.skipif(not supports("offload"), reason="version rule: offload exists from transformers 5.17")
@pytest.mark.parametrize("value", [True, False, 1, 0])
def test_boolean_offload_values_still_become_the_parameter_without_a_warning(caplog, value):
    """``True``/``1`` turn offload on, ``False``/``0`` leave it off, as today, and nothing is warned."""
    with caplog.at_level(logging.WARNING, logger="shim"):
        model = tiny_llama()
        getattr(model, ENABLE)({"use_reentrant": False, "offload": value})
    assert offloads(model) is bool(value)
    assert checkpoint_kwargs(model) == {"use_reentrant": False}
    assert caplog.text == ""


@pytest.mark.skipif(not supports("every_n_layers"), reason="version rule: every_n_layers exists from transformers 5.16")
@pytest.mark.parametrize("value, flags", [(1, [True] * 4), (2, [True, False] * 2), (3, [True, False, False, True])])
def test_positive_int_every_n_layers_values_still_become_the_parameter_without_a_warning(caplog, value, flags):
    with caplog.at_level(logging.WARNING, logger="shim"):
        model = tiny_llama()
        getattr(model, ENABLE)({"use_reentrant": False, "every_n_layers": value})
    assert layer_flags(model) == flags
    assert checkpoint_kwargs(model) == {"use_reentrant": False}
    assert caplog.text == ""
