"""Everyday workflows that ``tests/do_no_harm/test_do_no_harm.py`` runs in fresh interpreters, once with
``SHIM_DISABLE=all`` and once with the shim on: each script imports ``shim`` as a training script
does, runs the cases named on its command line and prints one line, :data:`MARK` and a JSON object
of ``{case: record}``. A record has ``ok``, ``error`` (``"Type: message"`` or ``None``), ``seconds``
and ``cpu`` (its wall and CPU time), and what the case produced (tokens, losses, digests of weights and gradients), nothing that
differs between two runs of the same computation.

Models come from ``tests/tinymodels.py`` and ``tests.tinymodels``; torch runs on one thread, so a
computation repeats bit for bit. They run on the suite's test device (:data:`DEVICE`, ``tests/devices.py``:
``SHIM_TEST_DEVICE``), made to repeat itself there too (:func:`tests.devices.deterministic`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from collections.abc import Callable

from tests import devices

MARK = "do-no-harm-result: "
DEVICE = devices.from_environment()
SEED_INPUTS = 1


def quiet() -> None:
    """One thread (repeatable sums, no fight for the shared cores) and no upstream chatter."""
    import warnings

    import torch

    from shim.tools.targets import quiet_transformers

    torch.set_num_threads(1)
    devices.deterministic(DEVICE)
    quiet_transformers()
    warnings.simplefilter("ignore")


def input_ids(rows: int = 2, length: int = 8, vocab: int = 64, device: devices.Device = DEVICE):
    """Token ids, on the test device unless ``device`` says otherwise."""
    import torch

    return device.put(torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(SEED_INPUTS)))


def digest(tensors) -> str:
    """A hash of named tensors (a ``{name: tensor or None}`` dict, or a list of such dicts), bit for bit."""
    import torch

    sha = hashlib.sha256()
    for group in tensors if isinstance(tensors, list) else [tensors]:
        for name, tensor in group.items():
            sha.update(name.encode())
            if tensor is None:
                sha.update(b"<none>")
            else:
                value = tensor.detach().to("cpu", torch.float32).contiguous()
                sha.update(str(tuple(value.shape)).encode())
                sha.update(value.numpy().tobytes())
    return sha.hexdigest()[:16]


def weights(model) -> dict:
    return {name: p for name, p in model.named_parameters()}


def grads(model) -> dict:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def error_of(exc: BaseException) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message[:300]}"


def run_cases(cases: dict[str, Callable[[], dict]], names: list[str]) -> None:
    """Run the named cases one after the other, each caught on its own, and print the results."""
    results = {}
    for name in names:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            record = {"ok": True, "error": None, **cases[name]()}
        except Exception as exc:  # the outcome is the record
            record = {"ok": False, "error": error_of(exc), "where": traceback.format_exc()[-1500:]}
        record["seconds"] = round(time.perf_counter() - start, 2)
        record["cpu"] = round(time.process_time() - cpu, 2)
        results[name] = record
        if "torch._dynamo" in sys.modules:  # the next case compiles from scratch
            sys.modules["torch._dynamo"].reset()
    print(MARK + json.dumps(results), flush=True)
