"""The engine's layer in one target: the wrapt layer on a function or method (an assign target's is
:mod:`shim.assigning`'s), the mark that finds it, putting it in a target and taking it off. One
layer per target, however many patches have a part there: the layer runs its :class:`shim.parts.Parts`.

The sentinel that makes application idempotent lives on the layer in the target, not in the shim's
module state: a reloaded ``shim`` or a second registry finds the layer already there with
``wrapt.find_wrapper`` and joins it (adopting a part of the same patch, with its switch) instead
of adding another.

Imported when the first patch applies, never by ``import shim`` itself (wrapt waits until then).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import sys
from typing import Any

import wrapt

from . import assigning
from .parts import Parts

# Stored on the layer itself (wrapt keeps ``_self_*`` attributes on the proxy, not the target).
_PARTS_ATTRIBUTE = "_self_shim_parts"
# Marks the function that stands for an inherited method under a layer (see _inherited).
_DISPATCH_ATTRIBUTE = "__shim_inherited_dispatch__"


PathResolutionError = wrapt.PathResolutionError


def object_at(module: object, path: str) -> object:
    """The object at ``module.path`` as wrapt will wrap it (raises :data:`PathResolutionError`)."""
    return wrapt.resolve_path(module, path)[2]


def owner_of(module: object, path: str) -> tuple[Any, str]:
    """The object that holds the attribute at ``module.path`` (a class, or the module), and its name."""
    parent, attribute, _current = wrapt.resolve_path(module, path)
    return parent, attribute


def parts_of(layer: object) -> Parts | None:
    """The parts ``layer`` runs, if it is a shim layer (never looked up through proxies)."""
    try:
        parts = object.__getattribute__(layer, _PARTS_ATTRIBUTE)
    except (AttributeError, TypeError):
        return None
    return parts if isinstance(parts, Parts) else None


def patch_names_of(layer: object) -> tuple[str, ...]:
    """The patches with a part in ``layer``, outermost first, if it is a shim layer."""
    parts = parts_of(layer)
    return parts.names() if parts is not None else ()


def wrappers_on(target: object) -> list[tuple[str, Any]]:
    """``(patch name, layer)`` for each part in the shim's layer in ``target``'s wrapper chain,
    outermost first; ``target``: an object, or a ``"module:Class.attribute"`` spec of a module
    already imported."""
    if isinstance(target, str):
        module_name, _, path = target.partition(":")
        module = sys.modules.get(module_name)
        try:
            target = object_at(module, path) if module is not None and path else None
        except PathResolutionError:
            target = None
        if target is None:
            return []
    chain = wrapt.wrapper_chain(target)
    return [(name, entry) for entry in chain for name in patch_names_of(entry)]


def find_layer(obj: object) -> Any:
    """The shim's layer anywhere in ``obj``'s wrapper chain, or ``None``."""
    return wrapt.find_wrapper(obj, predicate=lambda entry: parts_of(entry) is not None)


def find_shim_wrapper(obj: object, name: str) -> Any:
    """The shim's layer in ``obj``'s wrapper chain if patch ``name`` has a part in it, or ``None``."""
    return wrapt.find_wrapper(obj, predicate=lambda entry: name in patch_names_of(entry))


class _BoundLayer(wrapt.BoundFunctionWrapper[Any, Any]):
    """A shim layer bound to an instance: to code that inspects it, the bound method it wraps.

    ``__func__`` is the class-level layer, so ``obj.method.__func__ is Class.method`` holds for a
    stock ``obj`` (transformers' ``_is_overridden`` compares exactly that). It pickles and copies
    as a bound method does: by its instance and its name.
    """

    @property
    def __func__(self) -> Any:
        return self._self_parent

    def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
        return getattr, (self._self_instance, self.__name__)

    def __copy__(self) -> Any:
        return getattr(self._self_instance, self.__name__)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return getattr(copy.deepcopy(self._self_instance, memo), self.__name__)


class _Layer(wrapt.FunctionWrapper[Any, Any]):
    """A shim layer on a module function: pickled by reference and never copied, like a function.

    Its signature is the wrapped function's, read once: ``inspect.signature`` then takes it as it
    is instead of unwrapping the layer on every call (transformers asks for the signature of
    ``_set_gradient_checkpointing`` at every checkpointing enable and disable).
    """

    __bound_function_wrapper__ = _BoundLayer
    _self_signature: inspect.Signature

    @property
    def __signature__(self) -> inspect.Signature:
        try:
            signature = self._self_signature
        except AttributeError:
            try:
                signature = inspect.signature(self.__wrapped__)
            except (TypeError, ValueError):  # no signature to give: inspect looks as it would without it
                raise AttributeError("__signature__") from None
            self._self_signature = signature
        return signature

    def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
        return _lookup, (self.__module__, self.__qualname__)

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self


class _MethodLayer(_Layer):
    """A shim layer on a method: ``Class.method`` is this one object, as the function was.

    wrapt binds a class access to a new wrapper each time (instance ``None``); here it returns
    the layer itself, and a call through the class (``Class.method(obj, ...)``) is bound to its
    first argument, so the patch sees the instance as in ``obj.method(...)``.
    """

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return super().__get__(instance, owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not args:
            return super().__call__(*args, **kwargs)
        return super().__get__(args[0], type(args[0]))(*args[1:], **kwargs)


def _lookup(module: str, qualname: str) -> Any:
    """What ``module.qualname`` is now (how a pickled function is found again)."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _inherited(owner: type, attribute: str, original: Any) -> Any:
    """A method for ``owner`` that calls whatever ``attribute`` its base classes have at call time.

    Wrapping an inherited method (``GradientCheckpointingLayer.__call__``, which is
    ``nn.Module.__call__`` from transformers 5.23) must not freeze the base's method as it was:
    tools such as torch.fx and torch.ao patch ``nn.Module.__call__`` while they run, and a layer
    that called the captured original would route around them.
    """

    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(super(owner, self), attribute)(*args, **kwargs)

    functools.update_wrapper(dispatch, original)
    dispatch.__module__ = owner.__module__
    dispatch.__qualname__ = f"{owner.__qualname__}.{attribute}"
    setattr(dispatch, _DISPATCH_ATTRIBUTE, True)
    return dispatch


def install(module: object, path: str, parts: Parts, assign: bool = False) -> Any:
    """Put a layer running ``parts`` in ``module.path``; returns it. ``assign``: the target is an
    attribute instances are assigned, and the layer an :class:`~shim.assigning.AssignmentLayer`."""
    if assign:
        return assigning.install(module, path, parts)
    parent, attribute, _original = wrapt.resolve_path(module, path)
    owner = parent if isinstance(parent, type) else None
    inherited = owner is not None and attribute not in vars(owner)
    static = inspect.getattr_static(owner, attribute) if owner is not None else None
    # A function, or an inherited callable (a slot wrapper such as object.__setattr__) that the
    # layer reaches through a dispatch function: a method either way.
    method = owner is not None and (inspect.isfunction(static) or (inherited and callable(static)))
    layer_class = _MethodLayer if method else _Layer

    def factory(original: Any) -> Any:
        target = _inherited(owner, attribute, original) if owner and inherited and callable(original) else original
        layer = layer_class(target, parts)
        setattr(layer, _PARTS_ATTRIBUTE, parts)
        return layer

    return wrapt.wrap_object(module, path, factory)  # type: ignore[arg-type]  # a factory of one argument


def remove(module: object, path: str, layer: object) -> str | None:
    """Take ``layer`` off its target, whatever sits above it; returns a reason when it cannot be
    removed (it then stays, a pass-through with no part, until a patch joins it again)."""
    if type(layer) is assigning.AssignmentLayer:
        if assigning.remove(layer) or not wrapt.is_wrapped_by(getattr(layer.owner, layer.attribute, None), layer):
            return None
        return f"{layer!r} is under another descriptor of {layer.owner.__qualname__}.{layer.attribute}"
    try:
        wrapt.unwrap_object(module, path, layer, missing_ok=True)
    except wrapt.WrapperNotOutermostError as exc:
        # A non-wrapt wrapper (e.g. a functools.wraps closure) holds ours: it cannot be spliced
        # out, so it stays in place with no part, a plain pass-through.
        return str(exc)
    return None


def is_dispatch(obj: object) -> bool:
    """Whether ``obj`` is the stand-in :func:`install` puts under a layer on an inherited method."""
    return bool(getattr(obj, _DISPATCH_ATTRIBUTE, False))


def holds(outer: object, inner: object) -> bool:
    """Whether ``outer`` holds ``inner`` where a hand-written wrapper keeps what it calls: a closure
    cell or a default argument, of ``outer`` or of what it wraps (``contextlib.contextmanager``
    keeps the generator function, which keeps ``inner``)."""
    for entry in wrapt.wrapper_chain(outer):
        function = getattr(entry, "__func__", entry)
        held = list(getattr(function, "__defaults__", None) or ())
        for cell in getattr(function, "__closure__", None) or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                pass
        if any(value is inner or getattr(value, "__func__", None) is inner for value in held):
            return True
    return False
