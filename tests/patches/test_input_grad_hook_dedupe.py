"""input-grad-hook-dedupe: at most one input-require-grads hook on the embeddings over any number of cycles."""

import pytest

import shim
from shim.patches._checkpointing_calls import disable, enable
from shim.patches.input_grad_hook_dedupe import input_hook_count
from tests.patches.checkpointing_cases import DISABLE, ENABLE, TRANSFORMERS, configure, quietly, tiny_llama

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


@pytest.mark.skipif(TRANSFORMERS.major < 5, reason="version rule: hooks pile up from transformers 5.0")
def test_hook_dedupe_counts_hooks_it_removed(ledger):
    model = tiny_llama()
    configure(model, {"use_reentrant": False})
    assert ledger("input-grad-hook-dedupe") == (0, "")
    for _ in range(3):
        quietly(disable, model)
        quietly(enable, model, {"use_reentrant": False})
    count, last = ledger("input-grad-hook-dedupe")
    assert count == 3
    assert last.startswith("removed 1 input-require-grads hook(s) that LlamaForCausalLM still held")
