"""The first-step audit: what the family of silent bugs looks like at a model's first training step.

Every bug of the catalogue was silent. What they share is visible at the first step: a module ran
in the training forward, its parameters are trainable, and they got no gradient; or a model asked
for gradient checkpointing and no layer ran checkpointed. At the first optimizer step of a model
this room names both, one warning line each, with what the shim knows of the cause.

How it sees a step, and what it costs (nothing is wrapped on ``nn.Module``):

- ``torch.optim.Optimizer.__init__`` gets a pass-through function when ``torch.optim.optimizer`` is
  imported (it runs once per optimizer made, never per step). An optimizer made is the one sign a
  plain loop, the Trainer, trl, accelerate and DeepSpeed all give before their first forward; its
  trainable parameters are the ones to watch.
- Until the first forward in training mode with grad enabled of a module that holds some of them
  (the model: the outermost such call), one torch global module pre-hook looks for it, and is
  removed then. On that model, forward pre-hooks go on the modules that own the watched parameters,
  on its checkpointing layers and on itself, and a step pre-hook on the optimizer.
- At the optimizer's first step the module hooks come off and the audit is made. torch runs an
  optimizer's step hooks from the dict it holds, which a hook must not change: the optimizer gets a
  new, empty dict where the audit's hook was its only one (else that hook comes off at the next
  module call). After that step nothing of the audit is left on the model or optimizer.
- torch.compile: when dynamo starts compiling, every watch ends first (dynamo would trace its hooks,
  and compile again once they are gone); DeepSpeed ZeRO, whose gradients are partitioned: said once,
  on the ``shim`` logger, that the audit does not run there.
- Once per model. Opted out as a patch is: ``SHIM_DISABLE=first-step-audit`` (or ``all``).

``audit_first_step(model, batch)`` runs the same audit on one forward and backward, for a test.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

from . import importhooks, settings

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
    "unused": "their modules ran in the training forward, but the loss does not depend on their output "
    "(an output left out of the loss, a detach?)",
    "not-checkpointed": "gradient checkpointing is on, but no layer ran checkpointed in the first training step "
    "(a forward replaced after import, a checkpoint function that does not checkpoint?)",
}
SHOWN_GROUPS = 6  # groups of parameter names one line shows; more are counted
_COMPILED = f"hf-train-shim {NAME}: not run on a model whose first step torch.compile compiles"
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")
_log = logging.getLogger("shim")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the audit names: trainable parameters that got no gradient (``kind`` ``"no-gradient"``),
    or checkpointing asked for that no layer ran (``"not-checkpointed"``)."""

    kind: str
    model: str  # the class of the model audited
    watched: tuple[str, ...]  # every trainable parameter the audit watched (for the grouping)
    parameters: tuple[str, ...]  # the parameters named (no-gradient), or the checkpointing layers
    sizes: tuple[int, ...]  # how many numbers each of those parameters holds (0s for not-checkpointed)
    causes: tuple[str, ...]  # keys of CAUSES: what the audit saw of the parameters' modules
    patches: tuple[str, ...]  # the patches that fix those causes
    switched_off: tuple[str, ...]  # those of them switched off here (SHIM_DISABLE, shim.disable, ...)

    def line(self) -> str:
        """The warning line: what, grouped, why, and where to read more."""
        if self.kind == "no-gradient":
            what = (
                f"{len(self.parameters)} trainable tensor(s) of {self.model} got no gradient in the first "
                f"training step: {grouped(self.parameters, dict(zip(self.parameters, self.sizes)), self.watched)}"
            )
        else:
            what = f"{self.model} checkpoints {len(self.parameters)} layer(s) ({grouped(self.parameters)})"
        why = "; ".join(CAUSES[cause] for cause in self.causes)
        pointers = self.switched_off or self.patches  # a patch switched off is the likelier cause
        if self.switched_off:
            why += f"; {', '.join(self.switched_off)} fixes this and is switched off here"
        elif self.patches:
            why += f"; {', '.join(self.patches)} is on and did not cover it (python -m shim bug-report)"
        more = "".join(f"; python -m shim explain {name}" for name in pointers)
        return f"hf-train-shim first-step audit: {what}; {why}{more} (SHIM_DISABLE={NAME} for no audit)"

    def as_dict(self) -> dict[str, Any]:
        """The finding as plain data (``json.dumps`` takes it), its warning line included."""
        return {**dataclasses.asdict(self), "line": self.line()}


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
    if len(numbers) == 1:
        return str(numbers[0])
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{{{numbers[0]}..{numbers[-1]}}}"
    return "{" + ",".join(map(str, numbers)) + "}"


def _amount(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return str(count)


# -- what the audits found -------------------------------------------------------------------------

#: Every finding of this process's audits, in order (the exit line, the report table, bug-report).
found: list[Finding] = []
#: Notes on audits that could not run (DeepSpeed ZeRO), said once each.
notes: list[str] = []
_audited: weakref.WeakKeyDictionary[Any, tuple[Finding, ...]] = weakref.WeakKeyDictionary()
_is_on: Callable[[str], bool] = lambda name: True  # noqa: E731  (the registry's, given by install())


def findings_of(model: Any) -> tuple[Finding, ...] | None:
    """The automatic audit's findings on ``model`` (or on the model it was run on, inside which
    ``model`` is, or which is inside ``model``); ``None`` where no audit ran on it yet."""
    for audited, findings in list(_audited.items()):
        if audited is model or any(m is model for m in audited.modules()):
            return findings
        if any(m is audited for m in model.modules()):
            return findings
    return None


def said_of(model: Any) -> tuple[str, ...]:
    """What ``shim.in_effect(model)`` says of the audit: its findings' lines, or whether it ran."""
    if switched_off():
        return (f"first-step audit: switched off (SHIM_DISABLE names {NAME} or all)",)
    findings = findings_of(model)
    if findings is None:
        return ("first-step audit: not run on it yet (it runs at its first optimizer step)",)
    return tuple(f.line() for f in findings) or ("first-step audit: nothing named at its first step",)


def exit_line() -> str:
    """One line for the exit report where an audit named something; ``""`` where none did."""
    if not found:
        return ""
    said = [
        f"{f.model}: {len(f.parameters)} trainable tensor(s) got no gradient"
        if f.kind == "no-gradient"
        else f"{f.model}: checkpointing on, no layer ran checkpointed"
        for f in found
    ]
    return f"hf-train-shim first-step audit: {'; '.join(said)} (the warning says which and why)"


def switched_off() -> bool:
    """Whether ``SHIM_DISABLE`` names the audit (or all): read as the settings read it, without warnings."""
    names = {settings.canonical(item) for item in os.environ.get("SHIM_DISABLE", "").split(",")}
    return bool(names & (settings.ALL | {NAME}))


# -- installing --------------------------------------------------------------------------------------


def install(is_on: Callable[[str], bool]) -> None:
    """Watch optimizers as they are made (``torch.optim.optimizer`` has just been imported):
    ``is_on(name)`` tells whether a patch is on, for the cause a finding gives."""
    global _is_on
    if switched_off():
        return
    _is_on = is_on
    optimizer = sys.modules["torch.optim.optimizer"].Optimizer
    if getattr(optimizer.__init__, "_shim_audit", False):
        return  # a reloaded shim finds it in place
    upstream = optimizer.__init__

    # A plain function, not a wrapt wrapper: ``import shim`` after torch imports no wrapt.
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        upstream(self, *args, **kwargs)
        _made(self)

    functools.update_wrapper(__init__, upstream)
    __init__._shim_audit = True  # type: ignore[attr-defined]
    optimizer.__init__ = __init__
    importhooks.when_imported("torch._dynamo.callback", _watch_compiles)


def uninstall() -> None:
    """Put ``Optimizer.__init__`` back as it was (``shim.deactivate()``); a model watched already
    ends its watch at its first step, as ever."""
    optimizer = getattr(sys.modules.get("torch.optim.optimizer"), "Optimizer", None)
    ours = getattr(optimizer, "__init__", None)
    if getattr(ours, "_shim_audit", False):
        optimizer.__init__ = ours.__wrapped__  # type: ignore[misc,union-attr]  # functools.update_wrapper's


def _watch_compiles(callback: ModuleType) -> None:
    """Be told when torch.compile starts compiling (once ``torch._dynamo`` is imported)."""
    if _Watch.compiling not in callback.callback_handler.start_callbacks:
        callback.callback_handler.register_start_callback(_Watch.compiling)


def _made(optimizer: Any) -> None:
    """An optimizer was made: watch its model's first step, unless the audit is switched off now."""
    try:
        if not switched_off():
            _Watch.of_optimizer(optimizer)
    except Exception as exc:  # the audit never breaks training
        _failed(exc)


def _failed(exc: Exception) -> None:
    if settings.flag("SHIM_STRICT"):
        raise settings.PatchError(f"{NAME} failed: {exc!r}") from exc
    settings.warn_once(f"hf-train-shim {NAME} failed, nothing audited: {exc!r}")


# -- watching one model's first step ----------------------------------------------------------------


class _Watch:
    """One model's first step: which watched modules ran in a training forward, and how."""

    _finding_root: Any = None  # torch's global module pre-hook, while a watch waits for its model
    _live: list[_Watch] = []  # the watches not ended: waiting for their model, or watching it

    def __init__(self, trainable: Iterable[Any]) -> None:
        self.ids = {id(p) for p in trainable if p.requires_grad}
        self.root: Any = None
        self.handles: list[Any] = []
        self.checked: set[int] = set()  # modules already found not to hold watched parameters
        self.frames: list[bool] = []  # per call in progress: inside a training forward?
        self.owners: dict[int, Any] = {}  # modules that own watched parameters
        self.owner_hooks: dict[int, Any] = {}  # their hooks, each taken off once it has said what it can
        self.layer_of: dict[int, Any] = {}  # owner -> the checkpointing layer it sits in
        self.layers: dict[int, Any] = {}  # the checkpointing layers whose checkpointing is on
        self.ran: set[int] = set()  # owners run inside a training forward
        self.without_grad: set[int] = set()  # ... with grad off there (reentrant checkpointing)
        self.inputs: dict[int, tuple[bool, bool]] = {}  # layer -> (a positional, a keyword input requires grad)
        self.checkpointed = False  # some layer's module ran checkpointed
        self.done = False
        self.step_hook: Any = None  # on the optimizer: its first step is the audit's moment

    @classmethod
    def of_optimizer(cls, optimizer: Any) -> None:
        """Watch the first step of the model ``optimizer`` trains (found at its first training forward)."""
        watch = cls(p for group in optimizer.param_groups for p in group["params"])
        if not watch.ids:
            return
        callback = sys.modules.get("torch._dynamo.callback")
        if callback is not None:  # again: torch._dynamo.reset() clears its callbacks
            _watch_compiles(callback)
        watch.step_hook = optimizer.register_step_pre_hook(watch._stepping)
        cls._live.append(watch)
        weakref.finalize(optimizer, watch.end)
        if cls._finding_root is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            cls._finding_root = register_module_forward_pre_hook(cls._find_root)

    @classmethod
    def _find_root(cls, module: Any, args: Any) -> None:
        """torch's global module pre-hook: the outermost training call of a module that holds a
        waiting watch's parameters is its model."""
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return
        for watch in [watch for watch in cls._live if watch.root is None]:
            if id(module) in watch.checked:
                continue
            watch.checked.add(id(module))
            if module in _audited:
                watch.end()
            elif any(id(p) in watch.ids for p in module.parameters()):
                watch.attach(module)
                watch.frames.append(True)  # this call's own pre-hook was not in torch's list yet
        cls._stop_finding()

    @classmethod
    def _stop_finding(cls) -> None:
        if all(watch.root is not None for watch in cls._live) and cls._finding_root is not None:
            cls._finding_root.remove()
            cls._finding_root = None

    @classmethod
    def compiling(cls, args: object = None) -> None:
        """torch.compile starts compiling (dynamo's start callback): every watch ends before dynamo
        traces a hook of it (its guards would see the hooks go, and compile again)."""
        for watch in list(cls._live):
            if watch.root is not None and not watch.done and _COMPILED not in notes:
                notes.append(_COMPILED)
                _log.info(_COMPILED)
            watch.end()

    def attach(self, root: Any) -> None:
        """Hooks on ``root``, its checkpointing layers and the modules that own watched parameters."""
        self.root = root
        hooks = self.handles
        hooks += [
            root.register_forward_pre_hook(self._enter),
            root.register_forward_hook(self._leave, always_call=True),
        ]
        # one walk of the module tree (torch's own generators cost a first step a millisecond here)
        flagged, outer, layer_of, seen = [], set(), {}, set()
        stack: list[tuple[Any, Any]] = [(root, None)]
        while stack:
            module, layer = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            if vars(module).get("gradient_checkpointing") is True:  # set on each module by an enable
                if layer is not None:
                    outer.add(id(layer))  # it holds a layer: the base model, not a layer
                layer = module
                flagged.append(module)
            if layer is not None:
                layer_of[id(module)] = layer
            if any(p is not None and id(p) in self.ids for p in module._parameters.values()):
                self.owners[id(module)] = module
                self.owner_hooks[id(module)] = module.register_forward_pre_hook(self._owner_runs)
            stack += [(child, layer) for child in module._modules.values() if child is not None]
        self.layer_of = {key: layer for key, layer in layer_of.items() if id(layer) not in outer}
        for module in flagged:
            if id(module) not in outer:
                self.layers[id(module)] = module
                hooks.append(module.register_forward_pre_hook(self._enter_layer, with_kwargs=True))
                hooks.append(module.register_forward_hook(self._leave, always_call=True))

    def detach(self) -> None:
        for handle in [*self.handles, *self.owner_hooks.values()]:
            handle.remove()
        self.handles.clear()
        self.owner_hooks.clear()

    # the hooks: per call, as little as can tell what the audit needs

    def _enter(self, module: Any, args: Any) -> None:
        import torch

        self.frames.append((module.training and torch.is_grad_enabled()) or bool(self.frames and self.frames[-1]))

    def _enter_layer(self, layer: Any, args: Any, kwargs: Any) -> None:
        import torch

        training = layer.training and torch.is_grad_enabled()
        self.frames.append(training or bool(self.frames and self.frames[-1]))
        if training and id(layer) not in self.inputs:
            self.inputs[id(layer)] = (_requires_grad(args), _requires_grad(kwargs.values()))

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        if self.frames:
            self.frames.pop()

    def _owner_runs(self, module: Any, args: Any) -> None:
        import torch

        key = id(module)
        if torch.is_grad_enabled():
            self.ran.add(key)
            if key in self.layer_of and torch._C._current_graph_task_id() != -1:
                self.checkpointed = True  # a checkpoint's recomputation, in backward
        elif self.frames and self.frames[-1] and key in self.layer_of:
            self.ran.add(key)  # a reentrant checkpoint's forward, inside a training forward
            self.without_grad.add(key)
            self.checkpointed = True
        else:
            return  # a forward under no_grad: a reference model, generation, a computation kept out
        if self.checkpointed or key not in self.layer_of:  # nothing more to learn from its calls
            self.owner_hooks.pop(key).remove()

    # the step

    def _stepping(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.done:
            return
        root = self.root
        self.end(stepping=optimizer)
        if root is None or root in _audited:
            return
        try:
            findings = self.findings()
        except Exception as exc:
            _failed(exc)
            return
        self.publish(findings)

    def end(self, stepping: Any = None) -> None:
        """Nothing more to watch: every hook off. ``stepping``: the optimizer whose step hooks torch
        runs now, from the dict it holds, which a hook must not change: it gets a new dict where
        this hook was its only one, else the hook comes off at the next module call."""
        self.done = True
        self.detach()
        if self in _Watch._live:
            _Watch._live.remove(self)
            _Watch._stop_finding()
        hook, self.step_hook = self.step_hook, None
        if hook is None:
            return
        if stepping is None:
            hook.remove()
        elif list(stepping._optimizer_step_pre_hooks) == [hook.id]:
            stepping._optimizer_step_pre_hooks = type(stepping._optimizer_step_pre_hooks)()
        else:
            from torch.nn.modules.module import register_module_forward_pre_hook

            own: list[Any] = []

            def take_off(module: Any, args: Any) -> None:
                hook.remove()
                own.pop().remove()

            own.append(register_module_forward_pre_hook(take_off))

    def findings(self) -> tuple[Finding, ...]:
        root = self.root
        model = type(root).__name__
        if "deepspeed" in sys.modules and _under_deepspeed(root):
            note = f"hf-train-shim {NAME}: not run under DeepSpeed ZeRO, whose gradients are partitioned"
            if note not in notes:
                notes.append(note)
                _log.info(note)
            return ()
        lost_here: list[tuple[int, Any]] = [
            (key, p)
            for key in self.ran
            for p in self.owners[key]._parameters.values()
            if p is not None and id(p) in self.ids and p.requires_grad and p.grad is None
        ]
        out = []
        if lost_here:  # the names only now: most first steps lose nothing
            names = {id(p): name for name, p in root.named_parameters()}
            lost = sorted(
                ((names[id(p)], p.numel()) for _, p in lost_here if id(p) in names), key=lambda x: _natural(x[0])
            )
            causes = {self._cause(key) for key, _ in lost_here}
            watched = tuple(sorted((names[key] for key in self.ids if key in names), key=_natural))
            lost_names, sizes = tuple(n for n, _ in lost), tuple(s for _, s in lost)
            ordered = tuple(cause for cause in CAUSES if cause in causes)
            out.append(_finding("no-gradient", model, watched, lost_names, sizes, ordered))
        seen_in_layers = any(key in self.layer_of for key in self.ran)  # else it cannot tell
        if self.layers and seen_in_layers and not self.checkpointed:
            layer_names = {id(m): name for name, m in root.named_modules()}
            layers = tuple(layer_names[key] for key in self.layers if key in layer_names)
            out.append(_finding("not-checkpointed", model, (), layers, (0,) * len(layers), ("not-checkpointed",)))
        return tuple(out)

    def _cause(self, owner: int) -> str:
        if owner not in self.without_grad:
            return "unused"
        layer = self.layer_of.get(owner)
        positional, keyword = self.inputs.get(id(layer), (True, False)) if layer is not None else (True, False)
        if not positional:
            return "keyword-inputs" if keyword else "frozen-inputs"
        return "reentrant"

    def publish(self, findings: tuple[Finding, ...]) -> None:
        _audited[self.root] = findings
        for finding in findings:
            found.append(finding)
            _warn(finding.line())


def _finding(
    kind: str,
    model: str,
    watched: tuple[str, ...],
    names: tuple[str, ...],
    sizes: tuple[int, ...],
    causes: tuple[str, ...],
) -> Finding:
    patches = tuple(name for cause in causes for name in FIXES.get(cause, ()))
    off = tuple(name for name in patches if not _is_on(name))
    return Finding(kind, model, watched, names, sizes, causes, patches, off)


#: Frames a finding's warning is not attributed to: the libraries between the user's step and the audit.
_LIBRARIES = tuple(f"{os.sep}{name}{os.sep}" for name in ("shim", "torch", "accelerate", "transformers", "trl", "peft"))


def _warn(message: str) -> None:
    """``message`` as a ShimWarning (and to the ``shim`` logger), pointed at the user's step line."""
    import warnings

    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and any(part in frame.f_code.co_filename for part in _LIBRARIES):
        frame, level = frame.f_back, level + 1
    _log.warning(message)
    warnings.warn(message, settings.ShimWarning, stacklevel=level)


def _under_deepspeed(root: Any) -> bool:
    """Whether ``root`` is DeepSpeed's engine, or holds ZeRO-3 parameters (``ds_id``)."""
    return type(root).__module__.startswith("deepspeed") or any(hasattr(p, "ds_id") for p in root.parameters())


def _requires_grad(values: Iterable[Any]) -> bool:
    return any(getattr(value, "requires_grad", False) is True for value in values)


def _natural(name: str) -> list[Any]:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


# -- the public call -----------------------------------------------------------------------------------


def audit_first_step(model: Any, batch: Any, loss: Callable[[Any], Any] | None = None) -> list[Finding]:
    """Run one training forward and backward of ``model`` on ``batch`` (a mapping of keyword arguments,
    a tuple of positional ones, or one input) and return what the first-step audit finds in it:
    trainable parameters whose module ran that got no gradient, and checkpointing that did not run.
    ``loss(output)`` makes the loss (default: ``output.loss``). The model is put in training mode for
    the call and back; the gradients it had are given back. Runs whatever ``SHIM_DISABLE`` says."""
    import torch

    if not callable(getattr(model, "named_parameters", None)):
        raise TypeError(f"audit_first_step() takes a torch.nn.Module, not {type(model).__qualname__}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in trainable]
    modes = [(m, m.training) for m in model.modules()]
    watch = _Watch(trainable)
    try:
        for p in trainable:
            p.grad = None
        model.train()
        watch.attach(model)
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
        return list(watch.findings())
    finally:
        watch.detach()
        for p, grad in zip(trainable, grads):
            p.grad = grad
        for module, training in modes:
            module.training = training
