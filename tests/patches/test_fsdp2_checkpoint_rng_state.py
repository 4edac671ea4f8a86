"""fsdp2-checkpoint-rng-state: FSDP2 activation checkpointing recomputes layers with the forward's RNG state.

Every case runs accelerate's own ``fsdp2_apply_ac`` on a tiny LoRA Llama with dropout active (LoRA dropout
0.3, attention dropout 0.1), with a stand-in accelerator carrying a real FSDP2 plugin (one process, no
process group: ``fsdp2_apply_ac`` only wraps layers), and compares one step's gradients with the same step
without checkpointing. The two-rank run through ``Accelerator.prepare`` is in tests/e2e/test_fsdp2.py.
"""

import functools
import importlib.util
from importlib.metadata import version

import pytest
from packaging.version import Version

import shim
from tests import devices
from tests import steps as tinysteps
from tests import tinymodels as testmodels
from tests.conftest import run_python
from tests.probes import bug_found

NAME = "fsdp2-checkpoint-rng-state"
ACCELERATE = Version(version("accelerate")) if importlib.util.find_spec("accelerate") else Version("0")
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("peft") is None,
        reason="accelerate and peft are needed",
    ),
    pytest.mark.skipif(ACCELERATE < Version("1.8"), reason="version rule: fsdp2_apply_ac exists from accelerate 1.8"),
]


def input_ids(device=devices.CPU):
    import torch

    return device.put(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))


def ledger() -> tuple[int, str | None]:
    record = next(patch for patch in shim.status() if patch.name == NAME)
    return record.effects, record.last_effect


def step(model, device=devices.CPU):
    """One step's gradients, and the RNG state after it (what the next step's dropout draws from: the
    device's generator, CUDA's on CUDA)."""
    import torch

    grads = testmodels.causal_lm_grads(model, input_ids(device))
    return grads, torch.cuda.get_rng_state() if device.cuda else torch.get_rng_state()


def checkpointed(offload=False, device=devices.CPU, **build):
    """The model after accelerate's ``fsdp2_apply_ac``, called as ``Accelerator.prepare`` calls it."""
    from accelerate.utils import fsdp_utils

    model = device.put(testmodels.dropout_llama(**build))
    return fsdp_utils.fsdp2_apply_ac(tinysteps.fsdp2_accelerator(model, offload=offload), model)


def wrappers(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return [module for module in model.modules() if isinstance(module, CheckpointWrapper)]


def reference(device=devices.CPU):
    return step(device.put(testmodels.dropout_llama()), device)


def assert_like_the_uncheckpointed_step(model, expected, device=devices.CPU):
    import torch

    grads, rng = step(model, device)
    assert tinysteps.wrong_grads(expected[0], grads, **device.tolerance()) == []
    assert torch.equal(rng, expected[1]), "the recompute must leave the RNG stream where the forward left it"


def test_checkpointed_gradients_equal_the_uncheckpointed_step(device):
    import torch

    expected = reference(device)
    with shim.disabled(NAME):
        upstream = checkpointed(device=device)
        upstream_grads, upstream_rng = step(upstream, device)
    assert wrappers(upstream) and all(
        w.checkpoint_fn.keywords["preserve_rng_state"] is False for w in wrappers(upstream)
    )
    wrong = tinysteps.wrong_grads(expected[0], upstream_grads, **device.tolerance())
    assert wrong and all(".lora_" in name for name in wrong), "bug: upstream's recompute draws other LoRA masks"
    assert not torch.equal(upstream_rng, expected[1]), "bug: upstream's recompute moves the RNG stream on"

    count, _ = ledger()
    model = checkpointed(device=device)
    assert len(wrappers(model)) == len(wrappers(upstream))
    for wrapper, stock in zip(wrappers(model), wrappers(upstream)):
        function = wrapper.checkpoint_fn
        assert type(function) is functools.partial and function.func is stock.checkpoint_fn.func
        assert function.keywords == {**stock.checkpoint_fn.keywords, "preserve_rng_state": True}
    assert ledger()[0] == count + 1
    assert f"wrapped {len(wrappers(model))} layer(s) of PeftModel " in ledger()[1]
    assert_like_the_uncheckpointed_step(model, expected, device)


def test_attention_dropout_alone_is_fixed_too(device):
    """No PEFT: dropout inside the attention only."""
    expected = step(device.put(testmodels.dropout_llama(lora_dropout=None)), device)
    with shim.disabled(NAME):
        upstream = step(checkpointed(lora_dropout=None, device=device), device)
        assert tinysteps.wrong_grads(expected[0], upstream[0], **device.tolerance()), "bug"
    assert_like_the_uncheckpointed_step(checkpointed(lora_dropout=None, device=device), expected, device)


@pytest.mark.skipif(
    ACCELERATE < Version("1.15"),
    reason="version rule: fsdp2_apply_ac adds offload_wrapper (activation_checkpointing_offload) from accelerate 1.15",
)
def test_activation_checkpointing_offload_still_works_and_is_fixed():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper

    expected = reference()
    with shim.disabled(NAME):
        upstream = checkpointed(offload=True)
        assert tinysteps.wrong_grads(expected[0], step(upstream)[0]), "bug: the offloaded layers are affected too"

    model = checkpointed(offload=True)
    offloaded = [module for module in model.modules() if isinstance(module, OffloadWrapper)]
    assert offloaded and all(type(o._checkpoint_wrapped_module).__name__ == "CheckpointWrapper" for o in offloaded)
    assert all(w.checkpoint_fn.keywords["preserve_rng_state"] is True for w in wrappers(model))
    assert_like_the_uncheckpointed_step(model, expected)


def test_wrappers_that_were_there_before_are_left_alone():
    """A ``CheckpointWrapper`` the user put on the ``lm_head`` with ``preserve_rng_state=False`` stays as it
    was; only the wrappers ``fsdp2_apply_ac`` created change."""
    from accelerate.utils import fsdp_utils
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = testmodels.dropout_llama()
    inner = model.base_model.model
    inner.lm_head = checkpoint_wrapper(inner.lm_head, preserve_rng_state=False)
    users = inner.lm_head
    users_function = users.checkpoint_fn

    count, _ = ledger()
    fsdp_utils.fsdp2_apply_ac(tinysteps.fsdp2_accelerator(model), model)
    assert users.checkpoint_fn is users_function and users_function.keywords["preserve_rng_state"] is False
    created = [wrapper for wrapper in wrappers(model) if wrapper is not users]
    assert created and all(w.checkpoint_fn.keywords["preserve_rng_state"] is True for w in created)
    assert ledger()[0] == count + 1 and f"wrapped {len(created)} layer(s)" in ledger()[1]


def test_a_model_with_no_layer_the_policy_wraps_is_left_alone():
    from accelerate.utils import fsdp_utils

    model = testmodels.dropout_llama()
    modules = dict(model.named_modules())
    count, _ = ledger()
    result = fsdp_utils.fsdp2_apply_ac(tinysteps.fsdp2_accelerator(model, layer_classes=[]), model)

    assert result is model and dict(model.named_modules()) == modules and wrappers(model) == []
    assert ledger()[0] == count, "nothing changed, nothing counted"


def test_the_name_accelerate_binds_early_is_the_patched_one():
    """``Accelerator.prepare`` calls ``accelerate.accelerator.fsdp2_apply_ac``, bound by ``from .utils
    import fsdp2_apply_ac``. Imported after accelerate, the shim rebinds it (``consumers``), and
    deactivating puts upstream's function back; imported first (this process), the name is bound to the
    wrapped function from the start."""
    import accelerate.accelerator
    import accelerate.utils
    from accelerate.utils import fsdp_utils

    assert accelerate.accelerator.fsdp2_apply_ac is fsdp_utils.fsdp2_apply_ac
    assert accelerate.utils.fsdp2_apply_ac is fsdp_utils.fsdp2_apply_ac

    code = """
        import accelerate.accelerator, accelerate.utils
        from accelerate.utils import fsdp_utils
        original = fsdp_utils.fsdp2_apply_ac

        import shim
        record = next(p for p in shim.status() if p.name == "fsdp2-checkpoint-rng-state")
        assert record.state == "applied", record
        patched = fsdp_utils.fsdp2_apply_ac
        assert patched is not original and patched.__wrapped__ is original, "the target is wrapped"
        assert accelerate.accelerator.fsdp2_apply_ac is patched, "rebound in accelerate.accelerator"
        assert accelerate.utils.fsdp2_apply_ac is patched, "rebound in accelerate.utils"

        shim.deactivate()
        assert accelerate.accelerator.fsdp2_apply_ac is original and accelerate.utils.fsdp2_apply_ac is original
        print("ok")
    """
    assert run_python(code, torch_first=True).stdout.strip().endswith("ok")


def test_the_bug_probe_finds_the_bug_with_the_patch_off_only():
    """doctor's check: a torch-only stack of blocks with dropout (no transformers needed)."""

    with shim.disabled(NAME):
        assert bug_found(NAME) is True
    assert bug_found(NAME) is False


def test_the_shape_check_reads_upstreams_function():
    from accelerate.utils import fsdp_utils

    from shim.patches.fsdp2_checkpoint_rng_state import _check

    original = fsdp_utils.fsdp2_apply_ac.__wrapped__
    assert _check(original) is None

    def changed(accelerator, model):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        return checkpoint_wrapper(model)

    def elsewhere(accelerator, model):
        return model

    assert "preserve_rng_state" in _check(changed)
    assert "checkpoint_wrapper" in _check(elsewhere)
    assert "signature changed" in _check(lambda model: model)
