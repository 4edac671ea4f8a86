"""input-grad-hook-dedupe: at most one input-require-grads hook on the embeddings over any number of cycles."""

import pytest

import shim
from shim.patches.input_grad_hook_dedupe import input_hook_count
from tests.checkpointing_cases import DISABLE, ENABLE, TRANSFORMERS, tiny_llama

pytestmark = pytest.mark.skipif(
    TRANSFORMERS.major < 5, reason="version rule: enable adds the input hook on every call from transformers 5.0"
)


def counts_over_cycles(cycles=10):
    model = tiny_llama()
    getattr(model, ENABLE)({"use_reentrant": False})
    counts = []
    for _ in range(cycles):
        getattr(model, DISABLE)()
        getattr(model, ENABLE)({"use_reentrant": False})
        counts.append(input_hook_count(model))
    return model, counts


def test_hook_count_stays_one_over_ten_cycles():
    with shim.disabled():
        _, upstream = counts_over_cycles()
    assert upstream == list(range(2, 12)), "bug: upstream adds a hook per cycle"

    model, patched = counts_over_cycles()
    assert patched == [1] * 10
    embeddings = model.get_input_embeddings()
    output = embeddings(__import__("torch").tensor([[1, 2]]))
    assert output.requires_grad, "the one hook left still makes the embeddings' output require grad"
