"""trl-selective-reaches-peft: trl's selective checkpointing reaches the layers of a PEFT model."""

import functools
import logging
import warnings

import pytest
import torch
import transformers

import shim
from shim.tools.targets import quiet_transformers
from tests.probes import bug_found
from tests.steps import wrong_grads
from tests.tinymodels import lora_config, sft_inputs, tiny_llama

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
pytest.importorskip("datasets")

from shim.patches import trl_selective_reaches_peft as patch_module  # noqa: E402

NAME = "trl-selective-reaches-peft"
pytestmark = pytest.mark.skipif(
    not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    or not hasattr(trl.models, "enable_selective_activation_checkpointing"),
    reason="version rule: trl's selective checkpointing (trl 1.15) meets activation_checkpointing_enable (transformers 5.23)",
)
quiet_transformers()
LAYERS = 3


class CheckpointCalls:
    """Every call of ``torch.utils.checkpoint.checkpoint`` from a layer's checkpoint function: the
    layer and the ``context_fn`` it was given (transformers binds ``checkpoint`` at enable time, from
    ``transformers.modeling_utils``, so that name is where the recorder goes in)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = transformers.modeling_utils.checkpoint

        def checkpoint(function, *args, **kwargs):
            self.calls.append((_layer_of(function), kwargs.get("context_fn")))
            return real(function, *args, **kwargs)

        monkeypatch.setattr(transformers.modeling_utils, "checkpoint", checkpoint)

    def context_fns(self, model) -> list:
        """One entry per decoder layer, in order: the set of context functions its calls got."""
        layers = list(model.get_base_model().model.layers)
        assert {id(layer) for layer, _ in self.calls} <= {id(layer) for layer in layers}
        return [{context for layer, context in self.calls if layer is each} for each in layers]


def _layer_of(function):
    owner = function.func if isinstance(function, functools.partial) else function
    return function.args[0] if isinstance(function, functools.partial) and function.args else owner.__self__


def is_trl_policy(context_fn) -> bool:
    """trl's SAC context function: ``partial(create_selective_checkpoint_contexts, <trl's policy_fn>)``."""
    return (
        isinstance(context_fn, functools.partial)
        and context_fn.func is torch.utils.checkpoint.create_selective_checkpoint_contexts
        and context_fn.args[0].__qualname__ == "_build_policy_fn.<locals>.policy_fn"
        and context_fn.args[0].__module__ == "trl.models.selective_activation_checkpointing"
    )


class LoraGrads(transformers.TrainerCallback):
    """The LoRA parameters' gradients just before the optimizer step."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def sft_trainer(tmp_path, checkpointing: bool):
    """A real SFTTrainer on a tiny Llama with a LoraConfig (random B, so every LoRA gradient is
    non-zero), ``selective`` checkpointing when ``checkpointing``; seeded, so two builds are equal."""
    from trl import SFTConfig, SFTTrainer

    tokenizer, model, dataset = sft_inputs(LAYERS)
    extra = dict(gradient_checkpointing=checkpointing)  # trl's SFTConfig checkpoints by default
    if checkpointing:
        extra["gradient_checkpointing_kwargs"] = {"selective": True}
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        max_length=16,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataset_num_proc=None,
        **extra,
    )
    grads = LoraGrads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # trl on transformers' deprecated names
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora_config(init_lora_weights=False),
            callbacks=[grads],
        )
    assert isinstance(trainer.model, peft.PeftModel)
    return trainer, grads


def train(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer.train()


def test_sft_trainer_with_lora_checkpoints_every_layer_with_trl_policy(tmp_path, monkeypatch, caplog, ledger):
    # upstream, all of the shim off: the key trl's wrapper would take out reaches torch
    with shim.disabled():
        trainer, _ = sft_trainer(tmp_path, checkpointing=True)
        with pytest.raises(ValueError, match="Unexpected keyword arguments: selective"):
            train(trainer)

    # this patch off, checkpoint-kwargs-clean on: training runs, trl's policy reaches no layer, with a warning
    calls = CheckpointCalls(monkeypatch)
    with shim.disabled(NAME), caplog.at_level(logging.WARNING, logger="shim"):
        trainer, _ = sft_trainer(tmp_path, checkpointing=True)
        train(trainer)
    assert calls.context_fns(trainer.model) == [{None}] * LAYERS, "bug: every layer checkpoints without trl's policy"
    assert "'selective': True reached the checkpointing enable of LlamaForCausalLM" in caplog.text
    assert ledger(NAME) == (0, "")

    calls.calls.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shim"):
        trainer, grads = sft_trainer(tmp_path, checkpointing=True)
        train(trainer)
    per_layer = calls.context_fns(trainer.model)
    assert all(len(contexts) == 1 and is_trl_policy(next(iter(contexts))) for contexts in per_layer), per_layer
    assert "reached the checkpointing enable" not in caplog.text
    assert ledger(NAME) == (
        1,
        "trl put its selective-checkpointing wrapper on PeftModel, which the Trainer's activation_checkpointing_enable "
        "passes by; the shim put it on the inner LlamaForCausalLM too, so its layers get trl's context_fn",
    )

    # the LoRA gradients are those of the same step without checkpointing
    reference_trainer, reference = sft_trainer(tmp_path, checkpointing=False)
    calls.calls.clear()
    train(reference_trainer)
    assert not calls.calls
    assert reference.grads and set(reference.grads) == set(grads.grads)
    assert all(g.abs().sum() > 0 for g in reference.grads.values())
    assert wrong_grads(reference.grads, grads.grads) == []


def test_the_inner_model_follows_the_switch(monkeypatch):
    from trl.models import enable_selective_activation_checkpointing

    def enable(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return [layer._gradient_checkpointing_func.keywords.get("context_fn") for layer in inner.model.layers]

    model = peft.get_peft_model(tiny_llama(2), lora_config())
    inner = model.get_base_model()
    enable_selective_activation_checkpointing(model)
    assert all(is_trl_policy(context) for context in enable(model))
    with shim.disabled(NAME):
        assert enable(model) == [None, None], "switched off, the inner model enables as upstream's"
    assert all(is_trl_policy(context) for context in enable(model))
    # the PeftModel's own old name still runs trl's wrapper, as upstream's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    assert all(is_trl_policy(layer._gradient_checkpointing_func.keywords["context_fn"]) for layer in inner.model.layers)


def test_models_trl_reaches_directly_are_left_as_upstream(ledger):
    from trl.models import enable_selective_activation_checkpointing

    plain = tiny_llama(2)
    enable_selective_activation_checkpointing(plain)
    assert plain.__dict__["gradient_checkpointing_enable"].__qualname__.startswith("enable_selective_activation")
    assert ledger(NAME) == (0, "")

    model = peft.get_peft_model(tiny_llama(2), lora_config())
    enable_selective_activation_checkpointing(model)
    held = model.get_base_model().__dict__["gradient_checkpointing_enable"]
    enable_selective_activation_checkpointing(model)  # a second SFTTrainer on the same model
    assert model.get_base_model().__dict__["gradient_checkpointing_enable"] is held
    assert ledger(NAME)[0] == 1


def test_trainer_module_calls_the_wrapper():
    from trl.trainer import sft_trainer

    layers = shim.wrappers("trl.models.selective_activation_checkpointing:enable_selective_activation_checkpointing")
    assert [name for name, _ in layers] == [NAME]
    assert sft_trainer.enable_selective_activation_checkpointing is trl.models.enable_selective_activation_checkpointing


def test_the_shape_check_accepts_the_installed_trl_and_names_a_changed_signature():
    from trl.models import selective_activation_checkpointing as sac

    original = sac.enable_selective_activation_checkpointing.__wrapped__
    assert patch_module._check(original) is None

    def enable_selective_activation_checkpointing(module, policy=None):
        pass

    assert "signature changed" in patch_module._check(enable_selective_activation_checkpointing)


def test_the_bug_probe_finds_the_bug_off_and_not_on():
    with shim.disabled(NAME):
        assert bug_found(NAME) is True
    assert bug_found(NAME) is False
