"""``input-grad-hook-dedupe``: one input-require-grads hook, however many enable cycles.

Symptom (silent): every checkpointing disable/enable cycle adds one more forward hook on the input
embeddings (``1, 1, 2, 2, 3, 3, ...``): ``enable_input_require_grads()`` overwrites the handles it
kept without removing their hooks, and disabling removes them only for PEFT models. trl cycles once
per generation step, so the list grows for the whole run and every forward runs every hook.

Fix: ``PreTrainedModel.enable_input_require_grads`` is wrapped; before upstream registers new hooks,
the ones the model still holds (``_require_grads_hooks`` and the single ``_require_grads_hook``) are
removed.

Limits: hooks other code put on the embeddings are untouched; after a disable the last hook stays
until the next enable, as upstream. Which embeddings get hooked is ``frozen-tower-input-grads``'
business (it wraps the same method).

Full story, versions measured and references: docs/bugs.md#input-grad-hook-dedupe
"""

from __future__ import annotations

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

NAME = "input-grad-hook-dedupe"


def _enable_input_require_grads(wrapped, instance, args, kwargs):
    if instance is not None:
        state = instance.__dict__  # where upstream keeps them (a missing attribute costs torch's __getattr__)
        held = state.get("_require_grads_hooks") or ()
        single = state.get("_require_grads_hook")
        if single is not None and single not in held:  # the single one is the list's first, too
            held = (*held, single)
        if held:
            live = 0
            for handle in held:  # one pass: it runs at every enable (trl's generation cycle)
                live += _is_live(handle)
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


def _in_effect(model) -> list[str]:
    """How many input-require-grads hooks ``model`` holds, where it holds any."""
    handles = [h for h in model.__dict__.get("_require_grads_hooks") or () if _is_live(h)]
    if not handles:
        return []
    return [f"{len(handles)} input-require-grads hook(s) held, one per embeddings however many enables"]


def input_hook_count(model) -> int:
    return len(model.get_input_embeddings()._forward_hooks)


def _bug_probe() -> Evidence:
    """A bare model with input embeddings, holding a trainable bare sub-model with embeddings of its own
    (a VLM's tower), checkpointing enabled, disabled and enabled again: the bug is there when either
    embeddings then hold more than one hook (a fix that removes the model's first hook alone leaves
    the patch the sub-model's)."""
    from ._checkpointing_calls import disable, enable

    model = bare.model()
    model.tower = bare.model_without_layers(type(model))
    enable(model, {"use_reentrant": False})
    disable(model)
    enable(model, {"use_reentrant": False})
    hooks = [input_hook_count(model), input_hook_count(model.tower)]
    if max(hooks) > 1:
        return Evidence(
            True,
            f"a disable/enable cycle leaves {hooks[0]} and {hooks[1]} input-require-grads hooks on the model's "
            "and its sub-model's embeddings",
        )
    return Evidence(
        False,
        f"a disable/enable cycle leaves {hooks[0]} and {hooks[1]} input-require-grads hook(s) on "
        "the model's and its sub-model's embeddings",
    )


PATCH = Patch(
    name=NAME,
    summary="At most one input-require-grads hook on the embeddings across checkpointing cycles.",
    distribution="transformers",
    requires=">=5.0",
    targets=(
        Target("transformers.modeling_utils:PreTrainedModel.enable_input_require_grads", _enable_input_require_grads),
    ),
    references=("docs/bugs.md#input-grad-hook-dedupe",),
    bug_probe=BugProbe(_bug_probe),
    in_effect=_in_effect,
)
