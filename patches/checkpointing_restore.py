"""``checkpointing-restore``: re-enabling checkpointing brings back the configuration it had.

Symptom: after a disable, an enable without arguments (trl around every generation step, PEFT
helpers, user code) installs transformers' defaults: ``use_reentrant`` flips, ``every_n_layers``,
offload and a custom ``context_fn`` vanish; under DeepSpeed ZeRO-3 with frozen parameters the flip to
non-reentrant ends in ``CheckpointError: Recomputed values ... have different metadata``.

Fix: ``_set_gradient_checkpointing(enable=False)``, which every disable reaches, captures each
module's flag and checkpoint function into the model's own ``__dict__``; after an enable that
brought no configuration of its own (kwargs empty or equal to the capture, no ``every_n_layers`` or
``offload`` written by the caller) that state is put back. The enable side wraps the implementation
every entry point reaches, never the deprecated alias whose identity ``_is_overridden`` compares.

Limits: an explicit configuration wins and drops the capture. A model whose
``_set_gradient_checkpointing`` override does not call ``super()`` is not restored.

Full story, versions measured and references: docs/bugs.md#checkpointing-restore
"""

from __future__ import annotations

import contextvars

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument
from ._checkpointing_state import (
    ModelState,
    capture,
    captured_kwargs,
    describe,
    replaced_kwargs,
    restore,
)

NAME = "checkpointing-restore"

# Whether the caller of the public enable passed every_n_layers or offload itself. From 5.23 the
# public method always hands both to the implementation, so "explicit" is decided where the user's
# call comes in, not by value: an explicit every_n_layers=1 is a configuration too.
_explicit_layout: contextvars.ContextVar[bool | None] = contextvars.ContextVar("shim_explicit_layout", default=None)


def _passes_layout(args: tuple, kwargs: dict) -> bool:
    """Whether an enable call ``(kwargs, every_n_layers, offload)`` gives every_n_layers or offload."""
    return len(args) > 1 or "every_n_layers" in kwargs or "offload" in kwargs


def _set_gradient_checkpointing(wrapped, instance, args, kwargs):
    if instance is not None and not argument(args, kwargs, 0, "enable", True):
        captured = capture(instance)
        if captured is not None:
            ModelState.of(instance).captured = captured
    return wrapped(*args, **kwargs)


def _public_enable(wrapped, instance, args, kwargs):
    """``activation_checkpointing_enable`` (5.23+): note what the caller passed for the implementation."""
    token = _explicit_layout.set(_passes_layout(args, kwargs))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _explicit_layout.reset(token)


def _carries_no_configuration(checkpoint_kwargs, explicit_layout: bool, captured) -> bool:
    if explicit_layout:
        return False
    return not checkpoint_kwargs or dict(checkpoint_kwargs) == captured_kwargs(captured)


def _restoring_enable(kwargs_name: str):
    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if instance is None:
            return result
        state = ModelState.of(instance)
        captured, state.captured = state.captured, None
        explicit = _explicit_layout.get()
        if explicit is None:  # called directly, not through the public method
            explicit = _passes_layout(args, kwargs)
        if captured is not None and _carries_no_configuration(
            argument(args, kwargs, 0, kwargs_name, None), explicit, captured
        ):
            changed, replaced = restore(captured)
            if changed:
                record_effect(
                    NAME,
                    "%s was re-enabled without a configuration: transformers reset it to %s, the shim restored "
                    "%s on %d module(s)",
                    type(instance).__name__, describe(replaced_kwargs(replaced)), describe(captured_kwargs(captured)),
                    changed,
                )  # fmt: skip
        return result

    return wrapper


def _in_effect(model) -> list[str]:
    """The configuration ``model`` holds from its last disable, to put back at an enable without one."""
    state = model.__dict__.get(ModelState.KEY)
    captured = state.captured if state is not None else None
    if not captured:
        return []
    return [
        f"holds the configuration of the last disable ({describe(captured_kwargs(captured))}, {len(captured[0])} "
        "module(s)): an enable without one puts it back"
    ]


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """A bare model of 4 layers, checkpointing configured (reentrant, no RNG state kept, every second
    layer where the enable takes every_n_layers), disabled, then enabled with no configuration: the
    bug is there when the layers' checkpointing comes back otherwise."""
    import inspect

    from ._checkpointing_calls import ENABLE, disable, enable, method

    model = bare.model(layers=4)
    _name, configure = method(model, ENABLE)
    configured = {"use_reentrant": True, "preserve_rng_state": False}
    if "every_n_layers" in inspect.signature(configure).parameters:
        configure(configured, every_n_layers=2)
    else:
        configure(configured)
    before = bare.checkpointing(model)
    disable(model)
    enable(model, None)
    after = bare.checkpointing(model)
    if after != before:
        flags = "".join("T" if flag else "F" for flag, _, _ in after)
        return Evidence(
            True,
            f"an enable with no configuration after a disable gives the layers {after[-1][2]} and flags {flags} "
            f"where they had {configured} and {''.join('T' if flag else 'F' for flag, _, _ in before)}",
        )
    return Evidence(False, "an enable with no configuration after a disable brings back the layers' configuration")


PATCH = Patch(
    name=NAME,
    summary="Re-enabling gradient checkpointing without arguments restores the configuration it had.",
    distribution="transformers",
    requires=">=4.57",
    targets=(
        Target("transformers.modeling_utils:PreTrainedModel._set_gradient_checkpointing", _set_gradient_checkpointing),
        Target(
            "transformers.modeling_utils:PreTrainedModel.gradient_checkpointing_enable",
            _restoring_enable("gradient_checkpointing_kwargs"),
            requires="transformers<5.23",
        ),
        Target(
            "transformers.modeling_utils:PreTrainedModel._activation_checkpointing_enable",
            _restoring_enable("activation_checkpointing_kwargs"),
            requires="transformers>=5.23",
        ),
        Target(
            "transformers.modeling_utils:PreTrainedModel.activation_checkpointing_enable",
            _public_enable,
            requires="transformers>=5.23",
        ),
    ),
    references=("docs/bugs.md#checkpointing-restore", "huggingface/trl#6827", "huggingface/transformers#47254"),
    bug_probe=BugProbe(_bug_probe),
    in_effect=_in_effect,
)
