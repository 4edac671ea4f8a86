"""Benchmark of the ``reentrant-keyword-grads`` patch (run by hand, not a test).

One training step (forward + backward) of a small Llama whose decoder layers are called with
``hidden_states=`` as a keyword, as draft models and custom stacks do, in four modes:

- ``none``:            no checkpointing (the reference: most memory, least time)
- ``reentrant+shim``:  ``use_reentrant=True``, keyword call, this patch lifting the keyword tensors
- ``non-reentrant``:   ``use_reentrant=False``, keyword call (the patch passes it straight through)
- ``reentrant-pos``:   ``use_reentrant=True`` with ``hidden_states`` positional, the call upstream
                       already gets right: what the patched keyword call should cost

Modes are interleaved round by round; the median step time and the median peak memory of a step
(peak resident set size above the resident size before the step, reset through
``/proc/self/clear_refs``; Linux only) are printed, and ratios to ``none``. The gradients of the
checkpointed modes are checked against ``none`` first. glibc's dynamic mmap threshold would keep
freed activations in the heap and blur the peaks, so the script re-executes itself with
``MALLOC_MMAP_THRESHOLD_`` fixed.

It also times one layer call on the common path (no checkpointing) with the shim's layer in
place and after ``shim.deactivate()``, the per-call cost of the wrapper.

    python benchmarks/reentrant_keyword_grads.py [--rounds 7] [--layers 4] [--hidden 256] [--seq 256] [--batch 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
import warnings
from pathlib import Path

from harness import fixed_mmap_threshold, timed_step  # benchmarks/, first on sys.path for a script
from workloads import checkpointing_llama

fixed_mmap_threshold()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
import transformers.modeling_layers  # noqa: E402,F401  (the patch applies on this import)

import shim  # noqa: E402  (first, as a user would)
from shim.tools.targets import quiet_transformers  # noqa: E402
from tests.steps import enable_checkpointing, keyword_driven_grads, wrong_grads  # noqa: E402

NAME = "reentrant-keyword-grads"
MODES = ("none", "reentrant+shim", "non-reentrant", "reentrant-pos")


def positional_step(model, input_ids) -> None:
    model.zero_grad(set_to_none=True)
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    embeddings = inner.rotary_emb(hidden, positions)
    for layer in inner.layers:
        out = layer(hidden, position_ids=positions, position_embeddings=embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    logits = model.lm_head(inner.norm(hidden))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()


def configure(model, mode: str) -> None:
    if mode == "none":
        if hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()
    else:
        enable_checkpointing(model, {"use_reentrant": mode != "non-reentrant"})


def step(model, input_ids, mode: str) -> None:
    if mode == "reentrant-pos":
        positional_step(model, input_ids)
    else:
        keyword_driven_grads(model, input_ids)


def measure(model, input_ids, mode: str) -> tuple[float, int]:
    configure(model, mode)
    model.zero_grad(set_to_none=True)
    return timed_step(lambda: step(model, input_ids, mode))


def per_call_cost(repeats: int = 20000) -> dict:
    """Microseconds per call of a layer whose forward does nothing, shim layer in place vs removed:
    without checkpointing, and checkpointing (a pass-through function) with no grad keyword tensor."""

    class Light(transformers.modeling_layers.GradientCheckpointingLayer):
        def forward(self, hidden_states, attention_mask=None, use_cache=False):
            return hidden_states

    light = Light()
    light.train()
    hidden = torch.zeros(1, 1, 4, requires_grad=True)
    mask = torch.zeros(1, 1)

    def call():
        light(hidden, attention_mask=mask, use_cache=False)

    def best():
        return min(timeit.repeat(call, number=repeats, repeat=7)) / repeats * 1e6

    results = {}
    for label, checkpointing in (("plain", False), ("checkpointing, not diverted", True)):
        light.gradient_checkpointing = checkpointing
        light._gradient_checkpointing_func = lambda function, *args: function(*args)
        with_shim = best()
        shim.deactivate()
        try:
            without = best()
        finally:
            shim.activate()
        results[label] = (with_shim, without)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a shared machine's noise down)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    quiet_transformers()
    warnings.simplefilter("ignore", FutureWarning)
    assert shim.registry.is_on(NAME), shim.status()

    torch.manual_seed(0)
    model = checkpointing_llama(options.layers, options.hidden, options.seq)
    model.train()
    input_ids = torch.randint(0, model.config.vocab_size, (options.batch, options.seq))

    # Correctness first (and warm-up): every checkpointed mode must give the reference gradients.
    configure(model, "none")
    reference = keyword_driven_grads(model, input_ids)
    for mode in MODES[1:]:
        configure(model, mode)
        step(model, input_ids, mode)
        grads = {name: p.grad for name, p in model.named_parameters()}
        wrong = wrong_grads(reference, grads, rtol=1e-4, atol=1e-6)
        assert not wrong, f"{mode}: {len(wrong)} wrong gradients"
    configure(model, "reentrant+shim")
    with shim.disabled(NAME):
        upstream = keyword_driven_grads(model, input_ids)
    broken = len(wrong_grads(reference, upstream))

    times = {mode: [] for mode in MODES}
    peaks = {mode: [] for mode in MODES}
    for round_ in range(options.rounds):
        order = MODES if round_ % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            seconds, peak = measure(model, input_ids, mode)
            times[mode].append(seconds)
            peaks[mode].append(peak)

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
        f"Llama hidden={options.hidden} layers={options.layers}, batch={options.batch} x seq={options.seq}; "
        f"{options.rounds} interleaved rounds"
    )
    print(f"upstream reentrant with keyword hidden_states: {broken} of {len(reference)} gradients wrong")
    base_time = statistics.median(times["none"])
    base_peak = statistics.median(peaks["none"])
    print(f"{'mode':<16} {'step (ms)':>10} {'time ratio':>10} {'peak (MiB)':>11} {'peak ratio':>10}")
    for mode in MODES:
        t = statistics.median(times[mode])
        p = statistics.median(peaks[mode])
        print(f"{mode:<16} {t * 1e3:>10.1f} {t / base_time:>10.2f} {p / 1024:>11.1f} {p / base_peak:>10.2f}")
    for label, (with_shim, without) in per_call_cost().items():
        print(
            f"layer call ({label}): {with_shim:.2f} µs with the shim layer, {without:.2f} µs without "
            f"(+{with_shim - without:.2f} µs)"
        )


if __name__ == "__main__":
    main()
