"""Helpers shared by the checkpointing patches.

Checkpointing state lives only in the modules: each one with a ``gradient_checkpointing`` flag also
holds ``_gradient_checkpointing_func`` (a ``functools.partial`` of ``torch.utils.checkpoint.checkpoint``
or of transformers' offload closure, with the configured kwargs). These helpers read and write that
state, and call enable/disable the way the model's own class expects, preferring the
``activation_checkpointing_*`` names where the class has them so that no ``FutureWarning`` of ours
appears on transformers >= 5.23.
"""

from __future__ import annotations

import copy
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
    """``{module name: (flag, checkpoint function)}`` for every module that can checkpoint
    (readable and comparable; the patches use the cheaper :func:`capture`)."""
    return {
        name: (module.gradient_checkpointing, getattr(module, "_gradient_checkpointing_func", MISSING))
        for name, module in model.named_modules()
        if hasattr(module, "gradient_checkpointing")
    }


# class -> whether it declares a ``gradient_checkpointing`` attribute; cleared when it grows large,
# so classes made on the fly are not kept alive.
_class_can_checkpoint: dict = {}


def _class_declares_flag(cls) -> bool:
    known = _class_can_checkpoint.get(cls)
    if known is None:
        if len(_class_can_checkpoint) > 1024:
            _class_can_checkpoint.clear()
        known = _class_can_checkpoint[cls] = any("gradient_checkpointing" in vars(c) for c in cls.__mro__)
    return known


class _Layout:
    """Where a model's checkpointing modules sit: each with the ``_modules`` dict that holds it
    and that dict's size, so a module replaced or removed, or one appended beside them (a layer
    added to the list), is noticed without walking the model again."""

    __slots__ = ("modules", "places")

    def __init__(self) -> None:
        self.modules: list = []
        self.places: list = []  # (holder dict, key, holder size), or None for the model itself

    def current(self) -> bool:
        for module, place in zip(self.modules, self.places):
            if place is not None and (place[0].get(place[1]) is not module or len(place[0]) != place[2]):
                return False
        return True


class ModelState:
    """What the checkpointing patches keep about one model, stored in the model's own
    ``__dict__`` so that it lives and dies with the model: a capture may hold a checkpoint function
    that references the model (a ``context_fn`` bound to it), and kept anywhere else it would keep
    the model alive. A pickled model carries an empty one (the capture is transient and its
    functions need not pickle); a deep copy carries a copy of the capture, onto its own modules.
    """

    __slots__ = ("layout", "captured")
    KEY = "_shim_checkpointing_state"

    def __init__(self, captured: list | None = None) -> None:
        self.layout: _Layout | None = None
        self.captured = captured  # capture() at the last disable, until the next enable

    @classmethod
    def of(cls, model) -> ModelState:
        state = model.__dict__.get(cls.KEY)
        if state is None:
            state = model.__dict__[cls.KEY] = cls()
        return state

    def __reduce__(self):
        return ModelState, ()

    def __copy__(self) -> ModelState:
        return ModelState()

    def __deepcopy__(self, memo: dict) -> ModelState:
        return ModelState(copy.deepcopy(self.captured, memo))


def _scan(model) -> _Layout:
    """Walk ``_modules`` once with ``__dict__`` reads and a per-class answer (about a third of what
    transformers' own ``modules()`` and ``hasattr`` walk costs)."""
    layout = _Layout()
    seen = set()
    stack = [(model, None)]
    known = _class_can_checkpoint
    while stack:
        module, place = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        state = module.__dict__
        declares = known.get(type(module))
        if declares is None:
            declares = _class_declares_flag(type(module))
        if declares or "gradient_checkpointing" in state:
            layout.modules.append(module)
            layout.places.append(place)
        children = state.get("_modules")
        if children:
            size = len(children)
            stack.extend((child, (children, key, size)) for key, child in children.items())
    return layout


def checkpointing_modules(model) -> list:
    """Every module of ``model`` that can checkpoint, found once and then reused while its
    layout holds (it runs on every disable: trl's generation cycle).

    Limit: a subtree with checkpointing modules attached after the last walk in a place the
    layout does not watch is found at the next explicit enable (see :func:`forget_layout`).
    """
    state = ModelState.of(model)
    layout = state.layout
    if layout is None or not layout.current():
        layout = state.layout = _scan(model)
    return layout.modules


def forget_layout(model) -> None:
    """Walk ``model`` again at its next capture (called on an enable that carries a configuration)."""
    ModelState.of(model).layout = None


def capture(model) -> list:
    """``[(module, flag, checkpoint function)]`` for every module of ``model`` that can checkpoint."""
    return [
        (module, module.gradient_checkpointing, module.__dict__.get("_gradient_checkpointing_func", MISSING))
        for module in checkpointing_modules(model)
    ]


def same_function(first, second) -> bool:
    """Whether two checkpoint functions do the same: the same object, or partials of the same
    function with equal arguments (each enable builds a new partial, even for the same configuration)."""
    if first is second:
        return True
    if isinstance(first, functools.partial) and isinstance(second, functools.partial):
        return (
            first.func is second.func and first.args == second.args and first.keywords == second.keywords
        )  # fmt: skip
    return False


def restore(captured: list) -> tuple[int, object]:
    """Put a :func:`capture` back where it differs from what the modules hold now.

    Returns how many modules it changed and the first checkpoint function it replaced
    (``MISSING`` if none), which tells what upstream had configured instead.
    """
    changed, replaced = 0, MISSING
    for module, flag, function in captured:
        differs = module.gradient_checkpointing != flag
        if function is not MISSING:
            current = module.__dict__.get("_gradient_checkpointing_func", MISSING)
            if not same_function(current, function):
                module._gradient_checkpointing_func = function
                replaced = current if replaced is MISSING else replaced
                differs = True
        if differs:
            module.gradient_checkpointing = flag
            changed += 1
    return changed, replaced


def configured_kwargs(functions) -> dict | None:
    """The kwargs of the checkpoint partial that the checkpointing layers share, or ``None``.

    ``functions`` are ``(flag, function)`` pairs: the values of :func:`layer_state`, or a
    :func:`capture` read as ``(flag, function) for _module, flag, function in captured``.
    """
    for flag, function in functions:
        if flag and isinstance(function, functools.partial):
            return dict(function.keywords)
    return None


def captured_kwargs(captured: list) -> dict | None:
    """:func:`configured_kwargs` of a :func:`capture`."""
    return configured_kwargs((flag, function) for _module, flag, function in captured)


def describe(kwargs) -> str:
    """A configuration for a log line or an effect: a kwargs dict, :data:`MISSING` (the function
    :func:`restore` replaced was the same, only the flags differed), ``None`` or a checkpoint function."""
    if kwargs is MISSING:
        return "the same kwargs with another layer pattern"
    if kwargs is None:
        return "no checkpoint kwargs"
    if isinstance(kwargs, dict):
        return repr(kwargs)
    return f"checkpoint function {getattr(kwargs, '__qualname__', type(kwargs).__name__)}"


def replaced_kwargs(replaced):
    """What :func:`restore` replaced, as :func:`describe` reads it: a partial's kwargs, else itself."""
    return dict(replaced.keywords) if isinstance(replaced, functools.partial) else replaced


def is_reentrant(function) -> bool:
    """Whether ``function`` (a layer's ``_gradient_checkpointing_func``) checkpoints reentrantly.

    The ``use_reentrant`` keyword bound by ``functools.partial`` decides (the outermost partial
    wins; ``None`` counts as torch's default); without one, torch's default applies, which is
    reentrant (torch 2.x warns and uses ``use_reentrant=True``). A function that is no partial
    (plain ``checkpoint``, DeepSpeed's reentrant-style one, a closure) counts as reentrant.
    """
    while isinstance(function, functools.partial):
        keywords = function.keywords
        if "use_reentrant" in keywords:
            value = keywords["use_reentrant"]
            return True if value is None else bool(value)
        function = function.func
    return True


def first_trainable(module):
    """The first parameter of ``module`` (itself or below) that requires grad, or ``None``:
    ``module.parameters()`` without its generators and de-duplication, several times cheaper
    (it runs on layer calls and tower forwards)."""
    stack = [module]
    while stack:
        current = stack.pop()
        for parameter in current._parameters.values():
            if parameter is not None and parameter.requires_grad:
                return parameter
        stack.extend(child for child in current._modules.values() if child is not None)
    return None


def any_checkpointing(model) -> bool:
    """Whether any module of ``model`` has its checkpointing flag set: transformers'
    ``is_activation_checkpointing`` for a ``PreTrainedModel``, without its walk."""
    return any(module.gradient_checkpointing for module in checkpointing_modules(model))


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
            type(model).__name__,
            name,
            keyword,
            checkpoint_kwargs,
        )
        bound()


def disable(model) -> None:
    method(model, DISABLE)[1]()


class LayerMethod:
    """``function`` bound to ``layer`` as a method is (``__func__``, ``__self__``), which also takes
    the layer again as its first argument: handed over as ``partial(LayerMethod, layer, **kwargs)``,
    a checkpoint function finds the layer as ``func.args[0]`` and as ``func.func.__self__``, and
    both ``func(*args)`` and ``func.func(*args, **func.keywords)`` run ``function(layer, *args)``."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function, layer) -> None:
        self.__func__ = function
        self.__self__ = layer

    def __call__(self, *args, **kwargs):
        if args and args[0] is self.__self__:
            args = args[1:]
        return self.__func__(self.__self__, *args, **kwargs)

    def __getattr__(self, name: str):  # __name__, __qualname__, ... as a bound method has them
        return getattr(self.__func__, name)

    def __repr__(self) -> str:
        name = getattr(self.__func__, "__qualname__", repr(self.__func__))
        return f"<bound method {name} of {type(self.__self__).__name__} object>"


def handed(function, layer, *args, **keywords):
    """``partial(LayerMethod(function, layer), layer, *args, **keywords)``."""
    return functools.partial(LayerMethod(function, layer), layer, *args, **keywords)
