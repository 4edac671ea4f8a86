"""``trl-selective-reaches-peft``: trl's selective checkpointing reaches the layers of a PEFT model.

Symptom: ``SFTTrainer`` with ``gradient_checkpointing_kwargs={"selective": True}`` and a PEFT model
fails in the first step (``ValueError: Unexpected keyword arguments: selective``), or, with the
key stripped, trains with plain checkpointing: trl's policy never reaches a layer.

Fix: trl puts its enable wrapper on the object it is given, the ``PeftModel``; the Trainer's
``activation_checkpointing_enable`` is forwarded to the ``PreTrainedModel`` inside, which looks for
an override on itself only. After trl's installer, the patch runs it on that inner model too, so
transformers' own override path calls it. The inner model holds it behind a function that follows
the patch's switch (off: upstream's enable). Models trl's installer reaches directly are untouched.

Limits: only a model whose ``activation_checkpointing_enable`` is another object's is handled; an
inner model that already holds an enable of its own keeps it. The inner model copies and pickles as
a model trl wrapped itself does. Trainer modules that imported the name early are rebound.

Full story, versions measured and references: docs/bugs.md#trl-selective-reaches-peft
"""

from __future__ import annotations

import logging
import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect, switch_of
from shim.selfcheck import bare

from ._arguments import argument, leading_parameters
from ._checkpointing_calls import enable

log = logging.getLogger("shim")
NAME = "trl-selective-reaches-peft"
SELECTIVE = "trl.models.selective_activation_checkpointing"


def _inner_model(model):
    """The ``PreTrainedModel`` that ``model.activation_checkpointing_enable`` runs on, when that is not
    ``model`` itself (a ``PeftModel`` forwards the name to the model it wraps); else ``None``."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return None
    inner = getattr(getattr(model, "activation_checkpointing_enable", None), "__self__", None)
    return inner if inner is not model and isinstance(inner, PreTrainedModel) else None


def _following_switch(inner, selective):
    """What the inner model holds as ``gradient_checkpointing_enable``: trl's wrapper while the patch
    is on; off, what upstream's ``activation_checkpointing_enable`` runs when nothing is overridden."""
    switch = switch_of(NAME)

    def gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, **kwargs):
        if switch:
            return selective(gradient_checkpointing_kwargs, **kwargs)
        return inner._activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    gradient_checkpointing_enable._is_sac_wrapped = True  # trl's mark: its installer leaves it alone
    gradient_checkpointing_enable.__wrapped__ = selective
    return gradient_checkpointing_enable


def _install_on_inner(model, install) -> None:
    inner = _inner_model(model)
    if inner is None or "gradient_checkpointing_enable" in vars(inner):
        return  # reached directly, or the inner model already holds an enable (trl's, ours, the user's)
    install(inner)
    selective = vars(inner).get("gradient_checkpointing_enable")
    if not getattr(selective, "_is_sac_wrapped", False):
        return
    inner.gradient_checkpointing_enable = _following_switch(inner, selective)
    record_effect(
        NAME,
        "trl put its selective-checkpointing wrapper on %s, which the Trainer's activation_checkpointing_enable "
        "passes by; the shim put it on the inner %s too, so its layers get trl's context_fn",
        type(model).__name__, type(inner).__name__,
    )  # fmt: skip


def _enable_selective(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    try:
        _install_on_inner(argument(args, kwargs, 0, "model"), wrapped)
    except Exception:  # never break trl's trainer over this: the model still trains, as upstream's
        log.exception("%s: could not put trl's selective checkpointing on the inner model", NAME)
    return result


def _check(original) -> str | None:
    """trl's installer takes the model first; transformers' enable runs an instance's override."""
    problem = leading_parameters(original, ("model",))
    if problem:
        return problem
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling_utils, "PreTrainedModel", None)
    if base is None or not hasattr(base, "_activation_checkpointing_enable") or not hasattr(base, "_is_overridden"):
        return "transformers' PreTrainedModel has no _activation_checkpointing_enable/_is_overridden"
    return None


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """trl's selective checkpointing installed on a module that forwards unknown attributes to a bare
    model (as a ``PeftModel`` does), then enabled as the Trainer enables it: the bug is there when the
    model's layers get no trl ``context_fn``, or ``selective`` reaches them."""
    module = sys.modules.get(SELECTIVE)
    if module is None:
        return Evidence(False, "trl has no selective activation checkpointing")
    inner = bare.model()
    outer = bare.forwarding(inner)
    module.enable_selective_activation_checkpointing(outer)
    enable(outer, {"use_reentrant": False, "selective": True})
    keywords = [keywords or {} for flag, _, keywords in bare.checkpointing(inner.layers) if flag]
    if not keywords or not all("context_fn" in found and "selective" not in found for found in keywords):
        return Evidence(
            True, "trl's selective checkpointing on a model that forwards to another never reaches its layers"
        )
    return Evidence(False, "trl's selective checkpointing on a model that forwards to another reaches its layers")


PATCH = Patch(
    name=NAME,
    summary="trl's selective activation checkpointing, set up on a PEFT model, reaches the layers the Trainer checkpoints.",
    distribution="trl",
    requires=">=1.15",
    targets=(
        Target(
            f"{SELECTIVE}:enable_selective_activation_checkpointing",
            _enable_selective,
            requires="transformers>=5.23",
            check=_check,
        ),
    ),
    references=("docs/bugs.md#trl-selective-reaches-peft", "huggingface/trl#7194"),
    consumers=("trl.*",),
    bug_probe=BugProbe(_bug_probe),
)
