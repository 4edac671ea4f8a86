"""``peft-adapter-trainability``: adding or loading an adapter leaves the others' ``requires_grad`` alone.

Symptom (silent): adding or loading a second adapter applies the *new* adapter's inference mode to
the active ones. A frozen second adapter (``load_adapter(..., is_trainable=False)``, peft's own
PiSSA/OLoRA save conversion) freezes the trainable one, so the loss stays flat; a trainable
``load_adapter`` next to a frozen ``default`` swaps the two.

Fix: a backport of huggingface/peft#3495. ``BaseTuner.inject_adapter`` is wrapped: when the model
already holds a tuner layer, every existing parameter's flag is noted before the call (the new
adapter's own left out) and put back after it where upstream changed it. ``PeftModel.load_adapter``
is wrapped: an adapter it added with ``is_trainable=True`` is made trainable
(``set_requires_grad``). Calls where nothing differs pass through.

Limits: the snapshot is taken on entry (upstream's fix takes it later); a call that raises is left
as upstream leaves it; prompt-learning and ``PeftMixedModel`` adapters get the snapshot part only.

Full story, versions measured and references: docs/bugs.md#peft-adapter-trainability
"""

from __future__ import annotations

import sys

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument, leading_parameters

NAME = "peft-adapter-trainability"


def _peft_version() -> str:
    return getattr(sys.modules.get("peft"), "__version__", "?")


# -- BaseTuner.inject_adapter ------------------------------------------------------------------


def _snapshot(model, adapter_name: str) -> list:
    """``[(name, parameter, requires_grad)]`` of the parameters already in ``model``, as peft 0.21.0 takes it.

    Empty when ``model`` holds no tuner layer yet (the first injection freezes the base model on
    purpose). The new adapter's own parameters (``.<adapter>.`` in the name, or ``.<adapter>`` at its
    end: some tuners create them before calling ``inject_adapter``) are left out.
    """
    tuner_layer = sys.modules["peft.tuners.tuners_utils"].BaseTunerLayer
    named_modules = list(model.named_modules())
    if not any(isinstance(module, tuner_layer) for _, module in named_modules):
        return []
    inner, suffix = f".{adapter_name}.", f".{adapter_name}"
    seen: set[int] = set()
    taken = []
    for key, module in named_modules:
        for parameter_name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            full_name = f"{key}.{parameter_name}" if key else parameter_name
            if inner not in full_name and not full_name.endswith(suffix):
                taken.append((full_name, parameter, parameter.requires_grad))
    return taken


def _owners(names: list[str], adapters) -> str:
    """``adapter 'default'``, ``adapters 'a', 'b'``, ``the base model`` or both: whose parameters these are."""
    found: dict[str, None] = {}
    base = False
    for name in names:
        owner = next((part for part in name.split(".") if part in adapters), None)
        if owner is None:
            base = True
        else:
            found[owner] = None
    parts = []
    if found:
        quoted = ", ".join(repr(adapter) for adapter in found)
        parts.append(f"adapter {quoted}" if len(found) == 1 else f"adapters {quoted}")
    if base:
        parts.append("the base model")
    return " and ".join(parts)


def _inject_adapter(wrapped, instance, args, kwargs):
    try:
        model = argument(args, kwargs, 0, "model")
        adapter_name = argument(args, kwargs, 1, "adapter_name")
        taken = _snapshot(model, adapter_name) if isinstance(adapter_name, str) else []
    except Exception:  # arguments peft itself rejects: peft raises in its own way
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    if not taken:
        return result
    trainable, frozen = [], []
    for full_name, parameter, requires_grad in taken:
        if parameter.requires_grad != requires_grad:
            parameter.requires_grad = requires_grad
            (trainable if requires_grad else frozen).append(full_name)
    if trainable or frozen:
        adapters = getattr(instance, "peft_config", {})
        config = adapters.get(adapter_name)
        parts, values = [], []
        for names, state, upstream in ((trainable, "trainable", "froze"), (frozen, "frozen", "made trainable")):
            if names:
                parts.append(f"kept %d parameter(s) of %s {state} that peft %s {upstream}")
                values += [len(names), _owners(names, adapters), _peft_version()]
        record_effect(
            NAME,
            "; ".join(parts) + " when adapter %r was added with inference_mode=%s",
            *values, adapter_name, str(getattr(config, "inference_mode", "?")),
        )  # fmt: skip
    return result


# -- PeftModel.load_adapter --------------------------------------------------------------------


def _load_adapter(wrapped, instance, args, kwargs):
    peft_model = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    if peft_model is None or not isinstance(instance, peft_model):
        return wrapped(*args, **kwargs)
    adapter_name = argument(args, kwargs, 1, "adapter_name", None)
    is_trainable = argument(args, kwargs, 2, "is_trainable", False)
    added = bool(is_trainable) and isinstance(adapter_name, str) and adapter_name not in instance.peft_config
    result = wrapped(*args, **kwargs)
    if not added or adapter_name not in instance.peft_config:
        return result
    if instance.peft_config[adapter_name].is_prompt_learning or instance.active_peft_config.is_prompt_learning:
        return result
    before = [(parameter, parameter.requires_grad) for parameter in instance.parameters()]
    instance.set_requires_grad(adapter_name)
    changed = sum(1 for parameter, requires_grad in before if parameter.requires_grad != requires_grad)
    if changed:
        record_effect(
            NAME,
            "made %d parameter(s) of adapter %r trainable, as load_adapter(is_trainable=True) asked; "
            "peft %s left the new adapter frozen",
            changed, adapter_name, _peft_version(),
        )  # fmt: skip
    return result


# -- probes ------------------------------------------------------------------------------------


def _check_inject_adapter(original):
    module = sys.modules.get("peft.tuners.tuners_utils")
    if module is None or not isinstance(getattr(module, "BaseTunerLayer", None), type):
        return "peft.tuners.tuners_utils no longer defines the BaseTunerLayer class"
    return leading_parameters(original, ("self", "model", "adapter_name"))


def _check_load_adapter(original):
    module = sys.modules.get("peft.peft_model")
    peft_model = getattr(module, "PeftModel", None)
    for attribute in ("set_requires_grad", "active_peft_config", "add_adapter"):
        if not hasattr(peft_model, attribute):
            return f"peft.peft_model.PeftModel has no {attribute}"
    return leading_parameters(original, ("self", "model_id", "adapter_name", "is_trainable"))


# -- what the tests read of a model ----------------------------------------------------------------


def lora_requires_grad(model) -> dict[str, bool]:
    """``{parameter name: requires_grad}`` of every LoRA parameter (``lora_`` in the name) of ``model``."""
    return {name: parameter.requires_grad for name, parameter in model.named_parameters() if ".lora_" in name}


def expected_requires_grad(model, trainable: set[str]) -> dict[str, bool]:
    """What :func:`lora_requires_grad` must be when exactly the adapters in ``trainable`` are trainable."""
    return {name: any(f".{adapter}." in name for adapter in trainable) for name in lora_requires_grad(model)}


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """A LoRA adapter on a one-``Linear`` module, then a second one added in inference mode: the bug is
    there when the first adapter's parameters stop being trainable."""
    peft = sys.modules["peft"]
    torch = bare.torch_module()

    class Base(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = bare.linear()

        def forward(self, hidden):
            return self.linear(hidden)

    model = peft.get_peft_model(Base(), peft.LoraConfig(target_modules=["linear"], r=1))
    model.add_adapter("other", peft.LoraConfig(target_modules=["linear"], r=1, inference_mode=True))
    frozen = sorted(
        name for name, parameter in model.named_parameters() if ".default." in name and not parameter.requires_grad
    )
    if frozen:
        return Evidence(
            True, f"adding a second adapter in inference mode froze the first one's {len(frozen)} trainable parameters"
        )
    return Evidence(False, "adding a second adapter in inference mode leaves the first one trainable")


PATCH = Patch(
    name=NAME,
    summary="Adding or loading a PEFT adapter keeps the other adapters' requires_grad (peft<0.21 changes it).",
    distribution="peft",
    requires="<0.21",
    targets=(
        Target("peft.tuners.tuners_utils:BaseTuner.inject_adapter", _inject_adapter, check=_check_inject_adapter),
        Target("peft.peft_model:PeftModel.load_adapter", _load_adapter, check=_check_load_adapter),
    ),
    references=(
        "docs/bugs.md#peft-adapter-trainability",
        "huggingface/peft#3495",
        "huggingface/peft#3487",
        "huggingface/peft#3580",
    ),
    bug_probe=BugProbe(_bug_probe, needs=("peft",)),
)
