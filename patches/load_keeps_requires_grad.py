"""``load-keeps-requires-grad``: frozen parameters stay frozen when a checkpoint is loaded.

Symptom (silent): a model that froze part of itself before loading (a base, a tower, in
``__init__``) comes out of ``from_pretrained`` fully trainable, because transformers rebuilds each
loaded parameter with ``requires_grad=value.is_floating_point()`` and ignores the flag it replaces.

Fix: ``set_param_for_module`` and ``_load_parameter_into_model`` are wrapped; the parameter in the
slot is noted before the call, and a replacement that came back trainable where the old one was
frozen is frozen again. The frozen parameters' names are noted once per load (a load is told by
the object the loader hands every call of it fourth: ``loading_info`` in 5.2x, a set of keys before),
and a call for any other tensor goes straight to upstream. Arguments are read by name or position (a shape check reads the leading three, which
every signature of the loader shares).

Limits: only frozen → trainable is undone (trainable → frozen is transformers' intent for integer
and quantized weights). Buffers, ``_extra_state``, empty slots and DTensors are left to
transformers; freezing done after loading is not the patch's business.

Full story, versions measured and references: docs/bugs.md#load-keeps-requires-grad
"""

from __future__ import annotations

import sys
import weakref

from shim import BugProbe, Evidence, Patch, Target, record_effect
from shim.selfcheck import bare

from ._arguments import argument, leading_parameters

NAME = "load-keeps-requires-grad"
# model -> parameters kept frozen in it so far (weak: the ledger must not keep a model alive).
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# class -> names of its attributes: a submodule name that is also one of them is resolved by
# ``get_submodule`` (``getattr`` finds the class attribute first). Cleared when it grows large, so
# classes made on the fly are not kept alive.
_class_attributes: dict = {}


def _attributes_of(cls) -> frozenset:
    if len(_class_attributes) > 1024:
        _class_attributes.clear()
    names = _class_attributes[cls] = frozenset(dir(cls))
    return names


def _submodule(model, path: str):
    """``model.get_submodule(path)``, found through ``_modules`` directly.

    This runs once per loaded tensor: torch's ``get_submodule`` goes through ``Module.__getattr__``
    twice per step (about 6 µs for a decoder-layer path, 1 000 tensors -> 6 ms a load); the walk
    costs well under 1 µs. Where ``getattr`` could find something else than the registered
    submodule (the name is also an instance or class attribute) or nothing is registered under
    the name, it is ``get_submodule`` itself that answers, so the result is the same.
    """
    module = model
    for item in path.split("."):
        child = module._modules.get(item)
        cls = type(module)
        names = _class_attributes.get(cls) or _attributes_of(cls)
        if child is None or item in names or item in module.__dict__:
            return model.get_submodule(path)
        module = child
    return module


# The load under way: (a weak reference to the model, one to the object that tells its calls, the
# names of the parameters that were frozen when it started). One load at a time fills a model's slots.
_load: list = [None, None, frozenset()]


def _frozen_at_start(model, info) -> frozenset:
    """The names of ``model``'s frozen parameters as the load ``info`` belongs to started (``info``:
    what the loader hands each call of one load fourth). Raises ``TypeError``, before any walk, where
    ``info`` or the model takes no weak reference."""
    model_ref, info_ref, frozen = _load
    if model_ref is not None and model_ref() is model and info_ref() is info:
        return frozen
    references = [weakref.ref(model), weakref.ref(info)]
    frozen = frozenset(_frozen_names(model))
    _load[:] = [*references, frozen]
    return frozen


def _frozen_names(model) -> set:
    """The dotted names of ``model``'s frozen parameters, shared ones under each name (a walk over
    ``_modules``: a fifth of ``named_parameters()``'s cost, which builds every name)."""
    frozen = set()
    stack = [("", model)]
    while stack:
        prefix, module = stack.pop()
        for name, parameter in module._parameters.items():
            if parameter is not None and not parameter.requires_grad:
                frozen.add(prefix + name)
        stack.extend((f"{prefix}{name}.", child) for name, child in module._modules.items() if child is not None)
    return frozen


def _load_keeping_frozen(wrapped, args, kwargs, model, dotted_name):
    try:
        module_path, _, attribute = dotted_name.rpartition(".")
        module = _submodule(model, module_path) if module_path else model
        before = module._parameters.get(attribute)
    except Exception:
        # The slot does not exist: transformers reports it (unexpected key) in its own way.
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    if before is not None and not before.requires_grad:
        after = module._parameters.get(attribute)
        if after is not None and after is not before and after.requires_grad:
            after.requires_grad_(False)
            _count_kept(model)
    return result


def _count_kept(model) -> None:
    try:
        kept = _kept[model] = _kept.get(model, 0) + 1
    except TypeError:  # not weak-referenceable: count this one alone
        kept = 1
    version = getattr(sys.modules.get("transformers"), "__version__", "?")
    record_effect(
        NAME,
        "kept %d parameter(s) of %s frozen that transformers %s made trainable while loading",
        kept, type(model).__name__, version,
    )  # fmt: skip


def _set_param_for_module(wrapped, instance, args, kwargs):
    model = argument(args, kwargs, 0, "model")
    target_name = argument(args, kwargs, 1, "target_name")
    info = argument(args, kwargs, 3, "loading_info", None)
    if info is not None:
        try:
            if target_name not in _frozen_at_start(model, info):
                return wrapped(*args, **kwargs)  # the usual call: nothing frozen there to keep
        except TypeError:  # a model or record without weak references: looked at per call
            pass
    return _load_keeping_frozen(wrapped, args, kwargs, model, target_name)


def _load_parameter_into_model(wrapped, instance, args, kwargs):
    model = argument(args, kwargs, 0, "model")
    param_name = argument(args, kwargs, 1, "param_name")
    return _load_keeping_frozen(wrapped, args, kwargs, model, param_name)


def requires_grad_map(model) -> dict[str, bool]:
    return {name: parameter.requires_grad for name, parameter in model.named_parameters()}


# -- bug probe (python -m shim doctor, and the engine where the release cannot vouch) --------------


def _bug_probe() -> Evidence:
    """A module holding one frozen 1-element parameter, loaded through each of transformers' loaders
    that exists: the bug is there when one of them leaves the parameter trainable."""
    torch = bare.torch_module()
    loaders = []
    set_param = getattr(sys.modules.get("transformers.core_model_loading"), "set_param_for_module", None)
    if set_param is not None:
        loaders.append(("set_param_for_module", lambda module, value: _call_by_name(set_param, module, value)))
    load_param = sys.modules[bare.MODELING_UTILS]._load_parameter_into_model
    loaders.append(("_load_parameter_into_model", lambda module, value: load_param(module, "weight", value)))
    made_trainable = []
    for name, load in loaders:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        load(module, torch.ones(1))
        if module.weight.requires_grad:
            made_trainable.append(name)
    if made_trainable:
        return Evidence(True, f"{' and '.join(made_trainable)} made a frozen 1-element parameter trainable")
    return Evidence(False, f"{' and '.join(name for name, _ in loaders)} keep a frozen parameter frozen")


def _call_by_name(set_param, module, value) -> None:
    """``set_param_for_module`` called for ``module.weight`` with each argument bound by its name (the
    signature changed within 5.x); one the probe has no value for raises ``TypeError``."""
    import inspect
    import types

    info = types.SimpleNamespace(missing_keys=set(), unexpected_keys=set(), mismatched_keys=set())
    values = dict(model=module, target_name="weight", param_value=value, loading_info=info, hf_quantizer=None)
    values |= dict(distributed_operation=None, mismatch_keys=set(), missing_keys=set(), unexpected_keys=set())
    call = {}
    for name, parameter in inspect.signature(set_param).parameters.items():
        if name in values:
            call[name] = values[name]
        elif parameter.default is parameter.empty and parameter.kind not in (
            parameter.VAR_POSITIONAL,
            parameter.VAR_KEYWORD,
        ):
            raise TypeError(f"set_param_for_module takes {name}, which the probe has no value for")
    set_param(**call)


PATCH = Patch(
    name=NAME,
    summary="Frozen parameters stay frozen through from_pretrained (transformers 5.x resets requires_grad).",
    distribution="transformers",
    requires=">=5.0",
    targets=(
        Target(
            "transformers.core_model_loading:set_param_for_module",
            _set_param_for_module,
            check=lambda original: leading_parameters(original, ("model", "target_name", "param_value")),
        ),
        Target(
            "transformers.modeling_utils:_load_parameter_into_model",
            _load_parameter_into_model,
            check=lambda original: leading_parameters(original, ("model", "param_name", "tensor")),
        ),
    ),
    references=("docs/bugs.md#load-keeps-requires-grad", "vllm-project/speculators#593"),
    bug_probe=BugProbe(_bug_probe, needs=(bare.MODELING_UTILS,)),
)
