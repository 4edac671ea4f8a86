"""replaced-forward-keeps-checkpointing: a layer class whose ``forward`` was replaced after import still
checkpoints (transformers >= 5.23 checkpoints inside a wrapper it put on ``forward``).

Each bug test counts the checkpointed layer calls with the patch off (none: the bug) and on (every
layer), and checks that the replacement still runs and the gradients are those of a run without
checkpointing."""

import contextlib
import functools
import gc
import weakref

import pytest
import torch
import transformers
import wrapt
from packaging.version import Version
from torch.utils.checkpoint import checkpoint
from transformers.models.llama import modeling_llama

import shim
from shim import runtime as effects
from tests.steps import checkpointed_layer_calls, enable_checkpointing, trainable_grads, wrong_grads
from tests.tinymodels import replaced_forward_llama, tiny_llama, tiny_llama_config

NAME = "replaced-forward-keeps-checkpointing"
pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.23"),
    reason="version rule: transformers checkpoints inside a forward wrapper from 5.23 (up to 5.22 in __call__)",
)


def ids_for(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    return ids.to(model.device)


def loss_of(model):
    ids = ids_for(model)
    return model(ids, labels=ids).loss


@pytest.fixture
def restored_layer_class():
    """``LlamaDecoderLayer.forward`` as it was, put back after the test."""
    saved = vars(modeling_llama.LlamaDecoderLayer)["forward"]
    yield modeling_llama.LlamaDecoderLayer
    modeling_llama.LlamaDecoderLayer.forward = saved


@pytest.mark.parametrize("how", ["function", "wraps", "wrapt"])
def test_a_replaced_forward_checkpoints_again_and_still_runs(how, device):
    assert shim.registry.is_on(NAME)
    with shim.disabled(NAME), replaced_forward_llama(how=how) as model:
        device.put(model)
        assert checkpointed_layer_calls(model, lambda: loss_of(model).backward()) == 0, "bug: checkpointing is off"
    before = effects.count(NAME)
    with replaced_forward_llama(how=how) as model:
        device.put(model)
        reference = trainable_grads(model, loss_of)  # the same step, checkpointed: no-op for grads
        assert checkpointed_layer_calls(model, lambda: loss_of(model).backward()) == 3
        checkpointed = trainable_grads(model, loss_of)
        model.gradient_checkpointing_disable()
        uncheckpointed = trainable_grads(model, loss_of)
    tolerance = device.tolerance()
    assert wrong_grads(uncheckpointed, checkpointed, **tolerance) == []
    assert wrong_grads(reference, checkpointed, **tolerance) == []
    assert effects.count(NAME) == before + 1, "one class wrapped again, once"
    # who replaced it, by its own code (not the names functools.wraps or wrapt copy from transformers')
    by = "tests.tinymodels:replaced_forward_llama.<locals>.<lambda>"
    assert f"LlamaDecoderLayer.forward was replaced by {by} (" in effects.last(NAME)


@pytest.mark.parametrize("when", ["before the model is built", "after the model is built"])
def test_the_replacement_runs_inside_the_checkpoint(restored_layer_class, when):
    original, calls = restored_layer_class.forward, []

    def replacement(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return original(self, *args, **kwargs)

    def step(off):
        restored_layer_class.forward = original
        calls.clear()
        if when.startswith("before"):
            restored_layer_class.forward = replacement
        model = tiny_llama(3)
        model.train()
        if when.startswith("after"):
            restored_layer_class.forward = replacement
        with shim.disabled(NAME) if off else contextlib.nullcontext():
            enable_checkpointing(model, {"use_reentrant": True})
        ids = ids_for(model)
        model(ids, labels=ids).loss.backward()
        return list(calls)

    assert step(off=True) == [True] * 3, "bug: the replacement runs once, with grad, unchecked"
    # reentrant: each layer runs without grad in forward, then again with grad in the recomputation
    assert step(off=False) == [False] * 3 + [True] * 3


def test_a_subclass_with_its_own_forward_is_left_alone():
    class OwnForward(modeling_llama.LlamaDecoderLayer):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    wrapper = vars(OwnForward)["forward"]  # transformers wrapped it when the class was made
    model = tiny_llama(2)
    for layer in model.model.layers:
        layer.__class__ = OwnForward
    before = effects.count(NAME)
    enable_checkpointing(model, {"use_reentrant": False})
    model.train()
    assert checkpointed_layer_calls(model, lambda: loss_of(model).backward()) == 2
    assert vars(OwnForward)["forward"] is wrapper and effects.count(NAME) == before


def test_a_forward_replaced_after_the_enable_checkpoints_again_at_the_next_enable(restored_layer_class):
    model = tiny_llama(3)
    model.train()
    enable_checkpointing(model, {"use_reentrant": False})
    assert checkpointed_layer_calls(model, lambda: loss_of(model).backward()) == 3
    original = restored_layer_class.forward
    wrapt.wrap_function_wrapper(
        restored_layer_class, "forward", lambda wrapped, instance, args, kw: wrapped(*args, **kw)
    )
    assert original is not restored_layer_class.forward
    assert checkpointed_layer_calls(model, lambda: loss_of(model).backward()) == 0, "documented limit"
    enable_checkpointing(model, {"use_reentrant": False})
    assert checkpointed_layer_calls(model, lambda: loss_of(model).backward()) == 3


def test_a_stock_model_is_left_alone():
    forward = vars(modeling_llama.LlamaDecoderLayer)["forward"]
    before = effects.count(NAME)
    for _ in range(2):
        model = tiny_llama(2)
        enable_checkpointing(model, None)
    assert vars(modeling_llama.LlamaDecoderLayer)["forward"] is forward and effects.count(NAME) == before


# -- classes made on the fly are freed -------------------------------------------------------------


def given_a_function(model, cls, how):
    """The layers of ``model`` made of the class ``cls`` (as FSDP2's ``fully_shard`` and peft give a
    module a class of its own) and given a checkpoint function ``how``, then made of their own class
    again; for ``"assigned"`` a bare layer of ``cls``."""
    if how == "assigned":
        layer = cls(tiny_llama_config(), 0)
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        return
    for layer in model.model.layers:
        layer.__class__ = cls
    enable_checkpointing(model, {"use_reentrant": False})
    if how == "cycled":  # trl's disable/enable around generation: checkpointing-restore's capture
        getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
        enable_checkpointing(model, None)
    for layer in model.model.layers:
        layer.__class__ = modeling_llama.LlamaDecoderLayer


def classes_left_alive(how, count=30, replaced=False) -> int:
    """``count`` layer classes made on the fly (``type(f"Dyn{i}", (LlamaDecoderLayer,), {})``, the
    ``forward`` replaced after the class was made when ``replaced``), each used once, then
    dropped: how many are still alive after ``gc.collect()``."""
    alive = []
    model = tiny_llama(2)
    original = modeling_llama.LlamaDecoderLayer.forward

    def replacement(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    for index in range(count):
        cls = type(f"Dyn{index}", (modeling_llama.LlamaDecoderLayer,), {})
        if replaced:  # the patch wraps it again
            cls.forward = replacement
        given_a_function(model, cls, how)
        alive.append(weakref.ref(cls))
        del cls
    del model
    gc.collect()
    return sum(ref() is not None for ref in alive)


@pytest.mark.parametrize("how", ["enabled", "assigned", "cycled"])
def test_layer_classes_made_on_the_fly_are_freed(how):
    """FSDP2 and peft make a class per wrapped module. 30 such classes, a model of each enabled (or a
    bare layer given a function, or a model through trl's disable/enable cycle), everything dropped:
    every class is freed, as without the shim (today's shim keeps all 30 alive: the patch's record of
    the forward it last judged, per class, and checkpointing-restore's per-class answer, both plain
    dicts, cleared only past 1 024 entries)."""
    with shim.disabled():
        assert classes_left_alive(how) == 0, "without the shim a class is kept: the test is broken"
    assert classes_left_alive(how) == 0


def test_a_layer_class_made_on_the_fly_with_a_replaced_forward_is_freed():
    """The same with the ``forward`` replaced after each class was made, so the patch wraps it again
    and remembers it to follow its switch: freed all the same (today: 30 of 30 alive)."""
    with shim.disabled():
        assert classes_left_alive("enabled", replaced=True) == 0, "the test is broken"
    assert classes_left_alive("enabled", replaced=True) == 0
