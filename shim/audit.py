"""The first-step audit: what the family of silent bugs looks like at an optimizer's first step.

Every bug of the catalogue was silent. What they share is visible at the first step: a module ran
in the training forward, its parameters are trainable, they got no gradient, and modules after it
did get theirs (the gradient was cut inside the model's path); or a model asked for gradient
checkpointing and no layer ran checkpointed. At each optimizer's first step this room (the watch:
what ran, how, and what got a gradient) tells both, one finding per cause, and ``shim.findings``
(the findings and their wording, which this module hands on to the tools) keeps and says them: one
warning line per cause, with what the shim knows of the cause. A module that ran after every module
that got a gradient (a BERT pooler under mean pooling, a head this loss leaves out) is a dead-end
branch, how models are built: it is named as data (``shim.in_effect``, the report table,
``bug-report``, INFO on the ``shim`` logger), never warned.

How it sees a step, and what it costs (nothing is wrapped on ``nn.Module``):

- ``torch.optim.Optimizer.__init__`` gets a pass-through function when ``torch.optim.optimizer`` is
  imported (it runs once per optimizer made, never per step): its trainable parameters are watched.
- Until the first call, in training, of a module that holds some of them (the model: the outermost
  such call; or, where a training function calls the modules one by one, each of them), torch's
  global module pre-hook looks for it, and is removed once every watched parameter is in a module
  found. ``torch.compile(module)`` takes it off at once (the compiled module's first call would warn
  of a global hook), as does dynamo's start: compiled code is not audited.
- On each module found (a :class:`_Tracker`, shared by every optimizer over it): a forward pre-hook
  on each module that owns a watched parameter, taken off at its first run in training (the order of
  those runs tells a cut from a dead end); a forward pre-hook and hook on each checkpointing layer
  (whether it ran checkpointed, and with which inputs); a post-accumulate-grad hook on each watched
  parameter (whether it ever got a gradient: a first step skipped by GradScaler, with ``zero_grad``
  between, leaves nothing to mistake for a lost gradient). A deep copy or a pickle of the model gets
  a no-op of the standard library in their place.
- A step pre-hook on the optimizer: at its first step (after the closure's backward, for LBFGS and
  any optimizer that takes one) the audit is made and, once no other optimizer over the module waits
  for its step, every hook comes off. torch runs an optimizer's step hooks from the dict it holds,
  which a hook must not change: the optimizer gets a new, empty dict where the audit's hook was its
  only one; beside hooks of the user's, the audit's stays there, doing nothing and holding nothing.
- DeepSpeed ZeRO (gradients partitioned) and optimizers whose parameters were replaced after they
  were made (ZeRO's flat partitions): said once, on the ``shim`` logger, that it does not run there.
- Opted out as a patch is: ``SHIM_DISABLE=first-step-audit`` (or ``all``). A warning that a filter
  makes an error goes to the ``shim`` logger instead: the audit never raises into the user's step.

``audit_first_step(model, batch)`` runs the same audit on one forward and backward, for a test.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType, ModuleType
from typing import Any, NamedTuple

from . import findings, importhooks, settings
from .findings import (  # the tools and the tests read the findings through shim.audit
    CAUSES,
    FIXES,
    NAME,
    Finding,
    exit_line,
    findings_of,
    found,
    grouped,
    notes,
    said_of,
)

__all__ = [
    "CAUSES",
    "FIXES",
    "NAME",
    "Finding",
    "audit_first_step",
    "audited",
    "exit_line",
    "findings_of",
    "found",
    "grouped",
    "install",
    "notes",
    "said_of",
    "uninstall",
]

_is_on: Callable[[str], bool] = lambda name: True  # noqa: E731  (the registry's, given by install())
_compile_wraps = False  # torch.compile(module) was called in this process: no global hook from then on


# -- installing --------------------------------------------------------------------------------------


def install(is_on: Callable[[str], bool]) -> None:
    """Watch optimizers as they are made (``torch.optim.optimizer`` has just been imported):
    ``is_on(name)`` tells whether a patch is on, for the cause a finding gives."""
    global _is_on
    if settings.audit_switched_off():
        return
    _is_on = is_on
    _pass_through(sys.modules["torch.optim.optimizer"].Optimizer, _made)
    importhooks.when_imported("torch._dynamo.callback", _watch_compiles)
    importhooks.when_imported("torch._dynamo.eval_frame", _watch_compiled_modules)


def uninstall() -> None:
    """Put ``Optimizer.__init__`` (and ``OptimizedModule.__init__``) back as they were
    (``shim.deactivate()``); a model watched already ends its watch at its first step, as ever."""
    for module, name in (("torch.optim.optimizer", "Optimizer"), ("torch._dynamo.eval_frame", "OptimizedModule")):
        cls = getattr(sys.modules.get(module), name, None)
        ours = getattr(cls, "__init__", None)
        if getattr(ours, "_shim_audit", False):
            cls.__init__ = ours.__wrapped__  # type: ignore[misc,union-attr]  # functools.update_wrapper's


def _pass_through(cls: Any, then: Callable[[Any], None]) -> None:
    """``cls.__init__`` runs as ever, then ``then(instance)``: a plain function, not a wrapt wrapper
    (``import shim`` after torch imports no wrapt); once, whatever reloads the shim."""
    if getattr(cls.__init__, "_shim_audit", False):
        return
    upstream = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        upstream(self, *args, **kwargs)
        then(self)

    functools.update_wrapper(__init__, upstream)
    __init__._shim_audit = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _watch_compiles(callback: ModuleType) -> None:
    """Be told when torch.compile starts compiling (once ``torch._dynamo`` is imported)."""
    if _compiling not in callback.callback_handler.start_callbacks:
        callback.callback_handler.register_start_callback(_compiling)


def _watch_compiled_modules(eval_frame: ModuleType) -> None:
    """``torch.compile(module)`` makes an ``OptimizedModule``, whose calls warn where a global module
    hook is on: every watch ends there, and no optimizer made later waits for a module's call."""
    _pass_through(eval_frame.OptimizedModule, _wrapped_by_compile)


def _wrapped_by_compile(compiled: Any) -> None:
    global _compile_wraps
    _compile_wraps = True
    findings.ended_by_compile(compiled._orig_mod)
    _compiling()


def _compiling(args: object = None) -> None:
    """torch.compile starts (dynamo's start callback, a module wrapped): every watch ends before dynamo
    traces a hook of it (its guards would see the hooks go, and compile again)."""
    if _Watch.waiting or _Tracker.live:
        findings.note(findings.COMPILED)
    for watch in list(_Watch.waiting):
        watch.end(compiled=True)
    for tracker in list(_Tracker.live.values()):
        for watch in list(tracker.watches):
            watch.end(compiled=True)
        tracker.end()


def _made(optimizer: Any) -> None:
    """An optimizer was made: watch its first step, unless the audit is switched off now."""
    try:
        if not settings.audit_switched_off():
            _Watch.start(optimizer)
    except Exception as exc:  # the audit never breaks training
        _failed(exc)


def _failed(exc: Exception) -> None:
    settings.strict_or_warn(f"hf-train-shim {NAME} failed, nothing audited: {exc!r}", exc)


def _in_reentrant_forward() -> bool:
    """Whether the caller (a hook of a module call) runs inside torch's reentrant checkpoint forward,
    which runs the module under ``no_grad``: ``CheckpointFunction.forward`` a few frames up."""
    checkpoint = getattr(sys.modules.get("torch.utils.checkpoint"), "CheckpointFunction", None)
    code = getattr(getattr(checkpoint, "forward", None), "__code__", None)
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):  # the hook, Module._call_impl, _wrapped_call_impl, a wrapper or two of the function
        if frame is None or code is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _call_kwargs() -> dict[str, Any]:
    """The keyword arguments of the module call whose global pre-hook runs (torch hands a global
    pre-hook only the positional ones): ``Module._call_impl``'s, a frame that ends with the call."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(4):
        if frame is None:
            break
        if frame.f_code.co_name == "_call_impl":
            kwargs = frame.f_locals.get("kwargs")
            return kwargs if isinstance(kwargs, dict) else {}
        frame = frame.f_back
    return {}


# -- what a module's submodules did -------------------------------------------------------------------

_CLOCK = itertools.count()  # the order owners first ran in, across modules found (the layers of a loop)


class _Hook(functools.partial):  # type: ignore[type-arg]
    """One of the audit's hooks on a module: a tracker's method, called as a partial is (no frame of
    its own). A deep copy of the model (an EMA copy) and a pickled model get a no-op of the standard
    library in its place (a saved model loads where the shim is not installed, and a copy is not the
    model the optimizer trains)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return functools.partial, (logging.getLogger("shim").log, 0)  # level 0 is never logged

    def __copy__(self) -> _Hook:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return functools.partial(logging.getLogger("shim").log, 0)


def _walk(root: Any, ids: set[int]) -> tuple[list[Any], list[tuple[Any, Any, list[Any]]]]:
    """One walk of ``root``'s modules (torch's own generators cost a first step a millisecond): its
    checkpointing layers (the innermost modules an enable flags ``gradient_checkpointing``: a flagged
    module that holds another, a base model, is none), and each module that owns parameters of
    ``ids`` with the layer it is in (``None``) and those parameters."""
    flagged: list[Any] = []
    outer: set[int] = set()
    owners: list[tuple[Any, Any, list[Any]]] = []
    seen: set[int] = set()
    stack: list[tuple[Any, Any]] = [(root, None)]
    while stack:
        module, layer = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if vars(module).get("gradient_checkpointing") is True:
            if layer is not None:
                outer.add(id(layer))
            layer = module
            flagged.append(module)
        held = [p for p in module._parameters.values() if p is not None and id(p) in ids and p.requires_grad]
        if held:
            owners.append((module, layer, held))
        stack += [(child, layer) for child in module._modules.values() if child is not None]
    owners = [
        (module, layer if layer is None or id(layer) not in outer else None, held) for module, layer, held in owners
    ]
    return [module for module in flagged if id(module) not in outer], owners


class _Tracker:
    """What one module found (the model) and its submodules did from then to the first step of the
    optimizers over its parameters: which owners of watched parameters ran in training, in which
    order, and how (under a reentrant checkpoint's ``no_grad``, with which inputs); whether a
    checkpointing layer ran checkpointed; which parameters ever got a gradient. Shared by every
    optimizer over it; holds the module only weakly."""

    live: dict[int, _Tracker] = {}  # id(module) -> its tracker, while an optimizer over it waits for its step

    def __init__(self, root: Any, held: frozenset[int]) -> None:
        self.root = weakref.ref(root)
        self.key = id(root)
        self.name = type(root).__name__
        self.held = held  # every parameter of the module, for an optimizer made later over some of them
        self.watches: list[_Watch] = []  # the optimizers over it waiting for their first step
        self.hooks: list[Any] = []  # on layers and parameters, until the last watch ends
        self.owner_hooks: dict[int, Any] = {}  # per owner: off once it said what it can
        self.owners: dict[int, list[int]] = {}  # watched parameter -> the modules that own it
        self.order: dict[int, int] = {}  # owner -> place of its first run in training (_CLOCK)
        self.without_grad: dict[int, int] = {}  # owner -> the layer whose reentrant checkpoint ran it
        self.inputs: dict[int, tuple[bool, bool]] = {}  # layer -> (a positional, a keyword input requires grad)
        self.calls: list[int] = []  # the layers being called: their id in a training forward, else 0
        self.layers: list[int] = []  # the checkpointing layers (innermost modules flagged gradient_checkpointing)
        self.in_layer: set[int] = set()  # owners inside a checkpointing layer
        self.layers_ran: set[int] = set()  # ... run in a training forward
        self.checkpointed = False  # some layer ran checkpointed (a reentrant forward, a recomputation)
        self.judged_checkpointing = False
        self.graded: set[int] = set()  # watched parameters that got a gradient in some backward

    def watch(self, ids: set[int]) -> None:
        """Hooks on the module for the parameters ``ids`` (one walk of its submodules, where new ones come)."""
        root = self.root()
        if root is None or ids <= self.owners.keys():
            return
        layers, owners = _walk(root, ids)
        for module, layer, parameters in owners:
            for p in parameters:
                if id(p) not in self.owners:
                    self.hooks.append(p.register_post_accumulate_grad_hook(self._graded))
                self.owners.setdefault(id(p), []).append(id(module))
            if id(module) not in self.owner_hooks and id(module) not in self.order:
                self.owner_hooks[id(module)] = module.register_forward_pre_hook(_Hook(self._owner_runs))
                if layer is not None:
                    self.in_layer.add(id(module))
        for module in layers:
            if id(module) not in self.layers:
                self.layers.append(id(module))
                self.hooks.append(module.register_forward_pre_hook(_Hook(self._enter_layer), with_kwargs=True))
                self.hooks.append(module.register_forward_hook(_Hook(self._leave_layer), always_call=True))

    def entered(self, root: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """The call in which the module was found: torch read its pre-hooks before they were put on."""
        if id(root) in self.layers:
            self._enter_layer(root, args, kwargs)
        if id(root) in self.owner_hooks:
            self._owner_runs(root, args)

    def end(self) -> None:
        """Every hook off."""
        for handle in [*self.hooks, *self.owner_hooks.values()]:
            handle.remove()
        self.hooks.clear()
        self.owner_hooks.clear()
        self.watches.clear()
        if _Tracker.live.get(self.key) is self:
            del _Tracker.live[self.key]

    # the hooks: per call, as little as can tell what the audit needs

    def _graded(self, parameter: Any) -> None:
        self.graded.add(id(parameter))

    def _enter_layer(self, layer: Any, args: Any, kwargs: Any) -> None:
        """A layer is called: in a training forward (its own, or a reentrant checkpoint's of its
        ``__call__``, which runs it under ``no_grad``), its modules' runs without grad are that
        checkpoint's; its inputs say why they would lose their gradients."""
        import torch

        if torch._C._current_graph_task_id() != -1:
            self.checkpointed = True  # its __call__ recomputed in backward
            self.calls.append(0)
            return
        if torch.is_grad_enabled():
            training = layer.training
            if training:
                self.layers_ran.add(id(layer))
        else:
            training = bool(self.calls and self.calls[-1]) or _in_reentrant_forward()
        self.calls.append(id(layer) if training else 0)
        if training and id(layer) not in self.inputs:
            self.inputs[id(layer)] = (_requires_grad(args), _requires_grad(kwargs.values()))

    def _leave_layer(self, layer: Any, args: Any, output: Any) -> None:
        if self.calls:
            self.calls.pop()

    def _owner_runs(self, module: Any, args: Any) -> None:
        import torch

        key = id(module)
        if torch._C._current_graph_task_id() != -1:
            if key in self.in_layer:
                self.checkpointed = True  # a layer's module recomputed in backward
        elif torch.is_grad_enabled():
            if not module.training:
                return  # an evaluation with grad on
            self.order.setdefault(key, next(_CLOCK))
        elif self.calls and self.calls[-1]:
            self.without_grad[key] = self.calls[-1]  # a reentrant checkpoint's forward, in a training layer
            self.checkpointed = True
            self.order.setdefault(key, next(_CLOCK))
        else:
            return  # under no_grad: a reference computation, generation
        if key in self.order and (self.checkpointed or key not in self.in_layer):
            self.owner_hooks.pop(key).remove()  # nothing more to learn from its calls

    # what it tells

    def ran(self, parameter: Any) -> tuple[int, str] | None:
        """Where ``parameter``'s module first ran in training (its place, and ``"grad"`` or the cause of
        the reentrant checkpoint that ran it without grad); ``None`` where none of its modules did."""
        owners = [o for o in self.owners.get(id(parameter), ()) if o in self.order]
        if not owners:
            return None
        layer = next((self.without_grad[o] for o in owners if o in self.without_grad), None)
        if layer is None:
            return min(self.order[o] for o in owners), "grad"
        positional, keyword = self.inputs.get(layer, (True, False))
        cause = "reentrant" if positional else "keyword-inputs" if keyword else "frozen-inputs"
        return min(self.order[o] for o in owners), cause

    def unchecked_layers(self) -> list[int]:
        """The checkpointing layers that ran in a training forward, where none ran checkpointed (once)."""
        if self.judged_checkpointing or not self.layers_ran or not self.in_layer & self.order.keys():
            return []  # no layer ran, or none of the modules in them it watches: it cannot tell
        self.judged_checkpointing = True
        return [] if self.checkpointed else [key for key in self.layers if key in self.layers_ran]

    @classmethod
    def of(cls, root: Any, held: frozenset[int]) -> tuple[_Tracker, bool]:
        """The live tracker of ``root`` (whose parameters are ``held``), or a new one (``True``)."""
        tracker = cls.live.get(id(root))
        if tracker is not None and tracker.root() is root:
            return tracker, False
        tracker = cls.live[id(root)] = cls(root, held)  # none, or a dead module's whose id came back
        return tracker, True


# -- one optimizer's first step ----------------------------------------------------------------------


class _Watch:
    """One optimizer's first step: its watched parameters, the modules found that hold them."""

    waiting: list[_Watch] = []  # watches with parameters no module found holds yet
    _finder: Any = None  # torch's global module pre-hook, while a watch waits

    def __init__(self, ids: set[int]) -> None:
        self.ids = ids
        self.uncovered = set(ids)  # watched parameters no module found holds yet
        self.checked: set[int] = set()  # modules found not to hold any of them
        self.trackers: list[_Tracker] = []
        self.done = False
        self.step_hook: Any = None

    @classmethod
    def start(cls, optimizer: Any) -> None:
        """Watch the first step of ``optimizer``: its parameters, in the modules found already (an
        optimizer made after the model's first forward, a second one over it) or at their next call."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        if not ids:
            return
        callback = sys.modules.get("torch._dynamo.callback")
        if callback is not None:  # again: torch._dynamo.reset() clears its callbacks
            _watch_compiles(callback)
        watch = cls(ids)
        for tracker in list(_Tracker.live.values()):
            held = ids & tracker.held
            if held:
                watch.adopt(tracker, held)
        if watch.uncovered and _compile_wraps:  # a compiled module's call would warn of a global hook
            logging.getLogger("shim").debug(
                "%s: an optimizer made after torch.compile(module) is audited over modules found only", NAME
            )
            watch.uncovered.clear()
        if watch.uncovered:
            cls.waiting.append(watch)
            if cls._finder is None:
                from torch.nn.modules.module import register_module_forward_pre_hook

                cls._finder = register_module_forward_pre_hook(cls._find)
        watch.step_hook = optimizer.register_step_pre_hook(watch._stepping)
        weakref.finalize(optimizer, watch.end)

    @classmethod
    def _find(cls, module: Any, args: Any) -> None:
        """torch's global module pre-hook: a training call of a module that holds watched parameters
        no module found holds is a model (the outermost such call; each module a loop calls itself)."""
        import torch

        if not module.training:
            return
        if not torch.is_grad_enabled():  # a layer whose __call__ a reentrant checkpoint runs, or no training
            if not (vars(module).get("gradient_checkpointing") is True and _in_reentrant_forward()):
                return
        try:
            cls._look_at(module, args)
        except Exception as exc:  # the audit never breaks training
            for watch in list(cls.waiting):
                watch.end()
            _failed(exc)
        cls._stop_finding()

    @classmethod
    def _stop_finding(cls) -> None:
        cls.waiting = [watch for watch in cls.waiting if watch.uncovered and not watch.done]
        if not cls.waiting and cls._finder is not None:
            cls._finder.remove()
            cls._finder = None

    @classmethod
    def _look_at(cls, module: Any, args: Any) -> None:
        """A training call of ``module``: where it holds watched parameters no module found holds, it
        is found, for every watch waiting on some of them at once (one read of its parameters and one
        walk of it however many optimizers, as many as parameters where each has its own; what this
        call shows is read once all their hooks are on)."""
        unchecked = [watch for watch in cls.waiting if id(module) not in watch.checked]
        if not unchecked:
            return
        parameters = frozenset(id(p) for p in module.parameters())
        found = []
        for watch in unchecked:
            watch.checked.add(id(module))
            held = watch.uncovered & parameters
            if held:
                found.append((watch, held))
        if not found:
            return
        tracker, new = _Tracker.of(module, parameters)
        tracker.watch(set().union(*(held for _watch, held in found)))
        for watch, held in found:
            watch.adopt(tracker, held)
        if new:
            tracker.entered(module, args, _call_kwargs())

    def adopt(self, tracker: _Tracker, held: set[int]) -> None:
        """``tracker``'s module holds the watched parameters ``held``: hooks on it for them."""
        tracker.watch(held)
        if self not in tracker.watches:
            tracker.watches.append(self)
        if tracker not in self.trackers:
            self.trackers.append(tracker)
        self.uncovered -= held

    def _stepping(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._take_step_hook_off(optimizer)
        if self.done:
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.audit(optimizer)
            return None

        def closure_then_audit() -> Any:  # LBFGS and its kind: the gradients come from the closure's backward
            loss = closure()
            if not self.done:
                self.audit(optimizer)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_audit}
        return (args[0], closure_then_audit, *args[2:]), kwargs

    def _take_step_hook_off(self, optimizer: Any) -> None:
        """torch runs the step hooks from the dict it holds, which a hook must not change: a new dict
        where ours was the only hook; beside the user's, ours stays, done (it holds nothing)."""
        hook, self.step_hook = self.step_hook, None
        if hook is not None and list(optimizer._optimizer_step_pre_hooks) == [hook.id]:
            optimizer._optimizer_step_pre_hooks = type(optimizer._optimizer_step_pre_hooks)()

    def audit(self, optimizer: Any) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"] if id(p) in self.ids]
        try:
            if parameters:
                audits = audited(self.trackers, parameters)
            else:  # ZeRO's flat partitions in place of the model's parameters
                findings.note(findings.REPLACED)
                audits = []
        except Exception as exc:
            self.end()
            _failed(exc)
            return
        self.end()
        findings.publish(audits)

    def end(self, compiled: bool = False) -> None:
        """This optimizer's watch is over (its step, torch.compile, or the optimizer gone): its step hook
        off where torch is not running it, and its modules' hooks once no other optimizer waits on them."""
        if self.done:
            return
        self.done = True
        if self.step_hook is not None:
            self.step_hook.remove()  # not from its step: torch is not running the dict
            self.step_hook = None
        for tracker in self.trackers:
            root = tracker.root()
            if compiled and root is not None:
                findings.ended_by_compile(root)
            if self in tracker.watches:
                tracker.watches.remove(self)
            if not tracker.watches:
                tracker.end()
        self.trackers = []
        self.ids, self.uncovered, self.checked = set(), set(), set()
        _Watch._stop_finding()


def audited(trackers: list[_Tracker], parameters: list[Any]) -> list[tuple[Any, tuple[Finding, ...]]]:
    """``(module, findings)`` for each module the trackers watched: what they saw of ``parameters`` at
    the first step of the optimizer over them (several modules: those a training loop called itself)."""
    import torch

    live: list[tuple[_Tracker, Any]] = []
    for tracker in trackers:
        root = tracker.root()
        if root is None:
            continue
        if "deepspeed" in sys.modules and _under_deepspeed(root):
            findings.note(findings.ZERO)
            continue
        live.append((tracker, root))
    found_in: dict[int, list[Finding]] = {id(root): [] for _, root in live}
    for finding, root in _lost_gradients(live, parameters):
        found_in[id(root)].append(finding)
    if torch._C._current_graph_task_id() == -1:  # an optimizer stepping in backward: checkpointing may still run
        for tracker, root in live:
            layers = tracker.unchecked_layers()
            if layers:
                names = {id(m): name for name, m in root.named_modules()}
                shown = tuple(names[key] for key in layers if key in names)
                finding = Finding.of(
                    "not-checkpointed", tracker.name, (), shown, (0,) * len(shown), "not-checkpointed", _is_on
                )
                found_in[id(root)].append(finding)
    return [(root, tuple(found_in[id(root)])) for _, root in live]


def _lost_gradients(live: list[tuple[_Tracker, Any]], parameters: list[Any]) -> Iterator[tuple[Finding, Any]]:
    """The trainable ``parameters`` whose module ran in training and that never got a gradient, one
    finding per cause (:func:`_causes`), with the module found where the first of them ran."""
    graded = {id(p) for p in parameters if p.grad is not None}.union(*(tracker.graded for tracker, _ in live))
    ungraded = [p for p in parameters if id(p) not in graded]
    if not ungraded:
        return  # the usual first step: every parameter got a gradient
    ran = _first_runs(live, parameters)
    lost = [p for p in ungraded if id(p) in ran]
    if not lost:
        return
    causes = _causes(lost, ran, latest=max((ran[key].place for key in ran if key in graded), default=-1))
    losing = [(tracker, root) for tracker, root in live if any(ran[id(p)].tracker is tracker for p in lost)]
    model = ", ".join(dict.fromkeys(tracker.name for tracker, _ in losing))
    for finding in _by_cause(lost, causes, *_names(live, parameters), model):
        yield finding, losing[0][1]


def _by_cause(
    lost: list[Any], causes: dict[int, str], names: dict[int, str], watched: tuple[str, ...], model: str
) -> Iterator[Finding]:
    for cause in CAUSES:
        named = sorted(
            ((names[id(p)], p.numel()) for p in lost if causes[id(p)] == cause),
            key=lambda item: findings.natural(item[0]),
        )
        if named:
            shown, sizes = tuple(n for n, _ in named), tuple(s for _, s in named)
            yield Finding.of("no-gradient", model, watched, shown, sizes, cause, _is_on)


class _Run(NamedTuple):
    """Where a parameter's module first ran in training: its place, how (``"grad"``, or the cause of
    the reentrant checkpoint that ran it without grad), and the module found that holds it."""

    place: int
    how: str
    tracker: _Tracker


def _first_runs(live: list[tuple[_Tracker, Any]], parameters: list[Any]) -> dict[int, _Run]:
    ran: dict[int, _Run] = {}
    for tracker, _ in live:
        for p in parameters:
            seen = tracker.ran(p)
            if seen is not None and (id(p) not in ran or seen[0] < ran[id(p)].place):
                ran[id(p)] = _Run(*seen, tracker)
    return ran


def _causes(lost: list[Any], ran: dict[int, _Run], latest: int) -> dict[int, str]:
    """Each lost parameter's cause: under a reentrant checkpoint, what its layer's inputs say; run with
    grad, before a module that got a gradient (``cut``) or after all of them (``dead-end``; also where
    none of the optimizer's did: nothing then tells a cut from a branch, and the audit says nothing it
    cannot tell). A reentrant layer that loses the graph leaves every layer after it without an input
    that requires grad and every module before it without a gradient: all of them are put down to the
    first such layer's cause."""
    causes = {}
    for p in lost:
        run = ran[id(p)]
        causes[id(p)] = run.how if run.how != "grad" else "cut" if run.place < latest else "dead-end"
    chain = sorted((ran[id(p)].place, causes[id(p)]) for p in lost if causes[id(p)] in findings.REENTRANT)
    if chain:
        for p in lost:
            if causes[id(p)] in findings.REENTRANT or (causes[id(p)] == "cut" and ran[id(p)].place < chain[-1][0]):
                causes[id(p)] = chain[0][1]
    return causes


def _names(roots: list[tuple[_Tracker, Any]], parameters: list[Any]) -> tuple[dict[int, str], tuple[str, ...]]:
    """Each parameter's name in the module found (``model.layers.0.mlp.up_proj.weight``); where a loop
    called several modules itself, prefixed with each one's class and its place among the modules of
    its class found (``LlamaDecoderLayer.1.mlp.up_proj.weight``). And the names of all ``parameters``."""
    counts: dict[str, int] = {}
    for tracker, _ in roots:
        counts[tracker.name] = counts.get(tracker.name, 0) + 1
    places: dict[str, int] = {}
    names: dict[int, str] = {}
    for tracker, root in roots:
        prefix = ""
        if len(roots) > 1:
            place = places[tracker.name] = places.get(tracker.name, -1) + 1
            prefix = f"{tracker.name}." + (f"{place}." if counts[tracker.name] > 1 else "")
        for name, p in root.named_parameters():
            names.setdefault(id(p), prefix + name)
    watched = tuple(sorted((names[id(p)] for p in parameters if id(p) in names), key=findings.natural))
    return names, watched


def _under_deepspeed(root: Any) -> bool:
    """Whether ``root`` is DeepSpeed's engine, or holds ZeRO-3 parameters (``ds_id``)."""
    return type(root).__module__.startswith("deepspeed") or any(hasattr(p, "ds_id") for p in root.parameters())


def _requires_grad(values: Iterable[Any]) -> bool:
    return any(getattr(value, "requires_grad", False) is True for value in values)


# -- the public call -----------------------------------------------------------------------------------


def audit_first_step(model: Any, batch: Any, loss: Callable[[Any], Any] | None = None) -> list[Finding]:
    """Run one training forward and backward of ``model`` on ``batch`` (a mapping of keyword arguments,
    a tuple of positional ones, or one input) and return what the first-step audit finds in it:
    trainable parameters whose module ran that got no gradient (dead-end branches included, as data),
    and checkpointing that did not run. ``loss(output)`` makes the loss (default: ``output.loss``).
    The model is put in training mode for the call and back; the gradients it had are given back.
    Runs whatever ``SHIM_DISABLE`` says."""
    import torch

    if not callable(getattr(model, "named_parameters", None)):
        raise TypeError(f"audit_first_step() takes a torch.nn.Module, not {type(model).__qualname__}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in trainable]
    modes = [(m, m.training) for m in model.modules()]
    tracker = _Tracker(model, frozenset(id(p) for p in trainable))  # its own, beside any optimizer's watch
    try:
        for p in trainable:
            p.grad = None
        model.train()
        tracker.watch({id(p) for p in trainable})
        with torch.enable_grad():
            if isinstance(batch, Mapping):
                output = model(**batch)
            elif isinstance(batch, tuple):
                output = model(*batch)
            else:
                output = model(batch)
            value = loss(output) if loss is not None else getattr(output, "loss", None)
            if value is None:
                raise TypeError("audit_first_step(): the output has no .loss; pass loss=lambda output: ...")
            value.backward()
        return [finding for _, found_in in audited([tracker], trainable) for finding in found_in]
    finally:
        tracker.end()
        for p, grad in zip(trainable, grads):
            p.grad = grad
        for module, training in modes:
            module.training = training
