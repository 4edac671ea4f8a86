"""``ddp-find-unused-for-checkpointing``: DDP gets settings that reentrant checkpointing can train with.

Symptom: a PEFT (or other wrapped) model trained by transformers' Trainer under DDP with reentrant
checkpointing fails in the first backward with ``RuntimeError: Expected to mark a variable ready only
once``. Left unset, the Trainer gives every model that is no ``PreTrainedModel`` (a ``PeftModel``)
``find_unused_parameters=True``, which DDP cannot run when a reentrantly checkpointed layer holds a
trainable parameter.

Fix: the Trainer method that takes the decision is wrapped, and one case changes: the user set neither
``ddp_find_unused_parameters`` nor ``ddp_static_graph``, upstream chose ``True``, the model will be
wrapped in DDP (several processes, no DeepSpeed or FSDP), and a layer that will checkpoint reentrantly
holds a trainable parameter. Then DDP gets ``static_graph=True`` (which also trains with trainable
parameters that are never used), or ``find_unused_parameters=False`` under gradient accumulation, which
a static graph fails on. Everything else, single-process runs included, stays upstream's.

Limits: a trainable parameter used on some steps only trains with no setting here (the error changes,
and where ranks differ within a step DDP hangs instead of failing); a model ``model_init`` builds after
the decision keeps upstream's choice. Full story, versions measured and references:
docs/bugs.md#ddp-find-unused-for-checkpointing
"""

from __future__ import annotations

import contextlib
import functools
import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.checkpointing import is_reentrant
from shim.selfcheck import bare

from ._checkpointing_state import MISSING
from ._modules import first_trainable

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


def wraps_in_ddp(args) -> bool:
    """Whether accelerate will wrap the model in DDP: several processes of a ``MULTI_*`` distributed type
    (DeepSpeed, FSDP, XLA and single-process runs are not)."""
    state = getattr(args, "distributed_state", None)
    kind = getattr(getattr(state, "distributed_type", None), "name", "")
    return str(kind).startswith("MULTI_") and (getattr(state, "num_processes", 1) or 1) > 1


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


def _layer_class():
    return getattr(sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None)


def checkpointed_layers(model, every_n_layers: int | None = None) -> list:
    """The modules of ``model`` whose own forward runs under their checkpoint function.

    ``every_n_layers=None``: as the flags are now. A number: as transformers' enable will set them, every
    ``every_n_layers``-th ``GradientCheckpointingLayer`` in module order. A module with the flag that is
    no such layer and has none below it (older and remote-code models, whose parent module checkpoints
    its children) counts as a whole; one with such layers below it (``LlamaModel``) leaves them to it.
    """
    layer_class = _layer_class()
    found, index = [], 0
    for module in model.modules():
        if not hasattr(module, "gradient_checkpointing"):
            continue
        if layer_class is not None and isinstance(module, layer_class):
            if every_n_layers is None:
                checkpoints = bool(module.gradient_checkpointing)
            else:
                checkpoints = index % every_n_layers == 0
                index += 1
        else:
            has_layers = layer_class is not None and any(isinstance(m, layer_class) for m in module.modules())
            checkpoints = not has_layers and (every_n_layers is not None or bool(module.gradient_checkpointing))
        if checkpoints:
            found.append(module)
    return found


def _every_n_layers(checkpoint_kwargs) -> int:
    value = checkpoint_kwargs.get("every_n_layers", 1) if isinstance(checkpoint_kwargs, dict) else 1
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def reentrant_layer_with_trainable(model, args, enable_comes_later: bool):
    """The first layer of ``model`` that will checkpoint reentrantly and holds a trainable parameter, or
    ``None``: with ``find_unused_parameters=True`` DDP marks such a parameter ready at the end of forward
    (it is not in the graph) and again when the recomputation in backward uses it."""
    if enable_comes_later and _setting(args, "gradient_checkpointing"):
        checkpoint_kwargs = _setting(args, "gradient_checkpointing_kwargs")
        function = function_the_trainer_builds(checkpoint_kwargs)
        if function is None or not is_reentrant(function):
            return None
        layers = checkpointed_layers(model, _every_n_layers(checkpoint_kwargs))
        return next((layer for layer in layers if first_trainable(layer) is not None), None)
    for layer in checkpointed_layers(model):
        function = layer.__dict__.get("_gradient_checkpointing_func", MISSING)
        if function is not MISSING and is_reentrant(function) and first_trainable(layer) is not None:
            return layer
    return None


def _decide(trainer, handler, model, enable_comes_later: bool) -> None:
    """Change ``handler`` (accelerate's DDP kwargs) where upstream's ``find_unused_parameters=True`` meets a
    layer that checkpoints reentrantly with a trainable parameter, the user left both DDP settings unset
    and the model will be wrapped in DDP."""
    args = trainer.args
    if args.ddp_find_unused_parameters is not None or getattr(args, "ddp_static_graph", None) is not None:
        return
    if handler.find_unused_parameters is not True or getattr(handler, "static_graph", False):
        return
    if model is None or not wraps_in_ddp(args):
        return
    layer = reentrant_layer_with_trainable(model, args, enable_comes_later)
    if layer is None:
        return  # nothing trainable is checkpointed reentrantly: upstream's True trains
    handler.find_unused_parameters = False
    if (getattr(args, "gradient_accumulation_steps", 1) or 1) > 1:
        chosen = "find_unused_parameters=False (gradient accumulation: DDP's static graph fails under no_sync)"
    else:
        handler.static_graph = True
        chosen = "static_graph=True, find_unused_parameters=False"
    record_effect(
        NAME,
        "the Trainer chose find_unused_parameters=True for %s (not a PreTrainedModel), which DDP fails on "
        "('Expected to mark a variable ready only once') when a reentrantly checkpointed layer holds trainable "
        "parameters (%s does); the shim chose %s",
        type(model).__name__, type(layer).__name__, chosen,
    )  # fmt: skip


def _ddp_kwargs_class():
    return sys.modules["transformers.trainer"].DistributedDataParallelKwargs


def _build_accelerator_args(wrapped, instance, args, kwargs):
    """5.3+: the DDP kwargs handler is built here, in ``Trainer.__init__`` (and again by a hyperparameter
    search)."""
    result = wrapped(*args, **kwargs)
    # Under DeepSpeed or FSDP the model is never wrapped in DDP: the handler is not used.
    if instance is not None and isinstance(result, dict) and not _other_engine(result):
        # With model_init the model DDP wraps is built later, in train(): None in __init__, the previous
        # trial's in a hyperparameter search. Nothing to judge it by.
        model = None if getattr(instance, "model_init", None) is not None else getattr(instance, "model", None)
        for handler in result.get("kwargs_handlers") or ():
            if isinstance(handler, _ddp_kwargs_class()):
                _decide(instance, handler, model, enable_comes_later=True)
    return result


def _other_engine(accelerator_args: dict) -> bool:
    return any(accelerator_args.get(name) is not None for name in ("deepspeed_plugin", "fsdp_plugin"))


def _wrap_model(wrapped, instance, args, kwargs):
    """Up to 5.2: the DDP kwargs handler is built here, in training, after the Trainer enabled checkpointing
    (and called model_init), only for a distributed run."""
    if instance is None:
        return wrapped(*args, **kwargs)
    accelerator = getattr(instance, "accelerator", None)
    before = getattr(accelerator, "ddp_handler", None)
    result = wrapped(*args, **kwargs)
    handler = getattr(accelerator, "ddp_handler", None)
    if handler is not before and isinstance(handler, _ddp_kwargs_class()):
        _decide(instance, handler, instance.model, enable_comes_later=False)
    return result


def _check():
    if not hasattr(sys.modules["transformers.trainer"], "DistributedDataParallelKwargs"):
        return "transformers.trainer no longer builds accelerate's DistributedDataParallelKwargs"
    return None


# -- the decision, taken as on several processes (the bug probe, and the tests) --------------------


@contextlib.contextmanager
def as_multi_process(args):
    """``args`` read as a run of two CPU processes (the DDP decision's input) inside the block."""
    import types

    from accelerate.utils import DistributedType

    saved = args.__dict__.get("distributed_state", MISSING)
    args.distributed_state = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2)
    try:
        yield args
    finally:
        if saved is MISSING:
            del args.distributed_state
        else:
            args.distributed_state = saved


def ddp_decision(trainer) -> dict:
    """``{"find_unused_parameters": ..., "static_graph": ...}``: what ``trainer`` hands DDP when it trains on
    several processes, taken in this one.

    From 5.3 the Trainer decides in ``_build_accelerator_args`` (``__init__``): this helper calls it again
    with the arguments reading as a multi-process run. Up to 5.2 it decides in ``_wrap_model`` during
    ``train()``, only when the run is distributed, after enabling checkpointing: this helper does what
    ``train()`` does up to that point, with the arguments reading as a multi-process run.
    """
    args = trainer.args
    built = {}
    if hasattr(type(trainer), "_build_accelerator_args"):  # 5.2 has it too, without the DDP handler
        with as_multi_process(args):
            built = trainer._build_accelerator_args()
    if "kwargs_handlers" in built:
        handler = next(h for h in built["kwargs_handlers"] if isinstance(h, _ddp_kwargs_class()))
    else:
        if _setting(args, "gradient_checkpointing"):
            trainer.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=_setting(args, "gradient_checkpointing_kwargs")
            )
        with as_multi_process(args):
            trainer._wrap_model(trainer.model)
        handler = trainer.accelerator.ddp_handler
    return {
        "find_unused_parameters": bool(handler.find_unused_parameters),
        "static_graph": bool(getattr(handler, "static_graph", False)),
    }


def fails_under_reentrant_checkpointing(decision: dict) -> bool:
    """Whether DDP built with ``decision`` fails on a layer that checkpoints reentrantly with a trainable
    parameter (``Expected to mark a variable ready only once``)."""
    return decision["find_unused_parameters"] and not decision["static_graph"]


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


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """The Trainer's DDP decision (``_build_accelerator_args`` from 5.3, ``_wrap_model`` before) taken on
    a stand-in Trainer of two CPU processes, for a model that is no ``PreTrainedModel`` around a bare one
    whose layers checkpoint reentrantly: once with the arguments asking for that checkpointing, once
    with the model enabled before the Trainer and the arguments silent. The bug is there when DDP gets
    ``find_unused_parameters=True`` without a static graph in one of them (a fix that reads only the
    arguments leaves the patch the model enabled beforehand)."""
    from ._checkpointing_calls import enable

    inner = bare.model()
    enable(inner, {"use_reentrant": True})
    model = model_wrapper_class()(inner)
    failing = [how for how in ("asked for by the arguments", "enabled before the Trainer") if _fails(model, how)]
    if failing:
        return Evidence(
            True,
            "the Trainer hands DDP find_unused_parameters=True without a static graph for a wrapped model whose "
            f"layers checkpoint reentrantly ({' and '.join(failing)})",
        )
    return Evidence(
        False,
        "the Trainer hands DDP find_unused_parameters=False or a static graph for a wrapped model whose layers "
        "checkpoint reentrantly, whether the arguments ask for it or the model was enabled before",
    )


def _fails(model, how: str) -> bool:
    """Whether the decision for ``model`` (wrapped, its layers checkpointing reentrantly) fails under
    reentrant checkpointing, the arguments asking for that checkpointing or silent (``how``)."""
    trainer_module = sys.modules["transformers.trainer"]
    distributed = sys.modules["accelerate.utils"].DistributedType
    asked = how == "asked for by the arguments"
    checkpointing = dict(
        gradient_checkpointing=asked, gradient_checkpointing_kwargs={"use_reentrant": True} if asked else None
    )
    checkpointing |= {name.replace("gradient_", "activation_"): value for name, value in checkpointing.items()}
    arguments = bare.StandIn(
        **checkpointing,
        distributed_state=bare.StandIn(distributed_type=distributed.MULTI_CPU, num_processes=2),
        parallel_mode=sys.modules["transformers.training_args"].ParallelMode.DISTRIBUTED,
        n_gpu=0,
        gradient_accumulation_steps=1,
    )
    accelerator = bare.StandIn(unwrap_model=lambda model, **kwargs: model, ddp_handler=None)
    trainer = bare.StandIn(model=model, args=arguments, accelerator=accelerator)
    if hasattr(trainer_module.Trainer, "_build_accelerator_args") and "kwargs_handlers" in (
        built := trainer_module.Trainer._build_accelerator_args(trainer)
    ):
        handler = next(h for h in built["kwargs_handlers"] if isinstance(h, _ddp_kwargs_class()))
    else:
        trainer_module.Trainer._wrap_model(trainer, trainer.model)
        handler = accelerator.ddp_handler
    decision = {"find_unused_parameters": bool(handler.find_unused_parameters)}
    decision["static_graph"] = bool(getattr(handler, "static_graph", False))
    return fails_under_reentrant_checkpointing(decision)


PATCH = Patch(
    name=NAME,
    summary="DDP gets settings reentrant checkpointing trains with (a static graph, or find_unused_parameters=False "
    "under gradient accumulation) for PEFT and other wrapped models with trainable checkpointed layers.",
    distribution="transformers",
    requires=">=4.57",
    targets=(
        Target(
            "transformers.trainer:Trainer._wrap_model",
            _wrap_model,
            requires="transformers<5.3",
            check=lambda original: _check(),
        ),
        Target(
            "transformers.trainer:Trainer._build_accelerator_args",
            _build_accelerator_args,
            requires="transformers>=5.3",
            check=lambda original: _check(),
        ),
    ),
    references=(
        "docs/bugs.md#ddp-find-unused-for-checkpointing",
        "huggingface/trl#4782",
        "huggingface/peft#301",
        "huggingface/transformers#13961",
        "pytorch/pytorch#143580",
    ),
    bug_probe=BugProbe(_bug_probe, needs=("transformers.training_args",)),
)
