"""The pack's own test: run it where the pack is installed (pip install . && pytest). The bug with the
patch off, then fixed with it on, on the installed transformers."""

import os

import pytest
import transformers.trainer
from shim_example_pack.fixes import NAME, STATE

import shim


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
        assert shim.registry.patch(NAME).self_check() is True
    assert get_last_checkpoint(output_dir) == os.path.join(output_dir, "checkpoint-10")
    assert shim.registry.patch(NAME).self_check() is False


def test_the_trainer_gets_the_fix_and_a_finished_checkpoint_is_upstreams(output_dir):
    assert transformers.trainer.get_last_checkpoint is transformers.trainer_utils.get_last_checkpoint
    with open(os.path.join(output_dir, "checkpoint-20", STATE), "w") as state:
        state.write("{}")  # the save finished after all: upstream's answer stands
    assert get_last_checkpoint(output_dir) == os.path.join(output_dir, "checkpoint-20")


def test_pyproject_lists_the_target_modules():
    """`python -m shim pack-index --check`: the target modules pyproject.toml lists are the patches' own."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-m", "shim", "pack-index", "--check", root], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
