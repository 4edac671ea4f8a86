"""The checkpointing path as a whole: what reaches a layer's checkpoint, however
the layer got its function and whatever happened to its class, gives the gradients of a run without
checkpointing, recomputes each layer as often as upstream does, and leaves the user's code as the
user wrote it while the shim (or the patch) is off.

1. A reentrant model whose layers hold a plain ``partial(checkpoint, use_reentrant=True)`` (enabled
   before ``import shim``, or enabled with the shim and then pickled or ``torch.save``d): after trl's
   disable/enable cycle around generation its configuration stays reentrant and its gradients are
   right, and upstream's own outcome is right too; a round-tripped one trains right at once.
2. Checkpoint functions written for transformers >= 5.23 find their layer as ``func.args[0]``;
   ones written for <= 5.22 as ``func.func.__self__`` and call ``func.func(*args, **func.keywords)``.
   Each works, through ``_set_gradient_checkpointing`` and assigned after an enable.
3. A checkpoint function assigned straight to every layer (no enable call) is fixed as an enabled
   one is: frozen inputs and keyword-driven layers under reentrant checkpointing, a function that
   finds its layer.
4. A decoder-layer class whose ``forward`` was compiled, or replaced by a forward that checkpoints
   itself, is checkpointed once, as without the shim (counted on each layer's ``self_attn``).
5. The re-wrap of a replaced ``forward`` follows its switch (``shim.disable``, ``shim.disabled()``,
   ``shim.deactivate()``), and a ``staticmethod`` forward trains as without the shim.
6. A call shape the fixes do not know is found when ``transformers.modeling_layers`` is imported:
   skipped with the reason, and ``SHIM_STRICT=1`` raises there.
7. An enable passes each layer through each fix once, and the enable path carries one shim layer
   (the cycle's cost is measured in ``benchmarks/overhead.py``, never in a test).
8. A step declared later, in its own module with the public API (``tests/patches/late_step.py``),
   still acts before finds-layer's hand-over.
9. A step with nothing to do (no ``act`` nor ``given``, or an ``act`` without ``applies``) is refused
   where its targets are taken.
10. A patch pack's step (``shim.checkpointing`` alone, found through its entry point) sits outside the
    built-ins' steps of its place, and finds-layer still acts after it.

Only public behaviour is read: gradients, counts of hook and checkpoint-function calls, the class's
``forward`` and shim's public API. Do-no-harm runs of items 1, 2, 4 and 5 are in
``tests/do_no_harm/workflows/everyday.py``.
"""

import collections
import contextlib
import functools
import io
import json
import os
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
import wrapt
from packaging.version import Version
from torch.utils.checkpoint import checkpoint
from transformers.models.llama import modeling_llama

import shim
import shim.patches
from tests.conftest import run_python
from tests.steps import (
    enable_checkpointing,
    keyword_driven_grads,
    layer_finding_checkpoint,
    trainable_grads,
    wrong_grads,
)
from tests.tinymodels import frozen_input_llama, tiny_llama

TRANSFORMERS = Version(transformers.__version__)
REPLACED_FORWARD = "replaced-forward-keeps-checkpointing"
STEPS = ("checkpoint-function-finds-layer", "reentrant-keyword-grads", "reentrant-frozen-input-grads")
SLOT = "transformers.modeling_layers:GradientCheckpointingLayer._gradient_checkpointing_func"
SETSTATE = "transformers.modeling_layers:GradientCheckpointingLayer.__setstate__"

from_5_0 = pytest.mark.skipif(
    TRANSFORMERS < Version("5.0"),
    reason="version rule: transformers binds use_reentrant=False on a bare enable from 5.0 (True in 4.x), which "
    "is what makes upstream's own cycle end right",
)
from_5_23 = pytest.mark.skipif(
    TRANSFORMERS < Version("5.23"),
    reason="version rule: from 5.23 the layer hands over partial(forward, layer) and checkpoints inside a wrapper "
    "transformers puts on its class's forward (a bound method and __call__ up to 5.22)",
)
try:
    from trl.models.utils import disable_gradient_checkpointing
except ImportError:  # trl not installed, or before 0.26
    disable_gradient_checkpointing = None
needs_trl_cycle = pytest.mark.skipif(
    disable_gradient_checkpointing is None,
    reason="version rule: trl.models.utils.disable_gradient_checkpointing exists from trl 0.26",
)


# -- models, steps and counts ------------------------------------------------------------------------


def ids_of(model):
    return torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))


def keyword_driven():
    """A 3-layer Llama whose decoder layers are called with ``hidden_states=`` (draft models, custom
    stacks): ``(model, grads_of)``, every parameter's gradient."""
    torch.manual_seed(0)
    model = tiny_llama(3)
    model.train()
    ids = ids_of(model)
    return model, lambda m: keyword_driven_grads(m, ids)


def frozen_input():
    """``tinymodels.frozen_input_llama``: fed ``inputs_embeds`` from its frozen embeddings, layer 0
    frozen, so no input of layer 1 requires grad: ``(model, grads_of)``, the trainable parameters'."""
    model, loss_of = frozen_input_llama()
    return model, lambda m: trainable_grads(m, loss_of)


MODELS = {"keyword-driven": keyword_driven, "frozen-input": frozen_input}


def frozen_first_layer_llama(layers=3):
    torch.manual_seed(0)
    model = tiny_llama(layers)
    model.train()
    model.model.layers[0].requires_grad_(False)
    return model


def loss_of(model):
    ids = ids_of(model)
    return model(ids, labels=ids).loss


@contextlib.contextmanager
def quiet():
    """Upstream's own warnings kept out of the output: FutureWarnings (the gradient_checkpointing_*
    names from 5.23) and torch's UserWarnings (a reentrant checkpoint whose inputs need no grad)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def without_input_hook(model):
    """``model`` without the input-require-grads hook an enable puts on its embeddings: a local
    function, which upstream cannot pickle (neither input of these models needs it)."""
    if getattr(model, "_require_grads_hooks", None) or hasattr(model, "_require_grads_hook"):
        model.disable_input_require_grads()
    return model


def pickled(model):
    return pickle.loads(pickle.dumps(without_input_hook(model)))


def torch_saved(model):
    buffer = io.BytesIO()
    torch.save(without_input_hook(model), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS = {"pickle": pickled, "torch.save": torch_saved}


def trl_cycle(model):
    """What trl does around every generation step: disable, then re-enable without arguments."""
    with quiet(), disable_gradient_checkpointing(model, None):
        pass


def bound_use_reentrant(function):
    """The ``use_reentrant`` a layer's checkpoint function binds (outermost partial wins), or None."""
    while isinstance(function, functools.partial):
        if "use_reentrant" in function.keywords:
            return function.keywords["use_reentrant"]
        function = function.func
    return None


def configuration(model) -> list:
    """Each decoder layer's flag and bound ``use_reentrant``."""
    return [
        (layer.gradient_checkpointing, bound_use_reentrant(layer.__dict__.get("_gradient_checkpointing_func")))
        for layer in model.model.layers
    ]


def attention_runs(model, step) -> list:
    """How many times each decoder layer's ``self_attn`` ran in ``step()`` (a forward hook: from 5.23 a
    recomputation calls the layer's ``forward`` directly, past the layer's own hooks)."""
    runs = [0] * len(model.model.layers)

    def hook(index):
        return lambda *_: runs.__setitem__(index, runs[index] + 1)

    handles = [layer.self_attn.register_forward_hook(hook(index)) for index, layer in enumerate(model.model.layers)]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return runs


def counted(model, step):
    """Run ``step()``: :func:`attention_runs`, and how many times a layer's checkpoint function was
    called (not for compiled code, which calls it from inside its graph)."""
    calls, held = [], {}

    def counting(function):
        def call(*args, **kwargs):
            calls.append(function)
            return function(*args, **kwargs)

        return call

    for layer in model.model.layers:  # through __dict__: counting hands the layer no new function to act on
        function = layer.__dict__.get("_gradient_checkpointing_func")
        if function is not None:
            held[layer] = function
            layer.__dict__["_gradient_checkpointing_func"] = counting(function)
    try:
        runs = attention_runs(model, step)
    finally:
        for layer, function in held.items():
            layer.__dict__["_gradient_checkpointing_func"] = function
    return runs, len(calls)


@pytest.fixture
def layer_class():
    """``LlamaDecoderLayer`` with its ``forward`` put back after the test, whatever happened to it,
    and dynamo's caches dropped."""
    cls = modeling_llama.LlamaDecoderLayer
    saved = vars(cls)["forward"]
    try:
        yield cls
    finally:
        cls.forward = saved
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


# -- 1: a plain reentrant partial on the layers, and trl's generation cycle ---------------------------


@from_5_0
@needs_trl_cycle
def test_a_model_enabled_reentrant_before_import_shim_keeps_its_configuration_and_right_gradients_through_trls_cycle():
    """Checkpointing enabled with ``{"use_reentrant": True}`` before ``import shim``: the layers hold
    upstream's plain reentrant partial. After trl's disable/enable cycle the configuration is still
    reentrant (checkpointing-restore) and the gradients of a keyword-driven Llama and of a frozen-input
    Llama equal a run without checkpointing. Upstream's own cycle (the same models, cycled and trained
    inside ``shim.disabled()``) ends non-reentrant, with right gradients: the shim must not be worse."""
    code = """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, transformers

    def build(frozen):  # tests.tinymodels' tiny_llama(3), seeded as keyword_driven and frozen_input_llama are
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
        model.train()
        if frozen:
            model.model.embed_tokens.requires_grad_(False)
            model.model.layers[0].requires_grad_(False)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model

    built = {run: {"keyword-driven": build(False), "frozen-input": build(True)} for run in ("shim", "upstream")}
    assert "shim" not in sys.modules
    import shim
    from trl.models.utils import disable_gradient_checkpointing
    from tests.patches.test_checkpointing_path import MODELS, configuration
    from tests.steps import wrong_grads

    result = {}
    for run, models in built.items():
        with shim.disabled() if run == "upstream" else __import__("contextlib").nullcontext():
            for name, model in models.items():
                reference_model, grads_of = MODELS[name]()
                assert all(torch.equal(a, b) for a, b in zip(reference_model.parameters(), model.parameters()))
                before = configuration(model)
                with disable_gradient_checkpointing(model, None):
                    pass
                result[f"{run} {name}"] = {
                    "before": before,
                    "after": configuration(model),
                    "wrong": wrong_grads(grads_of(reference_model), grads_of(model)),
                }
    print(json.dumps(result))
    """
    result = json.loads(run_python(code, timeout=240, torch_first=True).stdout.strip().splitlines()[-1])
    reentrant = [[True, True]] * 3
    for name in MODELS:  # upstream: its bare re-enable is non-reentrant, and right
        assert result[f"upstream {name}"] == {"before": reentrant, "after": [[True, False]] * 3, "wrong": []}
    for name in MODELS:
        assert result[f"shim {name}"] == {"before": reentrant, "after": reentrant, "wrong": []}, name


@from_5_0
@needs_trl_cycle
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("round_trip", ROUND_TRIPS)
def test_a_round_tripped_reentrant_model_keeps_its_configuration_and_right_gradients_through_trls_cycle(
    round_trip, model_name
):
    """A model enabled reentrant with the shim, then pickled (or ``torch.save``/``torch.load``): its
    layers hold upstream's plain partial. After trl's cycle it is still reentrant and its gradients
    equal a run without checkpointing; upstream's own outcome (``shim.disabled()``) is right too."""
    upstream, grads_of = MODELS[model_name]()
    reference = grads_of(upstream)
    with shim.disabled(), quiet():
        enable_checkpointing(upstream, {"use_reentrant": True})
        upstream = ROUND_TRIPS[round_trip](upstream)
        trl_cycle(upstream)
        assert configuration(upstream) == [(True, False)] * 3, "upstream's bare re-enable is non-reentrant"
        assert wrong_grads(reference, grads_of(upstream)) == [], "upstream's own outcome is right"

    model, grads_of = MODELS[model_name]()
    enable_checkpointing(model, {"use_reentrant": True})
    model = ROUND_TRIPS[round_trip](model)
    trl_cycle(model)
    assert configuration(model) == [(True, True)] * 3, "checkpointing-restore keeps use_reentrant=True"
    with quiet():
        assert wrong_grads(reference, grads_of(model)) == []


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("round_trip", ROUND_TRIPS)
def test_a_round_tripped_reentrant_model_trains_with_the_gradients_of_no_checkpointing(round_trip, model_name):
    """A model enabled reentrant with the shim, pickled (or saved with ``torch.save``) and loaded,
    trained at once (no disable/enable since): its gradients equal a run without checkpointing."""
    model, grads_of = MODELS[model_name]()
    reference = grads_of(model)
    enable_checkpointing(model, {"use_reentrant": True})
    model = ROUND_TRIPS[round_trip](model)
    assert configuration(model) == [(True, True)] * 3
    with quiet():
        assert wrong_grads(reference, grads_of(model)) == []


# -- 2: functions written for transformers >= 5.23 (func.args[0]) and for <= 5.22 ---------------------


def finds_layer_in_args(inner):
    """Written for transformers >= 5.23: the layer is ``func.args[0]`` (``partial(forward, layer,
    **kwargs)``); checkpoints only layers with a trainable parameter."""

    def checkpoint_trainable_layers(func, *args, **kwargs):
        layer = func.args[0]
        if any(parameter.requires_grad for parameter in layer.parameters()):
            return inner(func, *args, **kwargs)
        return func(*args, **kwargs)

    return checkpoint_trainable_layers


def finds_layer_both_ways(inner, seen):
    """Reads the layer as ``func.args[0]`` and as ``func.func.__self__``: the same layer."""

    def checkpoint_layer(func, *args, **kwargs):
        layer = func.args[0]
        assert func.func.__self__ is layer, "func.args[0] and func.func.__self__ are two layers"
        seen.append(layer)
        return inner(func, *args, **kwargs)

    return checkpoint_layer


def calls_func_func(inner):
    """Written for transformers <= 5.22: ``func.func(*args, **func.keywords)`` (a bound ``forward``)."""

    def checkpoint_forward(func, *args, **kwargs):
        forward, keywords = func.func, func.keywords
        return inner(lambda *inputs: forward(*inputs, **keywords), *args, **kwargs)

    return checkpoint_forward


def through_the_model(model, function):
    """As training frameworks enable their own function."""
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)


def assigned_after_an_enable(model, function):
    """Checkpointing enabled as usual, then the layers' function replaced by one's own."""
    with quiet():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = function


HOW = {"_set_gradient_checkpointing": through_the_model, "enable, then assign": assigned_after_an_enable}


@from_5_23
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("how", HOW)
def test_a_function_that_finds_its_layer_as_args_0_gives_the_gradients_of_no_checkpointing(how, reentrant):
    """A function that finds its layer as ``func.args[0]`` and checkpoints only layers with a
    trainable parameter (layer 0 is frozen), torch's checkpoint underneath: it works without the shim
    and must work with it (today's shim hands it a partial without args: IndexError)."""
    inner = functools.partial(checkpoint, use_reentrant=reentrant)
    upstream = frozen_first_layer_llama()
    reference = trainable_grads(upstream, loss_of)
    with shim.disabled(), quiet():
        HOW[how](upstream, finds_layer_in_args(inner))
        assert wrong_grads(reference, trainable_grads(upstream, loss_of)) == [], "upstream: right"
    model = frozen_first_layer_llama()
    HOW[how](model, finds_layer_in_args(inner))
    with quiet():
        assert wrong_grads(reference, trainable_grads(model, loss_of)) == []


@from_5_23
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("how", HOW)
def test_a_function_that_reads_args_0_and_func_self_finds_one_layer(how, reentrant):
    """A function that reads both ``func.args[0]`` and ``func.func.__self__`` finds the same layer in
    each, the layer being checkpointed, and the gradients equal a run without checkpointing."""
    model = frozen_first_layer_llama()
    reference = trainable_grads(model, loss_of)
    seen = []
    HOW[how](model, finds_layer_both_ways(functools.partial(checkpoint, use_reentrant=reentrant), seen))
    with quiet():
        assert wrong_grads(reference, trainable_grads(model, loss_of)) == []
    assert seen == list(model.model.layers)


@from_5_23
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("how", HOW)
def test_a_function_written_for_5_22_that_calls_func_func_gives_the_gradients_of_no_checkpointing(how, reentrant):
    """A function that calls ``func.func(*args, **func.keywords)``, as code written for transformers
    <= 5.22 does (``func.func`` was the layer's bound ``__call__``): the gradients equal a run without
    checkpointing."""
    model = frozen_first_layer_llama()
    reference = trainable_grads(model, loss_of)
    HOW[how](model, calls_func_func(functools.partial(checkpoint, use_reentrant=reentrant)))
    with quiet():
        assert wrong_grads(reference, trainable_grads(model, loss_of)) == []


# -- 3: a function assigned straight to the layers -------------------------------------------------------


def assign_to_every_layer(model, function):
    for layer in model.model.layers:
        layer._gradient_checkpointing_func = function
        layer.gradient_checkpointing = True


@pytest.mark.parametrize("model_name", MODELS)
def test_a_reentrant_function_assigned_to_every_layer_gives_the_gradients_of_no_checkpointing(model_name):
    """``layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=True)`` and
    ``layer.gradient_checkpointing = True`` on every decoder layer, no enable call: frozen inputs
    (upstream loses 18 of 20) and keyword-driven layers (28 of 30) get the gradients of no
    checkpointing, as after an enable."""
    upstream, grads_of = MODELS[model_name]()
    reference = grads_of(upstream)
    with shim.disabled(), quiet():
        assign_to_every_layer(upstream, functools.partial(checkpoint, use_reentrant=True))
        assert wrong_grads(reference, grads_of(upstream)) != [], "bug: upstream loses gradients"
    model, grads_of = MODELS[model_name]()
    assign_to_every_layer(model, functools.partial(checkpoint, use_reentrant=True))
    with quiet():
        assert wrong_grads(reference, grads_of(model)) == []


@from_5_23
def test_a_layer_finding_function_assigned_to_every_layer_works():
    """A LlamaFactory-style function (``tests.steps.layer_finding_checkpoint``: the layer as
    ``func.func.__self__``) assigned straight to every layer: no AttributeError, the gradients of no
    checkpointing."""
    model = frozen_first_layer_llama()
    reference = trainable_grads(model, loss_of)
    assign_to_every_layer(model, layer_finding_checkpoint())
    with quiet():
        assert wrong_grads(reference, trainable_grads(model, loss_of)) == []


def test_what_a_layer_reads_back_equals_what_was_assigned_and_a_mock_stays_a_mock():
    """Where a step applies, a layer holds the shim's object: it equals the function assigned
    (``==`` both ways, the same hash) but is not it; a mock (``unittest.mock.patch.object``) is
    stored as it is, so a test sees its own object and the calls it records. Upstream, ``is``
    holds too: said in docs/how-it-works.md ("What the layer holds")."""
    from unittest import mock

    model = frozen_first_layer_llama()
    layer = model.model.layers[1]
    function = functools.partial(checkpoint, use_reentrant=True)
    layer._gradient_checkpointing_func = function
    held = layer._gradient_checkpointing_func
    assert held == function and function == held and hash(held) == hash(function)
    assert held is not function and held != functools.partial(checkpoint, use_reentrant=True)
    assert {held: 1}[function] == 1
    with mock.patch.object(layer, "_gradient_checkpointing_func", wraps=function) as spy:
        assert layer._gradient_checkpointing_func is spy
        layer.gradient_checkpointing = True
        with quiet():
            loss_of(model).backward()
        assert spy.call_count == 1
    assert layer._gradient_checkpointing_func is held


@from_5_23
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_function_of_yours_is_handed_a_layer_method_it_can_copy(reentrant):
    """What a checkpoint function of the user's receives: ``func.func`` bound to the layer (its
    ``__self__``), and a partial that ``copy.copy`` and ``copy.deepcopy`` copy (a look-alike with a
    ``__getattr__`` recursed there; a ``types.MethodType``, copied, is looked up on the layer again
    and recurses into its checkpointing forward on transformers 5.25) and that runs the layer."""
    import copy

    seen = []

    def mine(func, *args, **kwargs):
        seen.append((func.func.__self__ is func.args[0], func.func.__name__))
        shallow, deep = copy.copy(func), copy.deepcopy(func)  # a deep copy copies the layer, as upstream's
        assert shallow.func is func.func and deep.args[0] is not func.args[0]
        assert deep.func.__self__ is deep.args[0], "the copy is bound to the copied layer"
        return checkpoint(shallow, *args, use_reentrant=reentrant, **kwargs)

    model = frozen_first_layer_llama()
    reference = trainable_grads(model, loss_of)
    assign_to_every_layer(model, mine)
    with quiet():
        assert wrong_grads(reference, trainable_grads(model, loss_of)) == []
    assert seen and all(found == (True, "forward") for found in seen), seen


# -- 4: a class forward compiled, or one that checkpoints itself: checkpointed once ----------------------


def calls_outside_compiled_code(model, step):
    """Run ``step()``: how many times each decoder layer's checkpoint function was called, counted by a function
    dynamo never traces (``torch.compiler.disable``): called from compiled code it is a graph break there and
    runs in Python, as a call from the layer's own Python code does. A counter dynamo traces counts the trace,
    not the calls: from torch 2.14 :func:`attention_runs` inside a compiled region says 1 per layer, or 0 when
    the region was compiled for another model."""
    calls = [0] * len(model.model.layers)
    held = {}

    def counting(function, index):
        def call(*args, **kwargs):
            calls[index] += 1
            return function(*args, **kwargs)

        return torch.compiler.disable(call)

    for index, layer in enumerate(model.model.layers):  # through __dict__: the layer is given no new function
        function = layer.__dict__.get("_gradient_checkpointing_func")
        if function is not None:
            held[layer] = function
            layer.__dict__["_gradient_checkpointing_func"] = counting(function, index)
    try:
        step()
    finally:
        for layer, function in held.items():
            layer.__dict__["_gradient_checkpointing_func"] = function
    return calls


def compiled_step(cls, forward, reentrant, off):
    """A 2-layer Llama of ``cls`` whose ``forward`` is ``forward``, checkpointing enabled (inside
    ``shim.disabled()`` when ``off``): each layer's checkpoint-function calls in one step
    (:func:`calls_outside_compiled_code`), and the gradients."""
    cls.forward = forward
    torch.manual_seed(0)
    model = tiny_llama(2)
    model.train()
    reference = trainable_grads(model, loss_of)
    with shim.disabled() if off else contextlib.nullcontext(), quiet():
        enable_checkpointing(model, {"use_reentrant": reentrant})
        calls = calls_outside_compiled_code(model, lambda: loss_of(model).backward())
        grads = trainable_grads(model, loss_of)
    return calls, wrong_grads(reference, grads)


@from_5_23
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_compiled_class_forward_is_recomputed_as_often_as_without_the_shim(layer_class, reentrant):
    """``LlamaDecoderLayer.forward = torch.compile(LlamaDecoderLayer.forward, backend="eager")``: each layer's
    checkpoint function is called as often as without the shim, counted outside compiled code, and at most
    once per step: a shim that wrapped the compiled wrapper again would call it from its own Python wrapper
    as well, once more per layer, and recompute the layer once more. The gradients are those of no
    checkpointing.

    Upstream calls it once per layer up to torch 2.13 and not at all from torch 2.14: in the compiled frame,
    transformers' test ``type(self).forward is forward_with_checkpointing`` (only the outermost wrapper
    checkpoints) no longer finds its wrapper in the compiled function, so the layer is not checkpointed (the
    tensors a step saves are those of a step without checkpointing). The shim leaves both as they are."""
    compiled = torch.compile(layer_class.forward, backend="eager")
    upstream_calls, upstream_wrong = compiled_step(layer_class, compiled, reentrant, off=True)
    assert upstream_wrong == []
    assert len(upstream_calls) == 2 and set(upstream_calls) <= {0, 1}, "upstream checkpoints a layer at most once"
    calls, wrong = compiled_step(layer_class, compiled, reentrant, off=False)
    assert calls == upstream_calls, "checkpointed as often as without the shim"
    assert wrong == []


def self_checkpointing(original):
    """A replacement ``forward`` that checkpoints itself, as kernel libraries' layers do."""

    def forward(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(original, self, **kwargs), *args)
        return original(self, *args, **kwargs)

    return forward


@from_5_23
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_forward_that_checkpoints_itself_is_not_checkpointed_twice(layer_class, reentrant):
    """``LlamaDecoderLayer.forward`` replaced by a forward that checkpoints itself: each layer's
    checkpoint function is called and its attention runs as often as without the shim (upstream: the
    function once per layer, 2 runs each; today's shim checkpoints around the replacement too: the
    function 3 times per layer, 3 runs when reentrant), and the gradients equal no checkpointing."""
    replacement = self_checkpointing(layer_class.forward)

    def step(off):
        layer_class.forward = replacement
        model = frozen_first_layer_llama(2)
        reference = trainable_grads(model, loss_of)
        with shim.disabled() if off else contextlib.nullcontext(), quiet():
            enable_checkpointing(model, {"use_reentrant": reentrant})
            counts = counted(model, lambda: loss_of(model).backward())
            return counts, wrong_grads(reference, trainable_grads(model, loss_of))

    (upstream_runs, upstream_calls), upstream_wrong = step(off=True)
    assert (upstream_runs, upstream_calls, upstream_wrong) == ([2, 2], 2, [])
    (runs, calls), wrong = step(off=False)
    assert (runs, calls) == (upstream_runs, upstream_calls), "checkpointed once"
    assert wrong == []


# -- 5: the replaced-forward re-wrap follows its switch; a staticmethod forward -------------------------


def checkpointing_counts(cls):
    """A new 3-layer Llama of ``cls``, checkpointing enabled (non-reentrant): each layer's attention
    runs and the checkpoint-function calls of one step."""
    torch.manual_seed(0)
    model = tiny_llama(3)
    model.train()
    with quiet():
        enable_checkpointing(model, {"use_reentrant": False})
        return counted(model, lambda: loss_of(model).backward())


CHECKPOINTED = ([2, 2, 2], 3)  # every layer recomputed once, its checkpoint function called once
NOT_CHECKPOINTED = ([1, 1, 1], 0)


def replace_forward(cls):
    original = cls.forward

    def replacement(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    cls.forward = replacement
    return replacement


@contextlib.contextmanager
def switched_off(how):
    if how == "shim.disable(name)":
        shim.disable(REPLACED_FORWARD)
        try:
            yield
        finally:
            shim.enable(REPLACED_FORWARD)
    else:
        with shim.disabled():
            yield


@from_5_23
@pytest.mark.parametrize("how", ["shim.disable(name)", "shim.disabled()"])
def test_a_replaced_forward_is_left_as_the_user_set_it_while_the_patch_is_off(layer_class, how):
    """``LlamaDecoderLayer.forward`` replaced by a plain function calling the original; a model
    checkpointed with the patch on (the class wrapped again), then the patch switched off: a new model
    with checkpointing enabled is not checkpointed, as upstream, and the class's ``forward`` is the
    replacement object. Switched back on, the next enable checkpoints again."""
    replacement = replace_forward(layer_class)
    assert checkpointing_counts(layer_class) == CHECKPOINTED, "the patch on: checkpointed"
    with switched_off(how):
        counts = checkpointing_counts(layer_class)
        # as upstream: not checkpointed, and the class holds the user's replacement, as the user set it
        assert (counts, vars(layer_class)["forward"] is replacement) == (NOT_CHECKPOINTED, True)
    assert checkpointing_counts(layer_class) == CHECKPOINTED, "switched back on: checkpointed again"


@from_5_23
def test_a_replaced_forward_is_left_as_the_user_set_it_after_deactivate():
    """As above, with ``shim.deactivate()`` (fresh interpreter: the whole shim comes off), then
    ``shim.activate()``."""
    code = """
    import json, warnings
    warnings.simplefilter("ignore")
    import shim
    from transformers.models.llama import modeling_llama
    from tests.patches.test_checkpointing_path import checkpointing_counts, replace_forward

    cls = modeling_llama.LlamaDecoderLayer
    replacement = replace_forward(cls)
    result = {"on": checkpointing_counts(cls)}
    shim.deactivate()
    result["deactivated"] = checkpointing_counts(cls)
    result["is the replacement"] = vars(cls)["forward"] is replacement
    shim.activate()
    result["activated"] = checkpointing_counts(cls)
    print(json.dumps(result))
    """
    result = json.loads(run_python(code, timeout=180, torch_first=True).stdout.strip().splitlines()[-1])
    checkpointed, not_checkpointed = json.loads(json.dumps([CHECKPOINTED, NOT_CHECKPOINTED]))
    assert result == {
        "on": checkpointed,
        "deactivated": not_checkpointed,
        "is the replacement": True,
        "activated": checkpointed,
    }


@from_5_23
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_staticmethod_forward_trains_as_without_the_shim(layer_class, reentrant):
    """``LlamaDecoderLayer.forward = staticmethod(identity)`` (a layer that returns its hidden states,
    needing no ``self``), checkpointing enabled: a training step works with the shim as without it
    (today's shim wraps the function as a method and hands it the layer: AttributeError), with the
    same loss and gradients."""

    def step(off):
        layer_class.forward = staticmethod(lambda hidden_states, *args, **kwargs: hidden_states)
        torch.manual_seed(0)
        model = tiny_llama(2)
        model.train()
        with shim.disabled() if off else contextlib.nullcontext(), quiet():
            enable_checkpointing(model, {"use_reentrant": reentrant})
            model.zero_grad(set_to_none=True)
            loss = loss_of(model)
            loss.backward()
        return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    upstream_loss, upstream_grads = step(off=True)
    loss, grads = step(off=False)
    assert loss == upstream_loss
    assert wrong_grads(upstream_grads, grads) == []


# -- 6: strict mode and a call shape the steps do not know ------------------------------------------

CHANGED_SHAPE = """
import importlib.machinery, sys
import shim

class ChangingLoader(importlib.machinery.SourceFileLoader):
    # transformers.modeling_layers as a release that hands the layer call over in a closure
    def exec_module(self, module):
        super().exec_module(module)

        def __init_subclass__(cls, **kwargs):
            forward = cls.forward

            def forward_with_checkpointing(self, *args, **kwargs):
                if self.gradient_checkpointing and self.training:
                    return self._gradient_checkpointing_func(lambda *a: forward(self, *a, **kwargs), *args)
                return forward(self, *args, **kwargs)

            cls.forward = forward_with_checkpointing

        module.GradientCheckpointingLayer.__init_subclass__ = classmethod(__init_subclass__)

class Changing:
    def find_spec(self, name, path=None, target=None):
        if name != "transformers.modeling_layers":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = ChangingLoader(spec.loader.name, spec.loader.path)
        return spec

sys.meta_path.insert(1, Changing())  # behind the shim's finder, as the file on disk would be
"""


def test_strict_mode_raises_when_the_layers_call_shape_changed():
    """SHIM_STRICT=1 and a transformers whose layers hand their call over in a closure: importing
    transformers.modeling_layers raises shim.PatchError naming the patch (the shape is probed when
    that module is imported; before, the probe waited for the first enable and only logged)."""
    result = run_python(
        CHANGED_SHAPE
        + """
try:
    import transformers.modeling_layers
except shim.PatchError as exc:
    print("raised:", exc)
else:
    print("imported")
""",
        env={"SHIM_STRICT": "1"},
        timeout=240,
        torch_first=True,
    )
    assert "raised:" in result.stdout, result.stdout + result.stderr
    raised_for = [name for name in STEPS if f"patch {name!r}" in result.stdout]
    assert raised_for and "GradientCheckpointingLayer" in result.stdout, result.stdout


def test_without_strict_mode_a_changed_call_shape_skips_the_steps_with_the_reason():
    result = run_python(
        CHANGED_SHAPE
        + """
import transformers.modeling_layers
states = {s.name: (s.state, s.reason) for s in shim.status()}
for name in ("reentrant-keyword-grads", "reentrant-frozen-input-grads", "checkpoint-function-finds-layer"):
    state, reason = states[name]
    if name == "checkpoint-function-finds-layer" and state == "skipped" and "outside" in reason:
        continue  # transformers < 5.23: outside its gate
    assert state == "skipped" and "GradientCheckpointingLayer" in reason, (name, state, reason)
print("ok")
""",
        timeout=240,
        torch_first=True,
    )
    assert "ok" in result.stdout


# -- 7: what a disable/enable cycle costs -------------------------------------------------------------


def test_an_enable_passes_each_layer_through_the_path_once():
    """One place: an enable gives each layer its function once through the engine's one layer on
    the slot (however many patches have a step there: each is a part of it), and whether each step
    applies is decided once for the function every layer gets; the enable path carries one shim
    layer (checkpointing-restore's capture), not one per fix (on the last release before this path,
    three fixes each stacked the same installer there, and the cycle cost 1.6x upstream's)."""
    from shim.wrapping import patch_names_of

    model = tiny_llama(4)
    model.train()
    enable_checkpointing(model, {"use_reentrant": True})
    enable_path = vars(transformers.PreTrainedModel)["_set_gradient_checkpointing"]
    layers = [entry for entry in wrapt.wrapper_chain(enable_path) if patch_names_of(entry)]
    assert [patch_names_of(entry) for entry in layers] == [("checkpointing-restore",)]
    on_the_path = [name for name in (*STEPS, REPLACED_FORWARD) if shim.registry.is_on(name)]
    assert len(on_the_path) >= 2
    for target in (SLOT, SETSTATE):
        sharing = shim.wrappers(target)
        assert sorted(name for name, _layer in sharing) == sorted(on_the_path)
        assert len({id(layer) for _name, layer in sharing}) == 1, "one layer, whatever the number of patches"

    calls = collections.Counter()
    roots = tuple(os.path.dirname(path) + os.sep for path in (shim.__file__, shim.patches.__file__))

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            calls[(os.path.basename(frame.f_code.co_filename), frame.f_code.co_name)] += 1

    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
    sys.setprofile(profile)
    try:
        enable_checkpointing(model, {"use_reentrant": True})
    finally:
        sys.setprofile(None)
    assert calls[("assigning.py", "__set__")] == 4, calls  # one pass per layer
    # decided once per step for the function every layer gets, and shared: the two reentrant steps apply
    assert calls[("function.py", "layer_checkpoint")] == 2, calls
    steps_asked = sum(n for (file, name), n in calls.items() if name in ("is_reentrant", "_is_own"))
    assert steps_asked <= len(on_the_path), calls


def test_each_step_acts_by_its_patchs_one_switch():
    """The engine hands a step's part its patch's switch as the patch applies: what a layer holds
    carries, for each step, the switch the engine runs that patch's part by (``shim.switch_of``'s),
    no other looked up by a name."""
    from shim.checkpointing import ATTRIBUTE, LayerCheckpoint

    model = tiny_llama(2)
    model.train()
    enable_checkpointing(model, {"use_reentrant": True})
    held = model.model.layers[0].__dict__[ATTRIBUTE]
    assert type(held) is LayerCheckpoint and held.names, held
    assert [switch for switch, _act in held.steps] == [shim.switch_of(name) for name in held.names]
    assert all(switch is shim.switch_of(name) for (switch, _act), name in zip(held.steps, held.names))


# -- 8: a step added later still acts before finds-layer's hand-over ----------------------------------

#: A tiny Llama trained through a layer-finding checkpoint function with a step of ``STEP_MODULE``
#: (``USE_STEP`` makes it known); the order on the slot, what the step saw, the wrong gradients.
STEP_RUN = """
import json, sys
import torch
import shim
from tests.tinymodels import tiny_llama
from tests.steps import layer_finding_checkpoint, trainable_grads, wrong_grads
USE_STEP

torch.manual_seed(0)
model = tiny_llama(3)
model.train()
model.model.layers[0].requires_grad_(False)
ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
loss_of = lambda m: m(ids, labels=ids).loss
reference = trainable_grads(model, loss_of)
model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=layer_finding_checkpoint())
grads = trainable_grads(model, loss_of)
slot = "transformers.modeling_layers:GradientCheckpointingLayer._gradient_checkpointing_func"
print(json.dumps({
    "order": [name for name, _layer in shim.wrappers(slot)],
    "state": {s.name: s.state for s in shim.status()}[step.NAME],
    "seen": step.SEEN,
    "wrong": wrong_grads(reference, grads),
    "effects": {s.name: s.effects for s in shim.status() if s.name == "checkpoint-function-finds-layer"},
}))
"""
LATE_STEP = STEP_RUN.replace("USE_STEP", "from tests.patches import late_step as step\nshim.register(step.PATCH)")


@pytest.mark.parametrize("name", ["checkpoint-aware-step", "late-step", "zz-step"])
@pytest.mark.parametrize("after", [(), ("reentrant-frozen-input-grads",)], ids=["no after", "after frozen"])
def test_finds_layer_stays_innermost_whatever_a_new_step_is_called_or_declared_after(name, after):
    """Had finds-layer no place of its own, ties by name would put a step called, say,
    ``checkpoint-aware-step`` inside it (acting after its hand-over); ``place="innermost"`` keeps it
    next to upstream in the one order, without naming the steps before it."""
    import dataclasses

    from shim.tools.index import declared, stacking_order
    from tests.patches import late_step

    step = dataclasses.replace(late_step.PATCH, name=name, after=after)
    ordered = [patch.name for patch in stacking_order([*declared(), step])]
    on_the_slot = [n for n in ordered if n in (*STEPS, name)]
    assert on_the_slot[0] == "checkpoint-function-finds-layer", on_the_slot


@from_5_23
def test_a_step_declared_later_after_a_built_in_acts_before_finds_layers_hand_over():
    """A new step, in its own module, declared after reentrant-frozen-input-grads and naming no
    other step: finds-layer still acts last (``place="innermost"``), so the recomputation the new
    step hands over still carries the layer both ways and a layer-finding function trains right."""
    out = json.loads(run_python(LATE_STEP, torch_first=True).stdout.splitlines()[-1])
    assert out["order"].index("late-step") < out["order"].index("checkpoint-function-finds-layer"), out["order"]
    assert out["order"][-1] == "checkpoint-function-finds-layer"
    assert out["seen"] and not any(out["seen"]), "the late step acts before finds-layer's hand-over"
    assert out["wrong"] == []
    assert out["effects"]["checkpoint-function-finds-layer"] > 0


# -- 9: a step that cannot act is refused where it is declared ------------------------------------------


def test_a_step_with_nothing_to_do_or_a_name_is_refused_where_it_is_declared():
    """A ``Step`` is made when the patch module is imported: one with neither an ``act`` nor a
    ``given``, an ``act`` without ``applies``, or a name (which once could differ from its patch's)
    fails there, saying what is wrong, not at an enable."""
    from shim.checkpointing import Step, targets

    with pytest.raises(TypeError, match="an act, a given, or both"):
        Step()
    with pytest.raises(TypeError, match="needs applies"):
        Step(act=lambda layer, function, args: None)
    with pytest.raises(TypeError, match=r"Step\('my-step', \.\.\.\): a step takes no name"):
        Step("my-step", given=lambda layer, function: function)
    with pytest.raises(TypeError, match="applies must be a callable"):
        Step(applies="my-step", act=lambda layer, function, args: None)
    with pytest.raises(TypeError, match="takes a shim.checkpointing.Step"):
        targets("my-step")
    slot, setstate = targets(Step(given=lambda layer, function: function))
    assert slot.assign and not setstate.assign


# -- 10: a patch pack's step, through the public API ----------------------------------------------------

#: The pack's module: late_step.py's step under another name, in a distribution of its own.
PACK_STEP = (Path(__file__).with_name("late_step.py")).read_text().replace('NAME = "late-step"', 'NAME = "pack-step"')
#: The pack found through its entry points (its module imported with its target module).
PACK_RUN = STEP_RUN.replace("import shim\n", "sys.path.insert(0, PACK_ROOT)\nimport shim\n", 1).replace(
    "USE_STEP", "import shim_step_pack.fixes as step"
)


@from_5_23
def install_step_pack(root, package, patch, source, after=""):
    """An installed distribution under ``root``: package ``package`` whose ``fixes`` module (``source``)
    declares patch ``patch`` on the checkpointing path, with its record (``after``: the patch it sits after)."""
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    (root / package / "fixes.py").write_text(source)
    metadata = root / f"{package}-1.0.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 1.0\n")
    order = f"\n[hf_train_shim.order]\n{patch}.after.{after} = {package}.fixes\n" if after else ""
    (metadata / "entry_points.txt").write_text(
        f"[hf_train_shim.patches]\n{patch} = {package}.fixes:PATCH\n\n[hf_train_shim.targets]\n"
        f"{patch}.transformers.modeling_layers = transformers.modeling_layers\n{order}"
    )


def test_a_patch_packs_step_is_ordered_with_the_built_ins_steps(tmp_path):
    """A pack (another distribution, found through its entry point) declares a step with
    ``shim.checkpointing`` alone: it registers after the built-ins, so its part sits outside theirs
    of the same place (it acts first on a call), and finds-layer, innermost, still hands the layer
    both ways to what the pack's step handed over."""
    install_step_pack(tmp_path, "shim_step_pack", "pack-step", PACK_STEP, after="reentrant-frozen-input-grads")
    out = json.loads(
        run_python(PACK_RUN.replace("PACK_ROOT", repr(str(tmp_path))), torch_first=True).stdout.splitlines()[-1]
    )
    assert out["state"] == "applied"
    assert out["order"][0] == "pack-step" and out["order"][-1] == "checkpoint-function-finds-layer", out["order"]
    assert out["seen"] and not any(out["seen"]), "the pack's step acts before finds-layer's hand-over"
    assert out["wrong"] == []


# -- 11: a pack's step is its patch's, and its faults stay out of the user's code ------------------------

#: A pack's module with one step, ``STEP_SOURCE`` (``probe`` and ``targets`` imported), in patch ``my-fix``.
FAULTY_PACK = """
from shim import Patch
from shim.checkpointing import Step, probe, targets


def boom(*args):
    raise RuntimeError("the step broke")


STEP = STEP_SOURCE
PATCH = Patch(
    name="my-fix",
    summary="A pack's step.",
    distribution="transformers",
    requires=">=4.57",
    targets=targets(STEP, probe=probe),
)
"""
#: A tiny Llama trained twice with non-reentrant checkpointing, enabled through the public API,
#: what reached torch's checkpoint recorded (no built-in step applies to it: only the pack's may).
FAULTY_RUN = """
import functools, json, sys, warnings
sys.path.insert(0, PACK_ROOT)
caught = warnings.catch_warnings(record=True).__enter__()  # from the pack module's import on
warnings.simplefilter("always")
import torch
import shim
import transformers.modeling_utils as modeling_utils
from tests.tinymodels import tiny_llama
from tests.steps import trainable_grads, wrong_grads

reached, real = [], modeling_utils.checkpoint
def spy(function, *args, **kwargs):
    reached.append(function)
    return real(function, *args, **kwargs)
modeling_utils.checkpoint = torch.utils.checkpoint.checkpoint = spy  # torch's, as the steps see it

torch.manual_seed(0)
model = tiny_llama(2)
model.train()
ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
loss_of = lambda m: m(ids, labels=ids).loss
reference = trainable_grads(model, loss_of)
try:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    raised = None
except Exception as error:
    raised = f"{type(error).__name__}: {error}"
grads = [trainable_grads(model, loss_of) for _ in range(2)] if raised is None else []
status = {s.name: (s.state, s.reason) for s in shim.status()}.get("my-fix")
held = model.model.layers[0].__dict__.get("_gradient_checkpointing_func")
print(json.dumps({
    "raised": raised,
    "status": status,
    "warnings": [str(w.message) for w in caught if issubclass(w.category, shim.ShimWarning) and "my-fix" in str(w.message)],
    "held": type(held).__name__,
    "reached": sorted({f"{type(f).__name__} {getattr(f.func, '__module__', '').partition('.')[0]}" for f in reached}),
    "layer calls": len(reached),
    "wrong": [name for g in grads for name in wrong_grads(reference, g)],
    "grads": sum(1 for g in grads for value in g.values() if value is not None),
}))
"""


def run_step_pack(tmp_path, step_source, env=None):
    """``FAULTY_RUN`` with a pack (another distribution, found through its entry point) whose patch
    ``my-fix`` has the step ``step_source``; what it printed."""
    install_step_pack(tmp_path, "shim_faulty_pack", "my-fix", FAULTY_PACK.replace("STEP_SOURCE", step_source))
    code = FAULTY_RUN.replace("PACK_ROOT", repr(str(tmp_path)))
    return json.loads(run_python(code, env=env, torch_first=True).stdout.splitlines()[-1])


def test_a_pack_step_that_repeats_a_name_is_refused_and_the_enable_trains(tmp_path):
    """``Step("my-step", ...)`` in patch ``my-fix`` once showed ``applied`` and then raised
    ``KeyError: "no patch named 'my-step'"`` into every ``gradient_checkpointing_enable()``. A step
    has no name now: the declaration is refused when the pack's module is imported (its target's
    import), with one warning saying how to write it, and the enable and training go on."""
    out = run_step_pack(tmp_path, 'Step("my-step", applies=callable, act=lambda layer, function, args: None)')
    assert out["raised"] is None, out["raised"]
    state, reason = out["status"]
    assert state == "failed" and "a step takes no name" in reason, out["status"]
    (warned,) = out["warnings"]
    assert "my-fix" in warned and "Step(applies=..., act=..., given=...)" in warned
    assert out["held"] == "partial" and out["reached"] == ["partial transformers"], out
    assert out["wrong"] == [] and out["grads"] > 0


#: A step whose applies, act or given raises (and does nothing else).
FAULTS = {
    "applies": "Step(applies=boom, act=lambda layer, function, args: None)",
    "act": "Step(applies=callable, act=boom)",
    "given": "Step(given=boom)",
}


@pytest.mark.parametrize("where", list(FAULTS))
def test_a_step_that_raises_is_one_warning_and_the_layer_keeps_upstreams_function(tmp_path, where):
    """Nothing a pack's step does reaches ``gradient_checkpointing_enable()`` or the training step:
    its patch applied, a raise in its ``applies`` or ``given`` (as a layer is given its function) or
    in its ``act`` (on each checkpointed call) is one ``ShimWarning`` naming the patch; torch's
    checkpoint is handed what the layer handed over (upstream's partial, not a step's), and two
    training steps get the gradients of no checkpointing."""
    out = run_step_pack(tmp_path, FAULTS[where])
    assert out["raised"] is None, out["raised"]
    assert out["status"][0] == "applied", out["status"]
    (warned,) = out["warnings"]
    assert warned.startswith("patch 'my-fix': its checkpointing step raised RuntimeError: the step broke"), warned
    assert out["reached"] == ["partial transformers"], out["reached"]
    assert out["layer calls"] >= 4, "two steps through two checkpointed layers"
    # decided faults leave the layer upstream's partial; a fault per call, the decision the step made
    assert out["held"] == ("LayerCheckpoint" if where == "act" else "partial")
    assert out["wrong"] == [] and out["grads"] > 0


def test_under_strict_mode_a_step_that_raises_is_a_patch_error(tmp_path):
    out = run_step_pack(tmp_path, FAULTS["applies"], env={"SHIM_STRICT": "1"})
    assert out["raised"].startswith("PatchError: patch 'my-fix': its checkpointing step raised RuntimeError"), out
