"""``shim.in_effect(model)``: what the shim does on one model now, the answer to "is the fix in effect
on my model?".

For a model in hand it says how its checkpointing modules are configured (grouped where they hold
the same), which patches act on it and how (each applied patch's own ``Patch.in_effect``: the steps
on its layers' checkpointed calls, the input-grad hooks, frozen towers kept out of backward, a
configuration held for the next enable), and its adapters (peft). Printable
(``print(shim.in_effect(model))``) and a dict (``.as_dict()``). It reads the model and changes
nothing; a patch whose own answer raises is shown with the error, never raised.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .. import audit


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Modules that hold the same checkpointing: whether it is on, the function their calls go
    through (upstream's, whatever the shim made of it) and the keyword arguments bound into it."""

    modules: tuple[str, ...]
    on: bool
    function: str
    kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelView:
    """What the shim does on one model (``shim.in_effect``)."""

    model: str  # its class
    checkpointing: tuple[Checkpointing, ...]
    patches: dict[str, tuple[str, ...]]  # each patch on, with what it does on this model ([] for nothing)
    adapters: dict[str, dict[str, Any]]  # peft's: name -> active, trainable and all parameters
    audit: tuple[str, ...] = ()  # what the first-step audit said of it (shim.audit), one line each

    def as_dict(self) -> dict[str, Any]:
        """The view as plain data (lists, dicts, strings, numbers): ``json.dumps`` takes it."""
        plain: dict[str, Any] = _plain(dataclasses.asdict(self))
        return plain

    def __str__(self) -> str:
        from .render import view_text

        return view_text(self)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def in_effect(model: Any, registry: Any) -> ModelView:
    """What the patches of ``registry`` that are on do on ``model`` now."""
    if not callable(getattr(model, "named_modules", None)):
        got = "None" if model is None else f"a {type(model).__qualname__}"
        raise TypeError(
            f"shim.in_effect() takes a model (a torch.nn.Module, peft's wrapper included), not {got}: "
            "pass the model itself, e.g. shim.in_effect(trainer.model)"
        )
    patches: dict[str, tuple[str, ...]] = {}
    for name in registry.names:
        if not registry.is_on(name):
            continue
        said = registry.patch(name).in_effect
        if said is None:
            continue
        try:
            patches[name] = tuple(said(model))
        except Exception as exc:  # a view must always come back: the error is what it says
            patches[name] = (f"could not say what it does here: {exc!r}",)
    view = ModelView(type(model).__name__, tuple(checkpointing(model)), patches, adapters(model))
    return dataclasses.replace(view, audit=audit.said_of(model))


def checkpointing(model: Any) -> list[Checkpointing]:
    """The modules of ``model`` that can checkpoint, grouped in order where they hold the same."""
    groups: list[Checkpointing] = []
    for name, module in model.named_modules():
        if "gradient_checkpointing" not in vars(module) and not hasattr(type(module), "gradient_checkpointing"):
            continue
        function, kwargs = described(vars(module).get("_gradient_checkpointing_func"))
        on = bool(module.gradient_checkpointing)
        last = groups[-1] if groups else None
        if last is not None and (last.on, last.function, last.kwargs) == (on, function, kwargs):
            groups[-1] = dataclasses.replace(last, modules=(*last.modules, name or "(the model)"))
        else:
            groups.append(Checkpointing((name or "(the model)",), on, function, kwargs))
    return groups


def described(function: Any) -> tuple[str, dict[str, Any]]:
    """``module.qualname`` of the function under any partials, and the keywords they bind (the
    outermost wins, as a call does)."""
    if function is None:
        return "nothing", {}
    kwargs: dict[str, Any] = {}
    while isinstance(function, functools.partial):
        kwargs = {**function.keywords, **kwargs}
        function = function.func
    module = getattr(function, "__module__", None) or type(function).__module__
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}", kwargs


def adapters(model: Any) -> dict[str, dict[str, Any]]:
    """peft's adapters on ``model``: whether each is active, and its trainable and all parameters."""
    config = getattr(model, "peft_config", None)
    if not isinstance(config, dict) or not config:
        return {}
    try:
        active = getattr(model, "active_adapters", None) or [getattr(model, "active_adapter", None)]
    except Exception:  # peft raises where no adapter is set up yet
        active = []
    active = [active] if isinstance(active, str) else list(active)
    out = {}
    for name in config:
        parameters = [p for key, p in model.named_parameters() if f".{name}." in key]
        out[name] = {
            "active": name in active,
            "trainable": sum(1 for p in parameters if p.requires_grad),
            "parameters": len(parameters),
        }
    return out
