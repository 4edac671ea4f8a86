"""Installing and removing the shim's own wrapt layer on one target attribute.

The sentinel that makes application idempotent lives on the wrapper in the target, not in the
shim's module state: a reloaded ``shim`` or a second registry finds the layer already there with
``wrapt.find_wrapper`` and adopts it instead of adding another.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import wrapt

from .switch import Switch

# Stored on the wrapper itself (wrapt keeps ``_self_*`` attributes on the proxy, not the target).
_PATCH_ATTRIBUTE = "_self_shim_patch"
_SWITCH_ATTRIBUTE = "_self_shim_switch"


PathResolutionError = wrapt.PathResolutionError


def resolve(module: object, path: str) -> object:
    """The object at ``module.path`` as wrapt will wrap it (raises :data:`PathResolutionError`)."""
    return wrapt.resolve_path(module, path)[2]


def patch_name_of(entry: object) -> str | None:
    """The patch name stored on ``entry`` if it is a shim wrapper (never looked up through proxies)."""
    try:
        name = object.__getattribute__(entry, _PATCH_ATTRIBUTE)
    except (AttributeError, TypeError):
        return None
    return name if isinstance(name, str) else None


def find_shim_wrapper(obj: object, name: str) -> Any:
    """Our wrapper for patch ``name`` anywhere in ``obj``'s wrapper chain, or ``None``."""
    return wrapt.find_wrapper(obj, predicate=lambda entry: patch_name_of(entry) == name)


def switch_of(wrapper: object) -> Switch:
    switch: Switch = object.__getattribute__(wrapper, _SWITCH_ATTRIBUTE)
    return switch


def install(module: object, path: str, name: str, wrapper: Callable[..., Any], switch: Switch) -> Any:
    """Wrap ``module.path`` with ``wrapper``, marked as patch ``name``; returns the handle."""

    def factory(original: Any) -> Any:
        layer = wrapt.FunctionWrapper(original, wrapper, enabled=switch)
        setattr(layer, _PATCH_ATTRIBUTE, name)
        setattr(layer, _SWITCH_ATTRIBUTE, switch)
        return layer

    return wrapt.wrap_object(module, path, factory)  # type: ignore[arg-type]  # a factory of one argument


def remove(module: object, path: str, handle: object) -> str | None:
    """Remove our layer only, whatever sits above it; returns a reason when it cannot be removed."""
    try:
        wrapt.unwrap_object(module, path, handle, missing_ok=True)
    except wrapt.WrapperNotOutermostError as exc:
        # A non-wrapt wrapper (e.g. a functools.wraps closure) holds ours: it cannot be spliced
        # out, so it stays in place switched off, which makes it a plain pass-through.
        return str(exc)
    return None


def rebind(
    patterns: tuple[str, ...], original: object, replacement: object
) -> tuple[list[tuple[Any, str]], list[tuple[str, str]]]:
    """Point module-level names equal to ``original`` in modules matching ``patterns`` at ``replacement``.

    Returns ``(rebound, failed)``: ``(module, attribute)`` pairs, so the rebinding can be undone.
    """
    import fnmatch  # only where a patch names consumers

    rebound: list[tuple[Any, str]] = []
    failed: list[tuple[str, str]] = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not any(fnmatch.fnmatchcase(module_name, p) for p in patterns):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attribute, value in list(namespace.items()):
            if value is not original:
                continue
            try:
                setattr(module, attribute, replacement)
            except Exception:  # a module that refuses assignment: reported in the status reason
                failed.append((module_name, attribute))
            else:
                rebound.append((module, attribute))
    return rebound, failed


def unbind(rebound: list[tuple[Any, str]], replacement: object, original: object) -> None:
    """Undo :func:`rebind` where the name still points at our replacement."""
    for module, attribute in rebound:
        if getattr(module, attribute, None) is replacement:
            setattr(module, attribute, original)
