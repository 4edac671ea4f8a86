"""Benchmark of the ``replaced-forward-keeps-checkpointing`` patch (run by hand, not a test).

One training step (forward + backward) of a small Llama (hidden 256, 4 layers, batch 4 x 256
tokens, one torch thread) whose decoder-layer class had its ``forward`` replaced after import by a
plain function calling the original, with non-reentrant checkpointing enabled, in the same process:

- ``upstream``: enabled with the patch switched off: no layer checkpoints, every activation is kept;
- ``shim``:     enabled with the patch on: the replacement runs inside transformers' checkpoint;
- ``stock``:    no replacement, checkpointing on (what the run should cost);
- ``none``:     no replacement, no checkpointing.

Before each step the class gets the replacement again (the patch changes the class), and the
model's checkpointed layer calls are counted. Modes are interleaved round by round; the median step
time and peak memory of a step (peak resident set size above the size before it,
``/proc/self/clear_refs``; Linux only) are printed. glibc's dynamic mmap threshold would keep freed
activations in the heap and blur the peaks, so the script re-executes itself with
``MALLOC_MMAP_THRESHOLD_`` fixed.

    python benchmarks/replaced_forward.py [--rounds 7] [--layers 4] [--hidden 256] [--seq 256] [--batch 4]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import warnings
from pathlib import Path

from harness import fixed_mmap_threshold, timed_step  # benchmarks/, first on sys.path for a script

fixed_mmap_threshold()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

import shim  # noqa: E402  (first, as a user would)
from shim.tools.targets import quiet_transformers  # noqa: E402
from tests.steps import checkpointed_layer_calls, enable_checkpointing  # noqa: E402
from tests.tinymodels import tiny_llama  # noqa: E402

NAME = "replaced-forward-keeps-checkpointing"
MODES = ("upstream", "shim", "stock", "none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    options = parser.parse_args()
    torch.set_num_threads(1)
    quiet_transformers()
    warnings.simplefilter("ignore")
    layer_class = modeling_llama.LlamaDecoderLayer
    stock_forward = vars(layer_class)["forward"]
    original = layer_class.forward

    def replacement(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    sizes = dict(hidden_size=options.hidden, intermediate_size=options.hidden * 4, num_attention_heads=4)
    sizes |= dict(num_key_value_heads=4, vocab_size=1024, max_position_embeddings=options.seq)
    ids = torch.randint(0, 1024, (options.batch, options.seq), generator=torch.Generator().manual_seed(0))

    def prepared(mode: str):
        layer_class.forward = stock_forward if mode in ("stock", "none") else replacement
        torch.manual_seed(0)
        model = tiny_llama(options.layers, **sizes)
        model.train()
        if mode != "none":
            with shim.disabled(NAME) if mode == "upstream" else contextlib.nullcontext():
                enable_checkpointing(model, {"use_reentrant": False})
        return model

    def step(model):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    checkpointed = {}
    for mode in MODES:  # warm-up, and what each mode checkpoints
        model = prepared(mode)
        checkpointed[mode] = checkpointed_layer_calls(model, lambda model=model: step(model))
    times: dict = {mode: [] for mode in MODES}
    peaks: dict = {mode: [] for mode in MODES}
    for round_ in range(options.rounds):
        for mode in MODES if round_ % 2 == 0 else tuple(reversed(MODES)):
            model = prepared(mode)
            seconds, peak = timed_step(lambda model=model: step(model))
            times[mode].append(seconds)
            peaks[mode].append(peak)
            del model
    layer_class.forward = stock_forward
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread; Llama hidden "
        f"{options.hidden}, {options.layers} layers, batch {options.batch} x {options.seq}; {options.rounds} rounds"
    )
    print(f"{'mode':<10} {'checkpointed':>12} {'step (ms)':>10} {'peak (MiB)':>11}")
    for mode in MODES:
        time_ms, peak_mib = statistics.median(times[mode]) * 1e3, statistics.median(peaks[mode]) / 1024
        print(f"{mode:<10} {checkpointed[mode]:>12} {time_ms:>10.1f} {peak_mib:>11.1f}")
    ratio = statistics.median(peaks["shim"]) / max(1, statistics.median(peaks["upstream"]))
    print(f"peak memory, shim / upstream: {ratio:.2f}")


if __name__ == "__main__":
    main()
