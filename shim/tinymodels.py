"""Tiny models built in code, and the steps taken on them: one module for the self-checks of
``python -m shim doctor``, the tests and the benchmarks. Nothing is downloaded.

torch, transformers and peft are imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

Grads = dict[str, Any]  # parameter name -> gradient (None where autograd left none)


def quiet_transformers() -> None:
    """Silence transformers' progress bars and info logs for a readable report (if it is there)."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def tiny_llama_config(**overrides: Any) -> Any:
    """A Llama config small enough to build, save and load in milliseconds on CPU."""
    from transformers import LlamaConfig

    values: dict[str, Any] = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_llama(layers: int = 4, **overrides: Any) -> Any:
    """A ``LlamaForCausalLM`` of :func:`tiny_llama_config` with ``layers`` decoder layers."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers, **overrides))


def frozen_llama_class() -> type:
    """A Llama class whose ``__init__`` freezes the embeddings and the first decoder layer."""
    from transformers import LlamaForCausalLM

    class FrozenBaseLlama(LlamaForCausalLM):  # type: ignore[misc]
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model.embed_tokens.requires_grad_(False)
            self.model.layers[0].requires_grad_(False)

    return FrozenBaseLlama


def frozen_input_llama(layers: int = 3) -> tuple[Any, Callable[[Any], Any]]:
    """A Llama driven with ``inputs_embeds`` from its frozen embeddings, layer 0 frozen: the inputs
    of layer 1 require no grad. Returns ``(model, loss_of)``."""
    import torch

    torch.manual_seed(0)
    model = tiny_llama(layers)
    model.train()
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        embeds = model.model.embed_tokens(input_ids)

    def loss_of(m: Any) -> Any:
        return m(inputs_embeds=embeds, labels=input_ids).loss

    return model, loss_of


def tiny_qwen2_vl(depth: int = 2, width: int = 32, image: int = 8) -> tuple[Any, dict[str, Any]]:
    """A tiny Qwen2-VL in training mode (2 text layers; a vision tower of ``depth`` blocks of
    ``width``) and the forward's keyword arguments for one ``image`` x ``image`` image."""
    import inspect

    import torch
    import transformers

    text: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text |= dict(num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024, bos_token_id=1)
    text |= dict(eos_token_id=2, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})
    vision: dict[str, Any] = dict(
        depth=depth, embed_dim=width, hidden_size=32, num_heads=max(2, width // 32), mlp_ratio=2
    )
    vision |= dict(patch_size=2, temporal_patch_size=2)  # hidden_size: the merger's output, the text width
    config = transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=100, video_token_id=101, vision_start_token_id=102
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config)
    model.train()
    side = image // 2  # patches of 2 x 2 pixels
    patches = side * side
    pixel_values = torch.randn(patches, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(1))
    input_ids = torch.tensor([[1, 102] + [100] * (patches // 4) + [5, 6, 7]])  # 2 x 2 patches merge into a token
    grid = torch.tensor([[1, side, side]])  # temporal, height, width in patches
    inputs = dict(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid, labels=input_ids)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # 5.x processors return it
        inputs["mm_token_type_ids"] = (input_ids == 100).long()
    return model, inputs


def vision_tower(model: Any) -> Any:
    """The vision sub-model of a Qwen2-VL model (its place moved within 5.x)."""
    inner = getattr(model, "model", model)
    return inner.visual if hasattr(inner, "visual") else model.visual


def lora_config(**overrides: Any) -> Any:
    """A small ``peft.LoraConfig`` on the attention's q and v projections."""
    from peft import LoraConfig

    values: dict[str, Any] = dict(target_modules=["q_proj", "v_proj"], r=2, lora_alpha=4)
    values.update(overrides)
    return LoraConfig(**values)


def dropout_llama(layers: int = 2, lora_dropout: float | None = 0.3, attention_dropout: float = 0.1) -> Any:
    """A tiny Llama in training mode with dropout active: ``attention_dropout`` in every attention and,
    unless ``lora_dropout`` is ``None``, a PEFT LoRA adapter (:func:`lora_config`) with that dropout.
    Seeded: two builds have the same weights."""
    import torch

    torch.manual_seed(0)
    model = tiny_llama(layers, attention_dropout=attention_dropout)
    if lora_dropout is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(lora_dropout=lora_dropout))
    model.train()
    return model


def dropout_blocks(blocks: int = 2, width: int = 16, p: float = 0.3) -> tuple[Any, Callable[[Any], Any]]:
    """A torch-only stack of residual blocks (``Linear``, ``Dropout(p)``) in training mode, whose class
    names its block class in ``_no_split_modules`` as a transformers model does (so accelerate's
    transformer-based wrap policy finds the blocks), and ``loss_of(model)`` on a fixed input. Seeded."""
    import torch

    class DropoutBlock(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(width, width)
            self.dropout = torch.nn.Dropout(p)

        def forward(self, hidden: Any) -> Any:
            return hidden + self.dropout(torch.tanh(self.linear(hidden)))

    class DropoutStack(torch.nn.Module):  # type: ignore[misc]
        _no_split_modules = ["DropoutBlock"]

        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(DropoutBlock() for _ in range(blocks))

        def forward(self, hidden: Any) -> Any:
            for block in self.blocks:
                hidden = block(hidden)
            return hidden

    torch.manual_seed(0)
    model = DropoutStack()
    model.train()
    inputs = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(inputs).pow(2).mean()


def fsdp2_accelerator(model: Any, offload: bool = False, layer_classes: list[str] | None = None) -> Any:
    """What accelerate's ``fsdp2_apply_ac`` reads of an ``Accelerator``: ``state.fsdp_plugin``, a real
    ``FullyShardedDataParallelPlugin`` (FSDP2, transformer-based wrap, activation checkpointing, with
    ``activation_checkpointing_offload`` when ``offload``) whose auto-wrap policy is set for ``model``,
    as ``Accelerator.prepare`` sets it. ``layer_classes`` replaces the model's ``_no_split_modules`` as
    the classes to wrap. One process, no process group."""
    import types

    from accelerate.utils import FullyShardedDataParallelPlugin

    options: dict[str, Any] = dict(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    options |= dict(activation_checkpointing=True)
    if offload:
        options["activation_checkpointing_offload"] = True
    plugin = FullyShardedDataParallelPlugin(**options)
    if layer_classes is not None:
        plugin.transformer_cls_names_to_wrap = layer_classes
    plugin.set_auto_wrap_policy(model)
    return types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin))


# -- steps ------------------------------------------------------------------------------------------


def enable_checkpointing(model: Any, checkpoint_kwargs: dict[str, Any] | None, **options: Any) -> None:
    """Turn checkpointing on through the model's public API (``activation_*`` where it exists, 5.23+);
    ``None`` kwargs get transformers' default."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs, **options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs, **options)


def keyword_driven_grads(model: Any, input_ids: Any, seed: int = 0) -> Grads:
    """One backward through a ``LlamaForCausalLM`` whose decoder layers are called with
    ``hidden_states=`` as a keyword, as draft models and custom stacks do: every parameter's gradient."""
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    position_embeddings = inner.rotary_emb(hidden, positions)
    for layer in inner.layers:
        out = layer(hidden_states=hidden, position_ids=positions, position_embeddings=position_embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    logits = model.lm_head(inner.norm(hidden))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def trainable_grads(model: Any, loss_of: Callable[[Any], Any], seed: int = 1) -> Grads:
    """One backward of ``loss_of(model)``: the trainable parameters' gradients."""
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_of(model).backward()
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def causal_lm_grads(model: Any, input_ids: Any, seed: int = 1) -> Grads:
    """One backward of the language-modelling loss on ``input_ids``: the trainable parameters'
    gradients, named as without torch's activation wrappers (``_checkpoint_wrapped_module.`` left out),
    so a wrapped model compares with the same model unwrapped."""
    return unwrapped_names(trainable_grads(model, lambda m: m(input_ids=input_ids, labels=input_ids).loss, seed))


def unwrapped_names(grads: Grads) -> Grads:
    """``grads`` named as without torch's activation wrappers (``_checkpoint_wrapped_module.`` left out)."""
    return {name.replace("_checkpoint_wrapped_module.", ""): grad for name, grad in grads.items()}


def wrong_grads(reference: Grads, grads: Grads, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """Names whose gradient is ``None`` or differs from ``reference``."""
    import torch

    wrong = []
    for name, expected in reference.items():
        got = grads[name]
        if got is None or expected is None:
            if got is not expected:
                wrong.append(name)
        elif not torch.allclose(got, expected, rtol=rtol, atol=atol):
            wrong.append(name)
    return wrong


def reentrant_changes_grads(model: Any, grads_of: Callable[[Any], Grads]) -> bool:
    """Whether ``grads_of(model)`` differs once ``model`` checkpoints reentrantly (the self-check of
    the reentrant patches)."""
    reference = grads_of(model)
    with warnings.catch_warnings():
        # torch's "None of the inputs have requires_grad=True" is the bug speaking; keep the report clean
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_* names from 5.23
        enable_checkpointing(model, {"use_reentrant": True})
        checkpointed = grads_of(model)
    return bool(wrong_grads(reference, checkpointed))
