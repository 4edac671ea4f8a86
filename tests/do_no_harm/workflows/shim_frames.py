"""Which of the shim's functions run during calls that no patch can need to change:
``python tests/do_no_harm/workflows/shim_frames.py CASE ...``.

A tiny Llama is built and the shim has applied its patches (every target module imported); then
each case runs once untraced (warm-up) and once under ``sys.setprofile``, which records every Python
function entered whose file lies in the ``shim`` package or in ``shim.patches``. Cases: ``eval``
(forward in eval mode under ``no_grad``), ``eval-grad`` (the same with grad mode on), ``generate``
(greedy), ``train`` (forward, backward and an SGD step, no checkpointing; its optimizer made at the
warm-up, the first step, which the first-step audit watches). ``control`` traces
``shim.status()``: it must see shim frames, or the tracer sees nothing.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

import torch

import shim
import shim.patches
from tests import tinymodels
from tests.do_no_harm.workflows import DEVICE, input_ids, quiet, run_cases
from tests.engine_state import watchers_done

ROOTS = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep for module in (shim, shim.patches))


def shim_frames(work) -> list:
    """The shim functions entered while ``work()`` runs (``file:function``, first seen first)."""
    seen: dict = {}

    def profile(frame, event, arg):
        if event == "call":
            filename = os.path.abspath(frame.f_code.co_filename)
            if filename.startswith(ROOTS):
                seen.setdefault(f"{os.path.basename(filename)}:{frame.f_code.co_name}", None)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return list(seen)


def patched_model():
    for row in shim.patches.INDEX:  # every target module there is: each applicable patch applies
        for module in row["modules"]:
            try:
                importlib.import_module(module)
            except ImportError:
                pass
    watchers_done(30)
    torch.manual_seed(0)
    return DEVICE.put(tinymodels.tiny_llama(2))


def traced(work) -> dict:
    work()  # warm-up: first-call work of torch and transformers is not the question
    return {"shim frames": shim_frames(work)}


def run_eval(model, grad: bool) -> None:
    model.eval()
    with torch.set_grad_enabled(grad):
        model(input_ids())


def run_generate(model) -> None:
    model.eval()
    ids = input_ids()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)


def run_train(model) -> None:
    global optimizer
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    ids = input_ids()
    model(ids, labels=ids).loss.backward()
    optimizer.step()


if __name__ == "__main__":
    quiet()
    model = patched_model()
    optimizer = None  # made where training starts: until its first step the first-step audit watches
    applied = sorted(s.name for s in shim.status() if s.state == "applied")
    cases = {
        "applied": lambda: {"patches": applied},
        "eval": lambda: traced(lambda: run_eval(model, grad=False)),
        "eval-grad": lambda: traced(lambda: run_eval(model, grad=True)),
        "generate": lambda: traced(lambda: run_generate(model)),
        "train": lambda: traced(lambda: run_train(model)),
        "control": lambda: {"shim frames": shim_frames(shim.status)},
    }
    run_cases(cases, sys.argv[1:])
