#!/usr/bin/env python
"""N disable/enable cycles of checkpointing on a 4-layer tiny Llama, nothing else, for counting
instructions (repeatable, unlike time on a shared machine):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/cycles.py 0
    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/cycles.py 200

(the second total minus the first, over 200: instructions per cycle; ``SHIM_DISABLE=all`` for off).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shim  # noqa: E402,F401  (as a training script starts)
from shim.selfcheck.models import quiet_transformers, tiny_llama  # noqa: E402

quiet_transformers()
warnings.simplefilter("ignore")
model = tiny_llama(4)
model.train()
kwargs = {"use_reentrant": True}
model.activation_checkpointing_enable(kwargs)
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 200):
    model.activation_checkpointing_disable()
    model.activation_checkpointing_enable(kwargs)
