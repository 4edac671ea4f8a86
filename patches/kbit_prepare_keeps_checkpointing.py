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

import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument, leading_parameters
from ._checkpointing_calls import enable
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
    if captured is None:  # a fresh model: peft's own configuration
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


def _check(original) -> str | None:
    """The caller's kwargs must still be the third parameter, after the model and the switch."""
    return leading_parameters(original, PARAMETERS)


# -- bug probes (python -m shim doctor, and the engine where the release cannot vouch) -------------

PEFT_COPY, TRL_COPY = "peft.utils.other", "trl.experimental.utils"


def _changes_checkpointing(module_name: str) -> Evidence:
    """``prepare_model_for_kbit_training`` of ``module_name`` on a bare model flagged as loaded in 4 bits
    whose checkpointing is configured (its kwargs, and every second layer where the enable takes
    ``every_n_layers``): the bug is there when the layers' checkpointing changes (a fix that keeps the
    kwargs and loses the pattern leaves the patch the pattern)."""
    import inspect

    from ._checkpointing_calls import ENABLE, method

    prepare = getattr(sys.modules.get(module_name), "prepare_model_for_kbit_training", None)
    if prepare is None:  # trl before 0.28 has no copy of it
        return Evidence(False, f"there is no {module_name}.prepare_model_for_kbit_training")
    model = bare.model()
    _name, configure = method(model, ENABLE)
    configured = {"use_reentrant": False, "preserve_rng_state": False}
    if "every_n_layers" in inspect.signature(configure).parameters:
        configure(configured, every_n_layers=2)
    else:
        enable(model, configured)
    model.is_loaded_in_4bit = True
    before = bare.checkpointing(model)
    prepare(model)
    after = bare.checkpointing(model)
    if after != before:
        flags = "".join("T" if flag else "F" for flag, _, _ in after)
        return Evidence(
            True,
            f"{module_name}.prepare_model_for_kbit_training re-enables checkpointing with {after[-1][2]} and "
            f"flags {flags} where the model had {configured} and {''.join('T' if flag else 'F' for flag, _, _ in before)}",
        )
    return Evidence(False, f"{module_name}.prepare_model_for_kbit_training keeps the checkpointing a model has")


PROBES = (
    BugProbe(lambda: _changes_checkpointing(PEFT_COPY), library="peft"),
    BugProbe(lambda: _changes_checkpointing(TRL_COPY), library="trl"),
)


PATCH = Patch(
    name=NAME,
    summary="peft's prepare_model_for_kbit_training keeps the checkpointing configuration the model already has.",
    distribution="peft",
    requires=">=0.6",
    targets=(
        Target(f"{PEFT_COPY}:prepare_model_for_kbit_training", _prepare_model_for_kbit_training, check=_check),
        # trl's copy, which prepare_peft_model calls by its module-level name
        Target(
            f"{TRL_COPY}:prepare_model_for_kbit_training",
            _prepare_model_for_kbit_training,
            requires="trl>=0.28",
            check=_check,
        ),
    ),
    references=("docs/bugs.md#kbit-prepare-keeps-checkpointing", "huggingface/peft#1036"),
    consumers=("peft", "peft.*", "trl.*"),
    bug_probe=PROBES,
)
