"""What the overhead benchmark runs, shim on and off: ``from_pretrained`` of a saved tiny Llama, a
checkpointed training step with AdamW, greedy ``generate()``, plain disable/enable cycles, and trl's
cycles around generation and around a reference-model forward. Every model comes from ``tests/tinymodels.py``.

torch, transformers, trl and the shim are imported inside the functions: a fresh interpreter
imports this module before its ``import shim``.
"""

from __future__ import annotations

import warnings

#: The training step's model (a 4-layer Llama) and batch: ``overhead.py``'s step and ``first_step.py``.
STEP_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
)
STEP_SHAPE = (4, 64)


def quiet_libraries() -> None:
    """One torch thread, no warnings, no progress bars, no info logs."""
    warnings.simplefilter("ignore")
    import torch

    from shim.tools.targets import quiet_transformers

    torch.set_num_threads(1)
    quiet_transformers()


def llama(config: dict):
    """A ``LlamaForCausalLM`` of ``tests/tinymodels.py`` with the sizes of ``config`` (a dict)."""
    from tests.tinymodels import tiny_llama

    options = dict(config)
    return tiny_llama(options.pop("num_hidden_layers"), **options)


def checkpointing_llama(layers: int, hidden: int, seq: int, **overrides):
    """The Llama the checkpointing benchmarks step (``reentrant_keyword_grads.py``,
    ``checkpoint_memory.py``): ``layers`` layers of width ``hidden``, 4 heads, an intermediate 4 times
    as wide, a vocabulary of 1024, ``seq`` positions. Unseeded: the caller seeds."""
    from tests.tinymodels import tiny_llama

    options = dict(intermediate_size=hidden * 4, num_attention_heads=4, num_key_value_heads=4, vocab_size=1024)
    return tiny_llama(layers, hidden_size=hidden, max_position_embeddings=seq, **options, **overrides)


def save_model(directory: str, layers: int) -> int:
    """Save a tiny Llama of ``layers`` decoder layers for :func:`load`; returns its tensor count."""
    import torch

    from tests.tinymodels import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(layers)
    model.save_pretrained(directory)
    return len(model.state_dict())


def load(directory: str):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(directory)


def training_model(config: dict, reentrant: bool, seed: int = 0):
    """A tiny Llama with checkpointing on, in train mode, with AdamW, and one batch."""
    import torch

    from tests.steps import enable_checkpointing

    torch.manual_seed(seed)
    model = llama(config)
    enable_checkpointing(model, {"use_reentrant": reentrant})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def batch(config: dict, shape: tuple):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, config["vocab_size"], shape, generator=generator)


def train_step(model, optimizer, input_ids) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()


def trl_cycle(model, accelerator, kwargs) -> None:
    """What trl does around every generation step (GRPO, RLOO, online DPO, ...)."""
    import trl.models.utils

    with trl.models.utils.unwrap_model_for_generation(
        model, accelerator, gather_deepspeed3_params=True, gradient_checkpointing_kwargs=kwargs
    ):
        pass


def trl_reference_cycle(model, kwargs) -> None:
    """What trl's DPO/KTO/GRPO do around every reference-model forward."""
    import trl.models.utils

    with trl.models.utils.disable_gradient_checkpointing(model, kwargs):
        pass


def plain_cycle(model, kwargs) -> None:
    """A disable and an enable with a configuration, as user code and trainers call them."""
    model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def generate(model, input_ids, tokens: int):
    """Greedy generation of ``tokens`` new tokens (every token runs every decoder layer)."""
    return model.generate(input_ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)


def inert(function):
    """``function()`` under ``shim.disabled()``: the wrappers stay in place, inert."""
    import shim

    with shim.disabled():
        return function()


def deactivated(function):
    """``function()`` after ``shim.deactivate()``: no layer of the shim's in place, as with
    ``SHIM_DISABLE=all``; activated again afterwards (outside what is timed by the caller's block)."""
    import shim

    shim.deactivate()
    try:
        return function()
    finally:
        shim.activate()
