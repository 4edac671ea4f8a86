"""``checkpointing-call-signature``: re-enable calls fit the signature of the method they call.

Symptom: ``TypeError`` when checkpointing is switched back on. trl's
``disable_gradient_checkpointing`` passes the kwargs dict positionally, which keyword-only and
``**kwargs``-only enable methods reject (trl's own PPO wrapper among them); transformers' Trainer and
``activation_checkpointing_enable`` send ``every_n_layers=`` / ``offload=`` to overrides written
before those parameters existed.

Fix: trl's context manager is replaced by one of the same behaviour, calling the methods trl calls,
that passes the re-enable's configuration the way the method's signature allows (by keyword,
positionally, or with no argument); trainer modules that
imported it early are rebound. Calls to a narrow override leave ``every_n_layers`` / ``offload`` out
while they hold their defaults; a non-default value it cannot take raises a ``TypeError`` that
names the override and says to accept ``**kwargs``, never a silent drop.

Limits: a ``()`` signature cannot take a non-empty configuration (re-enabled without it, with a
warning). An override that calls ``activation_checkpointing_enable`` itself still recurses.

Full story, versions measured and references: docs/bugs.md#checkpointing-call-signature
"""

from __future__ import annotations

import contextlib
import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument
from ._checkpointing_calls import TRL, accepts, enable, takes_positional

NAME = "checkpointing-call-signature"

_DEFAULTS = {"every_n_layers": 1, "offload": False}


@contextlib.contextmanager
def _disable_gradient_checkpointing(model, gradient_checkpointing_kwargs=None):
    """trl's context manager, calling what trl calls (the ``gradient_checkpointing_*`` names, with
    transformers' FutureWarnings from 5.23, as without the shim); only the re-enable's arguments
    fit the method's signature."""
    was_enabled = model.is_gradient_checkpointing
    if was_enabled:
        model.gradient_checkpointing_disable()
    try:
        yield
    finally:
        if was_enabled:
            enable(model, gradient_checkpointing_kwargs, TRL)
            _note_trl_call_adapted(model, gradient_checkpointing_kwargs)


def _note_trl_call_adapted(model, gradient_checkpointing_kwargs) -> None:
    """Record an effect when trl's own re-enable, a positional call, would have raised."""
    trl_calls = getattr(model, "gradient_checkpointing_enable", None)
    if trl_calls is None or takes_positional(trl_calls):
        return
    function = getattr(trl_calls, "__func__", trl_calls)
    record_effect(
        NAME,
        "re-enabled checkpointing on %s through its signature %s; trl's disable_gradient_checkpointing "
        "would have passed %r positionally and raised TypeError",
        type(model).__name__, _signature(function), gradient_checkpointing_kwargs,
    )  # fmt: skip


def _signature(function) -> str:
    import inspect

    try:
        return f"{function.__qualname__}{inspect.signature(function)}"
    except (TypeError, ValueError, AttributeError):
        return repr(function)


def _trl_disable_gradient_checkpointing(wrapped, instance, args, kwargs):
    return _disable_gradient_checkpointing(
        argument(args, kwargs, 0, "model"), argument(args, kwargs, 1, "gradient_checkpointing_kwargs", None)
    )


def _narrowed_call(model, override, values: dict):
    """Call ``override`` with the keywords of ``values`` it accepts; defaults it cannot take are left out."""
    call, left_out = {}, []
    for name, value in values.items():
        if _takes(override, name):
            call[name] = value
        elif name == "gradient_checkpointing_kwargs" and value is None:
            continue
        elif name in _DEFAULTS and value == _DEFAULTS[name]:
            left_out.append(f"{name}={value!r}")
        else:
            function = getattr(override, "__func__", override)
            raise TypeError(
                f"{type(model).__name__}.gradient_checkpointing_enable ({function.__qualname__}) does not accept "
                f"{name}={value!r}, which transformers passes to it. Accept **kwargs in the override and pass them "
                f"on to super().gradient_checkpointing_enable(...) (raised by the shim patch "
                f"'checkpointing-call-signature' instead of dropping the setting silently)."
            )
    if left_out:
        record_effect(
            NAME,
            "left %s out of the call to %s, which cannot take them; transformers passes them and the "
            "override would have raised TypeError",
            ", ".join(left_out), _signature(getattr(override, "__func__", override)),
        )  # fmt: skip
    return override(**call)


def _takes(override, name: str) -> bool:
    return accepts(override, name) == "keyword"


def _narrow(override) -> bool:
    """Whether the override cannot take ``every_n_layers``/``offload`` as keywords."""
    return not all(_takes(override, name) for name in _DEFAULTS)


def _overrides_enable(model) -> bool:
    """Whether ``gradient_checkpointing_enable`` comes from somewhere other than ``PreTrainedModel``."""
    if "gradient_checkpointing_enable" in vars(model):
        return True
    base = sys.modules["transformers.modeling_utils"].PreTrainedModel
    owner = next((c for c in type(model).__mro__ if "gradient_checkpointing_enable" in vars(c)), base)
    return owner is not base


def _activation_checkpointing_enable(wrapped, instance, args, kwargs):
    if instance is None or not instance._is_overridden("gradient_checkpointing_enable"):
        return wrapped(*args, **kwargs)
    override = instance.gradient_checkpointing_enable
    if not _narrow(override):
        return wrapped(*args, **kwargs)
    values = {
        "gradient_checkpointing_kwargs": argument(args, kwargs, 0, "activation_checkpointing_kwargs", None),
        "every_n_layers": argument(args, kwargs, 1, "every_n_layers", 1),
        "offload": argument(args, kwargs, 2, "offload", False),
    }
    return _narrowed_call(instance, override, values)


def _trainer_train(wrapped, instance, args, kwargs):
    """transformers 5.16 – 5.22: ``train()`` calls the override with every_n_layers/offload itself."""
    model = getattr(instance, "model", None)
    training_args = getattr(instance, "args", None)
    if model is None or not getattr(training_args, "gradient_checkpointing", False):
        return wrapped(*args, **kwargs)
    override = model.gradient_checkpointing_enable
    if not _overrides_enable(model) or not _narrow(override):
        return wrapped(*args, **kwargs)

    def narrowing_adapter(gradient_checkpointing_kwargs=None, **more):
        return _narrowed_call(model, override, {"gradient_checkpointing_kwargs": gradient_checkpointing_kwargs, **more})

    had_instance_attribute = "gradient_checkpointing_enable" in vars(model)
    model.gradient_checkpointing_enable = narrowing_adapter
    try:
        return wrapped(*args, **kwargs)
    finally:
        if had_instance_attribute:
            model.gradient_checkpointing_enable = override
        else:
            del model.gradient_checkpointing_enable


# -- bug probes (python -m shim doctor, and the engine where the release cannot vouch) -------------


class _Reached(Exception):
    """Raised by a probe's enable override once a call reached it: enough was seen."""


def _trl_bug_probe() -> Evidence:
    """trl's ``disable_gradient_checkpointing`` around a model whose enable is keyword-only (with a
    configuration) and around one whose enable takes no argument (with none): the bug is there when
    a re-enable raises ``TypeError`` (a fix that passes the configuration by keyword still breaks the
    second)."""

    class KeywordOnlyEnable:
        is_gradient_checkpointing = True

        def gradient_checkpointing_disable(self):
            pass

        def gradient_checkpointing_enable(self, *, gradient_checkpointing_kwargs=None):
            pass

    class NoArgumentEnable(KeywordOnlyEnable):
        def gradient_checkpointing_enable(self):
            pass

    context = getattr(sys.modules["trl.models.utils"], "disable_gradient_checkpointing", None)
    if context is None:
        return Evidence(False, "trl has no disable_gradient_checkpointing to re-enable through")
    raised = []
    for model, configuration in ((KeywordOnlyEnable(), {"use_reentrant": False}), (NoArgumentEnable(), None)):
        try:
            with context(model, configuration):
                pass
        except TypeError as exc:
            raised.append(f"TypeError: {exc}")
    if raised:
        return Evidence(True, f"disable_gradient_checkpointing re-enables with: {'; '.join(raised)}")
    return Evidence(
        False, "disable_gradient_checkpointing re-enables a keyword-only enable and one that takes no argument"
    )


def _transformers_bug_probe() -> Evidence:
    """A bare model whose ``gradient_checkpointing_enable`` override takes only the kwargs, enabled the
    way transformers enables it (``activation_checkpointing_enable`` from 5.23; ``Trainer.train`` from
    5.16): the bug is there when transformers' call raises ``TypeError``."""
    import inspect

    base = sys.modules[bare.MODELING_UTILS].PreTrainedModel
    if hasattr(base, "activation_checkpointing_enable"):
        return _narrow_override_case(
            lambda model: model.activation_checkpointing_enable(), "activation_checkpointing_enable"
        )
    if "every_n_layers" in inspect.signature(base.gradient_checkpointing_enable).parameters:
        return _narrow_override_case(_trainer_enables, "Trainer.train")
    return Evidence(
        False, "transformers passes an enable override no every_n_layers or offload: its own enable takes neither"
    )


def _narrow_override_case(enabling, caller: str) -> Evidence:
    class NarrowOverride(bare.model_class()):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            if caller == "Trainer.train":
                raise _Reached
            super().gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    try:
        enabling(bare.model(cls=NarrowOverride))
    except TypeError as exc:
        return Evidence(True, f"{caller} calls an override that takes only the kwargs with: TypeError: {exc}")
    except _Reached:
        pass
    return Evidence(False, f"{caller} calls an override that takes only the kwargs as it can")


def _trainer_enables(model) -> None:
    """What ``Trainer.train`` (5.16 - 5.22) does up to enabling checkpointing, on a stand-in Trainer."""
    arguments = bare.StandIn(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = bare.StandIn(model=model, args=arguments, _memory_tracker=bare.StandIn(start=lambda: None))
    sys.modules["transformers.trainer"].Trainer.train(trainer)
    raise RuntimeError("Trainer.train returned without enabling checkpointing on the stand-in")


PATCH = Patch(
    name=NAME,
    summary="Re-enable calls from trl and transformers fit keyword-only, **kwargs-only and older override signatures.",
    distribution="transformers",
    requires=">=4.57",
    targets=(
        Target(
            "trl.models.utils:disable_gradient_checkpointing", _trl_disable_gradient_checkpointing, requires="trl>=0.26"
        ),
        Target(
            "transformers.modeling_utils:PreTrainedModel.activation_checkpointing_enable",
            _activation_checkpointing_enable,
            requires="transformers>=5.23",
        ),
        Target("transformers.trainer:Trainer.train", _trainer_train, requires="transformers>=5.16,<5.23"),
    ),
    references=("docs/bugs.md#checkpointing-call-signature", "unslothai/unsloth#6826", "huggingface/trl#5245"),
    consumers=("trl.*",),
    bug_probe=(
        BugProbe(_trl_bug_probe, library="trl"),
        BugProbe(_transformers_bug_probe, library="transformers"),
    ),
    after=("checkpointing-restore",),
)
