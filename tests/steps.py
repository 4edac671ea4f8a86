"""Steps the tests and the benchmarks take on the tiny models of ``tests/tinymodels.py``: enabling
checkpointing, one backward and its gradients, comparing them, counting checkpointed layer calls.
torch and transformers are imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

Grads = dict[str, Any]  # parameter name -> gradient (None where autograd left none)


def enable_checkpointing(model: Any, checkpoint_kwargs: dict[str, Any] | None, **options: Any) -> None:
    """Turn checkpointing on through the model's public API (``activation_*`` where it exists, 5.23+);
    ``None`` kwargs get transformers' default."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs, **options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs, **options)


def keyword_loss(model: Any, input_ids: Any) -> Any:
    """The next-token loss of a ``LlamaForCausalLM`` whose decoder layers are called with
    ``hidden_states=`` as a keyword, as draft models and custom stacks do."""
    import torch

    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    position_embeddings = inner.rotary_emb(hidden, positions)
    for layer in inner.layers:
        out = layer(hidden_states=hidden, position_ids=positions, position_embeddings=position_embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    logits = model.lm_head(inner.norm(hidden))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def keyword_driven_grads(model: Any, input_ids: Any, seed: int = 0) -> Grads:
    """One backward of :func:`keyword_loss`: every parameter's gradient."""
    import torch

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    keyword_loss(model, input_ids).backward()
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


def checkpointed_layer_calls(model: Any, step: Callable[[], object]) -> int:
    """How many times ``step()`` calls a layer's checkpoint function (counted around what each
    checkpointing layer holds, put back afterwards; written to the layers' ``__dict__``, so that
    counting does not hand them a new function, which the shim's patches would act on)."""
    calls = []
    held = {}

    def counting(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(function)
            return function(*args, **kwargs)

        return call

    for module in model.modules():
        function = module.__dict__.get("_gradient_checkpointing_func")
        if function is not None:
            held[module] = function
            module.__dict__["_gradient_checkpointing_func"] = counting(function)
    try:
        step()
    finally:
        for module, function in held.items():
            module.__dict__["_gradient_checkpointing_func"] = function
    return len(calls)


def layer_finding_checkpoint(checkpoint: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A checkpoint function of the kind training frameworks bring (LlamaFactory's): it finds the
    layer through the partial it is handed (``func.func.__self__``, or ``func.__self__``) and
    checkpoints only layers with a trainable parameter, running the others as they are.
    ``checkpoint`` defaults to torch's, reentrant."""
    import functools

    import torch.utils.checkpoint

    inner = checkpoint or functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)

    def checkpoint_trainable_layers(func: Any, *args: Any, **kwargs: Any) -> Any:
        # raises AttributeError where the partial holds no bound method, as the original does
        owner: Any = func.func if isinstance(func, functools.partial) else func
        layer = owner.__self__
        if any(parameter.requires_grad for parameter in layer.parameters()):
            return inner(func, *args, **kwargs)
        return func(*args, **kwargs)

    return checkpoint_trainable_layers


def unwrapped_names(grads: Grads) -> Grads:
    """``grads`` named as without torch's activation wrappers (``_checkpoint_wrapped_module.`` left out)."""
    return {name.replace("_checkpoint_wrapped_module.", ""): grad for name, grad in grads.items()}


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
