"""checkpointing-call-signature: re-enable calls fit every signature of the method they reach."""

import importlib.util
import inspect

import pytest
import torch
import transformers

import shim
from tests.conftest import run_python
from tests.patches.checkpointing_cases import (
    TRANSFORMERS,
    TrainerRows,
    checkpoint_kwargs,
    configure,
    layer_flags,
    quietly,
    supports,
    tiny_llama,
)
from tests.tinymodels import tiny_llama_config

HAS_TRL = importlib.util.find_spec("trl") is not None
CONFIGURED = {"use_reentrant": TRANSFORMERS.major >= 5}


def wrapper_class(shape: str):
    """A user wrapper around a model whose gradient_checkpointing_enable has the given signature."""
    enable_sources = {
        "(kw=None)": "def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):\n"
        "    self._enable(gradient_checkpointing_kwargs)",
        "(*, kw=None)": "def gradient_checkpointing_enable(self, *, gradient_checkpointing_kwargs=None):\n"
        "    self._enable(gradient_checkpointing_kwargs)",
        "(**kwargs)": "def gradient_checkpointing_enable(self, **kwargs):\n"
        "    self._enable(kwargs.get('gradient_checkpointing_kwargs'))",
        "(kw=None, **kwargs)": "def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):\n"
        "    self._enable(gradient_checkpointing_kwargs)",
        "()": "def gradient_checkpointing_enable(self):\n    self._enable(None)",
    }
    namespace = {}
    exec(enable_sources[shape], namespace)

    class Wrapper(torch.nn.Module):
        gradient_checkpointing_enable = namespace["gradient_checkpointing_enable"]

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def _enable(self, kwargs):
            quietly(self.inner.gradient_checkpointing_enable, gradient_checkpointing_kwargs=kwargs)

        def gradient_checkpointing_disable(self):
            quietly(self.inner.gradient_checkpointing_disable)

        @property
        def is_gradient_checkpointing(self):
            return quietly(lambda: self.inner.is_gradient_checkpointing)

    return Wrapper


SHAPES = ["(kw=None)", "(*, kw=None)", "(**kwargs)", "(kw=None, **kwargs)", "()"]
# Which shapes trl's positional re-enable breaks upstream.
BROKEN_UPSTREAM = {"(*, kw=None)", "(**kwargs)", "()"}


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
@pytest.mark.parametrize("pass_kwargs", [False, True], ids=["None", "kwargs"])
@pytest.mark.parametrize("shape", SHAPES)
def test_trl_disable_context_re_enables_every_signature_shape(shape, pass_kwargs):
    utils = importlib.import_module("trl.models.utils")
    if not hasattr(utils, "disable_gradient_checkpointing"):
        pytest.skip("version rule: disable_gradient_checkpointing exists from trl 0.26")

    def cycle():
        model = tiny_llama()
        configure(model, CONFIGURED)
        wrapper = wrapper_class(shape)(model)
        with utils.disable_gradient_checkpointing(wrapper, CONFIGURED if pass_kwargs else None):
            assert not wrapper.is_gradient_checkpointing
        return model

    with shim.disabled():
        if shape in BROKEN_UPSTREAM:
            with pytest.raises(TypeError):
                cycle()
        else:
            cycle()  # this shape works upstream: the shim must keep it working

    model = cycle()
    assert checkpoint_kwargs(model) == CONFIGURED


@pytest.mark.skipif(
    not HAS_TRL or not hasattr(importlib.import_module("trl.models.utils"), "disable_gradient_checkpointing"),
    reason="version rule: disable_gradient_checkpointing exists from trl 0.26",
)
def test_trainer_module_that_bound_the_name_before_import_shim_sees_the_fix():
    code = """
    import trl.models.utils, trl.trainer.dpo_trainer as dpo
    assert dpo.disable_gradient_checkpointing is trl.models.utils.disable_gradient_checkpointing
    unpatched = dpo.disable_gradient_checkpointing
    import shim
    from shim.wrapping import patch_names_of
    import wrapt
    bound = dpo.disable_gradient_checkpointing
    print(bound is not unpatched, any("checkpointing-call-signature" in patch_names_of(e) for e in wrapt.wrapper_chain(bound)))
    from tests.patches.test_checkpointing_call_signature import wrapper_class
    from tests.patches.checkpointing_cases import tiny_llama, configure, checkpoint_kwargs
    model = tiny_llama(); configure(model, {"use_reentrant": True})
    with dpo.disable_gradient_checkpointing(wrapper_class("(*, kw=None)")(model), {"use_reentrant": True}):
        pass
    print(checkpoint_kwargs(model))
    shim.deactivate()
    print(dpo.disable_gradient_checkpointing is unpatched)
    """
    lines = run_python(code, torch_first=True).stdout.strip().splitlines()[-3:]
    assert lines == ["True True", "{'use_reentrant': True}", "True"]


# -- transformers >= 5.16 sends every_n_layers/offload to overrides ------------------------

needs_new_keywords = pytest.mark.skipif(
    not supports("every_n_layers"), reason="version rule: every_n_layers/offload are sent from transformers 5.16"
)


def override_class(shape: str):
    if shape == "legacy":

        class Legacy(transformers.LlamaForCausalLM):
            def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
                quietly(
                    super().gradient_checkpointing_enable, gradient_checkpointing_kwargs=gradient_checkpointing_kwargs
                )

        return Legacy
    if shape == "keyword-only":

        class KeywordOnly(transformers.LlamaForCausalLM):
            def gradient_checkpointing_enable(self, *, gradient_checkpointing_kwargs=None):
                quietly(
                    super().gradient_checkpointing_enable, gradient_checkpointing_kwargs=gradient_checkpointing_kwargs
                )

        return KeywordOnly

    class Forwarding(transformers.LlamaForCausalLM):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
            quietly(
                super().gradient_checkpointing_enable,
                gradient_checkpointing_kwargs=gradient_checkpointing_kwargs,
                **kwargs,
            )

    return Forwarding


def train_one_step(model, tmp_path, kwargs):
    fields = {f.name for f in __import__("dataclasses").fields(transformers.TrainingArguments)}
    prefix = "activation" if "activation_checkpointing" in fields else "gradient"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        **{f"{prefix}_checkpointing": True, f"{prefix}_checkpointing_kwargs": kwargs},
    )
    quietly(transformers.Trainer(model=model, args=args, train_dataset=TrainerRows()).train)


TRAINER_KWARGS = {
    "None": None,
    "reentrant": {"use_reentrant": True},
    "non-reentrant every_n_layers=2": {"use_reentrant": False, "every_n_layers": 2},
}


@needs_new_keywords
@pytest.mark.parametrize("kwargs_id", list(TRAINER_KWARGS))
@pytest.mark.parametrize("shape", ["legacy", "keyword-only", "**kwargs"])
def test_trainer_step_with_an_override(shape, kwargs_id, tmp_path):
    kwargs = TRAINER_KWARGS[kwargs_id]
    model_class = override_class(shape)
    narrow = shape != "**kwargs"
    every_n = (kwargs or {}).get("every_n_layers", 1)

    if narrow:
        with shim.disabled(), pytest.raises(TypeError, match="every_n_layers"):
            train_one_step(model_class(tiny_config()), tmp_path, kwargs)

    model = model_class(tiny_config())
    if narrow and every_n != 1:
        with pytest.raises(TypeError, match=r"does not accept every_n_layers=2.*Accept \*\*kwargs in the override"):
            train_one_step(model, tmp_path, kwargs)
        return
    train_one_step(model, tmp_path, kwargs)
    expected = {k: v for k, v in (kwargs or {"use_reentrant": False}).items() if k != "every_n_layers"}
    assert checkpoint_kwargs(model) == expected
    assert layer_flags(model) == [i % every_n == 0 for i in range(4)]


def tiny_config():
    from tests.tinymodels import tiny_llama_config

    return tiny_llama_config(num_hidden_layers=4)


@needs_new_keywords
@pytest.mark.skipif(
    not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"),
    reason="version rule: activation_checkpointing_enable exists from transformers 5.23",
)
def test_activation_checkpointing_enable_reaches_a_narrow_override():
    model = override_class("keyword-only")(tiny_config())
    with shim.disabled(), pytest.raises(TypeError, match="every_n_layers"):
        model.activation_checkpointing_enable({"use_reentrant": True})
    model.activation_checkpointing_enable({"use_reentrant": True})
    assert checkpoint_kwargs(model) == {"use_reentrant": True}
    with pytest.raises(TypeError, match="KeywordOnly.gradient_checkpointing_enable .* does not accept offload=True"):
        model.activation_checkpointing_enable({"use_reentrant": True}, offload=True)


def test_peft_signature_check_still_sees_the_parameter():
    """PEFT passes kwargs only if `gradient_checkpointing_kwargs` is in the enable signature."""
    model = tiny_llama()
    assert "gradient_checkpointing_kwargs" in inspect.signature(model.gradient_checkpointing_enable).parameters


@pytest.mark.skipif(not HAS_TRL or importlib.util.find_spec("trl.models.utils") is None, reason="trl is not installed")
def test_call_signature_counts_calls_trl_would_have_broken(ledger):
    from trl.models import utils as trl_utils

    if not hasattr(trl_utils, "disable_gradient_checkpointing"):
        pytest.skip("version rule: disable_gradient_checkpointing exists from trl 0.26")

    class KeywordOnly(transformers.LlamaForCausalLM):
        def gradient_checkpointing_enable(self, *, gradient_checkpointing_kwargs=None):
            quietly(super().gradient_checkpointing_enable, gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    plain = tiny_llama()
    configure(plain, {"use_reentrant": False})
    with quietly(trl_utils.disable_gradient_checkpointing, plain, {"use_reentrant": False}):
        pass
    assert ledger("checkpointing-call-signature") == (0, "")

    model = KeywordOnly(tiny_llama_config())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with quietly(trl_utils.disable_gradient_checkpointing, model, {"use_reentrant": False}):
        pass
    count, last = ledger("checkpointing-call-signature")
    # The re-enable calls what trl calls, the override itself (by keyword): one effect on every release.
    assert count == 1
    assert last.startswith("re-enabled checkpointing on KeywordOnly through its signature ")
    assert "would have passed {'use_reentrant': False} positionally and raised TypeError" in last


@pytest.mark.skipif(
    not HAS_TRL or not hasattr(importlib.import_module("trl.models.utils"), "disable_gradient_checkpointing"),
    reason="version rule: disable_gradient_checkpointing exists from trl 0.26",
)
@pytest.mark.parametrize("pass_kwargs", [False, True], ids=["None", "kwargs"])
def test_trls_cycle_calls_what_trl_calls_with_the_same_warnings(pass_kwargs):
    """The replacement calls the methods trl's own calls (the ``gradient_checkpointing_*`` names):
    a stock model's cycle warns exactly as without the shim (transformers' FutureWarnings for the
    old names from 5.23), so ``-W error::FutureWarning`` runs end alike."""
    import warnings

    utils = importlib.import_module("trl.models.utils")

    def cycle():
        model = tiny_llama()
        configure(model, CONFIGURED)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with utils.disable_gradient_checkpointing(model, CONFIGURED if pass_kwargs else None):
                pass
        return sorted({(w.category.__name__, str(w.message)) for w in caught}), checkpoint_kwargs(model)

    with shim.disabled("checkpointing-call-signature"):
        upstream = cycle()
    assert cycle() == upstream
