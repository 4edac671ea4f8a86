"""Bare models for the bug probes (``Patch.bug_probe``): transformers classes instantiated without a
config or weights worth loading, in well under a millisecond, from modules that are already imported.

A probe imports nothing (``shim.probing``): these builders take torch's and transformers' classes
from ``sys.modules`` and make their classes anew on each call, so that nothing of a probe outlives
it. Each builder says which modules it takes (its ``needs``): a ``shim.BugProbe`` reads the builders
its probe calls and waits for those modules to finish importing, so a probe never declares them (one
that ran before them could not tell). Parameters are float32 on the CPU, seeded: ``shim.probing``
puts the random state back afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

#: Where the probes find transformers' model and layer classes.
MODELING_UTILS = "transformers.modeling_utils"
MODELING_LAYERS = "transformers.modeling_layers"
CHECKPOINT = "torch.utils.checkpoint"

_Builder = TypeVar("_Builder", bound=Callable[..., Any])


def _taking(*modules: str) -> Callable[[_Builder], _Builder]:
    """Mark a builder with the modules it takes from ``sys.modules``, itself or through the builders
    it calls (``shim.patch.needs_of`` reads them)."""

    def mark(builder: _Builder) -> _Builder:
        builder.needs = modules  # type: ignore[attr-defined]  # a function's attribute
        return builder

    return mark


@_taking("torch")
def torch_module() -> Any:
    return sys.modules["torch"]


@_taking("torch")
def seed(value: int = 0) -> None:
    """Seed torch's CPU generator alone: ``torch.manual_seed`` also queues a seed for CUDA, to be
    applied when CUDA initialises, which would outlive the probe (``shim.probing`` puts the CPU
    generator's state back)."""
    torch_module().random.default_generator.manual_seed(value)


@_taking("torch")
def linear(width: int = 2) -> Any:
    """A seeded float32 ``Linear(width, width)`` on the CPU."""
    torch = torch_module()
    seed()
    return torch.nn.Linear(width, width, dtype=torch.float32, device="cpu")


@_taking("torch", MODELING_LAYERS)
def layer_class() -> type:
    """A ``GradientCheckpointingLayer`` holding one ``Linear``, whose ``forward`` takes the hidden
    states positionally or by keyword and returns the linear map of them plus every tensor its other
    arguments hold, by keyword too and nested in tuples, lists and dicts (each one then gets a
    gradient, as a layer's keyword inputs do)."""
    base = sys.modules[MODELING_LAYERS].GradientCheckpointingLayer

    class ProbeLayer(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.linear = linear()

        def forward(self, hidden_states: Any = None, *others: Any, **kwargs: Any) -> Any:
            out = self.linear(hidden_states)
            for tensor in tensors_in((others, kwargs)):
                out = out + tensor
            return out

    return ProbeLayer


@_taking("torch")
def tensors_in(value: Any) -> list[Any]:
    """The tensors ``value`` holds, itself one or in tuples, lists and dicts, in order."""
    if isinstance(value, torch_module().Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensors_in(item)]
    return []


@_taking("torch", MODELING_LAYERS)
def layer() -> Any:
    """One layer of :func:`layer_class`, in training mode."""
    return layer_class()().train()


@_taking("torch", MODELING_LAYERS)
def checkpointing_layer(function: Any, cls: type | None = None) -> Any:
    """A layer of :func:`layer_class` (or of ``cls``) checkpointing with ``function``, assigned as a
    user assigns it (the shim's checkpointing path sees the assignment)."""
    built = (cls or layer_class())().train()
    built.gradient_checkpointing = True
    built._gradient_checkpointing_func = function
    return built


@_taking(CHECKPOINT)
def reentrant_checkpoint() -> Any:
    """``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)``, as transformers builds it."""
    import functools

    return functools.partial(sys.modules[CHECKPOINT].checkpoint, use_reentrant=True)


@_taking(MODELING_UTILS)
def model_class(base: type | None = None) -> type:
    """A ``PreTrainedModel`` subclass (or one of ``base``) whose input embeddings are ``self.embed``."""
    base = base or sys.modules[MODELING_UTILS].PreTrainedModel

    class ProbeModel(base):  # type: ignore[misc, valid-type]
        supports_gradient_checkpointing = True
        main_input_name = "input_ids"

        def get_input_embeddings(self) -> Any:
            return self.embed

        def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
            hidden = self.embed(input_ids)
            for block in self.layers:
                hidden = block(hidden)
            return hidden

    return ProbeModel


@_taking("torch", MODELING_UTILS, MODELING_LAYERS)
def model(layers: int = 2, cls: type | None = None) -> Any:
    """A bare model of :func:`model_class` (or of ``cls``): ``embed`` (4 tokens of width 2) and
    ``layers`` layers of :func:`layer_class`, in training mode, built without its ``__init__`` (no
    config): ``nn.Module``'s alone. Without layers: :func:`model_without_layers`, which does not
    need ``transformers.modeling_layers``."""
    built = model_without_layers(cls)
    layer_type = layer_class() if layers else None
    if layer_type is not None:
        built.layers.extend(layer_type() for _ in range(layers))
    return built


@_taking("torch", MODELING_UTILS)
def model_without_layers(cls: type | None = None) -> Any:
    """A bare model of :func:`model_class` (or of ``cls``) with its ``embed`` and no layers (an empty
    ``layers``), in training mode."""
    torch = torch_module()
    cls = cls or model_class()
    built: Any = object.__new__(cls)
    torch.nn.Module.__init__(built)
    seed()
    built.embed = torch.nn.Embedding(4, 2, dtype=torch.float32, device="cpu")
    built.layers = torch.nn.ModuleList()
    return built.train()


@_taking("torch")
def forwarding(inner: Any) -> Any:
    """A module holding ``inner`` (as ``inner``) that answers the attributes it lacks with
    ``inner``'s, as a ``PeftModel``, peft's ``ModulesToSaveWrapper`` and torch's ``CheckpointWrapper`` do."""
    module: Any = torch_module().nn.Module

    class Forwarding(module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                held = self.__dict__.get("_modules", {}).get("inner")
                if held is None:  # not built yet
                    raise
                return getattr(held, name)

    return Forwarding()


class StandIn:
    """An object with the attributes it is given; any other reads as ``None`` (a stand-in for a
    Trainer, its arguments or an accelerator, of which a probe's call reads a few)."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def checkpointing(module: Any) -> list[tuple[bool, Any, Any]]:
    """Every checkpointing module's flag, checkpoint function and its keywords, in order, comparable
    across enables (a new ``functools.partial`` of the same function and keywords compares equal)."""
    found = []
    for sub in module.modules():
        if hasattr(sub, "gradient_checkpointing"):
            function = getattr(sub, "_gradient_checkpointing_func", None)
            found.append((bool(sub.gradient_checkpointing), getattr(function, "func", function), _keywords(function)))
    return found


def _keywords(function: Any) -> Any:
    keywords = getattr(function, "keywords", None)
    return dict(keywords) if isinstance(keywords, dict) else None
