"""The checkpointing path's own steps under ``torch.compile`` with a graph break in every decoder layer
(``user_functions.graph_break_in_every_layer``: what a ``print``, a ``.item()`` or a custom kernel
there does).

Reentrant checkpointing where upstream loses gradients, compiled per layer (``layer.compile()``) and
whole, on ``eager`` and ``aot_eager``: keyword-driven layers (``reentrant-keyword-grads``; upstream
compiled with the graph break: 28 of 30 gradients wrong) and frozen inputs
(``reentrant-frozen-input-grads``; 18 of 20); and a LlamaFactory-style function that finds its layer
as ``func.func.__self__`` (``checkpoint-function-finds-layer``; upstream: ``AttributeError``). With
the shim each trains and gets the gradients of the uncompiled run without checkpointing (tolerances
of ``tests/do_no_harm/workflows/compiled.py``). Today's shim dies in the first step:
``InternalTorchDynamoError: RecursionError: maximum recursion depth exceeded``.

The default run takes a covering set (each step, backend and way of compiling once);
``DO_NO_HARM=full`` every combination, each after upstream's loss of gradients there. ``inductor``
joins the backends on CUDA (``--device cuda``, ``tests/devices.py``), and on a CPU with
``DO_NO_HARM=inductor``. Functions of the user's own compiled with a graph break,
where upstream is right, are do-no-harm workflows (``compiled.py``'s ``graph-break/...`` cases).
"""

import warnings

import pytest
import torch
import transformers
from packaging.version import Version

import shim
from tests import devices
from tests.do_no_harm.workflows.compiled import COMPILED_GRADIENTS
from tests.do_no_harm.workflows.user_functions import graph_break_in_every_layer
from tests.steps import (
    enable_checkpointing,
    keyword_driven_grads,
    layer_finding_checkpoint,
    trainable_grads,
    wrong_grads,
)
from tests.tinymodels import frozen_input_llama, tiny_llama

OPT_IN = devices.opt_in()
FULL = "full" in OPT_IN
BACKENDS = devices.backends(devices.chosen(), OPT_IN)
HOW = ("regional", "whole")
if FULL:
    CASES = [(step, backend, how) for step in ("keyword", "frozen-input") for backend in BACKENDS for how in HOW]
else:  # each step, each backend, each way of compiling once
    CASES = [("keyword", "aot_eager", "regional"), ("frozen-input", "eager", "whole")]
    if "inductor" in BACKENDS:
        CASES += [("keyword", "inductor", "whole"), ("frozen-input", "inductor", "regional")]


@pytest.fixture(autouse=True)
def graph_breaks():
    """A graph break in every decoder layer for the test, dynamo's caches dropped after it."""
    with warnings.catch_warnings(), graph_break_in_every_layer():
        warnings.simplefilter("ignore", FutureWarning)  # the gradient_checkpointing_* names from 5.23
        warnings.simplefilter("ignore", UserWarning)  # torch's "None of the inputs have requires_grad=True"
        try:
            yield
        finally:
            torch._dynamo.reset()


def compiled(model, backend, how):
    """``model`` with every decoder layer compiled in place (``regional``, returns the model), or
    ``torch.compile(model)`` (``whole``)."""
    if how == "regional":
        for layer in model.model.layers:
            layer.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend)


def keyword_driven(backend, how, checkpoint_kwargs, device):
    """A 3-layer Llama whose decoder layers are called with ``hidden_states=``: the gradients of the
    uncompiled run without checkpointing, and of the compiled one with ``checkpoint_kwargs``
    (``whole``: the whole step, ``keyword_driven_grads``, compiled as one function)."""
    torch.manual_seed(0)
    model = device.put(tiny_llama(3).train())
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    ids = device.put(ids)
    reference = keyword_driven_grads(model, ids)
    enable_checkpointing(model, checkpoint_kwargs)
    if how == "regional":
        return reference, keyword_driven_grads(compiled(model, backend, how), ids)
    return reference, torch.compile(keyword_driven_grads, backend=backend)(model, ids)


def frozen_input(backend, how, checkpoint_kwargs, device):
    """``frozen_input_llama``: no input of layer 1 requires grad; the same two gradients."""
    model, loss_of = frozen_input_llama(3, device=device.type)
    reference = trainable_grads(model, loss_of)
    enable_checkpointing(model, checkpoint_kwargs)
    forward = compiled(model, backend, how)
    return reference, trainable_grads(model, lambda _: loss_of(forward))


STEPS = {"keyword": keyword_driven, "frozen-input": frozen_input}


@pytest.mark.autocast
@pytest.mark.parametrize("step, backend, how", CASES, ids=["/".join(case) for case in CASES])
def test_a_reentrant_step_compiled_with_a_graph_break_trains_with_the_gradients_of_no_checkpointing(
    step, backend, how, device
):
    tolerance = device.tolerance(COMPILED_GRADIENTS)
    if FULL:  # upstream loses gradients there: the step has something to fix
        with shim.disabled(), device.autocast():
            reference, upstream = STEPS[step](backend, how, {"use_reentrant": True}, device)
        assert wrong_grads(reference, upstream, **tolerance) != [], "upstream is right: the test is broken"
        torch._dynamo.reset()
    with device.autocast():
        reference, got = STEPS[step](backend, how, {"use_reentrant": True}, device)
    assert wrong_grads(reference, got, **tolerance) == []


FINDS_LAYER_CASES = [(backend, how) for backend in BACKENDS for how in HOW] if FULL else [("aot_eager", "regional")]
if not FULL and "inductor" in BACKENDS:
    FINDS_LAYER_CASES += [("inductor", "whole")]


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.23"),
    reason="version rule: the layer hands over partial(forward, layer) from 5.23 (a bound method up to 5.22)",
)
@pytest.mark.parametrize("backend, how", FINDS_LAYER_CASES, ids=["/".join(case) for case in FINDS_LAYER_CASES])
def test_a_function_that_finds_its_layer_compiled_with_a_graph_break_gets_the_uncompiled_gradients(
    backend, how, device
):
    """LlamaFactory's kind of function (``layer_finding_checkpoint``: the layer as
    ``func.func.__self__``, checkpointing only layers with a trainable parameter), layer 0 frozen:
    compiled with a graph break in every layer, the gradients of the same run uncompiled."""

    def build():
        torch.manual_seed(0)
        model = device.put(tiny_llama(3).train())
        model.model.layers[0].requires_grad_(False)
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=layer_finding_checkpoint())
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        ids = device.put(ids)
        return model, lambda m: m(ids, labels=ids).loss

    model, loss_of = build()
    reference = trainable_grads(model, loss_of)
    model, loss_of = build()
    forward = compiled(model, backend, how)
    got = trainable_grads(model, lambda _: loss_of(forward))
    assert wrong_grads(reference, got, **device.tolerance(COMPILED_GRADIENTS)) == []
