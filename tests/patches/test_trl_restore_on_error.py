"""trl-restore-on-error: an exception inside trl's unwrap_model_for_generation leaves checkpointing on."""

import importlib.util
import types

import pytest

import shim
from tests.patches.checkpointing_cases import (
    TRANSFORMERS,
    checkpoint_kwargs,
    configure,
    is_checkpointing,
    quietly,
    tiny_llama,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")
NAME = "trl-restore-on-error"
CONFIGURED = {"use_reentrant": TRANSFORMERS.major >= 5, "preserve_rng_state": False}

HAS_TRL = importlib.util.find_spec("trl") is not None


def generate_and_fail(model, **extra):
    import accelerate
    from trl.models.utils import unwrap_model_for_generation

    accelerator = accelerate.Accelerator(cpu=True)
    with pytest.raises(RuntimeError, match="generation failed"):
        with unwrap_model_for_generation(model, accelerator, **extra):
            assert not quietly(is_checkpointing, model)
            raise RuntimeError("generation failed")


@pytest.mark.parametrize("pass_kwargs", [False, True], ids=["no kwargs", "with kwargs"])
def test_exception_in_generation_leaves_checkpointing_restored(pass_kwargs):
    import inspect

    from trl.models.utils import unwrap_model_for_generation

    if pass_kwargs and "gradient_checkpointing_kwargs" not in inspect.signature(unwrap_model_for_generation).parameters:
        pytest.skip("version rule: unwrap_model_for_generation takes gradient_checkpointing_kwargs from trl 1.16")
    extra = {"gradient_checkpointing_kwargs": CONFIGURED} if pass_kwargs else {}

    model = tiny_llama()
    configure(model, CONFIGURED)
    with shim.disabled():
        generate_and_fail(model, **extra)
    assert not is_checkpointing(model), "bug: upstream leaves checkpointing off"

    model = tiny_llama()
    configure(model, CONFIGURED)
    generate_and_fail(model, **extra)
    assert is_checkpointing(model)
    assert checkpoint_kwargs(model) == CONFIGURED


def test_the_normal_path_is_trls_own():
    import accelerate
    from trl.models.utils import unwrap_model_for_generation

    model = tiny_llama()
    configure(model, CONFIGURED)
    with unwrap_model_for_generation(model, accelerate.Accelerator(cpu=True)) as unwrapped:
        assert unwrapped is model and not is_checkpointing(model)
    assert checkpoint_kwargs(model) == CONFIGURED


def test_zero3_hooks_removed_for_generation_are_added_back_after_an_error(monkeypatch):
    """trl's add_hooks is called for an engine whose forward hooks remove_hooks emptied."""
    import trl.models.utils as trl_utils

    from shim.patches.trl_restore_on_error import _RestoreOnError

    added = []
    monkeypatch.setattr(trl_utils, "add_hooks", lambda engine: added.append(engine))
    offload = types.SimpleNamespace(forward_hooks=[], _register_deepspeed_module=lambda module: None)
    engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(parameter_offload=offload))
    accelerator = types.SimpleNamespace(
        unwrap_model=lambda model: types.SimpleNamespace(is_activation_checkpointing=False)
    )

    class Failing:
        def __enter__(self):
            return engine

        def __exit__(self, *exc):
            return False

    context = _RestoreOnError(Failing(), engine, accelerator, gather=True, checkpoint_kwargs=None)
    with pytest.raises(RuntimeError):
        with context:
            raise RuntimeError("generation failed")
    assert added == [engine]

    offload.forward_hooks.append("hook")  # hooks in place: nothing to add
    with pytest.raises(RuntimeError):
        with _RestoreOnError(Failing(), engine, accelerator, gather=True, checkpoint_kwargs=None):
            raise RuntimeError("generation failed")
    assert added == [engine]


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
def test_trl_restore_on_error_counts_the_restore_after_an_exception(ledger):
    import accelerate
    from trl.models.utils import unwrap_model_for_generation

    model = tiny_llama()
    configure(model, {"use_reentrant": False})
    accelerator = accelerate.Accelerator(cpu=True)
    with unwrap_model_for_generation(model, accelerator):
        pass
    assert ledger("trl-restore-on-error") == (0, "")
    with pytest.raises(KeyError):
        with unwrap_model_for_generation(model, accelerator):
            raise KeyError("bad sample")
    assert ledger("trl-restore-on-error") == (
        1,
        "KeyError raised inside trl's unwrap_model_for_generation on LlamaForCausalLM, which trl leaves "
        "without checkpointing; the shim re-enabled gradient checkpointing",
    )
