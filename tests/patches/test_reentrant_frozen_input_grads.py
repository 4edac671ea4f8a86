"""reentrant-frozen-input-grads: under reentrant checkpointing, a layer whose inputs are all frozen
still gives its trainable parameters (and every layer after it) their gradients.

Each bug test shows upstream losing the gradients with the patch off, then gradients equal to a
run without checkpointing with it on.
"""

import contextlib
import functools
import warnings

import pytest
import torch
import transformers
import transformers.modeling_layers
import transformers.modeling_utils  # noqa: F401  (the target module: the patch applies when it is imported)
from torch.utils.checkpoint import checkpoint

import shim
from shim import runtime as effects
from shim.checkpointing import is_reentrant
from tests.engine_state import shim_wrapper
from tests.steps import enable_checkpointing, trainable_grads, wrong_grads
from tests.tinymodels import frozen_input_llama


def checkpointing_layers(model) -> list:
    """The model's ``GradientCheckpointingLayer`` modules, in order."""
    return [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]


NAME = "reentrant-frozen-input-grads"
KEYWORDS = "reentrant-keyword-grads"  # stacked on the same method


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        # torch's "None of the inputs have requires_grad=True" is the bug (or a frozen layer) speaking
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_* names from 5.23
        yield


def frozen_vit(device: str = "cpu"):
    """A ViT classifier with frozen embeddings and a frozen first layer (the measured case), on ``device``."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=8,
        patch_size=4,
        num_labels=3,
    )
    model = transformers.ViTForImageClassification(config)
    model.to(device).train()
    model.vit.embeddings.requires_grad_(False)
    checkpointing_layers(model)[0].requires_grad_(False)
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)).to(device)
    labels = torch.tensor([0, 1], device=device)
    return model, lambda m: m(pixel_values=pixels, labels=labels).loss


def reference_and_checkpointed(model, loss_of, kwargs, *off):
    """Gradients without checkpointing, then with checkpointing and patches ``off`` switched off."""
    reference = trainable_grads(model, loss_of)
    enable_checkpointing(model, kwargs)
    with switched_off(*off):
        checkpointed = trainable_grads(model, loss_of)
    return reference, checkpointed


def switched_off(*names):
    """``shim.disabled(*names)``, or nothing at all for no names (not "every patch")."""
    return shim.disabled(*names) if names else contextlib.nullcontext()


def test_patch_is_applied_and_stacked_with_reentrant_keyword_grads():
    assert shim.registry.is_on(NAME) and shim.registry.is_on(KEYWORDS)
    slot = transformers.modeling_layers.GradientCheckpointingLayer._gradient_checkpointing_func
    assert shim_wrapper(slot, NAME) is not None
    assert shim_wrapper(slot, KEYWORDS) is not None


@pytest.mark.autocast
@pytest.mark.parametrize("build", [frozen_vit, frozen_input_llama], ids=["vit", "llama-inputs-embeds"])
def test_frozen_inputs_keep_the_trainable_gradients(build, device):
    model, loss_of = build(device=device.type)
    with device.autocast():
        reference, upstream = reference_and_checkpointed(model, loss_of, {"use_reentrant": True}, NAME)
    lost = wrong_grads(reference, upstream, **device.tolerance())
    assert all(upstream[name] is None for name in lost)
    # measured on 4.57.6 … 5.24.0: ViT 32 of 36, the 3-layer Llama 18 of 20
    assert len(lost) == {"ViTForImageClassification": 32, "LlamaForCausalLM": 18}[type(model).__name__], lost

    before = effects.count(NAME)
    with device.autocast():
        patched = trainable_grads(model, loss_of)
    assert wrong_grads(reference, patched, **device.tolerance()) == []
    assert effects.count(NAME) == before + 1, "one diverted layer call: the first trainable layer"


def test_outputs_and_requires_grad_flags_are_upstream_s():
    model, loss_of = frozen_input_llama()
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    enable_checkpointing(model, {"use_reentrant": True})
    seen = []
    hook = checkpointing_layers(model)[1].register_forward_hook(lambda m, i, out: seen.append(out))
    with shim.disabled(NAME):
        upstream = loss_of(model).detach()
    patched = loss_of(model)
    hook.remove()
    torch.testing.assert_close(patched.detach(), upstream, rtol=0, atol=0)
    first = [out[0] if isinstance(out, tuple) else out for out in seen]
    torch.testing.assert_close(first[1].detach(), first[0].detach(), rtol=0, atol=0)
    assert [out.requires_grad for out in first] == [False, True], "layer 1's output is in the graph again"
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags


@pytest.mark.parametrize("reentrant", [False, None], ids=["non-reentrant", "transformers-default"])
def test_non_reentrant_checkpointing_is_left_alone(reentrant):
    model, loss_of = frozen_input_llama()
    kwargs = None if reentrant is None else {"use_reentrant": reentrant}
    reference = trainable_grads(model, loss_of)
    enable_checkpointing(model, kwargs)
    function = checkpointing_layers(model)[1]._gradient_checkpointing_func
    if is_reentrant(function):
        pytest.skip("version rule: transformers 4.57 builds a reentrant function by default")
    before = effects.count(NAME)
    with shim.disabled(NAME):
        upstream = trainable_grads(model, loss_of)
    patched = trainable_grads(model, loss_of)
    assert wrong_grads(reference, upstream) == [] and wrong_grads(reference, patched) == []
    assert effects.count(NAME) == before


def test_a_layer_with_nothing_to_train_is_left_alone():
    # Every decoder layer frozen: their outputs rightly need no gradient, and an anchor would make
    # torch's backward raise "none of output has requires_grad=True".
    model, loss_of = frozen_input_llama()
    for layer in checkpointing_layers(model):
        layer.requires_grad_(False)
    reference = trainable_grads(model, loss_of)
    enable_checkpointing(model, {"use_reentrant": True})
    before = effects.count(NAME)
    patched = trainable_grads(model, loss_of)
    assert wrong_grads(reference, patched) == [] and set(patched) == {"model.norm.weight", "lm_head.weight"}
    assert effects.count(NAME) == before


def test_no_grad_and_eval_calls_are_left_alone():
    model, loss_of = frozen_input_llama()
    enable_checkpointing(model, {"use_reentrant": True})
    before = effects.count(NAME)
    with torch.no_grad():
        assert not loss_of(model).requires_grad
    model.eval()  # eval: no checkpointing, so the layers' parameters are in the graph as usual
    reference = trainable_grads(model, loss_of)
    assert all(grad is not None for grad in reference.values())
    assert effects.count(NAME) == before


class ConditionalAdapter(transformers.modeling_layers.GradientCheckpointingLayer):
    """A frozen layer with a trainable adapter it uses only when asked (a conditional adapter, an
    idle expert): a call without it leaves every trainable parameter of the layer unused."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(4, 4).requires_grad_(False)
        self.adapter = torch.nn.Linear(4, 4)

    def forward(self, x, use_adapter=False):
        out = self.base(x)
        return out + self.adapter(x) if use_adapter else out


@pytest.mark.parametrize("use_adapter", [False, True], ids=["adapter-unused", "adapter-used"])
def test_an_anchored_call_that_leaves_the_trainable_parameters_unused_still_backpropagates(use_adapter):
    def step(checkpointing):
        torch.manual_seed(0)
        layer, head = ConditionalAdapter(), torch.nn.Linear(4, 1)
        layer.train()
        if checkpointing:
            transformers.PreTrainedModel._set_gradient_checkpointing(
                layer, enable=True, gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=True)
            )
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))  # frozen input
        head(layer(x, use_adapter=use_adapter)).sum().backward()
        return {name: p.grad for name, p in [*layer.named_parameters(), *head.named_parameters()] if p.requires_grad}

    reference = step(checkpointing=False)
    with shim.disabled(NAME):
        upstream = step(checkpointing=True)  # upstream runs: nothing reaches the checkpoint in backward
    patched = step(checkpointing=True)  # the anchor must not make torch's backward raise
    for name, expected in reference.items():
        assert (patched[name] is None) == (expected is None), name
        if expected is not None:
            torch.testing.assert_close(patched[name], expected, msg=name)
    if use_adapter:
        assert upstream["adapter.weight"] is None, "bug: upstream loses the adapter's gradient"
    else:
        assert upstream["adapter.weight"] is None and patched["adapter.weight"] is None


def keyword_frozen_input_grads(model, embeds, ids):
    """Layers called with ``hidden_states=`` as a keyword on frozen ``inputs_embeds``: layer 1 of a
    model whose layer 0 is frozen gets no input that requires grad (this patch), the layers after it
    a keyword tensor that does (``reentrant-keyword-grads``)."""

    def loss_of(m):
        inner = m.model
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        position_embeddings = inner.rotary_emb(embeds, positions)
        hidden = embeds
        for layer in inner.layers:
            out = layer(hidden_states=hidden, position_ids=positions, position_embeddings=position_embeddings)
            hidden = out[0] if isinstance(out, tuple) else out
        logits = m.lm_head(inner.norm(hidden))
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return loss_of


def test_composes_with_reentrant_keyword_grads():
    model, _ = frozen_input_llama(layers=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        embeds = model.model.embed_tokens(ids)
    loss_of = keyword_frozen_input_grads(model, embeds, ids)
    reference = trainable_grads(model, loss_of)
    enable_checkpointing(model, {"use_reentrant": True})
    wrong = {}
    for off in [(NAME, KEYWORDS), (NAME,), (KEYWORDS,), ()]:
        with switched_off(*off):
            wrong[off] = wrong_grads(reference, trainable_grads(model, loss_of))
    # layer 1: no input requires grad (this patch); layers 2, 3: their input does, by keyword
    # (reentrant-keyword-grads). A layer whose output is cut off loses every gradient before it too.
    assert {off: wrong_layers(names) for off, names in wrong.items()} == {
        (NAME, KEYWORDS): [1, 2, 3],  # upstream
        (NAME,): [1, 2, 3],  # the keyword fix alone: layer 1 cuts the graph, nothing is left to lift
        (KEYWORDS,): [1, 2],  # this fix alone: layer 2 cuts it (keyword input); layer 3 is anchored
        (): [],  # both: every gradient as without checkpointing
    }


def wrong_layers(names) -> list:
    """The decoder layer indices among parameter names; every wrong name must be a layer's."""
    assert all(name.startswith("model.layers.") for name in names), names
    return sorted({int(name.split(".")[2]) for name in names})


def test_effect_is_described():
    model, loss_of = frozen_input_llama()
    enable_checkpointing(model, {"use_reentrant": True})
    trainable_grads(model, loss_of)
    record = next(s for s in shim.status() if s.name == NAME)
    assert record.effects >= 1 and "LlamaDecoderLayer" in record.last_effect
