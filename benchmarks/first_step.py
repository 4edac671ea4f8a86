"""What the first-step audit (``shim.audit``) costs: the first training step of a model, and the steps
after it (run by hand, not a test).

The 4-layer model of the step benchmark (``overhead.py``: a Llama of hidden 64, 4 layers, batch
4 x 64 tokens, reentrant checkpointing, AdamW, one torch thread), built fresh for every sample (the
audit runs once per model) from the same weights, outside the timing. A sample is the optimizer's
construction and the first step (forward, backward, ``optimizer.step()``), then the next two steps
timed apart. Three modes, in one process, their order rotated each round:

- ``shim off``: ``shim.disabled()`` (every patch inert) and the audit switched off;
- ``no audit``: the shim on, the audit switched off (``SHIM_DISABLE=first-step-audit``, read when an
  optimizer is made);
- ``audit``:    the shim on, the audit on (the default).

CPU time, median of the per-round ratios with their quartiles (``harness.compare``).

    python benchmarks/first_step.py [--rounds 21]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from harness import QUIET_ENV, compare, table, timed  # benchmarks/, first on sys.path for a script

for _name, _value in QUIET_ENV.items():
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from workloads import STEP_CONFIG as CONFIG  # noqa: E402  (the step benchmark's 4-layer model)
from workloads import STEP_SHAPE as SHAPE  # noqa: E402
from workloads import batch, llama, quiet_libraries  # noqa: E402

import shim  # noqa: E402

MODES = ("shim off", "no audit", "audit")


def sample(mode: str, weights: dict, input_ids) -> tuple[list, list]:
    """``([cpu, wall] of the first step, [cpu, wall] of the next two)`` on a fresh model."""
    from tests.steps import enable_checkpointing

    torch.manual_seed(0)
    model = llama(CONFIG)
    model.load_state_dict(weights)
    enable_checkpointing(model, {"use_reentrant": True})
    model.train()
    if mode == "audit":
        os.environ.pop("SHIM_DISABLE", None)
    else:
        os.environ["SHIM_DISABLE"] = "first-step-audit"
    holder: list = []

    def step() -> None:
        optimizer = holder[0]
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()

    def first() -> None:
        holder.append(torch.optim.AdamW(model.parameters(), lr=1e-3))
        step()

    with shim.disabled() if mode == "shim off" else contextlib.nullcontext():
        one = timed(first)
        later = timed(lambda: [step() for _ in range(2)], per=2)
    os.environ.pop("SHIM_DISABLE", None)
    return one, later


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args(argv)
    quiet_libraries()
    torch.set_num_threads(1)
    weights = llama(CONFIG).state_dict()
    input_ids = batch(CONFIG, SHAPE)
    for mode in MODES:  # warm up every path once
        sample(mode, weights, input_ids)
    firsts: dict[str, list] = {mode: [] for mode in MODES}
    laters: dict[str, list] = {mode: [] for mode in MODES}
    for index in range(args.rounds):
        for mode in MODES[index % 3 :] + MODES[: index % 3]:
            one, later = sample(mode, weights, input_ids)
            firsts[mode].append(one)
            laters[mode].append(later)
    rows = []
    for label, samples in (("first step", firsts), ("a later step", laters)):
        for on, off in (("audit", "no audit"), ("audit", "shim off"), ("no audit", "shim off")):
            result = compare(samples[on], samples[off])
            rows.append(
                [
                    f"{label}: {on} / {off}",
                    f"{result['on'] * 1e3:.2f}",
                    f"{result['off'] * 1e3:.2f}",
                    f"{result['ratio']:.3f}",
                    f"{result['ratio_q25']:.3f}-{result['ratio_q75']:.3f}",
                    f"{result['noise']:.0%}",
                    str(result["n"]),
                ]
            )
    print(f"torch {torch.__version__}, CPU, one thread; {args.rounds} rounds; ms of CPU time")
    print(table(rows, ["comparison", "on ms", "off ms", "ratio", "ratio IQR", "noise", "n"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
