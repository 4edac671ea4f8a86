"""The first-step audit: what the family of silent bugs looks like at an optimizer's first step.

Every bug of the catalogue was silent. What they share is visible at the first step: a module ran
in the training forward, its parameters are trainable, they got no gradient, and modules after it
did get theirs (the gradient was cut inside the model's path); or a model asked for gradient
checkpointing and no layer ran checkpointed. At each optimizer's first step this room names both,
one warning line per cause, with what the shim knows of the cause. A module that ran after every
module that got a gradient (a BERT pooler under mean pooling, a head this loss leaves out) is a
dead-end branch, how models are built: it is named as data (``shim.in_effect``, the report table,
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

import dataclasses
import functools
import itertools
import logging
import re
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType, ModuleType
from typing import Any, NamedTuple

from . import importhooks, ranges, settings

NAME = settings.AUDIT
#: The patches that fix each cause the audit can tell, for its pointer and "switched off" note.
FIXES = {
    "frozen-inputs": ("reentrant-frozen-input-grads",),
    "keyword-inputs": ("reentrant-keyword-grads",),
    "not-checkpointed": ("replaced-forward-keeps-checkpointing",),
}
CAUSES = {
    "frozen-inputs": "their layers ran under reentrant checkpointing with no input that requires grad",
    "keyword-inputs": "their layers ran under reentrant checkpointing, the input that requires grad passed by keyword",
    "reentrant": "their layers ran under reentrant checkpointing",
    "cut": "their modules ran before modules that got a gradient, and the gradient stopped before it reached them "
    "(a detach, a computation under no_grad?)",
    "dead-end": "their modules ran after every module that got a gradient, and nothing the loss depends on used "
    "their output (a pooler or head this loss leaves out?)",
    "not-checkpointed": "gradient checkpointing is on, but no layer ran checkpointed in the first training step "
    "(a forward replaced after import, a checkpoint function that does not checkpoint?)",
}
#: The causes of a reentrant checkpoint's forward, which runs its layer under no_grad.
REENTRANT = ("frozen-inputs", "keyword-inputs", "reentrant")
#: Causes said as data only, never warned: a dead-end branch is how models are built, not the family's evidence.
DATA_ONLY = frozenset({"dead-end"})
SHOWN_GROUPS = 6  # groups of parameter names one line shows; more are counted
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")
_log = logging.getLogger("shim")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the audit names: trainable parameters that got no gradient (``kind`` ``"no-gradient"``),
    or checkpointing asked for that no layer ran (``"not-checkpointed"``); one cause each."""

    kind: str
    model: str  # the class of the model audited
    watched: tuple[str, ...]  # every trainable parameter the audit watched (for the grouping)
    parameters: tuple[str, ...]  # the parameters named (no-gradient), or the checkpointing layers
    sizes: tuple[int, ...]  # how many numbers each of those parameters holds (0s for not-checkpointed)
    cause: str  # a key of CAUSES: what the audit saw of the parameters' modules
    patches: tuple[str, ...]  # the patches that fix that cause
    switched_off: tuple[str, ...]  # those of them switched off here (SHIM_DISABLE, shim.disable, ...)

    @property
    def warns(self) -> bool:
        """Whether it is the family's evidence (a ``ShimWarning``), not data only (a dead-end branch)."""
        return self.cause not in DATA_ONLY

    def line(self) -> str:
        """The warning line: what, grouped, why, and where to read more."""
        if self.kind == "no-gradient":
            what = (
                f"{len(self.parameters)} trainable tensor(s) of {self.model} got no gradient in the first "
                f"training step: {grouped(self.parameters, dict(zip(self.parameters, self.sizes)), self.watched)}"
            )
        else:
            what = f"{self.model} checkpoints {len(self.parameters)} layer(s) ({grouped(self.parameters)})"
        why = CAUSES[self.cause]
        pointers = self.switched_off or self.patches  # a patch switched off is the likelier cause
        if self.switched_off:
            why += f"; {', '.join(self.switched_off)} fixes this and is switched off here"
        elif self.patches:
            why += f"; {', '.join(self.patches)} is on and did not cover it (python -m shim bug-report)"
        more = "".join(f"; python -m shim explain {name}" for name in pointers)
        return f"hf-train-shim first-step audit: {what}; {why}{more} (SHIM_DISABLE={NAME} for no audit)"

    def as_dict(self) -> dict[str, Any]:
        """The finding as plain data (``json.dumps`` takes it), its line and whether it warns included."""
        return {**dataclasses.asdict(self), "warns": self.warns, "line": self.line()}


def grouped(names: Iterable[str], sizes: Mapping[str, int] | None = None, watched: Iterable[str] = ()) -> str:
    """``model.layers.{0..31}.mlp.down_proj.lora_A.weight: 32 tensors, 1.0 M parameters``: names alike
    but for their numbers as one group (the first :data:`SHOWN_GROUPS`, the rest counted). A module
    none of whose ``watched`` parameters got a gradient is named once, ``model.layers.{1..2}.*``."""
    names = list(names)
    whole = _whole_modules(names, list(watched))
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name in names:
        shown_as = whole.get(name, name)
        groups.setdefault(_NUMBER.sub("#", shown_as), []).append(
            (name, tuple(int(n) for n in _NUMBER.findall(shown_as)))
        )
    shown = []
    for pattern, members in list(groups.items())[:SHOWN_GROUPS]:
        text = pattern
        for column in zip(*(numbers for _, numbers in members)):
            text = text.replace("#", _span(sorted(set(column))), 1)
        if sizes is not None:
            count = sum(sizes.get(name, 0) for name, _ in members)
            text += f": {len(members)} tensor(s), {_amount(count)} parameters"
        shown.append(text)
    rest = len(groups) - len(shown)
    return "; ".join(shown) + (f"; and {rest} more group(s)" if rest > 0 else "")


def _whole_modules(names: list[str], watched: list[str]) -> dict[str, str]:
    """name -> ``prefix.*`` for the outermost numbered module (a layer of a list) whose watched
    parameters are all in ``names``."""
    if not watched:
        return {}
    lost = set(names)
    out = {}
    for name in names:
        parts = name.split(".")
        for cut in range(1, len(parts) - 1):
            if not parts[cut - 1].isdigit():
                continue
            prefix = ".".join(parts[:cut]) + "."
            if all(other in lost for other in watched if other.startswith(prefix)):
                out[name] = prefix + "*"
                break
    return out


def _span(numbers: list[int]) -> str:
    """``3``, ``{0..3}``, ``{1,3}``, ``{0..2,5}``: braces (with ``..`` for a run, :func:`shim.ranges.runs`)
    where a name stands for several, since the numbers sit inside a dotted name."""
    written = ranges.runs(numbers, to="..")
    return written[0] if len(numbers) == 1 else "{" + ",".join(written) + "}"


def _amount(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return str(count)


# -- what the audits found -------------------------------------------------------------------------

#: Every finding of this process's audits, in order (the exit line, the report table, bug-report).
found: list[Finding] = []
#: Notes on audits that could not run (DeepSpeed ZeRO, torch.compile), said once each.
notes: list[str] = []
_audited: weakref.WeakKeyDictionary[Any, tuple[Finding, ...]] = weakref.WeakKeyDictionary()
_compiled: weakref.WeakSet[Any] = weakref.WeakSet()  # modules whose watch torch.compile ended
_is_on: Callable[[str], bool] = lambda name: True  # noqa: E731  (the registry's, given by install())
_compile_wraps = False  # torch.compile(module) was called in this process: no global hook from then on
_COMPILED = f"hf-train-shim {NAME}: not run on a model whose first step torch.compile compiles"
_ZERO = f"hf-train-shim {NAME}: not run under DeepSpeed ZeRO, whose gradients are partitioned"
_REPLACED = (
    f"hf-train-shim {NAME}: not run on an optimizer whose parameters were replaced after it was made "
    "(DeepSpeed's or FSDP's flat parameters)"
)


def _related(model: Any, other: Any) -> bool:
    """Whether ``model`` is ``other``, or one of them is inside the other."""
    return model is other or any(m is model for m in other.modules()) or any(m is other for m in model.modules())


def findings_of(model: Any) -> tuple[Finding, ...] | None:
    """The automatic audit's findings on ``model`` (or on the model it was run on, inside which
    ``model`` is, or which is inside ``model``); ``None`` where no audit ran on it yet."""
    for audited, findings in list(_audited.items()):
        if _related(model, audited):
            return findings
    return None


def said_of(model: Any) -> tuple[str, ...]:
    """What ``shim.in_effect(model)`` says of the audit: its findings' lines, or whether it ran."""
    if settings.audit_switched_off():
        return (f"first-step audit: switched off (SHIM_DISABLE names {NAME} or all)",)
    findings = findings_of(model)
    if findings is None:
        if any(_related(model, compiled) for compiled in list(_compiled)):
            return ("first-step audit: not run on it: torch.compile compiles it (compiled code is not audited)",)
        return ("first-step audit: not run on it yet (it runs at its optimizer's first step)",)
    return tuple(f.line() for f in findings) or ("first-step audit: nothing named at its first step",)


def exit_line() -> str:
    """One line for the exit report where an audit warned; ``""`` where none did (data only is not said)."""
    warned = [f for f in found if f.warns]
    if not warned:
        return ""
    said = [
        f"{f.model}: {len(f.parameters)} trainable tensor(s) got no gradient"
        if f.kind == "no-gradient"
        else f"{f.model}: checkpointing on, no layer ran checkpointed"
        for f in warned
    ]
    return f"hf-train-shim first-step audit: {'; '.join(said)} (the warning says which and why)"


def _note(note: str) -> None:
    if note not in notes:
        notes.append(note)
        _log.info(note)


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
    _compiled.add(compiled._orig_mod)
    _compiling()


def _compiling(args: object = None) -> None:
    """torch.compile starts (dynamo's start callback, a module wrapped): every watch ends before dynamo
    traces a hook of it (its guards would see the hooks go, and compile again)."""
    if _Watch.waiting or _Tracker.live:
        _note(_COMPILED)
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
            _log.debug("%s: an optimizer made after torch.compile(module) is audited over modules found only", NAME)
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
            for watch in list(cls.waiting):
                watch.look_at(module, args)
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

    def look_at(self, module: Any, args: Any) -> None:
        """A training call of ``module``: where it holds watched parameters no module found holds, it
        is found (hooks on it, and what this call of it shows, read before they were on)."""
        if id(module) in self.checked:
            return
        self.checked.add(id(module))
        parameters = frozenset(id(p) for p in module.parameters())
        held = self.uncovered & parameters
        if held:
            tracker, new = _Tracker.of(module, parameters)
            self.adopt(tracker, held)
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
                _note(_REPLACED)
                audits = []
        except Exception as exc:
            self.end()
            _failed(exc)
            return
        self.end()
        publish(audits)

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
                _compiled.add(root)
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
            _note(_ZERO)
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
                finding = _finding("not-checkpointed", tracker.name, (), shown, (0,) * len(shown), "not-checkpointed")
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
        named = sorted(((names[id(p)], p.numel()) for p in lost if causes[id(p)] == cause), key=_key)
        if named:
            shown, sizes = tuple(n for n, _ in named), tuple(s for _, s in named)
            yield _finding("no-gradient", model, watched, shown, sizes, cause)


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
    chain = sorted((ran[id(p)].place, causes[id(p)]) for p in lost if causes[id(p)] in REENTRANT)
    if chain:
        for p in lost:
            if causes[id(p)] in REENTRANT or (causes[id(p)] == "cut" and ran[id(p)].place < chain[-1][0]):
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
    watched = tuple(sorted((names[id(p)] for p in parameters if id(p) in names), key=_natural))
    return names, watched


def publish(audits: list[tuple[Any, tuple[Finding, ...]]]) -> None:
    """Keep what an audit found, and say it: a warning for the family's evidence, INFO for data only;
    a line said already (another optimizer over the same model) is not said again."""
    for root, findings in audits:
        _audited[root] = (*_audited.get(root, ()), *findings)
        for finding in findings:
            line = finding.line()
            if any(f.line() == line for f in found):
                continue
            found.append(finding)
            if finding.warns:
                _warn(line)
            else:
                _log.info(line)


def _finding(
    kind: str,
    model: str,
    watched: tuple[str, ...],
    names: tuple[str, ...],
    sizes: tuple[int, ...],
    cause: str,
) -> Finding:
    patches = FIXES.get(cause, ())
    off = tuple(name for name in patches if not _is_on(name))
    return Finding(kind, model, watched, names, sizes, cause, patches, off)


#: Frames a finding's warning is not attributed to (beside the shim's): the libraries between the
#: user's step and the audit.
_BETWEEN = ("torch", "accelerate", "transformers", "trl", "peft")


def _warn(message: str) -> None:
    """``message`` as a ShimWarning (and to the ``shim`` logger), pointed at the user's step line; where
    a filter makes it an error (``-W error``), on the logger alone: never raised into the step."""
    import warnings

    _log.warning(message)
    try:
        warnings.warn(message, settings.ShimWarning, stacklevel=settings.user_stacklevel(_BETWEEN))
    except Warning:
        pass  # said on the logger above, and in the exit line


def _under_deepspeed(root: Any) -> bool:
    """Whether ``root`` is DeepSpeed's engine, or holds ZeRO-3 parameters (``ds_id``)."""
    return type(root).__module__.startswith("deepspeed") or any(hasattr(p, "ds_id") for p in root.parameters())


def _requires_grad(values: Iterable[Any]) -> bool:
    return any(getattr(value, "requires_grad", False) is True for value in values)


def _natural(name: str) -> list[Any]:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _key(item: tuple[str, int]) -> list[Any]:
    return _natural(item[0])


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
        return [finding for _, findings in audited([tracker], trainable) for finding in findings]
    finally:
        tracker.end()
        for p, grad in zip(trainable, grads):
            p.grad = grad
        for module, training in modes:
            module.training = training
