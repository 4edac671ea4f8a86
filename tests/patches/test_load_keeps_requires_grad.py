"""load-keeps-requires-grad on the installed transformers: loading must not unfreeze parameters.

Every test first shows the bug with the patch switched off, then the fix with it on.
"""

import tempfile

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

import shim
from shim.patches.load_keeps_requires_grad import requires_grad_map
from shim.tools.targets import quiet_transformers
from tests.patches.checkpointing_cases import TRANSFORMERS
from tests.tinymodels import frozen_llama_class, tiny_llama_config

NAME = "load-keeps-requires-grad"
pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.0"),
    reason="version rule: the load bug exists from transformers 5.0 (4.x loads with load_state_dict(assign=True))",
)
quiet_transformers()


def round_trip(model_class, model, save_model=None):
    """Save ``save_model`` (default: ``model``) and load it back as ``model_class``, patch off and on."""
    with tempfile.TemporaryDirectory() as directory:
        (save_model or model).save_pretrained(directory)
        with shim.disabled(NAME):
            upstream = model_class.from_pretrained(directory)
        patched = model_class.from_pretrained(directory)
    return upstream, patched


def test_patch_is_applied():
    assert shim.registry.is_on(NAME)


def test_frozen_in_init_stays_frozen():
    model_class = frozen_llama_class()
    model = model_class(tiny_llama_config())
    expected = requires_grad_map(model)
    assert list(expected.values()).count(False) == 10

    upstream, patched = round_trip(model_class, model)

    assert list(requires_grad_map(upstream).values()).count(False) == 0, "bug: upstream unfreezes everything"
    assert requires_grad_map(patched) == expected


def test_frozen_parameter_missing_from_the_checkpoint_stays_frozen():
    class WithFrozenDraftHead(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.draft_head = torch.nn.Linear(config.hidden_size, config.hidden_size)
            self.draft_head.requires_grad_(False)
            self.post_init()

    config = tiny_llama_config()
    expected = requires_grad_map(WithFrozenDraftHead(config))
    # The checkpoint has no draft_head: it is created by transformers' missing-key path.
    upstream, patched = round_trip(WithFrozenDraftHead, None, save_model=transformers.LlamaForCausalLM(config))

    assert upstream.draft_head.weight.requires_grad, "bug: upstream unfreezes the missing parameter"
    assert requires_grad_map(patched) == expected
    assert not patched.draft_head.weight.requires_grad and not patched.draft_head.bias.requires_grad


def test_tied_embeddings_stay_frozen_and_tied():
    class FrozenTiedEmbeddings(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.model.embed_tokens.requires_grad_(False)

    model = FrozenTiedEmbeddings(tiny_llama_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight

    upstream, patched = round_trip(FrozenTiedEmbeddings, model)

    assert upstream.lm_head.weight.requires_grad, "bug: upstream unfreezes tied embeddings"
    assert patched.lm_head.weight is patched.model.embed_tokens.weight
    assert not patched.model.embed_tokens.weight.requires_grad
    assert requires_grad_map(patched) == requires_grad_map(model)


def test_trainable_and_buffers_untouched():
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    _, patched = round_trip(transformers.LlamaForCausalLM, model)
    assert all(requires_grad_map(patched).values())
    assert {n for n, _ in patched.named_buffers()} == {n for n, _ in model.named_buffers()}
    for name, value in model.state_dict().items():
        torch.testing.assert_close(patched.state_dict()[name], value)


_NAMES = list(requires_grad_map(transformers.LlamaForCausalLM(tiny_llama_config())))


@settings(max_examples=12, deadline=None)
@given(mask=st.lists(st.booleans(), min_size=len(_NAMES), max_size=len(_NAMES)).filter(lambda m: not all(m)))
def test_random_freeze_masks_survive_loading(mask):
    frozen = {name for name, trainable in zip(_NAMES, mask) if not trainable}

    class Masked(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            for name, parameter in self.named_parameters():
                parameter.requires_grad_(name not in frozen)

    model = Masked(tiny_llama_config())
    upstream, patched = round_trip(Masked, model)

    assert all(requires_grad_map(upstream).values()), "bug: upstream unfreezes every masked parameter"
    assert requires_grad_map(patched) == requires_grad_map(model)


@pytest.mark.skipif(TRANSFORMERS.major < 5, reason="version rule: loading resets requires_grad from transformers 5.0")
def test_load_counts_each_parameter_kept_frozen(ledger):
    model_class = frozen_llama_class()
    model = model_class(tiny_llama_config())
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        transformers.LlamaForCausalLM.from_pretrained(directory)  # nothing frozen: nothing to keep
        assert ledger("load-keeps-requires-grad") == (0, "")
        model_class.from_pretrained(directory)
    frozen = sum(1 for p in model.parameters() if not p.requires_grad)
    assert ledger("load-keeps-requires-grad") == (
        frozen,
        f"kept {frozen} parameter(s) of FrozenBaseLlama frozen that transformers {transformers.__version__} "
        "made trainable while loading",
    )


def test_the_frozen_parameters_are_noted_once_per_load(monkeypatch):
    """The loader hands every call of one load the same fourth argument (``loading_info`` from 5.2x,
    a set of mismatched keys before): the frozen names are noted once per load, and every other
    tensor goes straight to upstream. An argument that takes no weak reference (a dict) leaves each
    call to look at its own slot, with no walk of the model."""
    from shim.patches import load_keeps_requires_grad as patch
    from tests.tinymodels import tiny_llama

    walks = []
    original = patch._frozen_names
    monkeypatch.setattr(patch, "_frozen_names", lambda model: walks.append(1) or original(model))
    model = tiny_llama(2)
    model.model.layers[0].requires_grad_(False)
    names = [name for name, _parameter in model.named_parameters()]
    passed = []

    def upstream(*args, **kwargs):
        passed.append(args[1])

    class LoadInfo:  # what transformers' LoadStateDictInfo is to the patch: an object of one load
        pass

    for load in (LoadInfo(), set(), {}):
        for name in names:
            patch._set_param_for_module(upstream, None, (model, name, None, load, None), {})
    assert walks == [1, 1], "once per load; none where the load cannot be told"
    assert passed == names * 3
