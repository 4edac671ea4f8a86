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
import types
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
    """Whether a call of ``outer`` can reach ``inner`` through what it keeps: a closure cell, a default
    argument, a module global or a class attribute its code names, the function and arguments of a
    ``functools.partial``, what it wraps (``__wrapped__``: ``contextlib.contextmanager`` keeps the
    generator function, which keeps ``inner``), a bound method's function and instance; looked
    through :data:`_REACH` levels of such holders. Read, never called: a replacement that keeps the
    shim's layer and calls it runs the fix."""
    seen: set[int] = set()
    level = [outer]
    for _ in range(_REACH + 1):
        if any(value is inner or _function_of(value) is inner for value in level):
            return True
        found = []
        for value in level:
            if id(value) not in seen:
                seen.add(id(value))
                found += _kept_by(value)
        level = found
    return False


#: How many holders deep :func:`holds` looks (a replacement, the class its code names, the partial
#: in that class's attribute, the function the partial holds, ...).
_REACH = 5
_NOTHING = object()


def _static(obj: object, name: str) -> Any:
    """``obj.name`` as stored, or :data:`_NOTHING`: no property, no module ``__getattr__`` runs (a
    lazy module would import on it)."""
    try:
        return inspect.getattr_static(obj, name, _NOTHING)
    except Exception:  # an object whose class or dict cannot be read
        return _NOTHING


def _function_of(value: object) -> Any:
    """The function a bound method runs (the shim's layer, for a method bound through it)."""
    if isinstance(value, types.MethodType):
        return value.__func__
    if isinstance(value, wrapt.BoundFunctionWrapper):
        return value._self_parent
    return None


def _kept_by(value: object) -> list[object]:
    """What ``value`` keeps that a call of it may call (:func:`holds`)."""
    if isinstance(value, (functools.partial, functools.partialmethod)):
        return [value.func, *value.args, *value.keywords.values()]
    if isinstance(value, (staticmethod, classmethod)):
        return [value.__func__]
    if isinstance(value, wrapt.ObjectProxy):  # a wrapt wrapper: what it wraps, and its wrapper function
        return [value.__wrapped__, _static(value, "_self_wrapper")]
    kept: list[object] = []
    if isinstance(value, types.FunctionType) and (wrapped := _static(value, "__wrapped__")) is not _NOTHING:
        kept.append(wrapped)  # functools.wraps
    function, holder = _runs(value)
    if isinstance(function, types.FunctionType):
        kept += _reached_from(function, holder)
    return kept


def _runs(value: object) -> tuple[object, object]:
    """The function a call of ``value`` runs, and the object it runs on (``None`` for a function): a
    bound method's function and instance, or an instance's class's ``__call__`` and the instance."""
    if isinstance(value, types.MethodType):
        return value.__func__, value.__self__
    if isinstance(value, types.FunctionType):
        return value, None
    return _static(type(value), "__call__"), value


def _reached_from(function: types.FunctionType, holder: object) -> list[object]:
    """What ``function``'s code can reach: its closure cells, its defaults, the module globals it
    names, and what those names are on the classes and modules among them and on ``holder``
    (``self.original``, ``type(self).original``)."""
    kept = [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
    kept += [*(function.__defaults__ or ()), *(function.__kwdefaults__ or {}).values()]
    names = _names(function.__code__)
    named = [found for name in names if (found := function.__globals__.get(name, _NOTHING)) is not _NOTHING]
    owners: list[object] = [owner for owner in named if isinstance(owner, (type, types.ModuleType))]
    if holder is not None:
        owners.append(holder)
    kept += named
    kept += [found for owner in owners for name in names if (found := _static(owner, name)) is not _NOTHING]
    return kept


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` reads, its nested functions' included."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names(constant)
    return names


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a cell not filled yet
        return False
    return True
