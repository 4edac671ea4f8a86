"""``kbit-prepare-keeps-checkpointing``: peft's k-bit preparation keeps the checkpointing set before.

Symptom (silent): ``prepare_model_for_kbit_training`` called without ``gradient_checkpointing_kwargs``
re-enables checkpointing with ``{}`` on a model whose checkpointing is already configured:
``use_reentrant``, ``preserve_rng_state``, ``every_n_layers``, offload and a ``context_fn`` are gone,
and torch's default (reentrant, with torch's warning on every forward) runs instead.

Fix: when the caller gave no kwargs and the model already checkpoints, each module's flag and
checkpoint function are captured before the call (the capture ``checkpointing-restore`` takes at a
disable) and put back where peft changed them. Names bound by ``from peft import ...`` before the
shim applied are rebound (``consumers``). trl's own copy of the function (``trl.experimental``,
which its PEFT set-up calls for QLoRA) is wrapped the same way.

Limits: kwargs the caller passes, ``{}`` included, are used as upstream uses them. A model that does
not checkpoint yet gets peft's own configuration, as without the shim. peft's decision to hook the
input embeddings is taken on its own ``{}``, as upstream takes it.

Full story, versions measured and references: docs/bugs.md#kbit-prepare-keeps-checkpointing
"""

from __future__ import annotations

from shim import Patch, Target, record_effect

from ._arguments import argument, leading_parameters
from ._checkpointing_state import capture, captured_kwargs, describe, replaced_kwargs, restore

NAME = "kbit-prepare-keeps-checkpointing"
PARAMETERS = ("model", "use_gradient_checkpointing", "gradient_checkpointing_kwargs")


def _prepare_model_for_kbit_training(wrapped, instance, args, kwargs):
    model = argument(args, kwargs, 0, "model", None)
    if (
        argument(args, kwargs, 2, "gradient_checkpointing_kwargs", None) is not None
        or not argument(args, kwargs, 1, "use_gradient_checkpointing", True)
        or "_modules" not in getattr(model, "__dict__", ())  # not a torch module: nothing to capture
    ):
        return wrapped(*args, **kwargs)
    captured = capture(model)
    if not any(flag for _module, flag, _function in captured):  # a fresh model: peft's own configuration
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    changed, replaced = restore(captured)
    if changed:
        record_effect(
            NAME,
            "prepare_model_for_kbit_training re-enabled checkpointing of %s with %s; the shim kept %s on %d module(s)",
            type(model).__name__, describe(replaced_kwargs(replaced)), describe(captured_kwargs(captured)), changed,
        )  # fmt: skip
    return result


def _probe(original) -> str | None:
    """The caller's kwargs must still be the third parameter, after the model and the switch."""
    return leading_parameters(original, PARAMETERS)


def _self_check() -> bool:
    """True when peft's preparation changes the checkpoint kwargs a k-bit model was configured with."""
    import warnings

    import peft

    from shim.selfcheck.models import kbit_flagged_llama
    from shim.selfcheck.steps import enable_checkpointing

    model = kbit_flagged_llama()
    configured = {"use_reentrant": False, "preserve_rng_state": False}
    enable_checkpointing(model, configured)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft calls the deprecated enable (transformers 5.23+)
        peft.prepare_model_for_kbit_training(model)
    return captured_kwargs(capture(model)) != configured


PATCH = Patch(
    name=NAME,
    summary="peft's prepare_model_for_kbit_training keeps the checkpointing configuration the model already has.",
    distribution="peft",
    requires=">=0.6",
    targets=(
        Target("peft.utils.other:prepare_model_for_kbit_training", _prepare_model_for_kbit_training, probe=_probe),
        # trl's copy, which prepare_peft_model calls by its module-level name
        Target(
            "trl.experimental.utils:prepare_model_for_kbit_training",
            _prepare_model_for_kbit_training,
            requires="trl>=0.28",
            probe=_probe,
        ),
    ),
    references=("docs/bugs.md#kbit-prepare-keeps-checkpointing", "huggingface/peft#1036"),
    consumers=("peft", "peft.*", "trl.*"),
    self_check=_self_check,
)
