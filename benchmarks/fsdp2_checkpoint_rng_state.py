"""Benchmark of the ``fsdp2-checkpoint-rng-state`` patch (run by hand, not a test).

What preserving the RNG state costs a checkpointed layer call. accelerate's ``fsdp2_apply_ac`` wraps
each layer with torch's ``checkpoint_wrapper(layer, preserve_rng_state=False)``; the patch gives the
wrappers that call created the same ``functools.partial`` with ``preserve_rng_state=True``. One run,
one process pinned to one CPU, one torch thread, three rows:

- ``RNG bookkeeping``: what ``preserve_rng_state=True`` adds to a non-reentrant checkpoint on CPU, timed
  alone: ``torch.get_rng_state()`` in forward, and ``torch.random.fork_rng`` (enabled against disabled)
  around ``torch.set_rng_state`` in the recompute (best of 5 ``timeit`` repeats, ns per call);
- ``minimal layer``: ``Linear(16, 16)`` + ``Dropout(0.3)``, where the fixed cost per call shows;
- ``decoder layer``: a Llama decoder layer with attention dropout, hidden 256, batch 4 x 256 tokens.

The two layer rows call the same module through both wrappers (forward, and the backward that
recomputes it), alternating round by round (ABBA); the CPU times are compared as the median of the
per-round ratios (``benchmarks/harness.py``). The gradients are checked first: with the RNG state
preserved they equal the unwrapped module's, without it they differ. On a GPU torch also saves and
restores the RNG state of the inputs' device (not measured here).

    python benchmarks/fsdp2_checkpoint_rng_state.py [--rounds 15] [--threads 1] [--cpu last]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from harness import compare, interleave, per_call_ns, pin, timed  # noqa: E402  (benchmarks/, first on sys.path)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402

from shim.tools.targets import quiet_transformers  # noqa: E402
from tests.tinymodels import tiny_llama  # noqa: E402


def decoder_layer(hidden: int = 256, batch: int = 4, seq: int = 256):
    """A Llama decoder layer with attention dropout 0.1, and its call's arguments (an input that
    requires grad, the position embeddings)."""
    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    model = tiny_llama(
        1,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(64, seq),
        attention_dropout=0.1,
    )
    model.train()
    hidden_states = torch.randn(batch, seq, hidden, requires_grad=True)
    embeddings = model.model.rotary_emb(hidden_states, torch.arange(seq).unsqueeze(0))
    return model.model.layers[0], (hidden_states,), {"position_embeddings": embeddings}


def minimal_layer():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.3))
    layer.train()
    return layer, (torch.randn(1, 16, requires_grad=True),), {}


def call(module, args, kwargs) -> None:
    """Forward through ``module`` and the backward that recomputes it."""
    out = module(*args, **kwargs)
    (out[0] if isinstance(out, tuple) else out).sum().backward()


def grads(module, layer, args, kwargs) -> list:
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    call(module, args, kwargs)
    return [p.grad.clone() for p in layer.parameters()]


def bookkeeping_ns() -> tuple[float, float]:
    """ns per checkpointed call of the CPU RNG handling, preserve_rng_state True and False."""
    saved = torch.get_rng_state()

    def preserving():
        torch.get_rng_state()  # forward: the state the recompute starts from
        with torch.random.fork_rng(devices=[], enabled=True, device_type="cpu"):
            torch.set_rng_state(saved)

    def not_preserving():
        with torch.random.fork_rng(devices=[], enabled=False, device_type="cpu"):
            pass

    return per_call_ns(preserving, 0.5), per_call_ns(not_preserving, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu", default="last", help="CPU to pin to: an index, 'last' or 'none'")
    options = parser.parse_args()
    pinned = pin(options.cpu)
    torch.set_num_threads(options.threads)
    quiet_transformers()
    warnings.simplefilter("ignore")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} thread(s), "
        f"{pinned}, {options.rounds} interleaved rounds"
    )
    print(
        f"{'per layer call':<16} {'False (upstream)':>17} {'True (patch)':>13} {'ratio':>6} {'ratio IQR':>12} {'extra':>10}"
    )
    preserving, not_preserving = bookkeeping_ns()
    extra = (preserving - not_preserving) / 1e3
    print(
        f"{'RNG bookkeeping':<16} {not_preserving / 1e3:>14.2f} µs {preserving / 1e3:>10.2f} µs {'':>6} {'':>12} {extra:>7.1f} µs"
    )
    for label, (layer, args, kwargs), calls in (
        ("minimal layer", minimal_layer(), 200),
        ("decoder layer", decoder_layer(), 1),
    ):
        upstream = checkpoint_wrapper(layer, preserve_rng_state=False)
        patched = checkpoint_wrapper(layer, preserve_rng_state=True)
        reference = grads(layer, layer, args, kwargs)
        assert all(torch.equal(a, b) for a, b in zip(reference, grads(patched, layer, args, kwargs)))
        assert not all(torch.equal(a, b) for a, b in zip(reference, grads(upstream, layer, args, kwargs)))

        def run(module, calls=calls, args=args, kwargs=kwargs):
            def many():
                for _ in range(calls):
                    call(module, args, kwargs)

            return timed(many, per=calls)

        on, off = interleave(lambda: run(patched), lambda: run(upstream), options.rounds)
        result = compare(on, off)
        scale, unit = (1e3, "ms") if result["off"] > 1e-2 else (1e6, "µs")
        extra = (result["ratio"] - 1) * result["off"] * 1e6  # the median ratio, in time
        print(
            f"{label:<16} {result['off'] * scale:>14.2f} {unit} {result['on'] * scale:>10.2f} {unit} "
            f"{result['ratio']:>6.3f} {result['ratio_q25']:>5.3f}-{result['ratio_q75']:<5.3f} {extra:>7.1f} µs"
        )


if __name__ == "__main__":
    main()
