"""A model's checkpointing state: which of its modules can checkpoint, what they hold, and putting a
capture of it back (``checkpointing-restore``, ``kbit-prepare-keeps-checkpointing``, ``trl-restore-on-error``).

Checkpointing state lives only in the modules: each one with a ``gradient_checkpointing`` flag also
holds ``_gradient_checkpointing_func`` (a ``functools.partial`` of ``torch.utils.checkpoint.checkpoint``
or of transformers' offload closure, with the configured kwargs).
"""

from __future__ import annotations

import copy
import functools
import operator
import weakref

MISSING = object()
# What capture() and any_checkpointing() read of each module, in C (map), not in a Python loop: they
# run at every disable and generation (trl's cycle), where a loop's bytecodes cost more than here.
_flag = operator.attrgetter("gradient_checkpointing")
_function = operator.methodcaller("get", "_gradient_checkpointing_func", MISSING)  # of a module's __dict__


def layer_state(model) -> dict:
    """``{module name: (flag, checkpoint function)}`` for every module that can checkpoint
    (readable and comparable; the patches use the cheaper :func:`capture`)."""
    return {
        name: (module.gradient_checkpointing, getattr(module, "_gradient_checkpointing_func", MISSING))
        for name, module in model.named_modules()
        if hasattr(module, "gradient_checkpointing")
    }


# class -> whether it declares a ``gradient_checkpointing`` attribute; weak, so that classes made on
# the fly (FSDP2's and peft's, one per model) are not kept alive.
_class_can_checkpoint: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _class_declares_flag(cls) -> bool:
    known = _class_can_checkpoint.get(cls)
    if known is None:
        known = any("gradient_checkpointing" in vars(c) for c in cls.__mro__)
        try:
            _class_can_checkpoint[cls] = known
        except TypeError:  # pragma: no cover - a class without weak references: asked again next time
            pass
    return known


class _Layout:
    """Where a model's checkpointing modules sit: each with the ``_modules`` dict that holds it,
    and the size of every ``_modules`` dict on the way from the model to them, so a module
    replaced or removed, or one added on that way (a layer appended to the list, a tower attached
    to the model), is noticed without walking the model again."""

    __slots__ = ("modules", "placed", "holders", "keys", "ways", "sizes")

    def __init__(self) -> None:
        self.modules: list = []  # every checkpointing module, the model itself included
        self.placed: list = []  # those held by a _modules dict: each in the holder of the same index
        self.holders: list = []
        self.keys: list = []
        self.ways: list = []  # every _modules dict on the way to a checkpointing module
        self.sizes: list = []  # and its size

    def current(self) -> bool:
        try:
            # identity, not ==: a module class may define its own __eq__
            held = map(dict.get, self.holders, self.keys)
            return all(map(operator.is_, held, self.placed)) and list(map(len, self.ways)) == self.sizes
        except TypeError:  # a _modules that is no dict: walked again each time
            return False


class ModelState:
    """What the checkpointing patches keep about one model, stored in the model's own
    ``__dict__`` so that it lives and dies with the model: a capture may hold a checkpoint function
    that references the model (a ``context_fn`` bound to it), and kept anywhere else it would keep
    the model alive. A deep copy carries a copy of the capture, onto its own modules. Pickled, it
    is ``None``: a saved model loads where the shim is not installed, and nothing of the shim is
    imported where it is (the capture is transient, and its functions need not pickle).
    """

    __slots__ = ("layout", "captured")
    KEY = "_shim_checkpointing_state"

    def __init__(self, captured: tuple | None = None) -> None:
        self.layout: _Layout | None = None
        self.captured = captured  # capture() at the last disable, until the next enable

    @classmethod
    def of(cls, model) -> ModelState:
        state = model.__dict__.get(cls.KEY)
        if state is None:  # none yet, or None as a pickled one loads
            state = model.__dict__[cls.KEY] = cls()
        return state

    def __reduce_ex__(self, protocol):
        return type(None), ()

    def __copy__(self) -> ModelState:
        return ModelState()

    def __deepcopy__(self, memo: dict) -> ModelState:
        return ModelState(copy.deepcopy(self.captured, memo))


def _scan(model) -> _Layout:
    """Walk ``_modules`` once with ``__dict__`` reads and a per-class answer (about a third of what
    transformers' own ``modules()`` and ``hasattr`` walk costs)."""
    layout = _Layout()
    seen = set()
    ways: dict = {}  # id(a _modules dict on the way to a checkpointing module) -> it
    stack = [(model, None, ())]  # (module, where it sits, the _modules dicts on the way to it)
    known = _class_can_checkpoint
    while stack:
        module, place, way = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        state = module.__dict__
        declares = known.get(type(module))
        if declares is None:
            declares = _class_declares_flag(type(module))
        if declares or "gradient_checkpointing" in state:
            layout.modules.append(module)
            if place is not None:
                layout.placed.append(module)
                layout.holders.append(place[0])
                layout.keys.append(place[1])
            ways.update((id(holder), holder) for holder in way)
        children = state.get("_modules")
        if children:
            inner = (*way, children)
            stack.extend((child, (children, key), inner) for key, child in children.items())
    layout.ways = list(ways.values())
    layout.sizes = list(map(len, layout.ways))
    return layout


def checkpointing_modules(model) -> list:
    """Every module of ``model`` that can checkpoint, found once and then reused while its
    layout holds (it runs on every disable: trl's generation cycle).

    Limit: a checkpointing module attached after the last walk inside a module that held none
    (off the way from the model to the ones it has) is found once that way changes.
    """
    state = ModelState.of(model)
    layout = state.layout
    if layout is None or not layout.current():
        layout = state.layout = _scan(model)
    return layout.modules


def capture(model) -> tuple | None:
    """``(modules, their flags, their checkpoint functions)`` for the modules of ``model`` that can
    checkpoint, or ``None`` where none of them checkpoints now (a model never enabled, or disabled
    already: nothing to put back)."""
    modules = checkpointing_modules(model)
    flags = list(map(_flag, modules))
    if not any(flags):
        return None
    return modules, flags, list(map(_function, map(vars, modules)))


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


def restore(captured: tuple) -> tuple[int, object]:
    """Put a :func:`capture` back where it differs from what the modules hold now.

    Returns how many modules it changed and the first checkpoint function it replaced
    (``MISSING`` if none), which tells what upstream had configured instead.
    """
    modules, flags, functions = captured
    changed, replaced = 0, MISSING
    compared = (MISSING, MISSING, True)  # the last pair compared: an enable gives every module one function
    for module, flag, function in zip(modules, flags, functions):
        differs = module.gradient_checkpointing != flag
        if function is not MISSING:
            current = module.__dict__.get("_gradient_checkpointing_func", MISSING)
            if compared[0] is not current or compared[1] is not function:
                compared = (current, function, same_function(current, function))
            if not compared[2]:
                module._gradient_checkpointing_func = function
                replaced = current if replaced is MISSING else replaced
                differs = True
        if differs:
            module.gradient_checkpointing = flag
            changed += 1
    return changed, replaced


def captured_kwargs(captured: tuple) -> dict | None:
    """The kwargs of the checkpoint partial that the checkpointing modules of a :func:`capture` share
    (the first whose flag is set), or ``None``."""
    _modules, flags, functions = captured
    for flag, function in zip(flags, functions):
        if flag and isinstance(function, functools.partial):
            return dict(function.keywords)
    return None


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


def any_checkpointing(model) -> bool:
    """Whether any module of ``model`` has its checkpointing flag set: transformers'
    ``is_activation_checkpointing`` for a ``PreTrainedModel``, without its walk."""
    return any(map(_flag, checkpointing_modules(model)))
