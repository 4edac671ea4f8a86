#!/usr/bin/env python
"""K first steps on fresh models of ``first_step.py``'s workload, nothing else, for counting
instructions (repeatable, unlike time on a shared machine):

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/first_step_instructions.py 0
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/first_step_instructions.py 8
    ... --build-only 8

The K + 1 models are built first (one takes its first step as a warm-up); then each of the K takes
its first step (an AdamW made, forward, backward, step), the heap frozen before that loop. (total(8)
- total(0) - (build-only(8) - total(0))) / 8 is one first step; ``SHIM_DISABLE=first-step-audit`` for
the audit off. docs/performance.md, "The first-step audit", has the figures.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from workloads import STEP_CONFIG as CONFIG  # noqa: E402
from workloads import STEP_SHAPE as SHAPE  # noqa: E402
from workloads import batch, llama, quiet_libraries  # noqa: E402

import shim  # noqa: E402,F401  (as a training script starts)
from tests.steps import enable_checkpointing  # noqa: E402

quiet_libraries()
torch.set_num_threads(1)
build_only = "--build-only" in sys.argv
count = int([arg for arg in sys.argv[1:] if not arg.startswith("--")][0])
weights = llama(CONFIG).state_dict()
input_ids = batch(CONFIG, SHAPE)
models = []
for _ in range(count + 1):
    torch.manual_seed(0)
    model = llama(CONFIG)
    model.load_state_dict(weights)
    enable_checkpointing(model, {"use_reentrant": True})
    models.append(model.train())


def first_step(model) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()


first_step(models.pop())  # warm-up: first-call work of torch and transformers is not the question
gc.collect()
gc.freeze()
for model in [] if build_only else models:
    first_step(model)
