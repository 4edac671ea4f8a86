"""The tiny models the tests and the benchmarks build in code (nothing is downloaded), and the one
step only the tests take on them; the steps taken on them are in ``tests/steps.py``. torch,
transformers, peft and trl are imported inside the functions. Nothing here ships: the bug probes
build bare models of their own (``shim.selfcheck.bare``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from tests.steps import Grads, trainable_grads, unwrapped_names


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
        from tests.steps import enable_checkpointing

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


def tiny_qwen2(layers: int = 2) -> Any:
    """A ``Qwen2ForCausalLM`` the size of ``tiny_llama`` (q/k/v projections with biases)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config)


def add_branch(model: Any, index: int = 1) -> Any:
    """Give decoder layer ``index`` of a tiny decoder a trainable sub-module used on some calls only,
    as routed or modality-specific blocks have: its MLP adds ``branch.extra(x)`` while
    ``branch.active`` is true (it starts false). Returns the branch."""
    import torch

    class Branch(torch.nn.Module):  # type: ignore[misc]
        def __init__(self, base: Any, width: int) -> None:
            super().__init__()
            self.base = base
            self.extra = torch.nn.Linear(width, width, bias=False)
            self.active = False

        def forward(self, x: Any) -> Any:
            out = self.base(x)
            return out + self.extra(x) if self.active else out

    layer = model.model.layers[index]
    layer.mlp = Branch(layer.mlp, model.config.hidden_size)
    return layer.mlp


def dropout_llama(layers: int = 2, lora_dropout: float | None = 0.3, attention_dropout: float = 0.1) -> Any:
    """A tiny Llama in training mode with dropout active: ``attention_dropout`` in every attention and,
    unless ``lora_dropout`` is ``None``, a PEFT LoRA adapter (``lora_config``) with that dropout.
    Seeded: two builds have the same weights. No KV cache, as a training script sets it: transformers
    4.x builds one in every forward, and a recompute outside its own checkpointing would grow it."""
    import torch

    torch.manual_seed(0)
    model = tiny_llama(layers, attention_dropout=attention_dropout, use_cache=False)
    if lora_dropout is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(lora_dropout=lora_dropout))
    model.train()
    return model


SFT_WORDS = "<pad> <unk> <bos> <eos> hi how are you what is your name i am fine my cat the dog a mat".split()


def word_tokenizer(words: list[str]) -> Any:
    """A word-level tokenizer of ``words`` split on whitespace, built in code (nothing downloaded);
    ``words`` starts with ``<pad> <unk> <bos> <eos>``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def sft_inputs(layers: int = 2) -> tuple[Any, Any, Any]:
    """What a trl ``SFTTrainer`` needs, built in code: a word-level tokenizer of :data:`SFT_WORDS`, a
    tiny Llama sized to it (seeded: two builds are equal) and a two-row ``datasets.Dataset`` of text."""
    import datasets  # type: ignore[import-untyped]
    import torch
    import transformers

    tokenizer = word_tokenizer(SFT_WORDS)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        tiny_llama_config(
            num_hidden_layers=layers, vocab_size=len(SFT_WORDS), pad_token_id=0, bos_token_id=2, eos_token_id=3
        )
    )
    dataset = datasets.Dataset.from_dict(
        {"text": ["hi how are you i am fine", "what is your name my cat the dog a mat"]}
    )
    return tokenizer, model, dataset


def causal_lm_grads(model: Any, input_ids: Any, seed: int = 1) -> Grads:
    """One backward of the language-modelling loss on ``input_ids``: the trainable parameters'
    gradients, named as without torch's activation wrappers (``_checkpoint_wrapped_module.`` left out),
    so a wrapped model compares with the same model unwrapped."""
    return unwrapped_names(trainable_grads(model, lambda m: m(input_ids=input_ids, labels=input_ids).loss, seed))
