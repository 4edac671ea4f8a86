"""checkpoint-function-finds-layer: a checkpoint function of one's own finds its layer through the
partial it is handed (``func.func.__self__``), as up to transformers 5.22, with identical results.

The bug test runs a LlamaFactory-style function (it checkpoints only layers with a trainable
parameter) with the patch off (AttributeError) and on (gradients equal a run without
checkpointing); transformers' own function is left untouched."""

import functools
import os
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from torch.utils.checkpoint import checkpoint

import shim
from shim import runtime as effects
from shim.checkpointing import LayerCheckpoint
from tests import devices
from tests.steps import (
    enable_checkpointing,
    keyword_driven_grads,
    layer_finding_checkpoint,
    trainable_grads,
    wrong_grads,
)
from tests.tinymodels import tiny_llama

NAME = "checkpoint-function-finds-layer"
from_5_23 = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.23"),
    reason="version rule: the layer hands over partial(forward, layer) from 5.23 (a bound method up to 5.22)",
)


def frozen_first_layer_llama(device=devices.CPU):
    torch.manual_seed(0)
    model = device.put(tiny_llama(3))
    model.train()
    model.model.layers[0].requires_grad_(False)
    return model


def loss_of(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    ids = ids.to(model.device)
    return model(ids, labels=ids).loss


def enable_with(model, function):
    """Checkpointing with a function of one's own, as training frameworks enable it."""
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)


@from_5_23
@pytest.mark.autocast
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_function_that_finds_its_layer_works_and_gives_the_gradients_of_no_checkpointing(reentrant, device):
    model = frozen_first_layer_llama(device)
    with device.autocast():
        reference = trainable_grads(model, loss_of)
    function = layer_finding_checkpoint(functools.partial(checkpoint, use_reentrant=reentrant))
    with shim.disabled(NAME):
        enable_with(model, function)
        with pytest.raises(AttributeError, match="__self__"), device.autocast():
            trainable_grads(model, loss_of)
    before = effects.count(NAME)
    enable_with(model, function)
    assert isinstance(model.model.layers[0]._gradient_checkpointing_func, LayerCheckpoint)
    with device.autocast():
        assert wrong_grads(reference, trainable_grads(model, loss_of), **device.tolerance()) == []
    assert effects.count(NAME) == before + 3, "each layer call handed its layer"
    assert "LlamaDecoderLayer" in effects.last(NAME)


@from_5_23
def test_the_function_sees_the_layer_and_the_keywords_as_up_to_5_22():
    model = frozen_first_layer_llama()
    seen = []

    def inspecting(func, *args, **kwargs):
        seen.append((func.func.__self__, set(func.keywords), func.args))
        return checkpoint(func, *args, use_reentrant=False, **kwargs)

    enable_with(model, inspecting)
    loss_of(model).backward()
    assert [layer for layer, _, _ in seen] == list(model.model.layers)
    # and as upstream hands it from 5.23: the layer first in func.args
    assert all("position_embeddings" in keywords and args == (layer,) for layer, keywords, args in seen)


@from_5_23
def test_transformers_own_function_is_left_as_it_is():
    for kwargs in ({"use_reentrant": False}, None):
        model = frozen_first_layer_llama()
        reference = trainable_grads(model, loss_of)
        enable_checkpointing(model, kwargs)
        function = model.model.layers[0]._gradient_checkpointing_func
        assert not isinstance(function, LayerCheckpoint), "torch's function needs no layer: no shim code per call"
        before = effects.count(NAME)
        assert wrong_grads(reference, trainable_grads(model, loss_of)) == []
        assert effects.count(NAME) == before


@from_5_23
def test_transformers_offload_function_is_left_as_it_is():
    """``offload=True`` hands the layers transformers' own offload function (a closure around torch's
    checkpoint, told by its module and name): the patch must record no effect on it. The day upstream
    moves it (huggingface/transformers#48461, activation offload), this fails rather than the patch
    acting on upstream's own function. (A step acts only through a ``LayerCheckpoint``; the layers
    hold none. The forward itself needs pinned memory, which only an accelerator has.)"""
    model = frozen_first_layer_llama()
    before = effects.count(NAME)
    model.activation_checkpointing_enable({"use_reentrant": False}, offload=True)
    functions = {
        id(layer._gradient_checkpointing_func): layer._gradient_checkpointing_func for layer in model.model.layers
    }
    [function] = functions.values()
    assert getattr(function.func, "__name__", None) == "checkpoint_func", "the offload function, as upstream names it"
    assert not isinstance(function, LayerCheckpoint), "upstream's own function needs no layer: no shim code per call"
    assert effects.count(NAME) == before


def test_lifted_keyword_calls_still_let_the_function_find_its_layer():
    # reentrant-keyword-grads hands the function a recomputation of its own: it is bound to the layer
    # too, on every release (up to 5.22 the function found it there before the shim lifted a call)
    torch.manual_seed(0)
    model = tiny_llama(3)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = keyword_driven_grads(model, ids)
    enable_with(model, layer_finding_checkpoint())
    assert wrong_grads(reference, keyword_driven_grads(model, ids)) == []


@from_5_23
def test_the_patch_adds_no_frame_to_a_layer_call_that_does_not_checkpoint():
    model = frozen_first_layer_llama()
    enable_with(model, layer_finding_checkpoint())
    model.eval()
    frames = []
    roots = tuple(os.path.dirname(path) + os.sep for path in (shim.__file__, shim.patches.__file__))

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            frames.append(frame.f_code.co_name)

    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    sys.setprofile(profile)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        sys.setprofile(None)
    assert frames == []
    model.train()  # and the same profile sees the patch where a checkpointed call runs
    sys.setprofile(profile)
    try:
        loss_of(model)
    finally:
        sys.setprofile(None)
    assert "__call__" in frames and "_both_ways" in frames
