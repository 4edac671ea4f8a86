"""``zero3-frozen-recompute``: ZeRO-3 keeps a frozen parameter gathered while a recomputation still needs it.

Symptom: under DeepSpeed ZeRO-3, non-reentrant checkpointing on a model with any frozen parameter
(every LoRA run) fails in the first backward with ``CheckpointError: Recomputed values ... have
different metadata`` (``recomputed metadata: {'shape': torch.Size([0]) ...}``): ZeRO-3 partitions the
recomputed layer's parameters in place while torch's checkpoint still holds the live frozen ones.

Fix: a backport of deepspeedai/DeepSpeed#8148 onto ``PartitionedParameterCoordinator``. Frozen
parameters gathered by a forward fetch inside backward (a recomputation) are attributed to the
module whose backward is running and stay gathered until that module's backward release; whatever
such modules still hold is released after the ZeRO-3 optimizer's ``backward_epilogue``.

Limits: trainable parameters are left to DeepSpeed (torch saves them detached). A module whose
backward release never comes keeps its *own* parameters gathered until its next forward release
(upstream's fix releases them at the end of backward). A release whose ZeRO-3 optimizer has no
``backward_epilogue`` is skipped.

Full story, versions measured and references: docs/bugs.md#zero3-frozen-recompute
"""

from __future__ import annotations

import sys
import threading
import weakref

from shim import BugProbe, Evidence, Patch, Target, record_effect

from ._arguments import argument

NAME = "zero3-frozen-recompute"
COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
_graph_task_id = None  # torch._C._current_graph_task_id, bound on first use (no torch import at module level)


class _Attribution:
    """One coordinator's recompute bookkeeping."""

    __slots__ = ("active", "kept", "lock")

    def __init__(self) -> None:
        self.active: dict = {}  # ds_id -> module fetched in backward and not yet released, in fetch order
        self.kept: dict = {}  # ds_id of an active module -> frozen parameters kept gathered for it
        self.lock = threading.Lock()  # autograd may run hooks of one backward on several threads


# coordinator -> _Attribution; weak, so an engine that is gone takes its bookkeeping along.
_attributions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_attributions_lock = threading.Lock()


def _attribution(coordinator) -> _Attribution:
    found = _attributions.get(coordinator)
    if found is None:
        with _attributions_lock:
            found = _attributions.setdefault(coordinator, _Attribution())
    return found


def _in_backward() -> bool:
    global _graph_task_id
    if _graph_task_id is None:
        import torch

        _graph_task_id = torch._C._current_graph_task_id
    return _graph_task_id() != -1


def _own_parameters(submodule):
    coordinator = sys.modules[COORDINATOR]
    return coordinator.iter_params(submodule, recurse=coordinator.z3_leaf_module(submodule))


def _fetch_sub_module(wrapped, instance, args, kwargs):
    submodule = argument(args, kwargs, 0, "current_submodule")
    if not argument(args, kwargs, 1, "forward"):
        state = _attribution(instance)
        with state.lock:
            state.active[submodule.ds_id] = submodule
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    state = _attributions.get(instance)
    if state is not None and state.active and _in_backward():
        _keep_for_recomputation(state, submodule)
    return result


def _keep_for_recomputation(state: _Attribution, submodule) -> None:
    """Attribute ``submodule``'s frozen parameters, just gathered by a recomputation, to the most recent
    active backward module: the recomputation's forward release then leaves them gathered."""
    frozen = [param for param in _own_parameters(submodule) if not param.requires_grad]
    if not frozen:
        return
    with state.lock:
        if not state.active:
            return
        owner = next(reversed(state.active.values()))
        state.kept.setdefault(owner.ds_id, set()).update(frozen)
    for param in frozen:
        param.ds_active_sub_modules.add(owner.ds_id)
    record_effect(
        NAME,
        "kept %d frozen parameter(s) of %s gathered through its recomputation in the backward of %s, which "
        "DeepSpeed %s partitions in place while torch's checkpoint still holds them",
        len(frozen), type(submodule).__name__, type(owner).__name__, _deepspeed_version(),
    )  # fmt: skip


def _deepspeed_version() -> str:
    return getattr(sys.modules.get("deepspeed"), "__version__", "<0.19.3")


def _release_sub_module(wrapped, instance, args, kwargs):
    if argument(args, kwargs, 1, "forward", False):
        return wrapped(*args, **kwargs)
    state = _attributions.get(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    submodule = argument(args, kwargs, 0, "submodule")
    with state.lock:
        state.active.pop(submodule.ds_id, None)
        kept = state.kept.pop(submodule.ds_id, None)
    result = wrapped(*args, **kwargs)
    if kept:
        _release(instance, submodule, kept)
    return result


def _release(coordinator, submodule, params) -> None:
    """Release ``params``, kept for ``submodule``, the way upstream releases a module's parameters."""
    namespace = sys.modules[COORDINATOR]
    release = coordinator._PartitionedParameterCoordinator__release_param
    free_data = not namespace.z3_leaf_module(submodule) or not coordinator.fast_sharding_for_leaf_module
    if not free_data:
        import torch

        empty_buffer = torch.empty(1, device=torch.device(namespace.get_accelerator().current_device_name()))
    for param in params:
        param.ds_active_sub_modules.discard(submodule.ds_id)
        if not param.ds_persist and not param.is_external_param:
            release(param, free_data)
            if not free_data:
                param.data = empty_buffer


def _backward_epilogue(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    offload = getattr(instance, "parameter_offload", None)
    coordinator = offload.get_param_coordinator() if offload is not None else None
    state = _attributions.get(coordinator) if coordinator is not None else None
    if state is not None and state.active:
        with state.lock:
            leftovers = [(module, state.kept.pop(module.ds_id, ())) for module in state.active.values()]
            state.active.clear()
            state.kept.clear()
        for module, kept in leftovers:
            if kept:
                _release(coordinator, module, kept)
    return result


# -- shape check -------------------------------------------------------------------------------


def _check_fetch(original):
    """The coordinator's helpers the wrappers call. (Its methods are wrapped by DeepSpeed's profiling
    decorators, which hide their signatures: the gate, not a signature, vouches for their arguments.)"""
    namespace = sys.modules[COORDINATOR]
    for name in ("iter_params", "z3_leaf_module", "get_accelerator"):
        if not hasattr(namespace, name):
            return f"{COORDINATOR} no longer has {name}"
    if not hasattr(namespace.PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__release_param"):
        return "PartitionedParameterCoordinator no longer has __release_param"
    import torch

    if not hasattr(torch._C, "_current_graph_task_id"):
        return "torch._C._current_graph_task_id does not exist in this torch"
    return None


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """Whether DeepSpeed has its own fix (deepspeedai/DeepSpeed#8148, in 0.19.3): the coordinator
    attributes the frozen parameters a recomputation fetches to the module whose backward runs, in
    ``update_recompute_parameters``; a git build labelled 0.19.3 from before the fix merged lacks it.
    The bug shows only in a ZeRO-3 run, which needs ``torch.distributed``: with the patch on (doctor's
    second question) the answer is one such run, on one rank in a child process, where the patch is
    on too (``_deepspeed_cases``)."""
    import shim

    namespace = sys.modules[COORDINATOR]
    if callable(getattr(namespace, "update_recompute_parameters", None)):
        return Evidence(False, f"{COORDINATOR} has update_recompute_parameters (deepspeedai/DeepSpeed#8148)")
    if shim.registry.is_on(NAME):
        from ._deepspeed_cases import reproduces

        if reproduces("frozen-recompute", NAME):
            return Evidence(
                True, "a one-rank ZeRO-3 run with a frozen parameter under non-reentrant checkpointing fails"
            )
        return Evidence(False, "a one-rank ZeRO-3 run with a frozen parameter under non-reentrant checkpointing trains")
    return Evidence(True, f"{COORDINATOR} has no update_recompute_parameters (deepspeedai/DeepSpeed#8148)")


PATCH = Patch(
    name=NAME,
    summary="ZeRO-3 keeps frozen parameters gathered while non-reentrant checkpointing recomputes "
    "(CheckpointError: recomputed shape [0]).",
    distribution="deepspeed",
    requires="<0.19.3",
    targets=(
        Target(
            f"{COORDINATOR}:PartitionedParameterCoordinator.fetch_sub_module", _fetch_sub_module, check=_check_fetch
        ),
        Target(f"{COORDINATOR}:PartitionedParameterCoordinator.release_sub_module", _release_sub_module),
        Target("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.backward_epilogue", _backward_epilogue),
    ),
    references=(
        "docs/bugs.md#zero3-frozen-recompute",
        "deepspeedai/DeepSpeed#8148",
        "deepspeedai/DeepSpeed#8130",
        "huggingface/transformers#47254",
    ),
    bug_probe=BugProbe(_bug_probe),
)
