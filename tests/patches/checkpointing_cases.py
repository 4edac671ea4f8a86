"""Shared helpers for the checkpointing tests: tiny models, configurations, disable/enable cycles."""

import functools
import inspect
import warnings

import torch
import transformers
from packaging.version import Version

from shim.patches._checkpointing_calls import is_checkpointing
from shim.tools.targets import quiet_transformers
from tests.tinymodels import tiny_llama

quiet_transformers()
TRANSFORMERS = Version(transformers.__version__)
ENABLE = (
    "activation_checkpointing_enable"
    if hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    else "gradient_checkpointing_enable"
)
DISABLE = ENABLE.replace("enable", "disable")


def supports(parameter: str) -> bool:
    return parameter in inspect.signature(getattr(transformers.PreTrainedModel, ENABLE)).parameters


def configure(model, kwargs, every_n_layers=1, offload=False):
    """Enable checkpointing the way a user would, through the public entry point."""
    extra = {}
    if every_n_layers != 1:
        extra["every_n_layers"] = every_n_layers
    if offload:
        extra["offload"] = offload
    getattr(model, ENABLE)(kwargs, **extra)


def describe(model) -> dict:
    """What each module will checkpoint with: its flag, the function under the partial, the kwargs."""
    described = {}
    for name, module in model.named_modules():
        if not hasattr(module, "gradient_checkpointing"):
            continue
        function = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(function, functools.partial):
            inner = getattr(function.func, "__qualname__", repr(function.func))
            described[name] = (module.gradient_checkpointing, inner, dict(function.keywords))
        else:
            described[name] = (module.gradient_checkpointing, getattr(function, "__qualname__", None), None)
    return described


def checkpoint_kwargs(model) -> dict:
    """The kwargs that reach torch.utils.checkpoint from the first checkpointing decoder layer."""
    layer = next(
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) and m is not model and hasattr(m, "mlp")
    )
    return dict(layer._gradient_checkpointing_func.keywords)


def layer_flags(model) -> list:
    return [layer.gradient_checkpointing for layer in model.model.layers]


class TrainerRows(torch.utils.data.Dataset):
    """``rows`` token rows for a ``Trainer`` step on the tiny Llama (ids inside its vocabulary)."""

    def __init__(self, rows: int = 4) -> None:
        self.rows = rows

    def __len__(self):
        return self.rows

    def __getitem__(self, index):
        ids = torch.arange(index, index + 6) % 60 + 1
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def quietly(function, *args, **kwargs):
    """Run upstream code that emits its own deprecation FutureWarnings (trl on transformers >= 5.23)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return function(*args, **kwargs)


__all__ = ["is_checkpointing", "tiny_llama"]
