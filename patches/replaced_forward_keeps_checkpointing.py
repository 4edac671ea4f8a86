"""``replaced-forward-keeps-checkpointing``: a layer class whose ``forward`` was replaced still checkpoints.

Symptom (silent): transformers checkpoints a layer inside a wrapper it puts on each layer class's
``forward``, only while ``type(layer).forward`` is that wrapper. Replacing ``LayerClass.forward``
afterwards (kernel libraries, tracers, your own patch) turns checkpointing off for every layer of
that class: no error, no warning, the memory saving gone.

Fix: a step of the checkpointing path (``shim.checkpointing``): when a layer is given a checkpoint
function, its class is looked at once per ``forward`` object. A replacement gets transformers' own wrapper again
(``GradientCheckpointingLayer.__init_subclass__``) and still runs, inside the checkpoint; a
``staticmethod``, ``classmethod`` or wrapt one is called as attribute lookup binds it. Left alone,
as upstream checkpoints them: transformers' wrapper, a ``torch.compile`` of it, and a replacement
that checkpoints itself (its code reads ``_gradient_checkpointing_func``). When the patch goes off,
each class gets the user's object back; when it comes back on, the wrapper again.

Limits: while on, the class holds transformers' wrapper around the user's object (``__wrapped__``);
a ``forward`` replaced after its layers were given their function checkpoints again only when a
layer of that class is next given one.

Full story, versions measured and references: docs/bugs.md#replaced-forward-keeps-checkpointing
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref

from shim import BugProbe, Evidence, Patch, record_effect, switch_of, written_by
from shim.checkpointing import ATTRIBUTE, Step, targets
from shim.selfcheck import bare

NAME = "replaced-forward-keeps-checkpointing"
MISSING = object()
_wrapper_code: list = []  # the code object of transformers' checkpointing wrapper, found once
# id(class) -> weak references to the class and to the forward last looked at: read on every
# assignment, and weak both ways, so that classes made on the fly (FSDP2's and peft's, one per
# model) and their forwards are not kept alive
_judged: dict = {}
# class -> (the user's forward, transformers' wrapper the shim put around it, whether the user's was the class's own)
_rewrapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.RLock()
_watching: list = []


def _checkpointing_wrapper_code(layers):
    """The code of the ``forward`` wrapper ``GradientCheckpointingLayer.__init_subclass__`` puts on
    every layer class (the same code object for all of them, a new function each)."""
    if not _wrapper_code:

        class _Probe(layers.GradientCheckpointingLayer):
            def forward(self):
                return None

        _wrapper_code.append(getattr(_Probe.forward, "__code__", None))
    return _wrapper_code[0]


def _own_forward(cls):
    """``forward`` as the class holds it (the first definition along its MRO), unbound."""
    for klass in cls.__mro__:
        if "forward" in vars(klass):
            return vars(klass)["forward"], klass is cls
    return MISSING, False


def _chain(forward):
    """``forward`` and what it wraps: ``__wrapped__`` (functools.wraps, wrapt), ``__func__``
    (staticmethod, classmethod), what ``torch.compile`` compiled; outermost first."""
    seen = []
    while forward is not None and all(forward is not other for other in seen) and len(seen) < 32:
        seen.append(forward)
        inner = getattr(forward, "_torchdynamo_orig_callable", None)
        if inner is None:
            inner = getattr(forward, "__wrapped__", None)
        if inner is None and isinstance(forward, (staticmethod, classmethod)):
            inner = forward.__func__
        forward = inner
    return seen


def _is_wrapper(function, code) -> bool:
    return type(function) is types.FunctionType and function.__code__ is code


def checks(forward, layers) -> str:
    """How layers whose class holds ``forward`` checkpoint: ``"stock"`` (transformers' wrapper),
    ``"compiled"`` (``torch.compile`` of it), ``"own"`` (a replacement that checkpoints itself), or
    ``"replaced"`` (upstream does not checkpoint them)."""
    code = _checkpointing_wrapper_code(layers)
    if _is_wrapper(forward, code):
        return "stock"
    chain = _chain(forward)
    if getattr(forward, "_torchdynamo_orig_callable", None) is not None and any(_is_wrapper(f, code) for f in chain):
        return "compiled"
    for function in chain:
        if _is_wrapper(function, code):
            break  # what transformers' wrapper wraps checkpoints only through it
        # A function's own code (a wrapt proxy would answer with the wrapped function's), and a
        # wrapt proxy's wrapper function, which is what runs.
        for candidate in (function, getattr(function, "_self_wrapper", None)):
            if type(candidate) is types.FunctionType and ATTRIBUTE in candidate.__code__.co_names:
                return "own"
    return "replaced"


def checkpoints(cls, layers) -> bool:
    """Whether layers of ``cls`` checkpoint when their flag is set, without this patch."""
    return checks(_own_forward(cls)[0], layers) != "replaced"


def _as_method(forward):
    """What transformers' wrapper can call as ``forward(self, *args, **kwargs)``: a plain function
    as it is; any other object (``staticmethod``, ``classmethod``, wrapt) bound to the layer as
    attribute lookup binds it."""
    if type(forward) is types.FunctionType:
        return forward

    def bound_forward(self, *args, **kwargs):
        return forward.__get__(self, type(self))(*args, **kwargs)

    functools.update_wrapper(bound_forward, getattr(forward, "__func__", forward))
    bound_forward.__wrapped__ = forward
    return bound_forward


def _rewrap(cls, forward, own: bool, layers) -> None:
    """transformers' own mechanism run again for ``cls``: its wrapper around the current forward."""
    cls.forward = _as_method(forward)
    layers.GradientCheckpointingLayer.__dict__["__init_subclass__"].__func__(cls)
    _rewrapped[cls] = (forward, vars(cls)["forward"], own)
    _watch()


def _judge(cls) -> None:
    """Look at ``cls``'s forward once per forward object; wrap a replacement again."""
    judged = _judged_forward(cls)
    if judged is not None and judged is cls.__dict__.get("forward", judged):
        return  # the usual case: the forward the class defines itself, already looked at
    forward, own = _own_forward(cls)
    if judged is forward:
        return
    layers = sys.modules.get("transformers.modeling_layers")
    if layers is None or forward is MISSING:
        return
    with _lock:
        if checks(forward, layers) == "replaced":
            _rewrap(cls, forward, own, layers)
            record_effect(
                NAME,
                "%s.forward was replaced by %s after transformers wrapped it for checkpointing, which "
                "turned checkpointing off for its layers; the shim wrapped the replacement again",
                cls.__name__,
                written_by(forward),
            )
        _remember(cls, _own_forward(cls)[0])


def _judged_forward(cls):
    entry = _judged.get(id(cls))
    if entry is None or entry[0]() is not cls:
        return None
    return entry[1]() if entry[1] is not None else None


def _remember(cls, forward) -> None:
    key = id(cls)
    try:
        judged = weakref.ref(forward)
    except TypeError:  # a forward without weak references (a staticmethod): looked at again next time
        judged = None
    _judged[key] = (weakref.ref(cls, functools.partial(_forget, key)), judged)


def _forget(key: int, reference: weakref.ref) -> None:
    entry = _judged.get(key)
    if entry is not None and entry[0] is reference:
        del _judged[key]


def _given(layer, function):
    """The step's ``given``: a layer given a function gets a class that checkpoints."""
    cls = type(layer)
    entry = _judged.get(id(cls))
    if entry is not None and entry[1] is not None and entry[0]() is cls:
        judged = entry[1]()
        if judged is not None and judged is cls.__dict__.get("forward", judged):
            return function  # the usual case, inline: on every assignment of a layer's function
    _judge(cls)
    return function


STEP = Step(given=_given)


# -- following the switch --------------------------------------------------------------------------


def _watch() -> None:
    if not _watching:
        _watching.append(True)
        switch_of(NAME).watch(_switched)


def _switched(on: bool) -> None:
    """Off: each class the shim wrapped gets the user's forward back; on: the wrapper again."""
    with _lock:
        for cls, (forward, wrapper, own) in list(_rewrapped.items()):
            current = vars(cls).get("forward", MISSING)
            if not on and current is wrapper:
                if own:
                    cls.forward = forward
                else:
                    delattr(cls, "forward")
            elif on and (current is forward or (not own and current is MISSING)):
                cls.forward = wrapper
            _judged.pop(id(cls), None)


def _in_effect(model) -> list[str]:
    """The layer classes of ``model`` whose replaced ``forward`` the patch wrapped again."""
    lines = []
    for cls in sorted({type(module) for module in model.modules()} & set(_rewrapped), key=lambda c: c.__name__):
        forward, wrapper, _own = _rewrapped[cls]
        now = "transformers' wrapper is around it" if vars(cls).get("forward") is wrapper else "it is as you set it now"
        lines.append(
            f"{cls.__name__}.forward was replaced by {written_by(forward)}, which stopped its checkpointing: {now}"
        )
    return lines


def _check(layer_class) -> str | None:
    layers = sys.modules.get("transformers.modeling_layers")
    init_subclass = vars(layer_class).get("__init_subclass__")
    if layers is None or not isinstance(init_subclass, classmethod) or _checkpointing_wrapper_code(layers) is None:
        return "GradientCheckpointingLayer no longer wraps each layer class's forward in __init_subclass__"
    return None


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """A layer class whose ``forward`` is replaced after it was made (by a function calling the one it
    had), then a layer of it given a checkpoint function: the bug is there when a training call does
    not checkpoint, or the replacement runs outside the checkpoint (a fix that checkpoints only the
    forward the replacement calls leaves the replacement's own work out of it)."""
    torch = bare.torch_module()
    cls = bare.layer_class()
    before = cls.forward
    depth, ran_inside = [0], []

    def replacement(self, *args, **kwargs):
        ran_inside.append(depth[0] > 0)
        return before(self, *args, **kwargs)

    cls.forward = replacement
    calls = []

    def counting(function, *args, **kwargs):
        calls.append(function)
        depth[0] += 1
        try:
            return function(*args, **kwargs)
        finally:
            depth[0] -= 1

    bare.checkpointing_layer(counting, cls)(torch.ones(1, 2, requires_grad=True))
    if not calls:
        return Evidence(True, "a layer class whose forward was replaced after it was made no longer checkpoints")
    if not all(ran_inside):
        return Evidence(
            True, "a layer class whose forward was replaced after it was made checkpoints without the replacement"
        )
    return Evidence(
        False, "a layer class whose forward was replaced after it was made checkpoints, replacement included"
    )


PATCH = Patch(
    name=NAME,
    summary="A layer class whose forward was replaced after import still checkpoints when checkpointing is on.",
    distribution="transformers",
    requires=">=5.23",
    targets=targets(STEP, check=_check),
    references=("docs/bugs.md#replaced-forward-keeps-checkpointing",),
    bug_probe=BugProbe(_bug_probe),
    in_effect=_in_effect,
)
