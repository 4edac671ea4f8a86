"""Small local stand-ins for the other patchers that touch what the shim touches (issue 24).

The real packages need GPUs (unsloth, unsloth-zoo, axolotl) or triton (liger-kernel), so each
function here does to the installed libraries what one upstream function does: which object it
rebinds, where, whether the new object calls the one it replaced, whether it is marked or
``functools.wraps``-ed. The docstrings name the upstream file and function; the code is written
from their reading, not copied. Where an upstream function cannot run on the installed versions
(it was written for transformers 4.x layers), the docstring says so and what the stand-in does
instead; the checkpoint math is kept so gradients can be compared with a reference.

Each patcher applies at once and returns an :class:`Applied` handle: ``replacement`` is the
object installed, ``previous`` what each location held, ``calls`` / ``forwarded`` count the
calls of the replacement and those it passed on to the object it replaced, and ``undo()`` puts
every location back as it was (a name that was absent is deleted again). Undo in reverse order of
applying when two patchers stack on one location.

``PATTERNS`` maps a pattern name to ``(patcher, target spec, kind)``; kind is ``"replace"`` (a
new object that never calls the one it replaced), ``"noop"`` (a replacement that does nothing)
or ``"wrap"`` (calls the one it replaced).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

_ABSENT = object()


class Applied:
    """What one patcher did, and how to put it back."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.replacement: Any = None
        self.previous: dict[str, Any] = {}  # "module:qualname" -> what was there (_ABSENT: nothing)
        self.calls = 0
        self.forwarded = 0
        self.applied = False
        self._undo: list[Callable[[], None]] = []

    def assign(self, owner: Any, attribute: str, value: Any, where: str) -> None:
        """``setattr(owner, attribute, value)``, remembering what ``owner`` itself held."""
        held = vars(owner).get(attribute, _ABSENT)
        self.previous.setdefault(where, held)

        def put_back() -> None:
            if held is _ABSENT:
                if attribute in vars(owner):
                    delattr(owner, attribute)
            else:
                setattr(owner, attribute, held)

        self._undo.append(put_back)
        setattr(owner, attribute, value)
        self.applied = True

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.applied = False


def spec_of(owner: Any, attribute: str) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}:{owner.__qualname__}.{attribute}"
    return f"{getattr(owner, '__name__', type(owner).__qualname__)}:{attribute}"


def resolve(spec: str) -> tuple[Any, str]:
    """``"pkg.module:Class.attr"`` -> (the owner object, ``"attr"``); the module is imported."""
    module_name, qualname = spec.split(":")
    owner: Any = importlib.import_module(module_name)
    *path, attribute = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attribute


# --------------------------------------------------------------------------------------------
# unsloth
# --------------------------------------------------------------------------------------------


def unsloth_enable_input_require_grads() -> Applied:
    """unslothai/unsloth ``unsloth/import_fixes.py``, ``patch_enable_input_require_grads``.

    Only when transformers' own ``PreTrainedModel.enable_input_require_grads`` iterates over
    ``self.modules()`` (read with ``inspect.getsource``, which sees through wrappers that set
    ``__wrapped__``), it assigns a plain function (no ``functools.wraps``, no marker) on the
    class. The function never calls the original: it walks the modules, takes each
    ``PreTrainedModel``'s input embeddings (skipping ``NotImplementedError``, ``None`` and
    embeddings already seen), registers a hook making their output require grad, and stores the
    hooks in ``_require_grads_hooks`` and the first in ``_require_grads_hook``.
    Kind: replace. ``applied`` stays False when the guard does not match.
    """
    from transformers import PreTrainedModel

    handle = Applied("unsloth_enable_input_require_grads")
    try:
        source = inspect.getsource(PreTrainedModel.enable_input_require_grads)
    except (OSError, TypeError):
        return handle
    if "for module in self.modules()" not in source:
        return handle

    def _patched_enable_input_require_grads(self: Any) -> None:
        handle.calls += 1

        def make_inputs_require_grads(module: Any, input: Any, output: Any) -> None:
            output.requires_grad_(True)

        hooks = []
        seen = set()
        for module in self.modules():
            if not (isinstance(module, PreTrainedModel) and hasattr(module, "get_input_embeddings")):
                continue
            try:
                embeddings = module.get_input_embeddings()
            except NotImplementedError:
                continue
            if embeddings is None or id(embeddings) in seen:
                continue
            seen.add(id(embeddings))
            hooks.append(embeddings.register_forward_hook(make_inputs_require_grads))
        self._require_grads_hooks = hooks
        if hooks:
            self._require_grads_hook = hooks[0]

    handle.replacement = _patched_enable_input_require_grads
    handle.assign(
        PreTrainedModel,
        "enable_input_require_grads",
        _patched_enable_input_require_grads,
        spec_of(PreTrainedModel, "enable_input_require_grads"),
    )
    return handle


def unsloth_trl_disable_gradient_checkpointing_noop() -> Applied:
    """unslothai/unsloth ``unsloth/models/rl.py``, ``patch_trl_disable_gradient_checkpointing``
    (added by unslothai/unsloth#4934; run first in ``PatchFastRL``).

    Returns early when ``trl.models.utils`` lacks the name, or when the name already carries
    ``_unsloth_noop_patched``. Otherwise a ``contextlib.contextmanager`` taking
    ``(model, gradient_checkpointing_kwargs=None)`` that only yields (``None``), marked
    ``_unsloth_noop_patched = True``, is assigned to ``trl.models.utils`` and then to every module
    in ``sys.modules`` whose name starts with ``"trl."`` and whose attribute of that name is not
    None (modules imported later pick it up from ``trl.models.utils``). Kind: noop.
    """
    handle = Applied("unsloth_trl_disable_gradient_checkpointing_noop")
    try:
        import trl.models.utils as trl_utils
    except ImportError:
        return handle
    if not hasattr(trl_utils, "disable_gradient_checkpointing"):
        return handle
    if getattr(trl_utils.disable_gradient_checkpointing, "_unsloth_noop_patched", False):
        return handle

    @contextlib.contextmanager
    def _noop_disable_gradient_checkpointing(model: Any, gradient_checkpointing_kwargs: Any = None) -> Iterator[None]:
        handle.calls += 1
        yield

    _noop_disable_gradient_checkpointing._unsloth_noop_patched = True
    handle.replacement = _noop_disable_gradient_checkpointing
    name = "disable_gradient_checkpointing"
    handle.assign(trl_utils, name, _noop_disable_gradient_checkpointing, f"trl.models.utils:{name}")
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("trl."):
            continue
        if getattr(module, name, None) is None:
            continue
        handle.assign(module, name, _noop_disable_gradient_checkpointing, f"{module_name}:{name}")
    return handle


def unsloth_unwrap_model_for_generation(trainers: tuple[str, ...] | None = None) -> Applied:
    """unslothai/unsloth ``unsloth/models/rl.py``, ``PatchRL``.

    Takes ``trl.models.utils.unwrap_model_for_generation`` as it is at that moment (a shim
    wrapper, if there is one), builds a ``contextlib.contextmanager`` around it (upstream also
    switches the model to inference and back and clones ``generate``'s output; left out here),
    and sets it with ``setattr`` on every ``trl.trainer.<x>_trainer`` attribute of ``trl.trainer``
    that has the name (``getattr`` imports each trainer module; ``trainers`` limits the walk to
    those names, all by default as upstream). ``trl.models.utils`` itself keeps its function.
    Kind: wrap.
    (``PatchRL`` also assigns ``transformers.Trainer.prediction_step``, which the shim does not
    touch.)
    """
    import trl.models.utils as trl_utils
    import trl.trainer

    handle = Applied("unsloth_unwrap_model_for_generation")
    original = trl_utils.unwrap_model_for_generation

    @contextlib.contextmanager
    def unsloth_unwrap_model_for_generation(model: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        handle.calls += 1
        handle.forwarded += 1
        with original(model, *args, **kwargs) as unwrapped_model:
            yield unwrapped_model

    handle.replacement = unsloth_unwrap_model_for_generation
    name = "unwrap_model_for_generation"
    for attribute in dir(trl.trainer) if trainers is None else trainers:
        if not attribute.endswith("_trainer"):
            continue
        try:
            module = getattr(trl.trainer, attribute)
        except Exception:  # trl's lazy modules import on first access
            continue
        if hasattr(module, name):
            handle.assign(module, name, unsloth_unwrap_model_for_generation, f"{module.__name__}:{name}")
    return handle


def _llama_decoder_layer_forward(
    self: Any,
    hidden_states: Any,
    attention_mask: Any = None,
    position_ids: Any = None,
    cache: Any = None,
    use_cache: Any = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> Any:
    residual = hidden_states
    hidden_states, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states),
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual + hidden_states
    return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def unsloth_decoder_layer_forward(layer_class: Any = None) -> Applied:
    """unslothai/unsloth ``unsloth/models/llama.py``, ``FastLlamaModel.pre_patch``.

    Assigns a plain function to ``LlamaDecoderLayer.forward`` (and likewise the attention's,
    model's and causal LM's ``forward``; those are not decoder layers and are left alone here).
    The function is a re-implementation ("ported from transformers") that never calls the
    original, and does not read ``_gradient_checkpointing_func``: on transformers releases where a
    ``GradientCheckpointingLayer`` checkpoints inside the ``forward`` wrapper made by
    ``__init_subclass__``, the assignment removes that wrapper. Upstream's own ``LlamaModel``
    forward only checkpoints layers that are not ``GradientCheckpointingLayer``s itself.
    Deviation: upstream's version takes the 4.x signature and returns a tuple with its fused
    kernels; this one takes the installed ``LlamaDecoderLayer``'s arguments, computes the same
    math from the layer's modules and returns a tensor, so an unpatched ``LlamaModel`` still runs
    and gradients match the reference. ``layer_class`` defaults to ``LlamaDecoderLayer``.
    Kind: replace.
    """
    if layer_class is None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as layer_class

    handle = Applied("unsloth_decoder_layer_forward")

    def LlamaDecoderLayer_fast_forward(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        handle.calls += 1
        return _llama_decoder_layer_forward(self, hidden_states, *args, **kwargs)

    handle.replacement = LlamaDecoderLayer_fast_forward
    handle.assign(layer_class, "forward", LlamaDecoderLayer_fast_forward, spec_of(layer_class, "forward"))
    return handle


def _first_output(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else output


def _recomputing_function(name: str, handle: Applied, offload: bool) -> type:
    """The autograd Function both unsloth-zoo's ``Unsloth_Gradient_Checkpointer`` and axolotl's
    ``CPU_Offloaded_Gradient_Checkpointer`` are: run the layer under ``no_grad``, keep only its
    first input (copied to the CPU when ``offload``), recompute it in backward."""
    import torch

    def forward(ctx: Any, forward_function: Any, hidden_states: Any, *args: Any) -> Any:
        handle.calls += 1
        ctx.device = hidden_states.device
        saved = hidden_states.to("cpu") if offload else hidden_states
        with torch.no_grad():
            output = forward_function(hidden_states, *args)
        ctx.save_for_backward(saved)
        ctx.forward_function = forward_function
        ctx.args = args
        return output

    def backward(ctx: Any, *grads: Any) -> Any:
        (hidden_states,) = ctx.saved_tensors
        hidden_states = hidden_states.to(ctx.device).detach().requires_grad_(True)
        with torch.enable_grad():
            output = _first_output(ctx.forward_function(hidden_states, *ctx.args))
        torch.autograd.backward(output, grads[0])
        return (None, hidden_states.grad) + (None,) * len(ctx.args)

    return type(
        name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    )


def unsloth_zoo_checkpoint() -> Applied:
    """unslothai/unsloth-zoo ``unsloth_zoo/gradient_checkpointing.py``, ``patch_gradient_checkpointing``
    (``patch_unsloth_gradient_checkpointing`` is the same with an offloading Function).

    Returns early when ``torch.utils.checkpoint.checkpoint.__name__`` already is its own. Keeps
    torch's function as ``torch.utils.checkpoint._old_checkpoint``, assigns its own function to
    ``torch.utils.checkpoint.checkpoint`` and to ``transformers.modeling_utils.checkpoint``
    (the name transformers builds every layer's ``partial`` from). The function
    ``(function, *args, use_reentrant=None, **kwargs)`` ignores ``use_reentrant`` and every other
    keyword and runs its own autograd Function (keep the first input, recompute in backward):
    torch's ``checkpoint`` is never called. Upstream's ``unpatch_*`` restores only torch's name;
    :meth:`Applied.undo` restores all three. Deviation: upstream's backward unpacks a one-element
    tuple (the 4.x layer output); this one also takes the tensor 5.x layers return.
    Kind: replace.
    """
    import torch.utils.checkpoint
    import transformers.modeling_utils

    handle = Applied("unsloth_zoo_checkpoint")
    if torch.utils.checkpoint.checkpoint.__name__ == "unsloth_gradient_checkpoint":
        return handle
    checkpointer = _recomputing_function("Unsloth_Gradient_Checkpointer", handle, offload=False)

    def unsloth_gradient_checkpoint(function: Any, *args: Any, use_reentrant: Any = None, **kwargs: Any) -> Any:
        return checkpointer.apply(function, *args)

    handle.replacement = unsloth_gradient_checkpoint
    module = torch.utils.checkpoint
    handle.assign(module, "_old_checkpoint", module.checkpoint, "torch.utils.checkpoint:_old_checkpoint")
    handle.assign(module, "checkpoint", unsloth_gradient_checkpoint, "torch.utils.checkpoint:checkpoint")
    handle.assign(
        transformers.modeling_utils,
        "checkpoint",
        unsloth_gradient_checkpoint,
        "transformers.modeling_utils:checkpoint",
    )
    return handle


def unsloth_instance_checkpointing_enable(model: Any) -> Applied:
    """unslothai/unsloth ``unsloth/models/vision.py``, ``FastBaseModel.post_patch_model`` (Gemma3N
    and Gemma4 models only; described in unslothai/unsloth#6826).

    Reads ``model.gradient_checkpointing_enable`` (the bound method, through any class-level
    wrapper) and sets on the instance a plain keyword-only function that forces
    ``use_reentrant=True`` into ``gradient_checkpointing_kwargs`` and calls the method it read.
    A positional call (trl's ``disable_gradient_checkpointing`` re-enables positionally) raises
    ``TypeError``. Kind: wrap (per instance).
    """
    handle = Applied("unsloth_instance_checkpointing_enable")
    original = model.gradient_checkpointing_enable

    def _gc_enable_reentrant(**kwargs: Any) -> Any:
        handle.calls += 1
        gc_kwargs = kwargs.get("gradient_checkpointing_kwargs", {}) or {}
        gc_kwargs["use_reentrant"] = True
        kwargs["gradient_checkpointing_kwargs"] = gc_kwargs
        handle.forwarded += 1
        return original(**kwargs)

    handle.replacement = _gc_enable_reentrant
    handle.assign(
        model, "gradient_checkpointing_enable", _gc_enable_reentrant, "<instance>:gradient_checkpointing_enable"
    )
    return handle


# --------------------------------------------------------------------------------------------
# axolotl
# --------------------------------------------------------------------------------------------


class _Marks:
    """Stands for axolotl's ``CheckpointHiddenStatesOffload`` stack: what was marked while on."""

    def __init__(self) -> None:
        self.active = 0
        self.marked: list[int] = []

    @contextlib.contextmanager
    def on(self) -> Iterator[_Marks]:
        self.active += 1
        try:
            yield self
        finally:
            self.active -= 1


def axolotl_layer_call(marks: _Marks | None = None) -> Applied:
    """axolotl-ai-cloud/axolotl ``src/axolotl/monkeypatch/checkpoint_activation_offload.py``,
    ``patch_gradient_checkpointing_layer_marker`` (run on the first ``__enter__`` of the offload
    context; here at once).

    Keeps ``GradientCheckpointingLayer.__call__`` as it resolves then (on transformers 5.x the
    inherited ``nn.Module.__call__``) and assigns on that class a plain function that, while an
    offload context is active and the layer is training with grad enabled and
    ``gradient_checkpointing`` set, marks the first positional argument (or ``hidden_states=``)
    for offloading, then always calls the kept ``__call__``. Guarded by a module global, no
    marker on the function. ``handle.marks`` stands for the context: ``with handle.marks.on():``.
    Kind: wrap.
    """
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    handle = Applied("axolotl_layer_call")
    handle.marks = marks or _Marks()
    original = GradientCheckpointingLayer.__call__

    def _checkpoint_offload_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        handle.calls += 1
        marks_ = handle.marks
        if (
            marks_.active
            and self.training
            and torch.is_grad_enabled()
            and getattr(self, "gradient_checkpointing", False)
        ):
            hidden_states = args[0] if args else kwargs.get("hidden_states")
            if torch.is_tensor(hidden_states):
                marks_.marked.append(id(hidden_states))
        handle.forwarded += 1
        return original(self, *args, **kwargs)

    handle.replacement = _checkpoint_offload_call
    handle.assign(
        GradientCheckpointingLayer,
        "__call__",
        _checkpoint_offload_call,
        spec_of(GradientCheckpointingLayer, "__call__"),
    )
    return handle


def axolotl_modeling_utils_checkpoint() -> Applied:
    """axolotl-ai-cloud/axolotl ``src/axolotl/loaders/patch_manager.py``,
    ``PatchManager._apply_gradient_checkpointing_patches`` (``gradient_checkpointing`` with
    ``activation_offloading: legacy``; ``offload_disk`` assigns a disk-offloading twin), function
    from ``src/axolotl/monkeypatch/gradient_checkpointing/__init__.py``.

    Assigns ``hf_grad_checkpoint_offload_wrapper(decoder_layer, *args, use_reentrant=None)`` to
    ``transformers.modeling_utils.checkpoint`` only; torch's ``checkpoint`` is untouched and never
    called. The function takes no other keyword (a ``partial`` holding e.g.
    ``preserve_rng_state`` raises ``TypeError``). It finds the layer through
    ``decoder_layer.func.__self__`` (a bound method's, as transformers 4.x handed over): when that
    is a ``GradientCheckpointingLayer`` it runs ``CPU_Offloaded_Gradient_Checkpointer``
    (offload_cpu.py: keep the first input on the CPU, recompute in backward) on the partial,
    otherwise on the object found. A ``partial`` of a plain function, as 5.x layers hand over
    ``partial(forward, layer)``, raises ``AttributeError`` there, as upstream does (the shim's
    ``checkpoint-function-finds-layer`` is about exactly this). Deviation: upstream's backward
    unpacks a one-element tuple (4.x layer output) and fails on the tensor 5.x layers return; this
    one takes either. Kind: replace.
    """
    import transformers.modeling_utils
    from transformers.modeling_layers import GradientCheckpointingLayer

    handle = Applied("axolotl_modeling_utils_checkpoint")
    checkpointer = _recomputing_function("CPU_Offloaded_Gradient_Checkpointer", handle, offload=True)

    def uses_gc_layers(decoder_layer: Any) -> bool:
        return isinstance(decoder_layer.func.__self__, GradientCheckpointingLayer)

    def hf_grad_checkpoint_offload_wrapper(decoder_layer: Any, *args: Any, use_reentrant: Any = None) -> Any:
        if uses_gc_layers(decoder_layer):
            return checkpointer.apply(decoder_layer, *args)
        layer = decoder_layer.func.__self__ if isinstance(decoder_layer, functools.partial) else decoder_layer.__self__
        return checkpointer.apply(layer, *args)

    handle.replacement = hf_grad_checkpoint_offload_wrapper
    handle.assign(
        transformers.modeling_utils,
        "checkpoint",
        hf_grad_checkpoint_offload_wrapper,
        "transformers.modeling_utils:checkpoint",
    )
    return handle


_AXOLOTL_UPCAST = """
        for param in model.parameters():
            if (
                (param.dtype == torch.float16) or (param.dtype == torch.bfloat16)
            ) and param.__class__.__name__ != "Params4bit":
                param.data = param.data.to(torch.float32)
"""
_AXOLOTL_UPCAST_SKIPPING_EMBEDDINGS = """
        for name, param in model.named_parameters():
            if (
                (param.dtype == torch.float16) or (param.dtype == torch.bfloat16)
            ) and param.__class__.__name__ != "Params4bit" and all(
                embed_name not in name for embed_name in ["embed_tokens", "lm_head"]
            ):
                param.data = param.data.to(torch.float32)
"""


def axolotl_prepare_model_for_kbit_training(*consumers: Any) -> Applied:
    """axolotl-ai-cloud/axolotl ``src/axolotl/monkeypatch/peft/utils.py``, ``patch_peft_prep_code``
    (applied by ``PatchManager._apply_adapter_patches`` when ``adapter`` and
    ``embeddings_skip_upcast`` are set).

    Reads ``peft.utils.other.prepare_model_for_kbit_training``'s source with ``inspect.getsource``
    and returns without patching unless it contains peft's fp16/bf16 -> fp32 upcast loop
    verbatim. Otherwise replaces that loop by one that skips ``embed_tokens`` and ``lm_head``,
    renames the function ``fixed_prepare_model_for_kbit_training``, imports into its own globals
    every ``peft.utils.other`` name the source mentions, ``exec``s it there and assigns the result
    to ``peft.utils.other.prepare_model_for_kbit_training`` and to
    ``axolotl.loaders.model.prepare_model_for_kbit_training`` (here: each of ``consumers``).
    The new function is a copy: it never calls the original, and it calls the model's
    ``enable_input_require_grads`` / ``gradient_checkpointing_enable`` the way peft's does.
    ``peft.prepare_model_for_kbit_training`` (the package's re-export) keeps the original. The
    copy's ``__module__`` is the patcher's module, its code's file ``"<string>"``; ``calls`` is not
    counted (counting would need a wrapper upstream does not have). Kind: replace.
    """
    import peft.utils.other

    handle = Applied("axolotl_prepare_model_for_kbit_training")
    try:
        source = inspect.getsource(peft.utils.other.prepare_model_for_kbit_training)
    except OSError:
        return handle
    # upstream keeps the source it read under this (oddly chosen) name, patchable or not
    stash = "_original_create_accelerator_and_postprocess"
    handle.assign(peft.utils.other, stash, source, f"peft.utils.other:{stash}")
    handle.applied = False  # ``applied``: the function was replaced
    source = textwrap.dedent(source)
    if _AXOLOTL_UPCAST not in source:
        return handle
    source = source.replace(_AXOLOTL_UPCAST, _AXOLOTL_UPCAST_SKIPPING_EMBEDDINGS)
    source = source.replace("def prepare_model_for_kbit_training(", "def fixed_prepare_model_for_kbit_training(", 1)
    # upstream: ``from peft.utils.other import (...)`` into axolotl's module globals, then ``exec``
    namespace: dict[str, Any] = {"__name__": __name__}
    namespace.update({item: getattr(peft.utils.other, item) for item in dir(peft.utils.other) if item in source})
    exec(source, namespace)
    fixed = namespace["fixed_prepare_model_for_kbit_training"]
    handle.replacement = fixed
    handle.source = source
    name = "prepare_model_for_kbit_training"
    handle.assign(peft.utils.other, name, fixed, f"peft.utils.other:{name}")
    for consumer in consumers:
        handle.assign(consumer, name, fixed, f"{consumer.__name__}:{name}")
    return handle


def axolotl_checkpoint_wrapper_setattr() -> Applied:
    """axolotl-ai-cloud/axolotl ``src/axolotl/monkeypatch/deepspeed_utils.py``,
    ``patch_checkpoint_wrapper_setattr`` (via ``apply_deepspeed_patches`` when deepspeed is
    importable).

    Returns early when torch's ``CheckpointWrapper`` already has ``_axolotl_setattr_patched``.
    Otherwise keeps ``CheckpointWrapper.__setattr__`` (inherited from ``nn.Module``), assigns on
    the class a plain function that sends every ``ds_*`` attribute to
    ``self._checkpoint_wrapped_module`` (when present) and passes every other name to the kept
    ``__setattr__``, and sets ``CheckpointWrapper._axolotl_setattr_patched = True``. Reads of
    ``ds_*`` already reach the wrapped module through ``CheckpointWrapper.__getattr__``; after
    this, writes do too, so DeepSpeed's ZeRO-3 hook attributes live on the wrapped module only.
    Same bug as the shim's ``zero3-delegating-wrapper-hooks``, fixed the other way round.
    Kind: wrap.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    handle = Applied("axolotl_checkpoint_wrapper_setattr")
    if hasattr(CheckpointWrapper, "_axolotl_setattr_patched"):
        return handle
    original_setattr = CheckpointWrapper.__setattr__

    def new_setattr(self: Any, name: str, value: Any) -> None:
        handle.calls += 1
        if name.startswith("ds_") and hasattr(self, "_checkpoint_wrapped_module"):
            setattr(self._checkpoint_wrapped_module, name, value)
        else:
            handle.forwarded += 1
            original_setattr(self, name, value)

    handle.replacement = new_setattr
    handle.assign(CheckpointWrapper, "__setattr__", new_setattr, spec_of(CheckpointWrapper, "__setattr__"))
    handle.assign(
        CheckpointWrapper, "_axolotl_setattr_patched", True, spec_of(CheckpointWrapper, "_axolotl_setattr_patched")
    )
    return handle


# --------------------------------------------------------------------------------------------
# a user's own monkey patch
# --------------------------------------------------------------------------------------------


def own_wrap(spec: str, *, wraps: bool = True) -> Applied:
    """A user's wrapper: ``owner.attr = wrapper`` where the wrapper calls what was there, with
    ``functools.wraps`` (``__wrapped__``, name and docstring copied) or plain. Installed before
    ``import shim`` it sits under the shim's wrapper; after, on top of it. Kind: wrap."""
    owner, attribute = resolve(spec)
    handle = Applied(f"own_wrap({spec})")
    original = getattr(owner, attribute)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        handle.calls += 1
        handle.forwarded += 1
        return original(*args, **kwargs)

    if wraps:
        wrapper = functools.wraps(original)(wrapper)
    handle.replacement = wrapper
    handle.assign(owner, attribute, wrapper, spec)
    return handle


def own_replace(spec: str, replacement: Callable[..., Any]) -> Applied:
    """A user's replacement: ``owner.attr = replacement``, which does not call what was there.
    Kind: replace."""
    owner, attribute = resolve(spec)
    handle = Applied(f"own_replace({spec})")

    def replaced(*args: Any, **kwargs: Any) -> Any:
        handle.calls += 1
        return replacement(*args, **kwargs)

    handle.replacement = replaced
    handle.assign(owner, attribute, replaced, spec)
    return handle


def own_noop(spec: str) -> Applied:
    """A user's ``owner.attr = lambda *a, **k: None`` (e.g. to silence a method). Kind: noop."""
    return own_replace(spec, lambda *args, **kwargs: None)


PATTERNS: dict[str, tuple[Callable[..., Applied], str, str]] = {
    "unsloth_enable_input_require_grads": (
        unsloth_enable_input_require_grads,
        "transformers.modeling_utils:PreTrainedModel.enable_input_require_grads",
        "replace",
    ),
    "unsloth_trl_disable_gradient_checkpointing_noop": (
        unsloth_trl_disable_gradient_checkpointing_noop,
        "trl.models.utils:disable_gradient_checkpointing",
        "noop",
    ),
    "unsloth_unwrap_model_for_generation": (
        unsloth_unwrap_model_for_generation,
        "trl.trainer.grpo_trainer:unwrap_model_for_generation",
        "wrap",
    ),
    "unsloth_decoder_layer_forward": (
        unsloth_decoder_layer_forward,
        "transformers.models.llama.modeling_llama:LlamaDecoderLayer.forward",
        "replace",
    ),
    "unsloth_zoo_checkpoint": (
        unsloth_zoo_checkpoint,
        "transformers.modeling_utils:checkpoint",
        "replace",
    ),
    "unsloth_instance_checkpointing_enable": (
        unsloth_instance_checkpointing_enable,
        "transformers.modeling_utils:PreTrainedModel.gradient_checkpointing_enable",
        "wrap",
    ),
    "axolotl_layer_call": (
        axolotl_layer_call,
        "transformers.modeling_layers:GradientCheckpointingLayer.__call__",
        "wrap",
    ),
    "axolotl_modeling_utils_checkpoint": (
        axolotl_modeling_utils_checkpoint,
        "transformers.modeling_utils:checkpoint",
        "replace",
    ),
    "axolotl_prepare_model_for_kbit_training": (
        axolotl_prepare_model_for_kbit_training,
        "peft.utils.other:prepare_model_for_kbit_training",
        "replace",
    ),
    "axolotl_checkpoint_wrapper_setattr": (
        axolotl_checkpoint_wrapper_setattr,
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointWrapper.__setattr__",
        "wrap",
    ),
    "own_wrap": (own_wrap, "<spec>", "wrap"),
    "own_replace": (own_replace, "<spec>", "replace"),
    "own_noop": (own_noop, "<spec>", "noop"),
}
