"""Assign targets (``Target(..., assign=True)``): the engine's layer on an attribute that instances of
a class are assigned, which passes every value assigned through the active parts and never runs on a
read.

The layer has the shape of wrapt's ``AttributeWrapper``: a data descriptor on the class whose
``__wrapped__`` is what the class held before (a descriptor, a plain class default) or
``wrapt.MISSING``, so ``wrapt.wrapper_chain``/``find_wrapper`` see it as they see the shim's
function layers. It is a slotted class rather than a wrapt proxy: it is passed on every assignment of
the attribute (per layer, per enable and disable) and read on every checkpointed layer call, and a
proxy's attribute reads made each of those six times dearer. One per target, whatever the number of
patches with a part there (``shim.parts``).

Where one object is assigned to many instances of a class in a row (an enable gives every layer of a
model one function), the parts run for the first and the next ones get what it got: the layer
remembers, weakly, the last value, the class of its instance and what the parts made of them, while
the same parts are active. It is the one memory of what the parts decide (the checkpointing path's
parts keep none of their own). A value the layer cannot refer to weakly goes through the parts each
time. What the parts made of a module's own function (one its module holds by its name, so it
lives as long as the module) is kept as well, strongly: every checkpointing disable gives the
layers torch's ``checkpoint`` again between two enables' new partials, and runs no part after the
first. What the parts make is shared by the instances given the same value, so it holds nothing of
one instance.
"""

from __future__ import annotations

import sys
import weakref
from types import FunctionType
from typing import TYPE_CHECKING, Any

import wrapt

if TYPE_CHECKING:
    from .parts import Parts

MISSING = wrapt.MISSING


def _is_data_descriptor(value: object) -> bool:
    kind = type(value)
    return hasattr(kind, "__get__") and (hasattr(kind, "__set__") or hasattr(kind, "__delete__"))


class AssignmentLayer:
    """The layer on ``owner.attribute``: a value assigned on an instance passes through the active
    parts (``parts.assigned(instance, value)``) and what they return is stored; a read returns what
    is stored (raising ``AttributeError``, handed on to the class's ``__getattr__``, as when the
    attribute was never set), and never runs a part."""

    __slots__ = ("__wrapped__", "_self_shim_parts", "attribute", "owner", "last", "kept")

    def __init__(self, prior: Any, owner: type, attribute: str, parts: Parts) -> None:
        self.__wrapped__ = prior
        self.owner, self.attribute, self._self_shim_parts = owner, attribute, parts
        # (the active parts, the last value, its instance's class, what the parts made of it): weakly
        self.last: tuple[Any, ...] | None = None
        # the same for the last module's own function given: the function and what was made strongly
        self.kept: tuple[Any, ...] | None = None

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        prior = self.__wrapped__
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
        active = self._self_shim_parts.active
        if active:
            last, kept = self.last, self.kept
            made = None
            if last is not None and last[0] is active and last[1]() is value and last[2]() is type(instance):
                made = last[3]()  # the usual case: the next layer given the function the first was given
            elif kept is not None and kept[0] is active and kept[1] is value and kept[2]() is type(instance):
                made = kept[3]  # a disable: torch's checkpoint again
            value = self._passed(instance, value, active) if made is None else made
        prior = self.__wrapped__
        if prior is not MISSING and hasattr(type(prior), "__set__"):
            prior.__set__(instance, value)
        else:
            instance.__dict__[self.attribute] = value

    def _passed(self, instance: Any, value: Any, active: tuple[Any, ...]) -> Any:
        """``value`` through the ``active`` parts, outermost first; remembered for the next instance."""
        given = value
        for assigned in active:
            value = assigned(instance, value)
        try:
            self.last = (active, weakref.ref(given), weakref.ref(type(instance)), weakref.ref(value))
        except TypeError:  # a value without weak references: the parts see it each time
            self.last = None
        if type(given) is FunctionType and _is_module_function(given):
            self.kept = (active, given, weakref.ref(type(instance)), value)
        return value

    def __delete__(self, instance: Any) -> None:
        prior = self.__wrapped__
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
        names = ", ".join(self._self_shim_parts.names())
        return f"<shim assign layer ({names}) on {self.owner.__qualname__}.{self.attribute}>"


def _is_module_function(value: FunctionType) -> bool:
    """Whether the function ``value`` is one its module holds by its name (``torch.utils.checkpoint.checkpoint``):
    keeping it, or what was made of it, keeps nothing alive that its module does not."""
    module = sys.modules.get(value.__module__)
    return module is not None and getattr(module, "__dict__", {}).get(value.__name__) is value


def resolve(module: object, path: str) -> tuple[type, Any]:
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


def install(module: object, path: str, parts: Parts) -> AssignmentLayer:
    """Put an :class:`AssignmentLayer` running ``parts`` on ``module.Class.attribute``; returns it."""
    owner, prior = resolve(module, path)
    layer = AssignmentLayer(prior, owner, path.rpartition(".")[2], parts)
    setattr(owner, layer.attribute, layer)
    return layer


def remove(layer: AssignmentLayer) -> bool:
    """Take ``layer`` off the class, which gets back what it held (or loses the attribute); False
    when the class no longer holds it (replaced, or under another descriptor)."""
    owner, attribute = layer.owner, layer.attribute
    if vars(owner).get(attribute, MISSING) is not layer:
        return False
    prior = layer.__wrapped__
    inherited = next((vars(c)[attribute] for c in owner.__mro__[1:] if attribute in vars(c)), MISSING)
    if prior is MISSING or prior is inherited:
        delattr(owner, attribute)
    else:
        setattr(owner, attribute, prior)
    return True
