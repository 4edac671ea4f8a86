"""After a disable/enable cycle, training through the restored checkpointing gives the right gradients.

Compared on the weights inside the checkpointed decoder layers (the embeddings get gradients by
another path), against the same model trained without checkpointing.
"""

import copy

import pytest
import torch

import shim
from tests import devices
from tests.patches.checkpointing_cases import DISABLE, ENABLE, TRANSFORMERS, checkpoint_kwargs, configure, tiny_llama


def layer_gradients(model, device) -> dict:
    model.train()
    ids = device.put(torch.arange(1, 13).reshape(2, 6))
    model.zero_grad()
    with device.autocast():
        model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if ".layers." in name}


#: rtol 1e-4, atol 1e-6 on a CPU, as measured there
TOLERANCE = devices.Tolerances(cpu=(1e-4, 1e-6), cuda=(1e-4, 1e-5), bf16=devices.GRADIENTS.bf16)


def compare(model, reference, device=devices.CPU) -> list:
    wrong = []
    expected = layer_gradients(reference, device)
    for name, grad in layer_gradients(model, device).items():
        if grad is None or not torch.allclose(grad, expected[name], **device.tolerance(TOLERANCE)):
            wrong.append(name)
    return wrong


@pytest.mark.autocast
@pytest.mark.parametrize(
    "configured", [{"use_reentrant": True}, {"use_reentrant": False}], ids=["reentrant", "non-reentrant"]
)
def test_layer_gradients_match_no_checkpointing_after_a_cycle(configured, device):
    torch.manual_seed(0)
    reference = device.put(tiny_llama(attention_dropout=0.0))
    # Frozen embeddings, as with adapters: only the layers learn.
    reference.get_input_embeddings().requires_grad_(False)

    def cycled(switched_off: bool):
        model = copy.deepcopy(reference)
        if configured["use_reentrant"] and TRANSFORMERS.major < 5:
            # Reentrant with frozen embeddings needs the input-grad hook; 5.x adds it on enable, 4.x does not.
            model.enable_input_require_grads()
        configure(model, configured)
        getattr(model, DISABLE)()
        if switched_off:
            with shim.disabled():
                getattr(model, ENABLE)()
        else:
            getattr(model, ENABLE)()
        return model

    upstream = cycled(switched_off=True)
    default = {"use_reentrant": TRANSFORMERS.major < 5}
    if configured != default:
        assert checkpoint_kwargs(upstream) == default, "bug: upstream re-enables with the default"
    if TRANSFORMERS.major < 5 and not configured["use_reentrant"]:
        # 4.x adds no input-grad hook, so the flip to reentrant silently drops every layer gradient
        # (upstream's step, all of it: reentrant-frozen-input-grads would give them back).
        with shim.disabled():
            lost = compare(upstream, reference, device)
        assert lost != [], "bug: upstream's flipped re-enable loses layer gradients"

    patched = cycled(switched_off=False)
    assert checkpoint_kwargs(patched) == configured
    assert compare(patched, reference, device) == []
