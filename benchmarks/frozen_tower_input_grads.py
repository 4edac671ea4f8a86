"""Benchmark of the ``frozen-tower-input-grads`` patch (run by hand, not a test).

One training step (forward + backward) of a small Qwen2-VL whose vision tower is frozen and whose
language model trains, the usual LoRA set-up of a VLM, with gradient checkpointing enabled
(transformers' default kwargs), in two modes of the same process:

- ``upstream``: the patch switched off (``shim.disabled("frozen-tower-input-grads")``): the tower's
  input embeddings are hooked, its output requires grad, and backward runs through its blocks;
- ``shim``:     the patch on: the frozen tower stays out of backward.

Gradients are checked first: bit-identical in both modes. Modes are interleaved round by round;
the median step time and the median peak memory of a step (peak resident set size above the
resident size before the step, reset through ``/proc/self/clear_refs``; Linux only) are printed,
with their ratio. glibc's dynamic mmap threshold would keep freed activations in the heap and
blur the peaks, so the script re-executes itself with ``MALLOC_MMAP_THRESHOLD_`` fixed.

It also times the patch's hook on the frozen tower's embeddings alone (it walks the tower's
parameters on every forward) against upstream's.

    python benchmarks/frozen_tower_input_grads.py [--rounds 7] [--depth 8] [--width 128] [--image 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
import warnings
from pathlib import Path

from harness import fixed_mmap_threshold, timed_step  # benchmarks/, first on sys.path for a script

fixed_mmap_threshold()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
import transformers.modeling_utils  # noqa: E402,F401  (the patch applies on this import)

import shim  # noqa: E402  (first, as a user would)
from shim.patches._checkpointing_calls import enable  # noqa: E402
from shim.tools.targets import quiet_transformers  # noqa: E402
from tests.tinymodels import tiny_qwen2_vl, vision_tower  # noqa: E402

NAME = "frozen-tower-input-grads"
MODES = ("upstream", "shim")


def step(model, inputs, mode: str) -> dict:
    model.zero_grad(set_to_none=True)
    if mode == "upstream":
        with shim.disabled(NAME):
            model(**inputs).loss.backward()
    else:
        model(**inputs).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def measure(model, inputs, mode: str) -> tuple[float, int]:
    model.zero_grad(set_to_none=True)
    return timed_step(lambda: step(model, inputs, mode))


def hook_cost(model, inputs, repeats: int = 2000) -> tuple[float, float]:
    """Microseconds per call of the forward hooks on the frozen tower's embeddings, shim vs upstream."""
    embeddings = vision_tower(model).get_input_embeddings()
    output = embeddings(inputs["pixel_values"]).detach()
    hooks = list(embeddings._forward_hooks.values())

    def call():
        for hook in hooks:
            hook(embeddings, (), output)

    def best():
        return min(timeit.repeat(call, number=repeats, repeat=5)) / repeats * 1e6

    with_shim = best()
    with shim.disabled(NAME):  # the same hook objects, handing over to upstream's hook
        upstream = best()
    return with_shim, upstream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--depth", type=int, default=8, help="vision blocks")
    parser.add_argument("--width", type=int, default=128, help="vision embedding width")
    parser.add_argument("--image", type=int, default=64, help="image side in pixels (2x2 patches)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a shared machine's noise down)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    quiet_transformers()
    warnings.simplefilter("ignore")
    model, inputs = tiny_qwen2_vl(options.depth, options.width, options.image)
    vision_tower(model).requires_grad_(False)  # the frozen tower, the language model training
    enable(model, None)  # transformers' default checkpointing kwargs
    assert shim.registry.is_on(NAME), shim.status()

    # Correctness first (and warm-up): the same gradients, bit for bit.
    upstream, patched = step(model, inputs, "upstream"), step(model, inputs, "shim")
    assert upstream.keys() == patched.keys() and all(torch.equal(upstream[k], patched[k]) for k in upstream)

    times = {mode: [] for mode in MODES}
    peaks = {mode: [] for mode in MODES}
    for round_ in range(options.rounds):
        for mode in MODES if round_ % 2 == 0 else tuple(reversed(MODES)):
            seconds, peak = measure(model, inputs, mode)
            times[mode].append(seconds)
            peaks[mode].append(peak)

    tower = vision_tower(model)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
        f"Qwen2-VL vision depth={options.depth} width={options.width} "
        f"({sum(p.numel() for p in tower.parameters()):,} frozen parameters), "
        f"image {options.image}x{options.image} ({int(inputs['image_grid_thw'].prod())} patches), "
        f"{options.rounds} interleaved rounds; gradients bit-identical"
    )
    print(f"{'mode':<10} {'step (ms)':>10} {'peak (MiB)':>11}")
    for mode in MODES:
        print(
            f"{mode:<10} {statistics.median(times[mode]) * 1e3:>10.1f} {statistics.median(peaks[mode]) / 1024:>11.1f}"
        )
    time_ratio = statistics.median(times["shim"]) / statistics.median(times["upstream"])
    peak_ratio = statistics.median(peaks["shim"]) / max(1, statistics.median(peaks["upstream"]))
    print(f"shim / upstream: time {time_ratio:.2f}, peak memory {peak_ratio:.2f}")
    with_shim, bare = hook_cost(model, inputs)
    print(
        f"embedding hook on the frozen tower: {with_shim:.1f} µs with the shim (walks "
        f"{sum(1 for _ in tower.parameters())} parameters), {bare:.1f} µs upstream"
    )


if __name__ == "__main__":
    main()
