"""Helpers shared by the checkpointing patches.

Checkpointing state lives only in the modules: each one with a ``gradient_checkpointing`` flag also
holds ``_gradient_checkpointing_func`` (a ``functools.partial`` of ``torch.utils.checkpoint.checkpoint``
or of transformers' offload closure, with the configured kwargs). These helpers read and write that
state, and call enable/disable the way the model's own class expects, preferring the
``activation_checkpointing_*`` names where the class has them so that no ``FutureWarning`` of ours
appears on transformers >= 5.23.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref

log = logging.getLogger("shim")
MISSING = object()

ENABLE = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
DISABLE = ("activation_checkpointing_disable", "gradient_checkpointing_disable")
KWARGS_NAME = {
    "activation_checkpointing_enable": "activation_checkpointing_kwargs",
    "gradient_checkpointing_enable": "gradient_checkpointing_kwargs",
}


def layer_state(model) -> dict:
    """``{module name: (flag, checkpoint function)}`` for every module that can checkpoint."""
    return {
        name: (module.gradient_checkpointing, getattr(module, "_gradient_checkpointing_func", MISSING))
        for name, module in model.named_modules()
        if hasattr(module, "gradient_checkpointing")
    }


def restore_layer_state(model, state: dict) -> None:
    for name, module in model.named_modules():
        if name in state:
            flag, function = state[name]
            module.gradient_checkpointing = flag
            if function is not MISSING:
                module._gradient_checkpointing_func = function


def configured_kwargs(state: dict):
    """The kwargs of the checkpoint partial that the checkpointing layers share, or ``None``."""
    for flag, function in state.values():
        if flag and isinstance(function, functools.partial):
            return dict(function.keywords)
    return None


def is_checkpointing(model) -> bool:
    """Whether checkpointing is on, without the deprecated property where the new one exists."""
    value = getattr(model, "is_activation_checkpointing", MISSING)
    if value is MISSING:
        value = model.is_gradient_checkpointing
    return bool(value)


def method(model, names: tuple[str, str]):
    """The bound method the model's own class defines, new name first; for objects that only
    delegate (``__getattr__``), whichever of the two names resolves, new name first."""
    for name in names:
        if hasattr(type(model), name):
            return name, getattr(model, name)
    for name in names:
        found = getattr(model, name, None)
        if found is not None:
            return name, found
    raise AttributeError(f"{type(model).__name__} has neither {names[0]} nor {names[1]}")


_accepts_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _accepts(function, keyword: str) -> str:
    """How ``function`` can receive ``keyword``: "keyword", "positional" or "" (not at all)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return "keyword"  # cannot tell: call it the way upstream does
    if parameters and parameters[0].name in ("self", "cls") and not inspect.ismethod(function):
        parameters = parameters[1:]
    for parameter in parameters:
        if parameter.name == keyword and parameter.kind is not parameter.POSITIONAL_ONLY:
            return "keyword"
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return "keyword"
    if parameters and parameters[0].kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
        return "positional"
    return ""


def accepts(bound, keyword: str) -> str:
    # Cached per function, weakly: a closure installed on one model must not keep that model alive.
    function = getattr(bound, "__func__", bound)
    try:
        per_keyword = _accepts_cache.setdefault(function, {})
    except TypeError:  # not weak-referenceable
        return _accepts(function, keyword)
    if keyword not in per_keyword:
        per_keyword[keyword] = _accepts(function, keyword)
    return per_keyword[keyword]


def enable(model, checkpoint_kwargs) -> None:
    """Re-enable checkpointing with ``checkpoint_kwargs`` on whatever signature the model has.

    ``None`` means "no configuration": the method is called with no arguments at all, which every
    signature accepts (and which ``checkpointing-restore`` answers with the captured configuration).
    """
    name, bound = method(model, ENABLE)
    if checkpoint_kwargs is None:
        bound()
        return
    keyword = KWARGS_NAME[name]
    how = accepts(bound, keyword)
    if how == "keyword":
        bound(**{keyword: checkpoint_kwargs})
    elif how == "positional":
        bound(checkpoint_kwargs)
    else:
        log.warning(
            "%s.%s() takes no %s; re-enabled checkpointing without %r",
            type(model).__name__, name, keyword, checkpoint_kwargs,
        )
        bound()


def disable(model) -> None:
    method(model, DISABLE)[1]()
