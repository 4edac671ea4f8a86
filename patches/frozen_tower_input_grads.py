"""``frozen-tower-input-grads``: a frozen sub-model's input embeddings are not made to require grad.

Symptom (time and memory, no wrong number): enabling checkpointing hooks the input embeddings of
every ``PreTrainedModel`` inside the model, so a frozen vision tower's output requires grad and
backward runs through all its frozen blocks for no gradient (3.4× the step time and 3× the peak
memory in ``benchmarks/frozen_tower_input_grads.py``).

Fix: ``PreTrainedModel.enable_input_require_grads`` is wrapped, stacked with
``input-grad-hook-dedupe``. Each hook upstream put on a *sub-model's* embeddings is replaced, under
the same hook id, by one that calls upstream's hook only while that sub-model has a trainable
parameter, checked per forward (a tower unfrozen later gets its hook back at once). The model's own
embeddings keep upstream's hook; switched off, a replaced hook runs upstream's again.

Limits: the check walks the sub-model's parameters on each of its forwards (tens of µs for the
benchmark's tower). A sub-model frozen by other means (``torch.no_grad``) and hooks put on the
embeddings by other code are left alone.

Full story, versions measured and references: docs/bugs.md#frozen-tower-input-grads
"""

from __future__ import annotations

import copy
import weakref

from shim import Patch, Target
from shim.effects import record

from ._checkpointing import first_trainable

NAME = "frozen-tower-input-grads"
_PreTrainedModel = None  # bound on first use: the patch module must not import transformers at import time


class _WhileTrainable:
    """A forward hook that runs upstream's input-require-grads hook only while ``owner`` (the
    sub-model whose embeddings it sits on) has a trainable parameter. The owner is held weakly:
    the hook lives inside the owner and must not keep it alive. It follows the patch's switch, so
    ``shim.disable()``, ``shim.disabled()`` and ``shim.deactivate()`` give upstream's hook back at once."""

    __slots__ = ("hook", "owner", "names", "switch", "__weakref__")

    def __init__(self, hook, owner, names: tuple[str, str], switch) -> None:
        self.hook = hook
        self.owner = weakref.ref(owner)
        self.names = names  # (sub-model class, model class), for the effects ledger
        self.switch = switch

    def __call__(self, module, inputs, output):
        owner = self.owner()
        if not self.switch or owner is None or first_trainable(owner) is not None:
            return self.hook(module, inputs, output)
        record(
            NAME,
            "kept the frozen %s (in %s) out of backward: upstream makes its input embeddings' output require grad",
            *self.names,
        )  # fmt: skip
        return None

    def __deepcopy__(self, memo: dict):
        # A deep copy of the model copies this hook inside the owner, after the owner itself: the
        # copy's hook watches the copy's owner.
        owner = self.owner()
        copied = memo.get(id(owner), owner) if owner is not None else None
        if copied is None:
            return self
        return _WhileTrainable(copy.deepcopy(self.hook, memo), copied, self.names, self.switch)


def _input_embeddings(model):
    """``model.get_input_embeddings()``, or ``None`` where it has none (as upstream tolerates)."""
    try:
        return model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None


def _sub_models_by_hooks(model) -> dict:
    """``{id(embeddings._forward_hooks): sub-model}`` for each sub-model of ``model`` whose input
    embeddings differ from the model's own; the first sub-model found owns shared embeddings, as in
    upstream's walk."""
    own = _input_embeddings(model)
    owners: dict = {}
    for module in model.modules():
        if module is model or not isinstance(module, _PreTrainedModel):
            continue
        embeddings = _input_embeddings(module)
        if embeddings is None or embeddings is own or not hasattr(embeddings, "_forward_hooks"):
            continue
        owners.setdefault(id(embeddings._forward_hooks), module)
    return owners


def _enable_input_require_grads(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    handles = instance.__dict__.get("_require_grads_hooks") if instance is not None else None
    if not handles:
        return result
    own = _input_embeddings(instance)
    own_hooks = getattr(own, "_forward_hooks", None)
    hooked = [(handle, handle.hooks_dict_ref()) for handle in handles]
    if all(hooks is own_hooks for _handle, hooks in hooked):  # a text-only model: nothing to walk
        return result
    global _PreTrainedModel
    if _PreTrainedModel is None:
        from transformers.modeling_utils import PreTrainedModel

        _PreTrainedModel = PreTrainedModel
    owners = _sub_models_by_hooks(instance)
    switch = _switch()
    for handle, hooks in hooked:
        owner = owners.get(id(hooks)) if hooks is not None and hooks is not own_hooks else None
        hook = hooks.get(handle.id) if owner is not None else None
        if hook is not None and not isinstance(hook, _WhileTrainable):
            names = (type(owner).__name__, type(instance).__name__)
            hooks[handle.id] = _WhileTrainable(hook, owner, names, switch)
    return result


def _switch():
    """The runtime switch of this patch's layer on ``PreTrainedModel.enable_input_require_grads``."""
    import inspect

    from shim.wrapping import find_shim_wrapper, switch_of

    layer = find_shim_wrapper(inspect.getattr_static(_PreTrainedModel, "enable_input_require_grads"), NAME)
    return switch_of(layer) if layer is not None else True


def _probe(original) -> str | None:
    """Upstream must keep its hook handles in ``_require_grads_hooks`` and register forward hooks."""
    names = getattr(getattr(original, "__code__", None), "co_names", ())
    if "_require_grads_hooks" not in names or "register_forward_hook" not in names:
        return "enable_input_require_grads no longer registers forward hooks kept in _require_grads_hooks"
    return None


# -- demonstration (self-check, tests, benchmark) ------------------------------------------------


def tiny_qwen2_vl(depth: int = 2, width: int = 32, image: int = 8):
    """A tiny Qwen2-VL built in code, in training mode (2 text layers; a vision tower of ``depth``
    blocks of ``width``), with one ``image`` x ``image`` image that fits it: ``(model, inputs)``.
    ``inputs`` are the forward's keyword arguments."""
    import inspect

    import torch
    import transformers

    config = transformers.Qwen2VLConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=1024,
            bos_token_id=1,
            eos_token_id=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
        ),
        vision_config=dict(
            depth=depth,
            embed_dim=width,
            hidden_size=32,  # the merger's output: the text model's width
            num_heads=max(2, width // 32),
            mlp_ratio=2,
            patch_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config)
    model.train()
    side = image // 2  # patches of 2 x 2 pixels
    grid = torch.tensor([[1, side, side]])  # temporal, height, width in patches
    patches = side * side
    generator = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(patches, 3 * 2 * 2 * 2, generator=generator)
    input_ids = torch.tensor([[1, 102] + [100] * (patches // 4) + [5, 6, 7]])  # 2 x 2 patches merge into a token
    inputs = dict(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid, labels=input_ids)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # 5.x processors return it
        inputs["mm_token_type_ids"] = (input_ids == 100).long()
    return model, inputs


def vision_tower(model):
    """The vision sub-model of a Qwen2-VL model (its place moved within 5.x)."""
    inner = getattr(model, "model", model)
    return inner.visual if hasattr(inner, "visual") else model.visual


def _self_check() -> bool:
    """True when enabling checkpointing makes a frozen vision tower's embeddings' output require grad."""
    import torch

    from ._checkpointing import enable

    model, inputs = tiny_qwen2_vl()
    tower = vision_tower(model)
    tower.requires_grad_(False)
    enable(model, {"use_reentrant": False})
    with torch.enable_grad():  # patch_embed: 4.x has no get_input_embeddings on the tower
        output = tower.patch_embed(inputs["pixel_values"])
    return bool(output.requires_grad)


PATCH = Patch(
    name=NAME,
    summary="A frozen sub-model (a VLM's vision tower) keeps its input embeddings' output free of requires_grad.",
    distribution="transformers",
    requires=">=5.0",
    targets=(
        Target(
            "transformers.modeling_utils:PreTrainedModel.enable_input_require_grads",
            _enable_input_require_grads,
            probe=_probe,
        ),
    ),
    references=(
        "docs/bugs.md#frozen-tower-input-grads",
        "huggingface/transformers#41993",
        "modelscope/ms-swift#10214",
    ),
    self_check=_self_check,
)
