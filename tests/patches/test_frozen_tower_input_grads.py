"""frozen-tower-input-grads: enabling checkpointing no longer drags a frozen vision tower into backward.

Each bug test shows upstream (patch off) making the frozen tower's output require grad and running
backward through its blocks, then the patch leaving the tower out with gradients bit-identical.
"""

import contextlib
import copy
import gc
import weakref

import pytest
import torch
import transformers
import transformers.modeling_utils  # noqa: F401  (the target module: the patch applies when it is imported)

import shim
from shim import runtime as effects
from shim.patches._checkpointing_calls import disable, enable
from shim.patches.frozen_tower_input_grads import _WhileTrainable
from shim.tools.targets import quiet_transformers
from tests import devices
from tests.engine_state import shim_wrapper
from tests.patches.checkpointing_cases import TRANSFORMERS
from tests.tinymodels import tiny_qwen2_vl, vision_tower

NAME = "frozen-tower-input-grads"
DEDUPE = "input-grad-hook-dedupe"  # stacked on the same method
pytestmark = pytest.mark.skipif(
    TRANSFORMERS.major < 5,
    reason="version rule: 4.x hooks only the model's own input embeddings (the patch's gate is >=5.0)",
)
quiet_transformers()


def step(model, inputs):
    """One forward and backward; what the vision tower did in it and the trainable gradients."""
    tower = vision_tower(model)
    seen = {"tower_output_requires_grad": [], "tower_backward": 0}

    def on_block(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: seen.__setitem__("tower_backward", seen["tower_backward"] + 1))

    def on_tower(module, args, output):
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        if not isinstance(hidden, torch.Tensor):
            hidden = getattr(output, "pooler_output", None) or output.last_hidden_state
        seen["tower_output_requires_grad"].append(hidden.requires_grad)

    handles = [tower.blocks[0].register_forward_hook(on_block), tower.register_forward_hook(on_tower)]
    model.zero_grad(set_to_none=True)
    try:
        model(**inputs).loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return seen, grads


def frozen_tower_model(checkpoint_kwargs=None, device=devices.CPU):
    model, inputs = tiny_qwen2_vl()
    model, inputs = device.put(model), {key: device.put(value) for key, value in inputs.items()}
    vision_tower(model).requires_grad_(False)
    enable(model, checkpoint_kwargs)
    return model, inputs


#: Bit for bit on a CPU; CUDA's atomic adds may sum the language model's gradients in another order.
SAME_GRADS = devices.Tolerances(cpu=(0.0, 0.0), cuda=(1e-5, 1e-7), bf16=(1e-2, 1e-3))


def assert_same_grads(first, second, device=devices.CPU):
    assert first.keys() == second.keys()
    for name in first:
        if device.cuda:
            assert torch.allclose(first[name], second[name], **device.tolerance(SAME_GRADS)), name
        else:
            assert torch.equal(first[name], second[name]), name


def test_patch_is_applied_and_stacked_with_input_grad_hook_dedupe():
    assert shim.registry.is_on(NAME) and shim.registry.is_on(DEDUPE)
    method = transformers.modeling_utils.PreTrainedModel.enable_input_require_grads
    assert shim_wrapper(method, NAME) is not None
    assert shim_wrapper(method, DEDUPE) is not None


@pytest.mark.autocast
@pytest.mark.parametrize("checkpoint_kwargs", [None, {"use_reentrant": True}], ids=["default", "reentrant"])
def test_a_frozen_vision_tower_stays_out_of_backward(checkpoint_kwargs, device):
    with shim.disabled(NAME), device.autocast():
        model, inputs = frozen_tower_model(checkpoint_kwargs, device)
        upstream, upstream_grads = step(model, inputs)
    assert upstream == {"tower_output_requires_grad": [True], "tower_backward": 1}, "bug: backward runs in the tower"
    assert not any(name.startswith(tower_prefix(model)) for name in upstream_grads), "and yields no gradient"

    model, inputs = frozen_tower_model(checkpoint_kwargs, device)
    before = effects.count(NAME)
    with device.autocast():
        patched, patched_grads = step(model, inputs)
    assert patched == {"tower_output_requires_grad": [False], "tower_backward": 0}
    assert_same_grads(patched_grads, upstream_grads, device)
    assert effects.count(NAME) == before + 1


def test_switching_the_patch_off_gives_upstreams_hook_back_at_once():
    model, inputs = frozen_tower_model()  # hooked with the patch on
    with shim.disabled(NAME):
        assert step(model, inputs)[0] == {"tower_output_requires_grad": [True], "tower_backward": 1}
    assert step(model, inputs)[0] == {"tower_output_requires_grad": [False], "tower_backward": 0}


def tower_prefix(model):
    return next(name for name, module in model.named_modules() if module is vision_tower(model)) + "."


def test_a_tower_unfrozen_later_gets_its_hook_back_at_once():
    with shim.disabled(NAME):
        model, inputs = frozen_tower_model()
        vision_tower(model).blocks[1].requires_grad_(True)
        upstream, upstream_grads = step(model, inputs)

    model, inputs = frozen_tower_model()
    step(model, inputs)
    vision_tower(model).blocks[1].requires_grad_(True)  # after enabling checkpointing, no re-enable
    patched, patched_grads = step(model, inputs)
    assert patched == upstream == {"tower_output_requires_grad": [True], "tower_backward": 1}
    assert any(name.startswith(tower_prefix(model)) for name in patched_grads)
    assert_same_grads(patched_grads, upstream_grads)


def test_the_models_own_embeddings_keep_upstreams_hook():
    model, inputs = frozen_tower_model()
    model.get_input_embeddings().requires_grad_(False)
    output = model.get_input_embeddings()(inputs["input_ids"])
    assert output.requires_grad, "the text embeddings' output still requires grad (checkpointed LoRA needs it)"
    hooks = model.get_input_embeddings()._forward_hooks.values()
    assert not any(isinstance(hook, _WhileTrainable) for hook in hooks)


def test_a_text_only_model_keeps_upstreams_hooks_untouched():
    from tests.patches.checkpointing_cases import tiny_llama

    model = tiny_llama()
    enable(model, None)
    hooks = [hook for handle in model._require_grads_hooks for hook in [handle.hooks_dict_ref()[handle.id]]]
    assert hooks and not any(isinstance(hook, _WhileTrainable) for hook in hooks)


def hook_counts(model):
    return [
        len(model.get_input_embeddings()._forward_hooks),
        len(vision_tower(model).get_input_embeddings()._forward_hooks),
    ]


def test_composes_with_input_grad_hook_dedupe_over_cycles():
    def cycles(*off):
        with shim.disabled(*off) if off else contextlib.nullcontext():
            model, _ = frozen_tower_model({"use_reentrant": False})
            counts = []
            for _ in range(3):
                disable(model)
                enable(model, {"use_reentrant": False})
                counts.append(hook_counts(model))
            return model, counts

    _, upstream = cycles(NAME, DEDUPE)
    assert upstream == [[2, 2], [3, 3], [4, 4]], "input-grad-hook-dedupe's bug, on both embeddings"
    model, both = cycles()
    assert both == [[1, 1]] * 3
    tower_hooks = list(vision_tower(model).get_input_embeddings()._forward_hooks.values())
    assert [type(hook) for hook in tower_hooks] == [_WhileTrainable]
    model.disable_input_require_grads()
    assert hook_counts(model) == [0, 0], "upstream's disable removes the replaced hook too"


def test_a_deep_copy_watches_its_own_tower():
    model, inputs = frozen_tower_model()
    clone = copy.deepcopy(model)
    vision_tower(clone).blocks[1].requires_grad_(True)  # the copy's tower only
    assert step(model, inputs)[0]["tower_output_requires_grad"] == [False]
    assert step(clone, inputs)[0]["tower_output_requires_grad"] == [True]


def test_the_hook_does_not_keep_the_model_alive():
    model, inputs = frozen_tower_model()
    step(model, inputs)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_effect_is_described():
    model, inputs = frozen_tower_model()
    step(model, inputs)
    record = next(s for s in shim.status() if s.name == NAME)
    assert record.effects >= 1
    assert "Qwen2VisionTransformerPretrainedModel" in record.last_effect and "Qwen2VL" in record.last_effect
