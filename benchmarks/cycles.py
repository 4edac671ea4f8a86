#!/usr/bin/env python
"""N disable/enable cycles of checkpointing on a 4-layer tiny Llama, nothing else, for counting
instructions (repeatable, unlike time on a shared machine):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/cycles.py 0
    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/cycles.py 400

(the second total minus the first, over 400: instructions per cycle; ``SHIM_DISABLE=all`` for off;
``PYTHONHASHSEED=0`` for the same hashes in every run). The objects made before the loop are moved
out of the garbage collector's sight (``gc.freeze()``), so a collection in the loop costs what the
loop made, not the size of the heap torch and transformers leave behind.
"""

from __future__ import annotations

import gc
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shim  # noqa: E402,F401  (as a training script starts)
from shim.tools.targets import quiet_transformers  # noqa: E402
from tests.tinymodels import tiny_llama  # noqa: E402

quiet_transformers()
warnings.simplefilter("ignore")
model = tiny_llama(4)
model.train()
kwargs = {"use_reentrant": True}
model.activation_checkpointing_enable(kwargs)
gc.collect()
gc.freeze()
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 200):
    model.activation_checkpointing_disable()
    model.activation_checkpointing_enable(kwargs)
