"""Helpers for the tiny models that self-checks (``python -m shim doctor``) and tests build in code.

Imports torch and transformers only inside functions: importing this module costs nothing.
"""

from __future__ import annotations

from typing import Any


def quiet_transformers() -> None:
    """Silence transformers' progress bars and info logs for a readable doctor report (if it is there)."""
    try:
        import transformers
    except ImportError:
        return

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def tiny_llama_config(**overrides: Any) -> Any:
    """A Llama config small enough to build, save and load in milliseconds on CPU."""
    from transformers import LlamaConfig

    values = dict(
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
