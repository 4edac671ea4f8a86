"""Calling a model's checkpointing enable and disable the way its own class expects: the
``activation_checkpointing_*`` names where the class has them (so that the shim's own calls raise no
``FutureWarning`` on transformers >= 5.23), or the names a caller the shim stands in for used
(:data:`TRL`), and the configuration passed as the signature takes it.
"""

from __future__ import annotations

import inspect
import logging
import weakref

log = logging.getLogger("shim")
_MISSING = object()

ENABLE = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
DISABLE = ("activation_checkpointing_disable", "gradient_checkpointing_disable")
#: What trl's ``disable_gradient_checkpointing`` calls: the old names, with their FutureWarnings.
TRL = ("gradient_checkpointing_enable",)
KWARGS_NAME = {
    "activation_checkpointing_enable": "activation_checkpointing_kwargs",
    "gradient_checkpointing_enable": "gradient_checkpointing_kwargs",
}


def is_checkpointing(model) -> bool:
    """Whether checkpointing is on, without the deprecated property where the new one exists."""
    value = getattr(model, "is_activation_checkpointing", _MISSING)
    if value is _MISSING:
        value = model.is_gradient_checkpointing
    return bool(value)


def method(model, names: tuple[str, ...]):
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


_accepts_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parameters(function):
    """``function``'s parameters without ``self``/``cls``, or ``None`` when they cannot be read."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if parameters and parameters[0].name in ("self", "cls") and not inspect.ismethod(function):
        parameters = parameters[1:]
    return parameters


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _accepts(function, keyword: str) -> str:
    """How ``function`` can receive ``keyword``: "keyword", "positional" or "" (not at all).

    The pseudo-keyword ``"*"`` asks whether it takes one positional argument at all:
    "positional" or "".
    """
    parameters = _parameters(function)
    if parameters is None:
        return "keyword" if keyword != "*" else "positional"  # cannot tell: call it the way upstream does
    if keyword == "*":
        takes = any(p.kind in _POSITIONAL or p.kind is p.VAR_POSITIONAL for p in parameters)
        return "positional" if takes else ""
    for parameter in parameters:
        if parameter.name == keyword and parameter.kind is not parameter.POSITIONAL_ONLY:
            return "keyword"
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return "keyword"
    if parameters and parameters[0].kind in _POSITIONAL:
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


def takes_positional(bound) -> bool:
    """Whether ``bound`` can be called with one positional argument."""
    return accepts(bound, "*") == "positional"


def enable(model, checkpoint_kwargs, names: tuple[str, ...] = ENABLE) -> None:
    """Re-enable checkpointing with ``checkpoint_kwargs`` on whatever signature the model has,
    through the first of ``names`` it has.

    ``None`` means "no configuration": the method is called with no arguments at all, which every
    signature accepts (and which ``checkpointing-restore`` answers with the captured configuration).
    """
    name, bound = method(model, names)
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
            type(model).__name__,
            name,
            keyword,
            checkpoint_kwargs,
        )
        bound()


def disable(model) -> None:
    method(model, DISABLE)[1]()
