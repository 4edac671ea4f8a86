"""``zero3-delegating-wrapper-hooks``: a module that forwards attribute lookups gets its own ZeRO-3 hooks.

Symptom: under DeepSpeed ZeRO-3, a PEFT model with ``modules_to_save=["lm_head"]`` (or a module
inside torch's ``CheckpointWrapper``) fails in its first forward with ``AttributeError: 'Linear'
object has no attribute 'ds_grads_remaining'``: DeepSpeed asks ``hasattr(module, "pre_bwd_fn")``,
the wrapper's ``__getattr__`` answers with its child's hook classes, and the wrapper gets none.

Fix: a backport of deepspeedai/DeepSpeed#8144 without changing DeepSpeed's code.
``_register_deepspeed_module`` is wrapped: while a model registers, each module's ``pre_bwd_fn`` /
``post_bwd_fn`` leave its ``__dict__`` once its own registration returns and come back when the
outermost one does, so an ancestor's ``hasattr`` sees only its own. A forwarding module that got its
own classes this way also gets its own ``applied_pre_backward_ref_cnt`` of 0.

Limits: only ``_register_deepspeed_module`` is covered; a module that already had its own classes
keeps them. axolotl fixes the same bug for torch's ``CheckpointWrapper`` alone (its ``ds_*``
attributes go to the wrapped module); both can be on, and status names it.

Full story, versions measured and references: docs/bugs.md#zero3-delegating-wrapper-hooks
"""

from __future__ import annotations

import sys
import threading

from shim import BugProbe, Evidence, Patch, SameFix, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument, leading_parameters

NAME = "zero3-delegating-wrapper-hooks"
OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
HOOK_CLASSES = ("pre_bwd_fn", "post_bwd_fn")
COUNTER = "applied_pre_backward_ref_cnt"
_module_getattr = None  # torch.nn.Module.__getattr__, bound on first use


class _Registration:
    """The outermost ``_register_deepspeed_module`` call in progress on this thread."""

    def __init__(self) -> None:
        self.depth = 0
        self.hidden: list = []  # (module, {name: hook class}) taken out of sight of the ancestors
        self.forwarding: list = []  # (module, held its own hook classes before) for modules with a __getattr__


_local = threading.local()


def _forwards_lookups(module) -> bool:
    """Whether ``module``'s class answers unknown attributes with a ``__getattr__`` of its own."""
    global _module_getattr
    if _module_getattr is None:
        import torch

        _module_getattr = torch.nn.Module.__getattr__
    return getattr(type(module), "__getattr__", _module_getattr) is not _module_getattr


def _register_deepspeed_module(wrapped, instance, args, kwargs):
    module = argument(args, kwargs, 0, "module")
    registration = getattr(_local, "registration", None)
    outermost = registration is None
    if outermost:
        registration = _local.registration = _Registration()
    if _forwards_lookups(module):
        registration.forwarding.append((module, all(name in module.__dict__ for name in HOOK_CLASSES)))
    registration.depth += 1
    try:
        result = wrapped(*args, **kwargs)
    finally:
        registration.depth -= 1
        if outermost:
            _local.registration = None
            for hidden_module, classes in registration.hidden:
                hidden_module.__dict__.update(classes)
    if outermost:
        _settle_forwarding(registration.forwarding)
    else:
        classes = {name: module.__dict__.pop(name) for name in HOOK_CLASSES if name in module.__dict__}
        registration.hidden.append((module, classes))
    return result


def _borrowed(module) -> str:
    """The class name of what ``module``'s own ``__getattr__`` answers for ``pre_bwd_fn`` (what DeepSpeed's
    ``hasattr`` would have found), or ``""``."""
    try:
        found = type(module).__getattr__(module, HOOK_CLASSES[0])
    except Exception:  # AttributeError, or a forwarding rule that cannot answer: nothing borrowed
        return ""
    return getattr(found, "__qualname__", type(found).__name__)


def _settle_forwarding(forwarding: list) -> None:
    for module, held_before in forwarding:
        if held_before or not all(name in module.__dict__ for name in HOOK_CLASSES):
            continue
        if COUNTER not in module.__dict__:
            module.__dict__[COUNTER] = 0
        if _borrowed(module):
            record_effect(
                NAME,
                "gave %s its own ZeRO-3 backward hooks; DeepSpeed 0.19.2's hasattr would have used those of "
                "the module its __getattr__ forwards to (AttributeError: ... 'ds_grads_remaining')",
                type(module).__name__,
            )


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """Whether DeepSpeed's ``_register_deepspeed_module`` gives a module that forwards unknown attributes
    hook classes of its own. Run where that costs nothing: its inner hooks are made with
    ``torch.compiler.disable``, whose first call imports ``torch._dynamo`` (seconds). Before anything
    imported it, and the patch off, the method's code is read instead for DeepSpeed's own fix
    (deepspeedai/DeepSpeed#8144, in 0.19.3: it looks for the hook classes in the module's ``__dict__``)."""
    import shim

    if "torch._dynamo" not in sys.modules and not shim.registry.is_on(NAME):
        method = vars(sys.modules[OFFLOAD].DeepSpeedZeRoOffload)["_register_deepspeed_module"]
        code = getattr(getattr(method, "__wrapped__", method), "__code__", None)
        if code is not None and "__dict__" in code.co_names and HOOK_CLASSES[0] in code.co_consts:
            return Evidence(
                False, "_register_deepspeed_module looks for a module's hook classes in its __dict__ (#8144)"
            )
        return Evidence(True, "_register_deepspeed_module asks hasattr, which a forwarding __getattr__ answers (#8144)")
    return _registered_forwarding_module()


def _registered_forwarding_module() -> Evidence:
    """DeepSpeed's ``_register_deepspeed_module`` run on a module that forwards unknown attributes to
    the ``Linear`` it holds, for an offload engine made without its ``__init__`` (no process group, no
    partitioning; the hooks it registers are removed again): the bug is there when the forwarding
    module gets no hook classes of its own (its ``hasattr`` found its child's)."""
    offload = sys.modules[OFFLOAD].DeepSpeedZeRoOffload
    engine = offload.__new__(offload)  # what the method reads of it, and nothing else: no __init__
    engine.__dict__.update(module=None, forward_hooks=[], backward_hooks=[])
    wrapper = bare.forwarding(bare.linear())
    try:  # count given: DeepSpeed's default list is shared by every call
        engine._register_deepspeed_module(wrapper, count=[0])
    finally:
        for handle in engine.forward_hooks + engine.backward_hooks:
            handle.remove()
    if not all(name in wrapper.__dict__ for name in HOOK_CLASSES):
        return Evidence(
            True, "_register_deepspeed_module gives a module that forwards attribute lookups no hook classes of its own"
        )
    return Evidence(
        False, "_register_deepspeed_module gives a module that forwards attribute lookups its own hook classes"
    )


PATCH = Patch(
    name=NAME,
    summary="ZeRO-3 gives wrappers that forward attribute lookups (PEFT modules_to_save, CheckpointWrapper) "
    "their own backward hooks (AttributeError: ds_grads_remaining).",
    distribution="deepspeed",
    requires="<0.19.3",
    targets=(
        Target(
            f"{OFFLOAD}:DeepSpeedZeRoOffload._register_deepspeed_module",
            _register_deepspeed_module,
            check=lambda original: leading_parameters(original, ("self", "module")),
        ),
    ),
    same_fix=(
        SameFix(
            "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointWrapper.__setattr__",
            mark="_axolotl_setattr_patched",  # axolotl's monkeypatch/deepspeed_utils.py sets it
            covers="modules inside torch's CheckpointWrapper (the shim's fix covers every forwarding wrapper)",
        ),
    ),
    references=(
        "docs/bugs.md#zero3-delegating-wrapper-hooks",
        "deepspeedai/DeepSpeed#8144",
        "deepspeedai/DeepSpeed#7615",
        "deepspeedai/DeepSpeed#7203",
    ),
    bug_probe=BugProbe(_bug_probe),
)
