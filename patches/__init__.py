"""The built-in patch catalogue of hf-train-shim: one module per upstream bug.

Each module declares ``PATCH`` (a :class:`shim.Patch`) and imports neither torch nor the target
library at module level.
"""

#: Tells ``shim`` this is its own catalogue and not a user's module that happens to be called ``patches``.
HF_TRAIN_SHIM_CATALOGUE = True

MODULES = (
    "patches.load_keeps_requires_grad",
    "patches.checkpointing_restore",
    "patches.trl_restore_on_error",
    "patches.checkpointing_call_signature",
    "patches.checkpoint_kwargs_clean",
    "patches.input_grad_hook_dedupe",
    "patches.reentrant_keyword_grads",
)
