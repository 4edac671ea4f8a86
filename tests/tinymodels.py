"""The tiny models only the tests build, and the one step only they take on them; what the
self-checks of ``python -m shim doctor`` build too ships in ``shim.selfcheck`` (``models``,
``steps``), which these build on. Nothing is downloaded; torch, transformers, peft and trl are
imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from shim.selfcheck.models import lora_config, tiny_llama, tiny_llama_config
from shim.selfcheck.steps import Grads, trainable_grads, unwrapped_names


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
