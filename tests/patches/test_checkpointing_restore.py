"""checkpointing-restore: every disable/enable cycle gives back the exact checkpointing configuration.

Each case first runs the cycle with the shim switched off (``shim.disabled()``) on the installed
upstream releases and shows the configuration lost, then with the shim on and shows it intact.
What is compared is what reaches ``torch.utils.checkpoint``: each module's flag, the function under
its checkpoint partial and the partial's keywords.
"""

import copy
import functools
import gc
import importlib.util
import pickle
import weakref

import accelerate
import pytest
import torch

import shim
from shim.patches._checkpointing_calls import disable, enable
from shim.patches._checkpointing_state import ModelState, layer_state
from tests.patches.checkpointing_cases import (
    DISABLE,
    ENABLE,
    TRANSFORMERS,
    checkpoint_kwargs,
    configure,
    describe,
    layer_flags,
    quietly,
    supports,
    tiny_llama,
)

HAS_TRL = importlib.util.find_spec("trl") is not None
if HAS_TRL:
    import trl
    from trl.models.utils import unwrap_model_for_generation

    TRL_HAS_DISABLE_CONTEXT = hasattr(importlib.import_module("trl.models.utils"), "disable_gradient_checkpointing")
    UNWRAP_TAKES_KWARGS = (
        "gradient_checkpointing_kwargs" in __import__("inspect").signature(unwrap_model_for_generation).parameters
    )

# The configured use_reentrant is the opposite of the installed default, so a bare re-enable flips it.
FLIPPED = {"use_reentrant": TRANSFORMERS.major >= 5}

CONFIGS = {
    "use_reentrant-flipped": (FLIPPED, 1, False),
    "no-rng-state": ({**FLIPPED, "preserve_rng_state": False}, 1, False),
    "every_n_layers=2": ({"use_reentrant": True}, 2, False),
    "offload": ({"use_reentrant": True}, 1, True),
}


def config_param(name):
    marks = []
    if name == "every_n_layers=2" and not supports("every_n_layers"):
        marks.append(pytest.mark.skip(reason="version rule: every_n_layers exists from transformers 5.16"))
    if name == "offload" and not supports("offload"):
        marks.append(pytest.mark.skip(reason="version rule: offload exists from transformers 5.17"))
    return pytest.param(name, marks=marks, id=name)


def bare_gradient_checkpointing(model, kwargs):
    quietly(model.gradient_checkpointing_disable)
    quietly(model.gradient_checkpointing_enable)


def bare_activation_checkpointing(model, kwargs):
    getattr(model, DISABLE)()
    getattr(model, ENABLE)()


def trl_disable_context(pass_kwargs):
    def cycle(model, kwargs):
        with quietly(trl.models.utils.disable_gradient_checkpointing, model, kwargs if pass_kwargs else None):
            pass

    return cycle


def trl_unwrap_for_generation(pass_kwargs):
    def cycle(model, kwargs):
        accelerator = accelerate.Accelerator(cpu=True)
        extra = {"gradient_checkpointing_kwargs": kwargs} if pass_kwargs else {}
        with warnings_ignored():
            with unwrap_model_for_generation(model, accelerator, **extra) as unwrapped:
                assert unwrapped is model

    return cycle


def warnings_ignored():
    import warnings

    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("ignore", FutureWarning)

    class _Exit:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return context.__exit__(*exc)

    return _Exit()


def needs_trl(cycle, *, disable_context=False, unwrap_kwargs=False):
    marks = []
    if not HAS_TRL:
        marks.append(pytest.mark.skip(reason="trl is not installed"))
    elif disable_context and not TRL_HAS_DISABLE_CONTEXT:
        marks.append(pytest.mark.skip(reason="version rule: disable_gradient_checkpointing exists from trl 0.26"))
    elif unwrap_kwargs and not UNWRAP_TAKES_KWARGS:
        marks.append(
            pytest.mark.skip(
                reason="version rule: unwrap_model_for_generation takes gradient_checkpointing_kwargs from trl 1.16"
            )
        )
    return marks


# (id, cycle, passes the checkpoint kwargs back?, marks)
CYCLES = [
    ("bare gradient_checkpointing_*", bare_gradient_checkpointing, False, []),
    ("bare activation_checkpointing_*", bare_activation_checkpointing, False, []),
    ("trl disable_gradient_checkpointing(None)", trl_disable_context(False) if HAS_TRL else None, False, "ctx"),
    ("trl disable_gradient_checkpointing(kwargs)", trl_disable_context(True) if HAS_TRL else None, True, "ctx"),
    ("trl unwrap_model_for_generation()", trl_unwrap_for_generation(False) if HAS_TRL else None, False, "unwrap"),
    (
        "trl unwrap_model_for_generation(kwargs)",
        trl_unwrap_for_generation(True) if HAS_TRL else None,
        True,
        "unwrap-kwargs",
    ),
]


def cycle_params(losing_only: bool):
    """Cycles × configurations where upstream loses the configuration (or, if not, where it keeps it)."""
    params = []
    for cycle_id, cycle, passes_kwargs, kind in CYCLES:
        marks = []
        if kind == "ctx":
            marks = needs_trl(cycle, disable_context=True)
        elif kind == "unwrap":
            marks = needs_trl(cycle)
        elif kind == "unwrap-kwargs":
            marks = needs_trl(cycle, unwrap_kwargs=True)
        elif cycle is bare_activation_checkpointing and ENABLE == "gradient_checkpointing_enable":
            marks = [pytest.mark.skip(reason="version rule: activation_checkpointing_* exists from transformers 5.23")]
        for config_name, (_kwargs, every_n_layers, offload) in CONFIGS.items():
            # Passing the checkpoint kwargs back keeps them; only every_n_layers/offload are lost then.
            loses = not passes_kwargs or every_n_layers != 1 or offload
            if loses != losing_only:
                continue
            config_marks = list(config_param(config_name).marks)
            params.append(pytest.param(cycle, config_name, marks=marks + config_marks, id=f"{cycle_id}-{config_name}"))
    return params


def run_cycle(cycle, config_name, wrap=None):
    kwargs, every_n_layers, offload = CONFIGS[config_name]
    model = tiny_llama()
    configure(model, kwargs, every_n_layers, offload)
    before = describe(model)
    cycle(wrap(model) if wrap else model, kwargs)
    return before, describe(model)


@pytest.mark.parametrize("cycle, config_name", cycle_params(losing_only=True))
def test_cycle_restores_the_configuration(cycle, config_name):
    with shim.disabled():
        before, after = run_cycle(cycle, config_name)
    assert after != before, "the bug should show upstream"

    before, after = run_cycle(cycle, config_name)
    assert after == before


@pytest.mark.parametrize("cycle, config_name", cycle_params(losing_only=False))
def test_cycles_that_keep_the_configuration_upstream_stay_unchanged(cycle, config_name):
    with shim.disabled():
        upstream = run_cycle(cycle, config_name)
    patched = run_cycle(cycle, config_name)
    assert upstream[0] == upstream[1] and patched[0] == patched[1]


def test_an_explicit_configuration_on_re_enable_wins():
    model = tiny_llama()
    configure(model, FLIPPED)
    getattr(model, DISABLE)()
    explicit = {"use_reentrant": not FLIPPED["use_reentrant"], "preserve_rng_state": False}
    getattr(model, ENABLE)(explicit)
    assert checkpoint_kwargs(model) == explicit


@pytest.mark.skipif(not supports("every_n_layers"), reason="version rule: every_n_layers exists from transformers 5.16")
def test_every_n_layers_pattern_comes_back_after_a_bare_re_enable():
    model = tiny_llama()
    configure(model, {"use_reentrant": True}, every_n_layers=2)
    assert layer_flags(model) == [True, False, True, False]
    getattr(model, DISABLE)()
    with shim.disabled("checkpointing-restore"):
        getattr(model, ENABLE)()
    assert layer_flags(model) == [True, True, True, True], "upstream forgets the pattern"
    getattr(model, DISABLE)()
    getattr(model, ENABLE)()
    assert layer_flags(model) == [True, True, True, True], "a capture is only taken while checkpointing is on"

    configure(model, {"use_reentrant": True}, every_n_layers=2)
    getattr(model, DISABLE)()
    getattr(model, ENABLE)()
    assert layer_flags(model) == [True, False, True, False]
    assert checkpoint_kwargs(model) == {"use_reentrant": True}


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
@pytest.mark.skipif(not supports("every_n_layers"), reason="version rule: every_n_layers exists from transformers 5.16")
@pytest.mark.skipif(
    not HAS_TRL or not hasattr(trl.models, "enable_selective_activation_checkpointing"),
    reason="version rule: trl selective activation checkpointing exists from trl 1.13 – 1.15 (measured: absent in 1.12, present in 1.15)",
)
def test_trl_selective_checkpointing_keeps_its_context_fn_and_the_pattern():
    def build():
        model = tiny_llama()
        trl.models.enable_selective_activation_checkpointing(model)
        configure(model, {"use_reentrant": False}, every_n_layers=2)
        return model

    for switched_off in (True, False):
        model = build()
        before = describe(model)
        assert "context_fn" in checkpoint_kwargs(model)
        context = shim.disabled() if switched_off else _nothing()
        with context:
            accelerator = accelerate.Accelerator(cpu=True)
            with warnings_ignored(), unwrap_model_for_generation(model, accelerator):
                pass
        if switched_off:
            assert describe(model) != before and layer_flags(model) == [True] * 4, "upstream loses the pattern"
        else:
            assert describe(model) == before


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
def test_peft_lora_model_cycle_through_trl_keeps_the_configuration():
    import peft

    def cycle(model, kwargs):
        lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        accelerator = accelerate.Accelerator(cpu=True)
        with warnings_ignored(), unwrap_model_for_generation(lora, accelerator):
            pass

    with shim.disabled():
        before, after = run_cycle(cycle, "use_reentrant-flipped")
    assert after != before
    before, after = run_cycle(cycle, "use_reentrant-flipped")
    assert after == before


def test_user_wrapper_that_delegates_to_an_inner_model():
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            quietly(
                self.inner.gradient_checkpointing_enable, gradient_checkpointing_kwargs=gradient_checkpointing_kwargs
            )

        def gradient_checkpointing_disable(self):
            quietly(self.inner.gradient_checkpointing_disable)

    def cycle(model, kwargs):
        wrapper = Wrapper(model)
        wrapper.gradient_checkpointing_disable()
        wrapper.gradient_checkpointing_enable()

    with shim.disabled():
        before, after = run_cycle(cycle, "use_reentrant-flipped")
    assert after != before
    before, after = run_cycle(cycle, "use_reentrant-flipped")
    assert after == before


def test_no_future_warning_of_the_shims_own(recwarn):
    import warnings

    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        configure(model, FLIPPED)
        getattr(model, DISABLE)()
        getattr(model, ENABLE)()
    # trl's own context calls the deprecated names, and so does the shim's replacement of it: it warns
    # as without the shim (test_checkpointing_call_signature.py, ..._with_the_same_warnings).
    assert checkpoint_kwargs(model) == FLIPPED


def test_trl_value_head_style_aliases_of_bound_methods():
    """trl's value-head models copy the inner model's bound enable/disable onto themselves."""

    class ValueHeadLike(torch.nn.Module):
        def __init__(self, pretrained_model):
            super().__init__()
            self.pretrained_model = pretrained_model
            self.gradient_checkpointing_disable = pretrained_model.gradient_checkpointing_disable
            self.gradient_checkpointing_enable = pretrained_model.gradient_checkpointing_enable

    def cycle(model, kwargs):
        value_head = ValueHeadLike(model)
        quietly(value_head.gradient_checkpointing_disable)
        quietly(value_head.gradient_checkpointing_enable)

    with shim.disabled():
        before, after = run_cycle(cycle, "use_reentrant-flipped")
    assert after != before
    before, after = run_cycle(cycle, "use_reentrant-flipped")
    assert after == before


# -- the layout the capture reuses between cycles ---------------------------------------------------


class _EqualToAll:
    """A layer that compares equal to anything (a user's ``__eq__``): the layout is told by
    identity, so replacing a layer with such a one is noticed too."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


@pytest.mark.parametrize(
    "change", ["replace a layer", "replace a layer by an equal one", "append a layer", "remove a layer"]
)
def test_a_layer_replaced_added_or_removed_between_cycles_is_captured_too(change):
    """The capture walks the model once and then watches where its checkpointing modules sit;
    a change there is noticed and the next cycle still restores every layer."""
    model = tiny_llama(layers=4)
    configure(model, {**FLIPPED, "preserve_rng_state": False})
    bare_activation_checkpointing(model, None)  # the first cycle walks the model and keeps its layout
    layers = model.model.layers
    if change == "replace a layer":
        layers[1] = type(layers[1])(model.config, layer_idx=1)
    elif change == "replace a layer by an equal one":
        equal = type("EqualLayer", (_EqualToAll, type(layers[1])), {})
        assert equal(model.config, layer_idx=1) == layers[1]
        layers[1] = equal(model.config, layer_idx=1)
    elif change == "append a layer":
        layers.append(type(layers[1])(model.config, layer_idx=4))
    else:
        del layers[3]
    configured = describe(model)["model.layers.0"]
    for layer in layers:  # the new layer joins the configuration by hand
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = model.model.layers[0]._gradient_checkpointing_func
    bare_activation_checkpointing(model, None)
    assert {name: state for name, state in describe(model).items() if name.startswith("model.layers.")} == {
        f"model.layers.{index}": configured for index in range(len(layers))
    }


def test_checkpointing_restore_counts_restored_configurations_only(ledger):
    model = tiny_llama()
    configure(model, None)  # transformers' defaults: a cycle changes nothing
    quietly(disable, model)
    quietly(enable, model, None)
    assert ledger("checkpointing-restore") == (0, "")

    configure(model, {"use_reentrant": True, "preserve_rng_state": False})
    quietly(disable, model)
    quietly(enable, model, None)
    count, last = ledger("checkpointing-restore")
    assert count == 1
    assert last.startswith("LlamaForCausalLM was re-enabled without a configuration: transformers reset it to ")
    modules = sum(1 for module in model.modules() if hasattr(module, "gradient_checkpointing"))
    assert last.endswith(
        f"the shim restored {{'use_reentrant': True, 'preserve_rng_state': False}} on {modules} module(s)"
    )


# -- an explicit every_n_layers=1 --------------------------------------------------------------------


@pytest.mark.skipif(not supports("every_n_layers"), reason="version rule: every_n_layers exists from transformers 5.16")
def test_an_explicit_every_n_layers_1_wins_over_the_captured_pattern():
    model = tiny_llama(layers=4)
    getattr(model, ENABLE)({"use_reentrant": True}, every_n_layers=2)
    assert layer_flags(model) == [True, False, True, False]
    quietly(disable, model)
    getattr(model, ENABLE)({"use_reentrant": True}, every_n_layers=1)
    assert layer_flags(model) == [True, True, True, True]
    quietly(disable, model)
    getattr(model, ENABLE)({"use_reentrant": True})  # nothing passed: the configuration comes back
    assert layer_flags(model) == [True, True, True, True]


# -- a disabled model is freed; a deep copy restores onto its own modules ---------------------------------------------------------------------


def test_a_disabled_model_whose_checkpoint_function_references_it_is_freed():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    model = tiny_llama(layers=2)

    def decide(model, ctx, op, *args, **kwargs):  # a policy that reads the model, as selective checkpointing does
        return CheckpointPolicy.PREFER_RECOMPUTE if model.training else CheckpointPolicy.MUST_SAVE

    policy = functools.partial(decide, model)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    quietly(enable, model, {"use_reentrant": False, "context_fn": context_fn})
    quietly(disable, model)
    alive = weakref.ref(model)
    del model, policy, context_fn
    gc.collect()
    assert alive() is None


def test_a_deep_copy_between_disable_and_enable_restores_onto_its_own_modules():
    model = tiny_llama(layers=4)
    quietly(enable, model, {"use_reentrant": True, "preserve_rng_state": False})
    configured = layer_state(model)
    quietly(disable, model)
    twin = copy.deepcopy(model)
    quietly(enable, twin, None)
    assert {k: (flag, dict(f.keywords)) for k, (flag, f) in layer_state(twin).items()} == {
        k: (flag, dict(f.keywords)) for k, (flag, f) in configured.items()
    }
    # A pickled model carries no capture (its functions need not pickle; upstream's hooks already
    # don't) and nothing of the shim's: it loads where the shim is not installed.
    assert pickle.loads(pickle.dumps(model.__dict__[ModelState.KEY])) is None
