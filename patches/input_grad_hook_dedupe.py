"""``input-grad-hook-dedupe``: one input-require-grads hook, however many enable cycles.

Upstream bug (transformers 5.0 – 5.24 at least; docs/bugs.md#input-grad-hook-dedupe): enabling checkpointing calls
``enable_input_require_grads()`` (when ``main_input_name == "input_ids"``), which registers a new
forward hook on the input embeddings and overwrites ``_require_grads_hooks`` without removing the
hooks it held; disabling removes them only for PEFT models. trl cycles checkpointing around every
generation step, so hooks pile up: ``[1, 1, 2, 2, 3, 3]`` over three cycles.

The fix removes the hooks the model already holds (``_require_grads_hooks`` and the single
``_require_grads_hook`` kept for backward compatibility) before ``enable_input_require_grads``
registers new ones.
"""

from __future__ import annotations

from shim import Patch, Target, record_effect

NAME = "input-grad-hook-dedupe"


def _enable_input_require_grads(wrapped, instance, args, kwargs):
    if instance is not None:
        held = list(getattr(instance, "_require_grads_hooks", None) or ())
        single = getattr(instance, "_require_grads_hook", None)
        if single is not None:
            held.append(single)
        live = sum(1 for handle in dict.fromkeys(held) if _is_live(handle))
        for handle in held:
            handle.remove()  # RemovableHandle.remove() is idempotent
        if live:
            record_effect(
                NAME,
                "removed %d input-require-grads hook(s) that %s still held before transformers added "
                "new ones (upstream leaves them registered, one more per checkpointing cycle)",
                live, type(instance).__name__,
            )  # fmt: skip
    return wrapped(*args, **kwargs)


def _is_live(handle) -> bool:
    """Whether a torch ``RemovableHandle`` still has its hook registered."""
    hooks = getattr(handle, "hooks_dict_ref", lambda: None)()
    return hooks is not None and getattr(handle, "id", None) in hooks


def input_hook_count(model) -> int:
    return len(model.get_input_embeddings()._forward_hooks)


def _self_check() -> bool:
    """True when disable/enable cycles leave more than one hook on the input embeddings."""
    import transformers

    from shim.tinymodels import tiny_llama_config

    from ._checkpointing import disable, enable

    model = transformers.LlamaForCausalLM(tiny_llama_config())
    enable(model, {"use_reentrant": False})
    for _ in range(3):
        disable(model)
        enable(model, {"use_reentrant": False})
    return input_hook_count(model) > 1


PATCH = Patch(
    name=NAME,
    summary="At most one input-require-grads hook on the embeddings across checkpointing cycles.",
    distribution="transformers",
    requires=">=5.0",
    targets=(
        Target("transformers.modeling_utils:PreTrainedModel.enable_input_require_grads", _enable_input_require_grads),
    ),
    references=("docs/bugs.md#input-grad-hook-dedupe",),
    self_check=_self_check,
)
