"""Putting the shim's layers in targets and taking them off: one target at a time (wrapt), the
assign targets' descriptors, and everything one patch has installed (:class:`Layers`).

The sentinel that makes application idempotent lives on the wrapper in the target, not in the
shim's module state: a reloaded ``shim`` or a second registry finds the layer already there with
``wrapt.find_wrapper`` and adopts it (with its switch) instead of adding another.

Assign targets (``Target(..., assign=True)``): the shim's layer on an attribute that instances of
a class are assigned, which sees every value assigned while its patch is on and never a read.
The layer has the shape of wrapt's ``AttributeWrapper``: a data descriptor on the class whose
``__wrapped__`` is what the class held before (another layer, a descriptor, a plain class default)
or ``wrapt.MISSING``, so layers stack and ``wrapt.wrapper_chain``/``find_wrapper`` see them as they
see the shim's function layers. It is a slotted class rather than a wrapt proxy: it is passed on
every assignment of the attribute (per layer, per enable and disable) and read on every
checkpointed layer call, and a proxy's attribute reads made each of those six times dearer.

Imported when the first patch applies, never by ``import shim`` itself (wrapt waits until then).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import wrapt

from .runtime import SharedSwitch, Switch

if TYPE_CHECKING:
    from .patch import Patch, Target

log = logging.getLogger("shim")

# Stored on the wrapper itself (wrapt keeps ``_self_*`` attributes on the proxy, not the target).
_PATCH_ATTRIBUTE = "_self_shim_patch"
_SWITCH_ATTRIBUTE = "_self_shim_switch"
# Marks the function that stands for an inherited method under a layer (see _inherited).
_DISPATCH_ATTRIBUTE = "__shim_inherited_dispatch__"


PathResolutionError = wrapt.PathResolutionError


def resolve(module: object, path: str) -> object:
    """The object at ``module.path`` as wrapt will wrap it (raises :data:`PathResolutionError`)."""
    return wrapt.resolve_path(module, path)[2]


def owner_of(module: object, path: str) -> tuple[Any, str]:
    """The object that holds the attribute at ``module.path`` (a class, or the module), and its name."""
    parent, attribute, _current = wrapt.resolve_path(module, path)
    return parent, attribute


def patch_names_of(entry: object) -> tuple[str, ...]:
    """The patches whose layer ``entry`` is, if it is a shim layer (never looked up through
    proxies): one name, or every member of a shared layer."""
    try:
        switch = object.__getattribute__(entry, _SWITCH_ATTRIBUTE)
        name = object.__getattribute__(entry, _PATCH_ATTRIBUTE)
    except (AttributeError, TypeError):
        return ()
    if isinstance(switch, SharedSwitch):
        return tuple(switch.members)
    return (name,) if isinstance(name, str) else ()


def wrappers_on(target: object) -> list[tuple[str, Any]]:
    """``(patch name, layer)`` for each shim layer in ``target``'s wrapper chain, outermost first;
    ``target``: an object, or a ``"module:Class.attribute"`` spec of a module already imported."""
    if isinstance(target, str):
        module_name, _, path = target.partition(":")
        module = sys.modules.get(module_name)
        try:
            target = resolve(module, path) if module is not None and path else None
        except PathResolutionError:
            target = None
        if target is None:
            return []
    chain = wrapt.wrapper_chain(target)
    return [(name, entry) for entry in chain for name in patch_names_of(entry)]


def find_shim_wrapper(obj: object, name: str) -> Any:
    """Our wrapper for patch ``name`` anywhere in ``obj``'s wrapper chain, or ``None``."""
    return wrapt.find_wrapper(obj, predicate=lambda entry: name in patch_names_of(entry))


def switch_of(wrapper: object, name: str) -> Switch:
    """The switch patch ``name``'s layer ``wrapper`` answers to for it (a member's own, in a shared layer)."""
    switch: Switch = object.__getattribute__(wrapper, _SWITCH_ATTRIBUTE)
    if isinstance(switch, SharedSwitch):
        return switch.members[name]
    return switch


def _wrapper_of(layer: object) -> Any:
    """The function a shim layer runs: an assign layer's ``assigned``, a wrapt layer's wrapper."""
    if type(layer) is AssignmentLayer:
        return layer.assigned
    try:
        return object.__getattribute__(layer, "_self_wrapper")
    except AttributeError:
        return None


def find_shared(obj: object, wrapper: object) -> Any:
    """The shared layer running ``wrapper`` in ``obj``'s wrapper chain (another patch declared
    the same shared target), or ``None``."""

    def shares(entry: object) -> bool:
        try:
            switch = object.__getattribute__(entry, _SWITCH_ATTRIBUTE)
        except (AttributeError, TypeError):
            return False
        return isinstance(switch, SharedSwitch) and _wrapper_of(entry) is wrapper

    return wrapt.find_wrapper(obj, predicate=shares)


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


def _drop_dispatch(owner: object, attribute: str) -> None:
    """Delete a dispatch of :func:`_inherited` left in ``owner``'s own namespace, so the method is
    inherited again. It is left there when two layers stacked on an inherited method are removed
    inner first: wrapt splices the inner one out, and the outer one then restores what it wrapped."""
    if isinstance(owner, type) and getattr(vars(owner).get(attribute), _DISPATCH_ATTRIBUTE, False):
        delattr(owner, attribute)


def install(
    module: object,
    path: str,
    name: str,
    wrapper: Callable[..., Any],
    switch: Switch,
    assign: bool = False,
    shared: bool = False,
) -> Any:
    """Wrap ``module.path`` with ``wrapper``, marked as patch ``name``; returns the handle.
    ``assign``: ``wrapper(instance, value)`` is given each value assigned to an instance attribute
    and returns the value to store (:class:`AssignmentLayer`). ``shared``: the layer answers to a
    :class:`SharedSwitch` that ``name`` joins, and other patches may join (:func:`join`)."""
    if shared:
        joint = SharedSwitch()
        joint.join(name, switch)
        switch = joint
    if assign:
        return _install_assigned(module, path, name, wrapper, switch)
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
        layer = layer_class(target, wrapper, enabled=switch)
        setattr(layer, _PATCH_ATTRIBUTE, name)
        setattr(layer, _SWITCH_ATTRIBUTE, switch)
        return layer

    return wrapt.wrap_object(module, path, factory)  # type: ignore[arg-type]  # a factory of one argument


def remove(module: object, path: str, handle: object, name: str) -> str | None:
    """Take patch ``name``'s layer off, whatever sits above it; returns a reason when it cannot be
    removed. A shared layer loses ``name`` as a member and comes off with its last one."""
    switch = object.__getattribute__(handle, _SWITCH_ATTRIBUTE)
    if isinstance(switch, SharedSwitch):
        switch.leave(name)
        if switch.members:
            return None
    if type(handle) is AssignmentLayer:
        if _remove_assigned(handle) or not wrapt.is_wrapped_by(getattr(handle.owner, handle.attribute, None), handle):
            return None
        return f"{handle!r} is under another descriptor of {handle.owner.__qualname__}.{handle.attribute}"
    try:
        wrapt.unwrap_object(module, path, handle, missing_ok=True)
    except wrapt.WrapperNotOutermostError as exc:
        # A non-wrapt wrapper (e.g. a functools.wraps closure) holds ours: it cannot be spliced
        # out, so it stays in place switched off, which makes it a plain pass-through.
        return str(exc)
    try:
        parent, attribute, _current = wrapt.resolve_path(module, path)
    except wrapt.PathResolutionError:
        return None
    _drop_dispatch(parent, attribute)
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


# -- assign targets ---------------------------------------------------------------------------------

MISSING = wrapt.MISSING


def _is_data_descriptor(value: object) -> bool:
    kind = type(value)
    return hasattr(kind, "__get__") and (hasattr(kind, "__set__") or hasattr(kind, "__delete__"))


class AssignmentLayer:
    """One patch's layer on ``owner.attribute``: ``assigned(instance, value)`` is given each value
    assigned on an instance while the patch's switch is on, and returns what to store; a read
    returns what is stored (raising ``AttributeError``, handed on to the class's ``__getattr__``,
    as when the attribute was never set), and never runs the patch."""

    __slots__ = ("__wrapped__", "_self_shim_patch", "_self_shim_switch", "attribute", "assigned", "owner")

    def __init__(
        self, prior: Any, owner: type, attribute: str, assigned: Callable[[Any, Any], Any], name: str, switch: Switch
    ) -> None:
        self.__wrapped__ = prior
        self.owner, self.attribute, self.assigned = owner, attribute, assigned
        self._self_shim_patch, self._self_shim_switch = name, switch

    def _beneath(self) -> Any:
        """The first thing under the shim's layers: a descriptor, a class default, or MISSING."""
        prior = self.__wrapped__
        while type(prior) is AssignmentLayer:
            prior = prior.__wrapped__
        return prior

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        prior = self._beneath()
        if prior is MISSING or not hasattr(type(prior), "__get__"):
            try:
                return instance.__dict__[self.attribute]
            except KeyError:
                if prior is MISSING:
                    raise AttributeError(self.attribute) from None
                return prior  # a plain class default
        if _is_data_descriptor(prior) or self.attribute not in instance.__dict__:
            return prior.__get__(instance, owner)
        return instance.__dict__[self.attribute]

    def __set__(self, instance: Any, value: Any) -> None:
        layer = self
        while True:  # down the shim's layers in one frame
            if layer._self_shim_switch.on:
                value = layer.assigned(instance, value)
            prior = layer.__wrapped__
            if type(prior) is not AssignmentLayer:
                break
            layer = prior
        if prior is not MISSING and hasattr(type(prior), "__set__"):
            prior.__set__(instance, value)
        else:
            instance.__dict__[self.attribute] = value

    def __delete__(self, instance: Any) -> None:
        prior = self._beneath()
        if prior is not MISSING and hasattr(type(prior), "__delete__"):
            prior.__delete__(instance)
            return
        try:
            del instance.__dict__[self.attribute]
        except KeyError:
            raise AttributeError(self.attribute) from None

    def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
        return getattr, (self.owner, self.attribute)  # by reference, as its class pickles

    def __copy__(self) -> AssignmentLayer:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> AssignmentLayer:
        return self

    def __repr__(self) -> str:
        return f"<shim assign layer {self._self_shim_patch!r} on {self.owner.__qualname__}.{self.attribute}>"


def resolve_assigned(module: object, path: str) -> tuple[type, Any]:
    """For an assign target ``Class.attribute``: the class, and what it holds for the attribute
    (found along its MRO), or ``wrapt.MISSING`` (raises ``wrapt.PathResolutionError``)."""
    owner_path, _, attribute = path.rpartition(".")
    owner = wrapt.resolve_path(module, owner_path)[2]
    if not isinstance(owner, type):
        raise wrapt.PathResolutionError(f"{owner_path} is not a class")
    for cls in owner.__mro__:
        if attribute in vars(cls):
            return owner, vars(cls)[attribute]
    return owner, MISSING


def _install_assigned(module: object, path: str, name: str, assigned: Callable[[Any, Any], Any], switch: Switch) -> Any:
    """Put patch ``name``'s :class:`AssignmentLayer` on ``module.Class.attribute``; returns it."""
    owner, prior = resolve_assigned(module, path)
    layer = AssignmentLayer(prior, owner, path.rpartition(".")[2], assigned, name, switch)
    setattr(owner, layer.attribute, layer)
    return layer


def _remove_assigned(handle: AssignmentLayer) -> bool:
    """Take ``handle`` off: from the class when it is outermost there (the class gets back what it
    held, or loses the attribute), or from under the shim's other layers. False when it is not
    found there (replaced, or under something else)."""
    owner, attribute = handle.owner, handle.attribute
    current = vars(owner).get(attribute, MISSING)
    if current is handle:
        prior = handle.__wrapped__
        inherited = next((vars(c)[attribute] for c in owner.__mro__[1:] if attribute in vars(c)), MISSING)
        if prior is MISSING or prior is inherited:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, prior)
        return True
    while type(current) is AssignmentLayer:
        if current.__wrapped__ is handle:
            current.__wrapped__ = handle.__wrapped__
            return True
        current = current.__wrapped__
    return False


# -- other patchers on the shim's targets -----------------------------------------------------------

BYPASSED, ABOVE, BELOW, SAME_FIX = "bypassed", "above", "below", "same fix"
#: Where upstream's own functions live: anything else in a target's wrapper chain is another patcher's.
_STACK = frozenset({"transformers", "trl", "peft", "accelerate", "deepspeed", "torch", "builtins", "functools"})


class Other(NamedTuple):
    """Another patcher's object on one of the shim's targets, and where it sits."""

    target: str  # "module:path", or "module.attribute" for a name the shim rebound
    relation: str  # BYPASSED (the fix does not run there), ABOVE (it runs first), BELOW (the fix runs first),
    # or SAME_FIX (beside the targets: it fixes the same bug its own way)
    by: str  # "module:qualname" where it was defined
    file: str  # its source file, or ""
    covers: str = ""  # SAME_FIX: for what its fix holds

    def text(self) -> str:
        by = _located(self.by, self.file)
        if self.relation == SAME_FIX:
            return f"{self.target} holds {by}, which fixes the same bug for {self.covers}: both can be on"
        if self.relation == BYPASSED:
            return f"{self.target} was replaced by {by}: the fix does not run there"
        if self.relation == ABOVE:
            return f"{self.target} is wrapped again by {by}: it runs first, then the fix"
        return f"{self.target} held {by} when the shim wrapped it: the fix runs first, then it"


def _definition(obj: object, home: str) -> tuple[str, str] | None:
    """``(module:qualname, file)`` of where ``obj`` was written, or ``None`` for upstream's own: the
    target's package (``home``), the libraries the shim patches, torch (named as :func:`_code_of`
    finds them). The standard library's decorators (``contextlib.contextmanager``) and the shim's
    own parts are no other patcher."""
    if obj is MISSING or getattr(obj, _DISPATCH_ATTRIBUTE, False):
        return None
    obj, code, module, qualname, file = _code_of(obj)
    top = module.partition(".")[0]
    if top in sys.stdlib_module_names and top not in _STACK:  # a decorator: whose function it decorates
        inner = getattr(obj, "__wrapped__", None)
        return _definition(inner, home) if inner is not None and inner is not obj else None
    if top == "shim":
        return None
    if top in _STACK or top == home:
        if code is None or not file.startswith("<"):
            return None
        file = f"{file}: its source re-executed by another patcher"  # upstream's functions come from files
    return f"{module}:{qualname}", file


def _code_of(obj: object) -> tuple[object, Any, str, str, str]:
    """``(function, code, module, qualname, file)`` of the code ``obj`` runs: a wrapt wrapper's
    wrapper function, a method's or partial's function; a ``functools.wraps`` copy by its own code
    and globals, not the names it copied. ``code`` is ``None`` (and ``file`` ``""``) for what has
    none: a class, a C function."""
    if isinstance(obj, wrapt.BaseObjectProxy):  # a wrapt wrapper: its wrapper function says whose
        try:
            obj = object.__getattribute__(obj, "_self_wrapper")
        except AttributeError:
            obj = type(obj)
    obj = getattr(obj, "__func__", obj)
    while isinstance(obj, functools.partial):
        obj = obj.func
    code = getattr(obj, "__code__", None)
    if code is not None:
        module = getattr(obj, "__globals__", {}).get("__name__", "?")
        return obj, code, module, getattr(code, "co_qualname", code.co_name), code.co_filename
    kind = obj if isinstance(obj, type) else type(obj)
    module = kind.__module__
    if module == "builtins":  # a C function or slot wrapper: its own module, when it says
        module = getattr(obj, "__module__", None) or "builtins"
    return obj, None, module, kind.__qualname__, ""


def written_by(obj: object) -> str:
    """Where the code ``obj`` runs was written: ``module:qualname (file)``, as status names another
    patcher (for an effect that says who replaced something the shim does not wrap)."""
    _, _, module, qualname, file = _code_of(obj)
    return _located(f"{module}:{qualname}", file)


def _located(by: str, file: str) -> str:
    """``module:qualname (file)``, as the status lines and effects name another patcher's code."""
    return f"{by} ({file})" if file else by


def _name(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _calls(outer: object, inner: object) -> bool:
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


def others_on(layer: Layer, patch: str) -> list[Other]:
    """Other patchers on one of patch ``patch``'s layers: above it, below it, or in its place."""
    spec, home = f"{layer.module_name}:{layer.path}", layer.module_name.partition(".")[0]
    try:
        current = resolve(layer.module, layer.path)
    except PathResolutionError:
        return []
    found: list[Other] = []
    chain = list(wrapt.wrapper_chain(current))
    if not any(entry is layer.handle for entry in chain) and not _calls(current, layer.handle):
        where = _definition(current, home)
        if where is not None:  # else upstream's own again (a reload): the engine's stale check says so
            found.append(Other(spec, BYPASSED, *where))
        return found
    for entry in chain:
        if entry is layer.handle or patch in patch_names_of(entry):
            break
        if not patch_names_of(entry) and (where := _definition(entry, home)) is not None:
            if Other(spec, ABOVE, *where) not in found:
                found.append(Other(spec, ABOVE, *where))
    for entry in wrapt.wrapper_chain(layer.original):
        if not patch_names_of(entry) and (where := _definition(entry, home)) is not None:
            found.append(Other(spec, BELOW, *where))
            break  # the outermost one names it; what it wraps is its business
    return found


def same_fixes(patch: Patch) -> list[Other]:
    """The patchers of ``patch.same_fix`` that are on: the owner carries the mark and the attribute
    holds code that is not upstream's. Modules nobody imported are not looked into."""
    found = []
    for same in patch.same_fix:
        module = sys.modules.get(same.module)
        if module is None:
            continue
        try:
            owner = resolve(module, same.path.rpartition(".")[0])
            current = resolve(module, same.path)
        except PathResolutionError:
            continue
        if not getattr(owner, same.mark, False):
            continue
        where = _definition(current, same.module.partition(".")[0])
        if where is not None:
            found.append(Other(same.spec, SAME_FIX, *where, covers=same.covers))
    return found


def foreign_targets(patch: Patch, module_names: list[str]) -> list[Other]:
    """Targets of ``patch`` in ``module_names`` that hold another patcher's object, not upstream's
    (said when the patch cannot apply to them: its probe refused what it found there)."""
    found = []
    for target in patch.targets:
        module = sys.modules.get(target.module)
        if target.module not in module_names or module is None or target.assign:
            continue
        try:
            current = resolve(module, target.path)
        except PathResolutionError:
            continue
        for entry in wrapt.wrapper_chain(current):  # under the layers of the shim's other patches
            if not patch_names_of(entry):
                where = _definition(entry, target.module.partition(".")[0])
                if where is not None:
                    found.append(Other(target.spec, BYPASSED, *where))
                break
    return found


# -- what one patch has installed -------------------------------------------------------------------


class Layer(NamedTuple):
    module: Any  # the module object the target lives in
    path: str  # the attribute path in it
    handle: Any  # our wrapper
    original: Any  # what it wraps
    owner: Callable[[], Any]  # (a weak reference to) the object holding it: a class, or the module
    attribute: str  # its name there
    module_name: str  # the target module's name, under which sys.modules holds ``module``


def _reference(obj: object) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # an object without weak references: held, as wrapt holds it anyway
        return lambda: obj


class Resolved(NamedTuple):
    target: Target
    module: Any  # the imported module object
    original: object  # what the target path holds now (for an assign target: what the class holds, or wrapt.MISSING)


class Layers:
    """Everything one patch has installed: its layers and the consumer names it rebound."""

    __slots__ = ("name", "installed", "replaced", "rebound", "consumers")

    def __init__(self, name: str) -> None:
        self.name = name
        self.installed: list[Layer] = []
        # Layers whose target was replaced (a reload makes new classes): the old class, still the
        # base of models built before, keeps its layer, working, until the patch comes off.
        self.replaced: list[Layer] = []
        self.rebound: list[tuple[Any, str, Any, Any]] = []  # (module, attribute, handle, original)
        self.consumers: tuple[str, ...] = ()  # the patch's consumer module patterns

    def __bool__(self) -> bool:
        return bool(self.installed or self.rebound)

    @property
    def in_place(self) -> bool:
        """Whether any of its layers is in place, also one a reload left on an old class."""
        return bool(self.installed or self.rebound or self.replaced)

    def wrap(self, patch: Patch, resolved: list[Resolved], switch: Switch) -> tuple[Switch, list[str]]:
        """Wrap each resolved target (or adopt the layer already there); rebind the patch's
        consumers. Returns the switch the layers answer to and the names it could not rebind.
        An exception leaves the layers added so far in :attr:`installed`, for :meth:`remove`."""
        added = []
        for target, module, original in resolved:
            handle = find_shim_wrapper(original, patch.name)
            if handle is not None:
                # Another registry (or a reloaded shim) already applied it: adopt that layer
                # and share its switch instead of adding a second one.
                switch = switch_of(handle, patch.name)
                original = handle.__wrapped__
            elif target.shared and (handle := find_shared(original, target.wrapper)) is not None:
                object.__getattribute__(handle, _SWITCH_ATTRIBUTE).join(patch.name, switch)
                original = handle.__wrapped__
            else:
                handle = install(module, target.path, patch.name, target.wrapper, switch, target.assign, target.shared)
            owner, attribute = owner_of(module, target.path)
            layer = Layer(module, target.path, handle, original, _reference(owner), attribute, target.module)
            self.installed.append(layer)
            added.append(layer)
        missed: list[str] = []
        self.consumers = patch.consumers
        for layer in added if patch.consumers else ():
            rebound, failed = rebind(patch.consumers, layer.original, layer.handle)
            self.rebound.extend((module, attribute, layer.handle, layer.original) for module, attribute in rebound)
            missed.extend(f"could not rebind {module}.{attribute}" for module, attribute in failed)
        return switch, missed

    def remove(self) -> None:
        """Take every layer off, whatever sits above it; a layer that cannot be spliced out stays,
        and the caller switches it off (it is adopted again on the next activation)."""
        for module, attribute, handle, original in self.rebound:
            unbind([(module, attribute)], handle, original)
        self.rebound.clear()
        for layer in self.installed if self.consumers else ():
            # Consumers that imported the name after the shim applied hold the layer without a
            # rebinding to undo (peft's package re-exports its function that way): given back too.
            copies, _failed = rebind(self.consumers, layer.handle, layer.original)
            log.debug("%s: gave %d later copies of %s back", self.name, len(copies), layer.path)
        stuck = [
            problem
            for layer in reversed(self.installed)
            if (problem := remove(layer.module, layer.path, layer.handle, self.name))
        ]
        for layer in self.replaced:  # from the old object it sits in, if that still holds it
            owner = layer.owner()
            if owner is not None and (problem := remove(owner, layer.attribute, layer.handle, self.name)):
                stuck.append(problem)
        self.installed.clear()
        self.replaced.clear()
        if stuck:
            log.warning("%s: left in place switched off: %s", self.name, "; ".join(stuck))

    def stale(self) -> list[Layer]:
        """Layers no longer in place: their target was replaced (``importlib.reload``, assignment),
        or their module was (a failed import discards it; the next one makes a new module)."""
        stale = []
        for layer in self.installed:
            if sys.modules.get(layer.module_name) is not layer.module:
                stale.append(layer)
                continue
            try:
                current = resolve(layer.module, layer.path)
            except PathResolutionError:
                stale.append(layer)
                continue
            if find_shim_wrapper(current, self.name) is not layer.handle and not _calls(current, layer.handle):
                stale.append(layer)
        return stale

    def drop_stale(self, foreign_too: bool) -> set[str]:
        """Set aside the layers whose target was replaced; returns their modules, to apply again.
        A target another patcher replaced stays as it is unless ``foreign_too`` (``shim.activate()``,
        the explicit way to put the shim back on top): the shim never fights it on its own."""
        stale = self.stale() if self.installed else []
        if not foreign_too:
            bypassed = {other.target for layer in stale for other in others_on(layer, self.name)}
            stale = [layer for layer in stale if f"{layer.module_name}:{layer.path}" not in bypassed]
        for layer in stale:
            self.installed.remove(layer)
            self.replaced.append(layer)
        return {layer.module_name for layer in stale}

    def others(self, consumers: bool = True) -> list[Other]:
        """Other patchers on this patch's layers, and (``consumers``) on the names it rebound (a
        rebound copy replaced since is bypassed: calls through that name skip the fix) and the
        consumer modules' other copies, which takes a walk over ``sys.modules``."""
        found = [other for layer in self.installed for other in others_on(layer, self.name)]
        if not consumers:
            return found
        for module, attribute, handle, _original in self.rebound:
            current = getattr(module, attribute, None)
            if current is handle:
                continue
            where = _definition(current, getattr(handle, "__module__", "").partition(".")[0])
            if where is not None:
                calls = any(e is handle for e in wrapt.wrapper_chain(current)) or _calls(current, handle)
                relation = ABOVE if calls else BYPASSED
                found.append(Other(f"{getattr(module, '__name__', module)}.{attribute}", relation, *where))
        found += self._around()
        return found

    def _around(self) -> list[Other]:
        """Consumer modules whose copy of a target wraps upstream's function, not the shim's layer
        (put there before the shim applied, so the rebinding did not recognise it): calls through
        that name skip the fix."""
        import fnmatch

        found = []
        rebound = {(id(module), attribute) for module, attribute, *_ in self.rebound}
        for layer in self.installed if self.consumers else ():
            home = layer.module_name.partition(".")[0]
            for module_name, module in list(sys.modules.items()):
                if module is None or not any(fnmatch.fnmatchcase(module_name, p) for p in self.consumers):
                    continue
                value = getattr(module, "__dict__", {}).get(layer.attribute)
                if (
                    value is None
                    or value is layer.handle
                    or value is layer.original
                    or (id(module), layer.attribute) in rebound
                ):
                    continue
                if any(patch_names_of(entry) for entry in wrapt.wrapper_chain(value)):
                    continue  # the shim's own layers (this patch's, or another's on the same function)
                if getattr(value, "__module__", None) == layer.module_name and _definition(value, home) is None:
                    # upstream's own function, as the target held it before another patcher's
                    # replacement, which the shim wrapped: calls through this name skip both
                    file = "upstream's, from before another patcher replaced the target"
                    found.append(Other(f"{module_name}.{layer.attribute}", BYPASSED, _name(value), file))
                    continue
                if not (any(e is layer.original for e in wrapt.wrapper_chain(value)) or _calls(value, layer.original)):
                    continue  # another function of that name, not a copy of the target
                where = _definition(value, home)
                if where is not None and not _calls(value, layer.handle):
                    found.append(Other(f"{module_name}.{layer.attribute}", BYPASSED, *where))
        return found

    def describe(self, layers: list[Layer]) -> str:
        return ", ".join(f"{getattr(layer.module, '__name__', layer.module)}:{layer.path}" for layer in layers)
