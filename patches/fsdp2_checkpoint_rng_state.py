"""``fsdp2-checkpoint-rng-state``: FSDP2 activation checkpointing recomputes with the forward's RNG state.

Symptom (silent): with FSDP2 and ``activation_checkpointing`` (accelerate's ``fsdp2_apply_ac``, which
transformers' Trainer and ``Accelerator.prepare`` run), every wrapped layer checkpoints with
``preserve_rng_state=False``. With any dropout active (LoRA's ``lora_dropout``, ``attention_dropout``)
the recomputation in backward draws other masks than the forward that gave the loss: the gradients
belong to a forward that never happened, and the recompute moves the RNG stream on. Nothing raises.

Fix: ``fsdp2_apply_ac`` is wrapped. After upstream has wrapped the layers, each ``CheckpointWrapper``
that call created (also inside an ``offload_wrapper``) gets its checkpoint function back with
``preserve_rng_state=True``, the rest of it as upstream built it; wrappers that were there before
are left alone. Modules that imported the name early are rebound (``consumers``).

Limits: only layers wrapped by ``fsdp2_apply_ac``; FSDP1 and transformers' own checkpointing already
preserve the RNG state. The layer calls pay torch's cost of keeping the state (docs/performance.md).

Full story, versions measured and references: docs/bugs.md#fsdp2-checkpoint-rng-state
"""

from __future__ import annotations

import functools
import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument, leading_parameters

NAME = "fsdp2-checkpoint-rng-state"
WRAPPERS = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
AUTO_WRAP = "torch.distributed.fsdp.wrap"  # both imported by fsdp2_apply_ac when it is called


def _checkpoint_wrappers(model, kind) -> list:
    return [module for module in model.modules() if isinstance(module, kind)]


def _fsdp2_apply_ac(wrapped, instance, args, kwargs):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.nn import Module

    model = argument(args, kwargs, 1, "model", None)
    # Kept (not only their ids) so that none is freed and its id reused by a wrapper of this call.
    before = _checkpoint_wrappers(model, CheckpointWrapper) if isinstance(model, Module) else []
    result = wrapped(*args, **kwargs)
    root = result if isinstance(result, Module) else model
    if not isinstance(root, Module):
        return result
    existing = {id(module) for module in before}
    fixed = 0
    for module in _checkpoint_wrappers(root, CheckpointWrapper):
        function = module.checkpoint_fn
        if (
            id(module) in existing
            or type(function) is not functools.partial
            or function.keywords.get("preserve_rng_state") is not False
        ):
            continue
        keywords = {**function.keywords, "preserve_rng_state": True}
        module.checkpoint_fn = functools.partial(function.func, *function.args, **keywords)
        fixed += 1
    if fixed:
        record_effect(
            NAME,
            "accelerate's fsdp2_apply_ac wrapped %d layer(s) of %s to checkpoint with preserve_rng_state=False "
            "(the recompute draws other dropout masks than the forward); the shim made them preserve the RNG state",
            fixed, type(root).__name__,
        )  # fmt: skip
    return result


def _check(original) -> str | None:
    """Upstream must still build torch's ``checkpoint_wrapper`` with ``preserve_rng_state`` given."""
    reason = leading_parameters(original, ("accelerator", "model"))
    if reason:
        return reason
    code = getattr(original, "__code__", None)
    names = getattr(code, "co_names", ())
    if WRAPPERS not in names or "checkpoint_wrapper" not in names:
        return "fsdp2_apply_ac no longer wraps layers with torch's checkpoint_wrapper"
    keywords = {name for const in getattr(code, "co_consts", ()) if isinstance(const, tuple) for name in const}
    if "preserve_rng_state" not in keywords:
        return "fsdp2_apply_ac no longer passes preserve_rng_state to checkpoint_wrapper"
    return None


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """accelerate's ``fsdp2_apply_ac`` on a stack of one block, through a stand-in accelerator whose
    FSDP2 plugin wraps that block class (one process, no process group), with activation offload off
    and on (accelerate 1.15 puts an offload wrapper around the checkpoint): the bug is there when a
    checkpoint wrapper it builds is told not to preserve the RNG state (a fix on one of the two paths
    leaves the patch the other)."""
    apply = getattr(sys.modules["accelerate.utils.fsdp_utils"], "fsdp2_apply_ac", None)
    if apply is None:
        return Evidence(False, "accelerate has no fsdp2_apply_ac: FSDP2 layers checkpoint with torch's default")
    torch = bare.torch_module()

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = bare.linear()

    class Stack(torch.nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block()])

    policy = sys.modules[AUTO_WRAP].transformer_auto_wrap_policy
    wrapper_class = sys.modules[WRAPPERS].CheckpointWrapper
    dropped = []
    for offload in (False, True):
        plugin = bare.StandIn(
            auto_wrap_policy=policy, transformer_cls_names_to_wrap=["Block"], activation_checkpointing_offload=offload
        )
        model = apply(bare.StandIn(state=bare.StandIn(fsdp_plugin=plugin)), Stack())
        kept = [
            getattr(m.checkpoint_fn, "keywords", {}).get("preserve_rng_state")
            for m in model.modules()
            if isinstance(m, wrapper_class)
        ]
        if not kept:
            raise RuntimeError("fsdp2_apply_ac wrapped no block of the stand-in")
        if False in kept:
            dropped.append("with activation offload" if offload else "without activation offload")
    if dropped:
        return Evidence(
            True, f"fsdp2_apply_ac wraps layers to checkpoint with preserve_rng_state=False ({' and '.join(dropped)})"
        )
    return Evidence(False, "fsdp2_apply_ac wraps layers to checkpoint with the RNG state preserved, offloaded or not")


PATCH = Patch(
    name=NAME,
    summary="FSDP2 activation checkpointing (accelerate) recomputes layers with the forward's RNG state.",
    distribution="accelerate",
    requires=">=1.8",
    targets=(Target("accelerate.utils.fsdp_utils:fsdp2_apply_ac", _fsdp2_apply_ac, check=_check),),
    references=(
        "docs/bugs.md#fsdp2-checkpoint-rng-state",
        "huggingface/accelerate#4172",
        "allenai/OLMo-core#828",
        "pytorch/torchtitan#1323",
    ),
    consumers=("accelerate.*",),
    bug_probe=BugProbe(_bug_probe, needs=(WRAPPERS, AUTO_WRAP)),
)
