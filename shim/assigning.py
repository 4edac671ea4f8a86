"""Assign targets (``Target(..., assign=True)``): the shim's layer on an attribute that instances of
a class are assigned, which sees every value assigned while its patch is on and never a read.

The layer has the shape of wrapt's ``AttributeWrapper``: a data descriptor on the class whose
``__wrapped__`` is what the class held before (another layer, a descriptor, a plain class default)
or ``wrapt.MISSING``, so layers stack and ``wrapt.wrapper_chain``/``find_wrapper`` see them as they
see the shim's function layers. It is a slotted class rather than a wrapt proxy: it is passed on
every assignment of the attribute (per layer, per enable and disable) and read on every
checkpointed layer call, and a proxy's attribute reads made each of those six times dearer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import wrapt

if TYPE_CHECKING:
    from .runtime import Switch

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


def install(module: object, path: str, name: str, assigned: Callable[[Any, Any], Any], switch: Switch) -> Any:
    """Put patch ``name``'s :class:`AssignmentLayer` on ``module.Class.attribute``; returns it."""
    owner, prior = resolve(module, path)
    layer = AssignmentLayer(prior, owner, path.rpartition(".")[2], assigned, name, switch)
    setattr(owner, layer.attribute, layer)
    return layer


def remove(handle: AssignmentLayer) -> bool:
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
