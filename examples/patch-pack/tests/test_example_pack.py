"""The pack's own test: run it where the pack is installed (pip install . && pytest). The bug with the
patch off, then fixed with it on, on the installed transformers."""

import os

import pytest
import transformers.trainer
from shim_example_pack.fixes import NAME, STATE

import shim


def bug_found(name: str) -> bool:
    """Whether the patch's bug probe finds its bug now, as ``python -m shim doctor`` asks it."""
    return any(probe.ask().present for probe in shim.registry.patch(name).probes)


def get_last_checkpoint(folder):
    """transformers' function as the Trainer calls it: looked up when called (this module is imported
    before the shim has applied the pack, so a name imported at its top would be upstream's)."""
    return transformers.trainer_utils.get_last_checkpoint(folder)


@pytest.fixture
def output_dir(tmp_path):
    """A Trainer's output folder: checkpoint-10 saved whole, checkpoint-20 cut short by a kill."""
    for step in (10, 20):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-10" / STATE).write_text("{}")
    return str(tmp_path)


def test_the_shim_applies_the_pack_patch():
    (status,) = [s for s in shim.status() if s.name == NAME]
    assert status.state == "applied", status.reason
    assert status.provider == "shim-example-pack"


def test_the_bug_shows_with_the_patch_off_and_not_with_it_on(output_dir):
    with shim.disabled(NAME):
        assert get_last_checkpoint(output_dir) == os.path.join(output_dir, "checkpoint-20")
        assert bug_found(NAME) is True
    assert get_last_checkpoint(output_dir) == os.path.join(output_dir, "checkpoint-10")
    assert bug_found(NAME) is False


def test_the_trainer_gets_the_fix_and_a_finished_checkpoint_is_upstreams(output_dir):
    assert transformers.trainer.get_last_checkpoint is transformers.trainer_utils.get_last_checkpoint
    with open(os.path.join(output_dir, "checkpoint-20", STATE), "w") as state:
        state.write("{}")  # the save finished after all: upstream's answer stands
    assert get_last_checkpoint(output_dir) == os.path.join(output_dir, "checkpoint-20")


def test_pyproject_lists_the_target_modules():
    """`python -m shim index --check`: the target modules pyproject.toml lists are the patches' own."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "shim", "index", "--check", root], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- example-checkpoint-keeps-dropout-masks: a step on the checkpointing path ---------------------------


def test_dropout_masks_are_replayed_with_the_patch_on_and_not_with_it_off():
    from shim_example_pack.dropout_masks import NAME as DROPOUT

    with shim.disabled(DROPOUT):
        assert bug_found(DROPOUT) is True, "upstream: the gradients are not the loss's"
    assert bug_found(DROPOUT) is False


def test_a_layer_that_does_not_drop_out_keeps_its_choice_and_the_layer_pickles_as_torchs():
    import functools
    import pickle

    import torch
    from shim_example_pack.dropout_masks import NAME as DROPOUT
    from transformers import LlamaConfig, LlamaForCausalLM

    options = {"use_reentrant": False, "preserve_rng_state": False}
    for dropout, kept in ((0.0, False), (0.1, True)):
        config = LlamaConfig(
            vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, attention_dropout=dropout,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        before = shim.registry.status()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        held = model.model.layers[0].__dict__["_gradient_checkpointing_func"]
        assert type(held) is functools.partial and held.func is torch.utils.checkpoint.checkpoint
        assert held.keywords == {"use_reentrant": False, "preserve_rng_state": kept}
        effects = {s.name: s.effects for s in shim.registry.status()}[DROPOUT]
        assert effects == {s.name: s.effects for s in before}[DROPOUT] + int(kept)
        copy = pickle.loads(pickle.dumps(model.model.layers[0]))
        assert copy.__dict__["_gradient_checkpointing_func"].keywords == held.keywords
