"""``checkpoint-kwargs-clean``: only checkpoint options reach ``torch.utils.checkpoint``.

Symptom: ``every_n_layers`` / ``offload`` written inside ``gradient_checkpointing_kwargs`` (the
documented way through the Trainer) stay in the training arguments, and trl passes that dict back on
every re-enable: reentrant steps raise ``ValueError: Unexpected keyword arguments: every_n_layers``,
non-reentrant ones silently lose the every-n pattern. trl's ``selective`` key can leak the same way.

Fix: the enable implementation is wrapped. Those three keys are taken out of the kwargs dict;
``every_n_layers`` and ``offload`` are passed as the parameters they are (an explicit parameter wins
over the dict; a value they do not take, ``"offload": "no"``, is dropped with a warning).
``selective`` is dropped; set, it is also warned about: trl's wrapper takes it out, so reaching here
means that wrapper did not run and trl's selective checkpointing is off. Nothing else in the dict
changes.

Limits: where the installed transformers has no such parameter the key is dropped with a warning.
Any other key ``torch.utils.checkpoint`` does not accept still reaches it.

Full story, versions measured and references: docs/bugs.md#checkpoint-kwargs-clean
"""

from __future__ import annotations

import inspect
import logging
import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument

log = logging.getLogger("shim")
NAME = "checkpoint-kwargs-clean"
_PARAMETERS = ("every_n_layers", "offload")
_NOT_FOR_CHECKPOINT = frozenset(_PARAMETERS + ("selective",))
_DEFAULTS = {"every_n_layers": 1, "offload": False}
# What each parameter takes: a value of another type ("no", "2", 2.0) is dropped with a warning,
# never turned into a parameter whose meaning it would change (offload="no" is true).
_VALID = {
    "every_n_layers": lambda value: type(value) is int and value >= 1,
    "offload": lambda value: type(value) is bool or (type(value) is int and value in (0, 1)),
}
_EXPECTED = {
    "every_n_layers": ("an int of 1 or more", "every_n_layers=2, say"),
    "offload": ("True or False", "offload=True or offload=False"),
}


def _cleaning_enable(kwargs_name: str):
    def wrapper(wrapped, instance, args, kwargs):
        config = argument(args, kwargs, 0, kwargs_name, None)
        if not config or _NOT_FOR_CHECKPOINT.isdisjoint(config):
            return wrapped(*args, **kwargs)
        config = dict(config)
        moved = sorted(_NOT_FOR_CHECKPOINT.intersection(config))
        lifted = {name: config.pop(name) for name in _PARAMETERS if name in config}
        if config.pop("selective", None):
            log.warning(
                "%s: 'selective': True reached the checkpointing enable of %s, so trl's selective "
                "checkpointing wrapper did not run on it: its layers checkpoint without trl's policy "
                "(docs/bugs.md#trl-selective-reaches-peft)",
                NAME, type(instance).__name__,
            )  # fmt: skip
        record_effect(
            NAME,
            "took %s out of the checkpointing kwargs of %s, which transformers would pass to "
            "torch.utils.checkpoint; every_n_layers/offload became the parameters they are",
            ", ".join(moved), type(instance).__name__,
        )  # fmt: skip
        # Everything by keyword: the enable methods take (kwargs, every_n_layers, offload) and nothing more.
        call = dict(kwargs)
        call.update(zip((kwargs_name, *_PARAMETERS), args))  # given positionally: explicit, it wins
        call[kwargs_name] = config or None
        supported = _supported_parameters(wrapped)
        for name, value in lifted.items():
            if not _VALID[name](value):
                log.warning(
                    "%s: the checkpointing kwargs of %s hold %s=%r, which is not %s; dropped it rather than "
                    "guess what it means (pass %s)",
                    NAME, type(instance).__name__, name, value, *_EXPECTED[name],
                )  # fmt: skip
            elif name in supported:
                if call.get(name, _DEFAULTS[name]) == _DEFAULTS[name]:
                    call[name] = value
            else:
                log.warning(
                    "checkpoint-kwargs-clean: transformers %s has no %s parameter; dropped %s=%r from the "
                    "checkpointing kwargs instead of passing it to torch.utils.checkpoint",
                    getattr(sys.modules.get("transformers"), "__version__", "?"),
                    name,
                    name,
                    value,
                )
        return wrapped(**call)

    return wrapper


def _supported_parameters(function) -> frozenset:
    try:
        return frozenset(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return frozenset()


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """A bare model of two layers enabled with ``every_n_layers`` (2 where the enable takes it),
    ``offload`` (where it takes it) and ``selective`` inside the checkpointing kwargs: the bug is there
    when one of them reaches the layers' checkpoint partial, or ``every_n_layers`` is not what checkpoints
    (a fix that drops the keys without passing them on, or drops transformers' own keys and not trl's
    ``selective``, leaves the patch the rest)."""
    from ._checkpointing_calls import enable

    model = bare.model()
    cls = type(model)
    takes = _supported_parameters(getattr(cls, "_activation_checkpointing_enable", cls.gradient_checkpointing_enable))
    every = 2 if "every_n_layers" in takes else 1
    configured = {"use_reentrant": True, "every_n_layers": every, "selective": False}
    if "offload" in takes:
        configured["offload"] = False
    enable(model, configured)
    layers = bare.checkpointing(model.layers)
    leaked = sorted({key for _, _, keywords in layers for key in keywords or () if key in _NOT_FOR_CHECKPOINT})
    flags = [flag for flag, _, _ in layers]
    said = [f"{' and '.join(leaked)} in the checkpointing kwargs reach torch.utils.checkpoint"] if leaked else []
    if flags != [index % every == 0 for index in range(len(flags))]:
        said.append(f"every_n_layers={every} in the checkpointing kwargs checkpoints the layers {flags}")
    if said:
        return Evidence(True, "; ".join(said))
    return Evidence(
        False,
        f"{', '.join(sorted(configured.keys() - {'use_reentrant'}))} in the checkpointing kwargs stay out of the "
        f"checkpoint partial, every_n_layers={every} acting as the parameter",
    )


PATCH = Patch(
    name=NAME,
    summary="every_n_layers/offload inside the checkpointing kwargs act as parameters; they and trl's 'selective' never reach torch.utils.checkpoint.",
    distribution="transformers",
    requires=">=4.57",
    targets=(
        Target(
            "transformers.modeling_utils:PreTrainedModel.gradient_checkpointing_enable",
            _cleaning_enable("gradient_checkpointing_kwargs"),
            requires="transformers<5.23",
        ),
        Target(
            "transformers.modeling_utils:PreTrainedModel._activation_checkpointing_enable",
            _cleaning_enable("activation_checkpointing_kwargs"),
            requires="transformers>=5.23",
        ),
    ),
    references=("docs/bugs.md#checkpoint-kwargs-clean", "huggingface/transformers#48200"),
    bug_probe=BugProbe(_bug_probe),
    after=("checkpointing-restore",),
)
