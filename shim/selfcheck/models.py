"""Tiny models built in code: the builders of the self-checks of ``python -m shim doctor``, which the
tests and the benchmarks build too (the steps taken on them are in ``shim.selfcheck.steps``; what
only the tests build, in the repository's ``tests/tinymodels.py``). Nothing is downloaded.

torch, transformers and peft are imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


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


def frozen_input_llama(layers: int = 3, device: str = "cpu") -> tuple[Any, Callable[[Any], Any]]:
    """A Llama driven with ``inputs_embeds`` from its frozen embeddings, layer 0 frozen: the inputs
    of layer 1 require no grad. Returns ``(model, loss_of)``, both on ``device``."""
    import torch

    torch.manual_seed(0)
    model = tiny_llama(layers)
    model.to(device).train()
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.to(device)
    with torch.no_grad():
        embeds = model.model.embed_tokens(input_ids)

    def loss_of(m: Any) -> Any:
        return m(inputs_embeds=embeds, labels=input_ids).loss

    return model, loss_of


@contextlib.contextmanager
def replaced_forward_llama(layers: int = 3, how: str = "function") -> Iterator[Any]:
    """A Llama whose decoder-layer class had its ``forward`` replaced after import (``how``: a plain
    ``"function"``, a ``functools.wraps`` wrapper ``"wraps"``, or a ``"wrapt"`` wrapper), the
    replacement calling the original; checkpointing enabled (non-reentrant). The class is put back
    on exit."""
    import functools

    import torch
    from transformers.models.llama import modeling_llama

    cls = modeling_llama.LlamaDecoderLayer
    saved = vars(cls)["forward"]
    original = cls.forward
    if how == "wrapt":
        import wrapt

        wrapt.wrap_function_wrapper(cls, "forward", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    elif how == "wraps":
        cls.forward = functools.wraps(original)(lambda self, *args, **kwargs: original(self, *args, **kwargs))
    else:
        cls.forward = lambda self, *args, **kwargs: original(self, *args, **kwargs)
    try:
        torch.manual_seed(0)
        model = tiny_llama(layers)
        model.train()
        from .steps import enable_checkpointing

        enable_checkpointing(model, {"use_reentrant": False})
        yield model
    finally:
        cls.forward = saved


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


def kbit_flagged_llama(layers: int = 4, **overrides: Any) -> Any:
    """A :func:`tiny_llama` that peft's ``prepare_model_for_kbit_training`` takes for a 4-bit model:
    it carries the ``is_loaded_in_4bit`` flag a quantized ``from_pretrained`` sets, with float32
    weights (no bitsandbytes, nothing quantized). Seeded: two builds have the same weights."""
    import torch

    torch.manual_seed(0)
    model = tiny_llama(layers, use_cache=False, **overrides)
    model.is_loaded_in_4bit = True
    return model


def lora_config(**overrides: Any) -> Any:
    """A small ``peft.LoraConfig`` on the attention's q and v projections."""
    from peft import LoraConfig

    values: dict[str, Any] = dict(target_modules=["q_proj", "v_proj"], r=2, lora_alpha=4)
    values.update(overrides)
    return LoraConfig(**values)


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
