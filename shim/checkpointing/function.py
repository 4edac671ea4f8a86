"""What a layer calls when a step of the checkpointing path acts on its calls: :class:`LayerCheckpoint`,
and what steps need to read and hand over a checkpointed call (a built-in's step and a pack's alike
import them from ``shim.checkpointing``).

A ``GradientCheckpointingLayer`` calls its checkpoint function as ``function(partial(fn, **kwargs),
*args)``: ``fn`` is the layer's bound ``super().__call__`` up to transformers 5.22, its own ``forward``
with the layer bound first (``partial(forward, layer, **kwargs)``) from 5.23. Where a step applies to
the function a layer is given (decided once, when it is given: ``shim.checkpointing.path``), the layer
holds a ``LayerCheckpoint`` of it: upstream's partial (same ``func``, ``args``, ``keywords``) that,
per checkpointed call, lets each of its steps whose patch is on change what the checkpoint is
handed, in the catalogue's order of their patches. Any other shape of call goes to the function
unchanged.

Nothing of it outlives the shim: a ``LayerCheckpoint`` pickles and copies as the function the layer
was given, and what a step hands the checkpoint is a plain ``functools.partial`` of a plain function or of a
:class:`LayerMethod` (``torch.compile`` traces both, also across a graph break).
"""

from __future__ import annotations

import copy
import functools
import operator
import sys
from collections.abc import Callable, Iterable
from types import CodeType, FunctionType
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar, cast

from shim import record_effect
from shim.settings import strict_or_warn

if TYPE_CHECKING:
    from shim.runtime import Switch

#: A step's ``act(layer, function, args)``: ``None``, or the ``(function, args)`` to hand the checkpoint instead.
Act = Callable[[Any, Any, tuple[Any, ...]], tuple[Any, tuple[Any, ...]] | None]
_F = TypeVar("_F", bound=Callable[..., Any])

_partial = functools.partial
_first = operator.itemgetter(0)
_torch: Any = None


def bind_torch() -> Any:
    """torch, imported on first use (the patch modules are imported before torch may be)."""
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


# The code objects of the shim's own per-call code (the checkpoint object's decision, the steps),
# with the functions nested in them: dynamo runs a frame of one as it is and compiles what it calls.
_eager_code: list[CodeType] = []
_eager: list[Callable[[CodeType], object]] = []  # [skip_code] once dynamo is told


def eager(function: _F) -> _F:
    """Mark ``function`` (and the functions defined inside it) as the shim's per-call code: under
    ``torch.compile``, dynamo does not compile a frame of it (it is the shim's decision, as
    uncompiled as without the shim) but compiles what it calls, the layer's ``forward``, torch's
    checkpoint, a checkpoint function of the user's, as without the shim. Traced from compiled
    code, dynamo never reaches it: it calls a partial's ``func`` directly, the function the layer
    was given, where the reentrant bugs do not arise."""
    code = cast(FunctionType, function).__code__
    _eager_code.append(code)
    if _eager:
        _skip(code)
    return function


def leave_to_eager() -> None:
    """Tell dynamo about the code marked :func:`eager` (the first time a layer holds a
    ``LayerCheckpoint``; dynamo is imported by then, transformers imports it)."""
    if _eager:
        return
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - a dynamo without it traces those frames and falls back
        return
    _eager.append(skip_code)
    for code in _eager_code:
        _skip(code)


def _skip(code: CodeType) -> None:
    _eager[0](code)
    for constant in code.co_consts:
        if isinstance(constant, type(code)):
            _skip(constant)


class LayerCheckpoint(functools.partial[Any]):
    """A layer's checkpoint function where a step applies to it: the function it was given, as a
    partial, with the steps that act on its calls.

    ``given`` is the function the layer was given; the layer reads back this object, which equals
    it (``==``, same hash) but is not it (``is``). It pickles, copies and deep-copies as ``given``
    would, so a saved model holds only what upstream's holds; a layer unpickled or copied with the
    shim loaded is given its function again and gets a ``LayerCheckpoint`` anew.
    ``steps``: ``(switch, act)`` of each step that applies, in the order they act (each by its
    patch's switch, the one the engine runs the patch's part on the slot by), ``names`` their
    patches'. A step whose ``act`` raises is one warning (:func:`step_failed`): that call is handed
    to the function as the layer handed it over, as without the steps.
    """

    __slots__ = ("given", "steps", "names")
    given: Any
    steps: tuple[tuple[Switch, Act], ...]
    names: tuple[str, ...]

    def __call__(self, function: Any, *args: Any, **options: Any) -> Any:
        if type(function) is _partial:  # the call shape path.check checked
            layer = None
            handed_over, inputs = function, args
            try:
                for switch, act in self.steps:
                    if switch.on:
                        if layer is None:
                            layer = layer_of(function)
                            if layer is None:
                                break
                        handed = act(layer, function, args)
                        if handed is not None:
                            function, args = handed
            except Exception as error:  # a step's fault never reaches the training step
                step_failed(self.names[[acts for _on, acts in self.steps].index(act)], "on a checkpointed call", error)
                function, args = handed_over, inputs
        if options:
            return self.func(*self.args, function, *args, **{**self.keywords, **options})
        return self.func(*self.args, function, *args, **self.keywords)

    def __eq__(self, other: object) -> bool:
        if type(other) is LayerCheckpoint:
            other = other.given
        equal: bool = self.given == other
        return equal

    def __hash__(self) -> int:
        return hash(self.given)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        if type(self.given) is _partial:
            reduced: str | tuple[Any, ...] = self.given.__reduce_ex__(protocol)  # upstream's partial, byte for byte
            return reduced
        # Anything else (a function, pickled by name) as itself: the first item of a 1-tuple.
        return _first, ((self.given,),)

    def __copy__(self) -> Any:
        return copy.copy(self.given)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.given, memo)


def step_failed(name: str, when: str, error: Exception) -> None:
    """Patch ``name``'s step raised ``error`` (``when``): one ``ShimWarning`` per patch and moment,
    a ``PatchError`` under ``SHIM_STRICT=1``. The caller carries on without the step."""
    message = (
        f"patch {name!r}: its checkpointing step raised {type(error).__name__}: {error} {when}; the "
        f"layer keeps the function it was given, without this fix (SHIM_DISABLE={name} turns it off)"
    )
    strict_or_warn(message, error, once=("step failed", name, when))


eager(LayerCheckpoint.__call__)
eager(record_effect)  # a step that acts counts its effect on that call


def layer_checkpoint(given: Any, steps: tuple[tuple[Switch, Act], ...], names: tuple[str, ...]) -> LayerCheckpoint:
    """``given`` as a :class:`LayerCheckpoint` running ``steps`` (of the patches ``names``)."""
    if type(given) is _partial:
        made = LayerCheckpoint(given.func, *given.args, **given.keywords)
    else:  # any other callable, a partial subclass included, is called as it is
        made = LayerCheckpoint(given)
    made.given, made.steps, made.names = given, steps, names
    if not _eager:
        bind_torch()  # the steps read torch through this module's global
        leave_to_eager()
    return made


@eager
def layer_of(function: functools.partial[Any]) -> Any:
    """The ``GradientCheckpointingLayer`` a layer's call handed over: the ``__self__`` of the
    partial's function (``partial(super().__call__)``) or bound first in it
    (``partial(forward, layer, ...)``)."""
    layers = sys.modules.get("transformers.modeling_layers")
    if layers is None:
        return None
    owner = getattr(function.func, "__self__", None)
    if owner is None and function.args:
        owner = function.args[0]
    if isinstance(owner, layers.GradientCheckpointingLayer) or _of_a_reloaded_class(owner):
        return owner
    return None


def _of_a_reloaded_class(owner: object) -> bool:
    """Whether ``owner`` is a layer of a ``GradientCheckpointingLayer`` class that a reload of
    ``transformers.modeling_layers`` replaced (a model built before it keeps the old class)."""
    return any(
        cls.__name__ == "GradientCheckpointingLayer" and cls.__module__ == "transformers.modeling_layers"
        for cls in type(owner).__mro__
    )


class LayerMethod:
    """``function`` bound to ``layer`` as a method is (``__func__``, ``__self__``, ``__name__``), which
    runs ``function(layer, *args)`` whether or not it is handed the layer again first:
    ``partial(LayerMethod(f, layer), layer)`` is both shapes a layer hands over at once.

    Not a ``types.MethodType``: ``copy.copy`` of one looks its name up on the layer again, which finds
    the layer's checkpointing ``forward`` (transformers 5.25) and recurses. Not a plain function with
    ``__self__``: dynamo will not inline one (a graph break upstream does not have). Plain slots and
    no ``__getattr__``, so dynamo, which may build one without ``__init__``, reads what it holds."""

    __slots__ = ("__func__", "__self__")

    __func__: Callable[..., Any]
    __self__: Any

    def __init__(self, function: Callable[..., Any], layer: Any) -> None:
        self.__func__ = function
        self.__self__ = layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self.__self__
        if args and args[0] is layer:
            args = args[1:]
        return self.__func__(layer, *args, **kwargs)

    @property
    def __name__(self) -> str:
        return getattr(self.__func__, "__name__", "forward")

    def __repr__(self) -> str:
        name = getattr(self.__func__, "__qualname__", self.__name__)
        return f"<bound method {name} of {type(self.__self__).__name__} object>"


@eager
def hand_over(function: functools.partial[Any], recompute: Callable[..., Any], layer: Any) -> functools.partial[Any]:
    """``recompute(layer, *inputs)`` in the shape the layer handed ``function``: ``partial(recompute,
    layer)`` for ``partial(forward, layer, **kwargs)`` (transformers >= 5.23), ``partial(<recompute
    bound to the layer>)`` for ``partial(<the layer's bound __call__>, **kwargs)`` (up to 5.22). A
    checkpoint function that finds its layer in the one keeps finding it in the other."""
    if function.args:
        return _partial(recompute, layer)
    return _partial(LayerMethod(recompute, layer))


@eager
def any_grad(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` holds a tensor that requires grad (one frame for the usual case of
    plain tensors and flags; containers go through :func:`wants_grad`)."""
    tensor = _torch.Tensor
    for value in values:
        if isinstance(value, tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (tuple, list, dict)) and wants_grad(value):
            return True
    return False


@eager
def wants_grad(value: Any) -> bool:
    """Whether ``value`` holds a tensor that requires grad, in tuples, lists and dicts."""
    if isinstance(value, _torch.Tensor):
        requires: bool = value.requires_grad
        return requires
    if isinstance(value, (tuple, list)):
        return any(wants_grad(item) for item in value)
    if type(value) is dict:
        return any(wants_grad(item) for item in value.values())
    return False


def is_reentrant(function: Any) -> bool:
    """Whether ``function`` (a layer's ``_gradient_checkpointing_func``) checkpoints reentrantly.

    The ``use_reentrant`` keyword bound by ``functools.partial`` decides (the outermost partial
    wins; ``None`` counts as torch's default); without one, torch's default applies, which is
    reentrant (torch 2.x warns and uses ``use_reentrant=True``). A function that is no partial
    (plain ``checkpoint``, DeepSpeed's reentrant-style one, a closure) counts as reentrant.
    """
    while isinstance(function, _partial):
        keywords = function.keywords
        if "use_reentrant" in keywords:
            value = keywords["use_reentrant"]
            return True if value is None else bool(value)
        function = function.func
    return True
