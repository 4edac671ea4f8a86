#!/usr/bin/env python
"""Which files' code a checkpointing configuration passes through on its way from an enable call
to ``torch.utils.checkpoint``: what a reader follows to see what becomes of it.

    .venv/bin/python benchmarks/configuration_walk.py

A 2-layer tiny Llama is enabled with ``{"use_reentrant": True}`` (a second time, as in trl's
cycle: the first enable made the decisions), then runs one forward. Every Python frame that holds
that kwargs dict, or a function made of it (a partial whose keywords are it, and anything made of
such a function), in its arguments or locals counts; a file counts once per entry into it from
another file. The walk ends at the first call of ``torch.utils.checkpoint.checkpoint``.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import shim  # noqa: E402,F401  (as a training script starts)
from shim.tools.targets import quiet_transformers  # noqa: E402
from tests.tinymodels import tiny_llama  # noqa: E402


def walk() -> collections.Counter:
    """``{file: times entered}`` for the configuration's way from an enable to torch's checkpoint."""
    model = tiny_llama(2)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model.activation_checkpointing_enable({"use_reentrant": True})
    model(ids, labels=ids).loss.backward()
    model.activation_checkpointing_disable()

    config = {"use_reentrant": True}
    tracked = {id(config)}

    def holds(value) -> bool:
        if id(value) in tracked:
            return True
        made_of = id(getattr(value, "given", None)) in tracked
        if isinstance(value, functools.partial) and (value.keywords == config or made_of):
            tracked.add(id(value))
            return True
        return isinstance(value, (tuple, list)) and any(id(item) in tracked for item in value)

    files: collections.Counter = collections.Counter()
    last: list = [None]

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "checkpoint" and code.co_filename.endswith(os.path.join("torch", "utils", "checkpoint.py")):
            sys.setprofile(None)
        if any(holds(value) for value in list(frame.f_locals.values())):
            name = shown(code.co_filename)
            if last[0] != name:
                files[name] += 1
                last[0] = name

    sys.setprofile(profile)
    try:
        model.activation_checkpointing_enable(config)
        model(ids, labels=ids)
    finally:
        sys.setprofile(None)
    return files


def shown(path: str) -> str:
    """A file as the report names it: relative to the checkout, or to site-packages."""
    if path.startswith(str(ROOT)) and "site-packages" not in path:
        return os.path.relpath(path, ROOT)
    return path.split("site-packages" + os.sep)[-1]


def main() -> None:
    quiet_transformers()
    warnings.simplefilter("ignore")
    files = walk()
    ours = [name for name in files if name.startswith(("shim" + os.sep, "patches" + os.sep))]
    print(f"{len(files)} files ({len(ours)} of the shim's), {sum(files.values())} entries:")
    for name, entries in files.items():
        print(f"  {entries}  {name}")


if __name__ == "__main__":
    main()
