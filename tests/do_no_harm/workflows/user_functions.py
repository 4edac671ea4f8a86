"""Code of a user's own, for the workflows and the tests: checkpoint functions as training
frameworks write them (LlamaFactory's, axolotl's, a closure, a ``functools.partial`` of a
module-level function), and a graph break in every decoder layer.

A layer calls its checkpoint function as ``function(func, *args)``, ``func`` a ``functools.partial``
of the layer's call with its keyword arguments: ``partial(forward, layer, **kwargs)`` from
transformers 5.23, ``partial(<bound __call__>, **kwargs)`` up to 5.22. The functions here that
checkpoint a :func:`copied` partial do what a user's function may do with it: copy it, copy the
function under it, deep-copy it with its layer kept.

Nothing of the shim is imported here: a saved model given one of these functions refers to it by
name, and ``saved_models.py`` loads it where ``import shim`` fails.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch.utils.checkpoint


def layer_of(func):
    """The layer a checkpoint function is handed: ``func.args[0]`` from transformers 5.23, the
    ``__self__`` of ``func.func`` up to 5.22."""
    return func.args[0] if func.args else func.func.__self__


def copied(func):
    """``func`` copied as a user's function may copy it: ``copy.copy`` of the partial and (from 5.23,
    where ``func.func`` is the class's ``forward``) of the function under it, then ``copy.deepcopy``
    of the result with its layer kept (a deep copy of the layer would train a copy of its weights)."""
    layer = layer_of(func)
    shallow = copy.copy(func)
    if shallow.args:  # up to 5.22 func.func is a bound __call__, and a copy of it calls the layer again
        shallow = functools.partial(copy.copy(shallow.func), *shallow.args, **shallow.keywords)
    return copy.deepcopy(shallow, {id(layer): layer})


def checkpoint_layer(function, *args, **kwargs):
    """torch's non-reentrant checkpoint, at module level (a saved model refers to it by name)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def checkpoint_a_copy(function, *args, use_reentrant: bool, **kwargs):
    """torch's checkpoint of :func:`copied` ``function``; used as ``partial(checkpoint_a_copy,
    use_reentrant=...)``, a partial of a module-level function."""
    return torch.utils.checkpoint.checkpoint(copied(function), *args, use_reentrant=use_reentrant, **kwargs)


def closure(use_reentrant: bool):
    """A closure around torch's checkpoint of :func:`copied` ``function``."""

    def checkpoint_closure(function, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(copied(function), *args, use_reentrant=use_reentrant, **kwargs)

    return checkpoint_closure


def checkpoint_trainable_layers(function, *args, **kwargs):
    """Written for transformers >= 5.23: finds its layer as ``function.args[0]`` and checkpoints
    (non-reentrant) only a layer with a trainable parameter."""
    layer = function.args[0]
    if any(parameter.requires_grad for parameter in layer.parameters()):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    return function(*args, **kwargs)


@contextlib.contextmanager
def graph_break_in_every_layer():
    """``LlamaMLP.forward`` replaced, inside the block, by one that breaks dynamo's graph
    (``torch._dynamo.graph_break()``) and then runs the original: a graph break inside every decoder
    layer, as a ``print``, a ``.item()`` or a custom kernel there makes. Put back after the block."""
    from transformers.models.llama import modeling_llama

    cls = modeling_llama.LlamaMLP
    saved, original = vars(cls)["forward"], cls.forward

    def forward(self, x):
        torch._dynamo.graph_break()
        return original(self, x)

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = saved


#: The functions of a user's own the compiled workflow sets with ``_set_gradient_checkpointing``
#: (non-reentrant, as upstream compiles them), by name.
NON_REENTRANT = {
    "closure": closure(use_reentrant=False),
    "partial": functools.partial(checkpoint_a_copy, use_reentrant=False),
    "args0": checkpoint_trainable_layers,
}
