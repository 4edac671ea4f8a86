"""The built-in patch catalogue of hf-train-shim, installed as ``shim.patches``: one module per bug.

Each module declares ``PATCH`` (a :class:`shim.Patch`) and imports neither torch nor the target
library at module level. ``import shim`` does not import these modules: it registers its import
hooks from :data:`INDEX`, and a patch module is imported only when one of its targets is (or
when ``shim.status()`` / ``python -m shim`` needs its summary). ``tests/test_catalogue.py``
checks that the index says what each module's ``PATCH`` says.
"""

#: ``(patch name, module in this package, distribution, version gate, target modules)``, in the
#: order the patches stack when they wrap the same function.
INDEX = (
    (
        "load-keeps-requires-grad",
        "load_keeps_requires_grad",
        "transformers",
        ">=5.0",
        ("transformers.core_model_loading", "transformers.modeling_utils"),
    ),
    ("checkpointing-restore", "checkpointing_restore", "transformers", ">=4.57", ("transformers.modeling_utils",)),
    ("trl-restore-on-error", "trl_restore_on_error", "trl", ">=0.22", ("trl.models.utils",)),
    (
        "checkpointing-call-signature",
        "checkpointing_call_signature",
        "transformers",
        ">=4.57",
        ("trl.models.utils", "transformers.modeling_utils", "transformers.trainer"),
    ),
    ("checkpoint-kwargs-clean", "checkpoint_kwargs_clean", "transformers", ">=4.57", ("transformers.modeling_utils",)),
    ("input-grad-hook-dedupe", "input_grad_hook_dedupe", "transformers", ">=5.0", ("transformers.modeling_utils",)),
    ("reentrant-keyword-grads", "reentrant_keyword_grads", "transformers", ">=4.57", ("transformers.modeling_layers",)),
    (
        "ddp-find-unused-for-checkpointing",
        "ddp_find_unused_for_checkpointing",
        "transformers",
        ">=4.57",
        ("transformers.trainer",),
    ),
    (
        "zero3-frozen-recompute",
        "zero3_frozen_recompute",
        "deepspeed",
        "<0.19.3",
        ("deepspeed.runtime.zero.partitioned_param_coordinator", "deepspeed.runtime.zero.stage3"),
    ),
    (
        "zero3-delegating-wrapper-hooks",
        "zero3_delegating_wrapper_hooks",
        "deepspeed",
        "<0.19.3",
        ("deepspeed.runtime.zero.parameter_offload",),
    ),
    (
        "reentrant-frozen-input-grads",
        "reentrant_frozen_input_grads",
        "transformers",
        ">=4.57",
        ("transformers.modeling_layers",),
    ),
    ("frozen-tower-input-grads", "frozen_tower_input_grads", "transformers", ">=5.0", ("transformers.modeling_utils",)),
    (
        "peft-adapter-trainability",
        "peft_adapter_trainability",
        "peft",
        "<0.21",
        ("peft.tuners.tuners_utils", "peft.peft_model"),
    ),
)
