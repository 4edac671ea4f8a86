"""ddp-find-unused-for-checkpointing: for a PEFT (or any wrapped) model whose trainable parameters sit in layers
that checkpoint reentrantly, the Trainer hands DDP a static graph (``find_unused_parameters=False`` under gradient
accumulation) instead of upstream's ``find_unused_parameters=True``; every other decision, and every single-process
run, stays as upstream takes it.

What DDP then does with each setting needs two processes: tests/e2e/test_ddp_unused.py trains on two gloo ranks.
"""

import importlib.util
import tempfile
import types
import warnings

import pytest
import torch
import transformers

import shim
from shim import runtime as effects
from shim.patches.ddp_find_unused_for_checkpointing import (
    NAME,
    ddp_decision,
    model_wrapper_class,
    wraps_in_ddp,
)
from tests.patches.checkpointing_cases import TRANSFORMERS, configure, quietly, tiny_llama
from tests.probes import bug_found

HAS_PEFT = importlib.util.find_spec("peft") is not None
needs_peft = pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed")
# transformers' enable without kwargs: reentrant on 4.x, non-reentrant from 5.0
DEFAULT_REENTRANT = TRANSFORMERS.major < 5
# From 5.3 the Trainer decides in __init__ (_build_accelerator_args), before train() enables checkpointing.
TRAINER_DECIDES_IN_INIT = TRANSFORMERS.release >= (5, 3)

UPSTREAM = {"find_unused_parameters": True, "static_graph": False}
STATIC = {"find_unused_parameters": False, "static_graph": True}
FALSE = {"find_unused_parameters": False, "static_graph": False}


@pytest.fixture(autouse=True)
def empty_ledger():
    effects.clear()
    yield
    effects.clear()


def training_arguments(directory: str, **overrides) -> transformers.TrainingArguments:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_* names from 5.23
        return transformers.TrainingArguments(output_dir=directory, use_cpu=True, report_to="none", **overrides)


def decision(model, **overrides) -> dict:
    """What a Trainer for ``model`` hands DDP on a multi-process run."""
    with tempfile.TemporaryDirectory() as directory:
        trainer = transformers.Trainer(model=model, args=training_arguments(directory, **overrides))
        return quietly(ddp_decision, trainer)


def upstream_and_shim(make_model, **overrides) -> tuple[dict, dict]:
    with shim.disabled(NAME):
        upstream = decision(make_model(), **overrides)
    return upstream, decision(make_model(), **overrides)


def peft_model():
    from peft import LoraConfig, get_peft_model

    # peft reads the deprecated is_gradient_checkpointing on transformers >= 5.23
    return quietly(get_peft_model, tiny_llama(layers=2), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))


def wrapped(model, checkpointing=None):
    """``model`` in a wrapper that is no PreTrainedModel, checkpointing configured before the Trainer."""
    if checkpointing is not None:
        quietly(configure, model, checkpointing)
    return model_wrapper_class()(model)


def frozen_layers_trainable_heads():
    """Frozen embeddings and decoder layers, a trainable lm_head and a trainable head the forward never uses,
    checkpointing reentrantly: nothing trainable is inside a checkpointed layer."""
    model = tiny_llama(layers=2)
    model.requires_grad_(False)
    model.lm_head.requires_grad_(True)
    outer = wrapped(model, {"use_reentrant": True})
    outer.head = torch.nn.Linear(model.config.hidden_size, 1)
    return outer


def count() -> tuple[int, str]:
    record = next(s for s in shim.status() if s.name == NAME)
    return record.effects, record.last_effect


REENTRANT = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}


def test_the_bug_probe_finds_the_bug_upstream_and_not_with_the_patch():
    with shim.disabled(NAME):
        assert bug_found(NAME) is True
    assert bug_found(NAME) is False


@needs_peft
def test_peft_model_with_reentrant_checkpointing_gets_a_static_graph():
    upstream, fixed = upstream_and_shim(peft_model, **REENTRANT)
    assert upstream == UPSTREAM, "bug: a PeftModel is no PreTrainedModel, so upstream chooses True"
    assert fixed == STATIC
    assert count() == (
        1,
        "the Trainer chose find_unused_parameters=True for PeftModel (not a PreTrainedModel), which DDP fails on "
        "('Expected to mark a variable ready only once') when a reentrantly checkpointed layer holds trainable "
        "parameters (LlamaDecoderLayer does); the shim chose static_graph=True, find_unused_parameters=False",
    )


@needs_peft
def test_with_gradient_accumulation_it_gets_false_not_a_static_graph():
    """DDP's static graph fails under no_sync (measured: torch's expect_autograd_hooks_ assert)."""
    upstream, fixed = upstream_and_shim(peft_model, gradient_accumulation_steps=2, **REENTRANT)
    assert upstream == UPSTREAM
    assert fixed == FALSE
    assert count()[0] == 1
    assert count()[1].endswith(
        "the shim chose find_unused_parameters=False (gradient accumulation: DDP's static graph fails under no_sync)"
    )


@needs_peft
@pytest.mark.parametrize(
    "checkpoint_kwargs, reentrant",
    [
        (None, DEFAULT_REENTRANT),
        ({"use_reentrant": False}, False),
        ({"preserve_rng_state": False}, True),  # no use_reentrant bound: torch's default, reentrant
    ],
    ids=["transformers default", "non-reentrant", "torch default"],
)
def test_peft_model_follows_the_reentrancy_training_runs_with(checkpoint_kwargs, reentrant):
    upstream, fixed = upstream_and_shim(
        peft_model, gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpoint_kwargs
    )
    assert upstream == UPSTREAM
    assert fixed == (STATIC if reentrant else UPSTREAM)
    assert count()[0] == (1 if reentrant else 0)


def test_a_wrapped_model_checkpointing_before_the_trainer_is_read_through_the_wrapper():
    upstream, fixed = upstream_and_shim(lambda: wrapped(tiny_llama(layers=2), {"use_reentrant": True}))
    assert (upstream, fixed) == (UPSTREAM, STATIC)


def test_nothing_trainable_in_a_checkpointed_layer_keeps_true():
    """Upstream's True trains this model (an unused trainable head included); False or a static graph would not
    all do so (tests/e2e/test_ddp_unused.py)."""
    assert upstream_and_shim(frozen_layers_trainable_heads) == (UPSTREAM, UPSTREAM)
    assert count() == (0, "")


@pytest.mark.skipif(
    TRANSFORMERS.release < (5, 16), reason="version rule: the Trainer takes every_n_layers from transformers 5.16"
)
@pytest.mark.parametrize("trainable_layer, expected", [(0, STATIC), (1, UPSTREAM)])
def test_only_the_layers_every_n_layers_checkpoints_count(trainable_layer, expected):
    def model():
        inner = tiny_llama(layers=2)
        inner.requires_grad_(False)
        inner.model.layers[trainable_layer].requires_grad_(True)
        return model_wrapper_class()(inner)

    # Layer 0 checkpoints, layer 1 does not: the Trainer's enable builds that from every_n_layers=2.
    kwargs = {"use_reentrant": True, "every_n_layers": 2}
    assert upstream_and_shim(model, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs) == (
        UPSTREAM,
        expected,
    )


def test_a_model_without_checkpointing_keeps_true():
    assert upstream_and_shim(lambda: wrapped(tiny_llama(layers=2))) == (UPSTREAM, UPSTREAM)
    assert count() == (0, "")


def test_the_users_find_unused_parameters_wins():
    def model():
        return wrapped(tiny_llama(layers=2), {"use_reentrant": True})

    assert upstream_and_shim(model, ddp_find_unused_parameters=True) == (UPSTREAM, UPSTREAM)
    assert count() == (0, "")


@pytest.mark.skipif(
    not hasattr(transformers.TrainingArguments, "ddp_static_graph"),
    reason="version rule: TrainingArguments has no ddp_static_graph before it was added in 5.x",
)
def test_the_users_static_graph_wins():
    def model():
        return wrapped(tiny_llama(layers=2), {"use_reentrant": True})

    users = {"find_unused_parameters": True, "static_graph": False}
    assert upstream_and_shim(model, ddp_static_graph=False) == (users, users)
    assert count() == (0, "")


def test_a_pretrained_model_keeps_upstreams_false():
    assert upstream_and_shim(lambda: tiny_llama(layers=2), **REENTRANT) == (FALSE, FALSE)
    assert count() == (0, "")


@pytest.mark.parametrize(
    "kind, processes, wraps",
    [("MULTI_CPU", 2, True), ("MULTI_GPU", 8, True), ("MULTI_CPU", 1, False), ("NO", 1, False),
     ("DEEPSPEED", 2, False), ("FSDP", 2, False)],
)  # fmt: skip
def test_only_a_multi_process_ddp_run_counts(kind, processes, wraps):
    from accelerate.utils import DistributedType

    state = types.SimpleNamespace(distributed_type=DistributedType[kind], num_processes=processes)
    assert wraps_in_ddp(types.SimpleNamespace(distributed_state=state)) is wraps
    assert wraps_in_ddp(types.SimpleNamespace(distributed_state=None)) is False


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: int = 4, length: int = 8) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (rows, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def train_one_process(directory: str, **trainer_kwargs) -> transformers.Trainer:
    args = training_arguments(directory, max_steps=2, per_device_train_batch_size=2, save_strategy="no", **REENTRANT)
    trainer = transformers.Trainer(args=args, train_dataset=Rows(), **trainer_kwargs)
    quietly(trainer.train)
    return trainer


@needs_peft
def test_a_single_process_run_trains_and_records_nothing(tmp_path):
    trainer = train_one_process(str(tmp_path), model=peft_model())
    assert trainer.state.global_step == 2
    assert count() == (0, "")
    handler = getattr(trainer.accelerator, "ddp_handler", None)  # built in __init__ from 5.3, never before
    if TRAINER_DECIDES_IN_INIT:
        assert (handler.find_unused_parameters, handler.static_graph) == (True, False), "upstream's, untouched"
    else:
        assert handler is None


@needs_peft
def test_model_init_builds_and_trains_with_upstreams_choice(tmp_path):
    trainer = train_one_process(str(tmp_path), model_init=peft_model)
    assert trainer.state.global_step == 2
    assert count() == (0, "")
    if TRAINER_DECIDES_IN_INIT:
        # The accelerator is built while the model is None (and again in a hyperparameter search, with the
        # previous trial's model): upstream's choice stays.
        assert quietly(ddp_decision, trainer) == UPSTREAM
        assert count() == (0, "")
    else:
        # Up to 5.2 the decision is taken in train(), on the model model_init built.
        assert quietly(ddp_decision, trainer) == STATIC
