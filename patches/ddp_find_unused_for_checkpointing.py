"""``ddp-find-unused-for-checkpointing``: DDP's ``find_unused_parameters`` follows the checkpointing the model runs.

Symptom: a PEFT model trained by transformers' Trainer under DDP with reentrant checkpointing fails
in the first backward with ``RuntimeError: Expected to mark a variable ready only once``. Left unset,
the Trainer decides ``find_unused_parameters`` from the model's class: anything that is not a
``PreTrainedModel`` (a ``PeftModel``) gets ``True``, which reentrant checkpointing cannot run with.

Fix: the Trainer method that takes the decision is wrapped, and one case changes: the user left the
setting unset, upstream chose ``True``, neither DeepSpeed nor FSDP is in use, and the checkpoint
function the model's layers will run (found through any wrapper, or the one the Trainer's own enable
will build from ``gradient_checkpointing_kwargs``) is reentrant by ``_checkpointing.is_reentrant``.
Then DDP gets ``False``. Every other decision is upstream's; ``False`` never becomes ``True``.

Limits: the opposite mistake (``False`` with parameters unused in a step) is not corrected;
checkpointing changed between ``Trainer(...)`` and ``train()`` may be judged as it was before.

Full story, versions measured and references: docs/bugs.md#ddp-find-unused-for-checkpointing
"""

from __future__ import annotations

import functools
import sys

from shim import Patch, Target, record_effect

from ._checkpointing import MISSING, checkpointing_modules, is_reentrant

NAME = "ddp-find-unused-for-checkpointing"
# Keys the Trainer takes out of the checkpointing kwargs before enabling (5.16+; checkpoint-kwargs-clean earlier).
TRAINER_KEYS = ("every_n_layers", "offload")
# What transformers' enable binds when it gets no kwargs, on every release that decides in
# _build_accelerator_args (5.3+): {"use_reentrant": False} since 5.0.
TRANSFORMERS_DEFAULT = {"use_reentrant": False}


def _setting(args, name: str):
    """A checkpointing training argument under the name the Trainer reads: ``activation_*`` from 5.23,
    ``gradient_*`` before."""
    new = name.replace("gradient_", "activation_")
    return getattr(args, new) if hasattr(args, new) else getattr(args, name, None)


def function_in_effect(model):
    """The checkpoint function ``model``'s checkpointing layers hold now; ``None`` when none checkpoints
    (or when a checkpointing layer holds no function this rule can read)."""
    for module in checkpointing_modules(model):
        if module.gradient_checkpointing:
            function = module.__dict__.get("_gradient_checkpointing_func", MISSING)
            return None if function is MISSING else function
    return None


def function_the_trainer_builds(checkpoint_kwargs):
    """The function transformers' enable builds from the Trainer's ``gradient_checkpointing_kwargs``
    (``None`` when they are not a dict: the shim does not guess)."""
    import torch.utils.checkpoint

    if checkpoint_kwargs is None:
        checkpoint_kwargs = {}
    if not isinstance(checkpoint_kwargs, dict):
        return None
    kwargs = {key: value for key, value in checkpoint_kwargs.items() if key not in TRAINER_KEYS}
    return functools.partial(torch.utils.checkpoint.checkpoint, **(kwargs or TRANSFORMERS_DEFAULT))


def _decide(trainer, handler, enable_comes_later: bool) -> None:
    """Set ``handler.find_unused_parameters`` to ``False`` where upstream chose ``True`` for a model whose
    checkpointing will be reentrant and the user left the setting unset."""
    args = trainer.args
    if args.ddp_find_unused_parameters is not None or handler.find_unused_parameters is not True:
        return
    model = trainer.model
    if enable_comes_later and _setting(args, "gradient_checkpointing"):
        function = function_the_trainer_builds(_setting(args, "gradient_checkpointing_kwargs"))
        source = "the checkpointing the Trainer will enable"
    else:
        function = function_in_effect(model)
        source = "its checkpointing"
    if function is None or not is_reentrant(function):
        return
    handler.find_unused_parameters = False
    record_effect(
        NAME,
        "the Trainer chose find_unused_parameters=True for %s (not a PreTrainedModel) although %s is reentrant, "
        "which DDP fails on ('Expected to mark a variable ready only once'); the shim chose False",
        type(model).__name__, source,
    )  # fmt: skip


def _ddp_kwargs_class():
    return sys.modules["transformers.trainer"].DistributedDataParallelKwargs


def _build_accelerator_args(wrapped, instance, args, kwargs):
    """5.3+: the DDP kwargs handler is built here, in ``Trainer.__init__``."""
    result = wrapped(*args, **kwargs)
    # Under DeepSpeed or FSDP the model is never wrapped in DDP: the handler is not used.
    if instance is not None and isinstance(result, dict) and not _other_engine(result):
        handlers = result.get("kwargs_handlers") or ()
        for handler in handlers:
            if isinstance(handler, _ddp_kwargs_class()):
                _decide(instance, handler, enable_comes_later=True)
    return result


def _other_engine(accelerator_args: dict) -> bool:
    return any(accelerator_args.get(name) is not None for name in ("deepspeed_plugin", "fsdp_plugin"))


def _wrap_model(wrapped, instance, args, kwargs):
    """Up to 5.2: the DDP kwargs handler is built here, in training, after the Trainer enabled checkpointing."""
    if instance is None:
        return wrapped(*args, **kwargs)
    accelerator = getattr(instance, "accelerator", None)
    before = getattr(accelerator, "ddp_handler", None)
    result = wrapped(*args, **kwargs)
    handler = getattr(accelerator, "ddp_handler", None)
    if handler is not before and isinstance(handler, _ddp_kwargs_class()):
        _decide(instance, handler, enable_comes_later=False)
    return result


def _probe():
    if not hasattr(sys.modules["transformers.trainer"], "DistributedDataParallelKwargs"):
        return "transformers.trainer no longer builds accelerate's DistributedDataParallelKwargs"
    return None


# -- self-check (python -m shim doctor) ------------------------------------------------------------


def ddp_decision(trainer) -> bool:
    """The ``find_unused_parameters`` ``trainer`` hands DDP when it trains on several processes.

    From 5.3 the Trainer decided it in ``__init__``; up to 5.2 it decides in ``_wrap_model`` during
    ``train()``, only when the run is distributed, after enabling checkpointing: this helper does what
    ``train()`` does up to that point, with the arguments made to read as a multi-process run.
    """
    handler = getattr(trainer.accelerator, "ddp_handler", None)
    if handler is not None:
        return bool(handler.find_unused_parameters)
    import types

    from accelerate.utils import DistributedType

    args = trainer.args
    if _setting(args, "gradient_checkpointing"):
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=_setting(args, "gradient_checkpointing_kwargs")
        )
    args.distributed_state = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    trainer._wrap_model(trainer.model)
    return bool(trainer.accelerator.ddp_handler.find_unused_parameters)


def model_wrapper_class():
    """A model that is no ``PreTrainedModel`` around one that is, as PEFT's ``PeftModel`` is."""
    import torch

    class WrappedModel(torch.nn.Module):
        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def forward(self, **inputs):
            return self.model(**inputs)

    return WrappedModel


def _self_check() -> bool:
    """True when the Trainer hands DDP ``find_unused_parameters=True`` for a model that is no
    ``PreTrainedModel`` and checkpoints reentrantly."""
    import tempfile
    import warnings

    import transformers

    from shim.tinymodels import tiny_llama_config

    from ._checkpointing import enable

    model = transformers.LlamaForCausalLM(tiny_llama_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable(model, {"use_reentrant": True})
    with tempfile.TemporaryDirectory() as directory:
        args = transformers.TrainingArguments(output_dir=directory, use_cpu=True, report_to="none")
        trainer = transformers.Trainer(model=model_wrapper_class()(model), args=args)
        return ddp_decision(trainer)


PATCH = Patch(
    name=NAME,
    summary="DDP's find_unused_parameters follows the model's real checkpointing: False under reentrant "
    "checkpointing for PEFT and other wrapped models.",
    distribution="transformers",
    requires=">=4.57",
    targets=(
        Target(
            "transformers.trainer:Trainer._wrap_model",
            _wrap_model,
            requires="transformers<5.3",
            probe=lambda original: _probe(),
        ),
        Target(
            "transformers.trainer:Trainer._build_accelerator_args",
            _build_accelerator_args,
            requires="transformers>=5.3",
            probe=lambda original: _probe(),
        ),
    ),
    references=(
        "docs/bugs.md#ddp-find-unused-for-checkpointing",
        "huggingface/trl#4782",
        "huggingface/peft#301",
        "huggingface/transformers#13961",
    ),
    self_check=_self_check,
)
