"""The device of the tests that compare gradients or run workflows, from one switch.

``pytest --device cuda`` or ``SHIM_TEST_DEVICE=cuda`` (default ``cpu``): ``tests/conftest.py`` reads
the switch once (:func:`chosen`), hands the in-process tests a :class:`Device` (the ``device``
fixture) and writes the choice back to ``SHIM_TEST_DEVICE`` for the fresh interpreters the
do-no-harm workflows run in, which read it with :func:`from_environment`. On CUDA a test marked
``autocast`` runs twice, in float32 and under bf16 autocast (:func:`variants`); on a CPU it runs once,
as it always did, with the same name.

A comparison with another computation states its tolerance per device (:class:`Tolerances`): the
CPU's is what the suite always used (torch on one thread repeats a computation bit for bit), never
loosened for a device; CUDA's allow for kernels that sum in another order from run to run (atomic
adds in the embedding's and attention's backward); bf16's for autocast's rounding. The CUDA figures
are stated, not yet measured: the device check (``scripts/device-check.sh``) is where they will be.

Standard library only at import (torch inside the functions): the workflows import this before torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

VARIABLE = "SHIM_TEST_DEVICE"
DEVICES = ("cpu", "cuda")
#: The environment of a CUDA run, set before CUDA starts. What CUDA needs to repeat a computation bit
#: for bit in two processes (the do-no-harm workflows compare the shim off and on exactly): cuBLAS's
#: fixed workspace, inductor without on-device benchmarking (its kernels chosen the same way each
#: time). And torch's CUDA checks through NVML: the workflows' interpreters are forked from one that
#: has imported torch (tests/zygote.py), which must not have started CUDA's driver by asking.
CUDA_ENVIRONMENT = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "TORCHINDUCTOR_DETERMINISTIC": "1",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}


def chosen(option: str | None = None, environ: Mapping[str, str] = os.environ) -> str:
    """The test device: the pytest option when given, else ``SHIM_TEST_DEVICE``, else ``cpu``.
    Raises ``ValueError`` naming the valid ones for anything else."""
    raw = option if option is not None else environ.get(VARIABLE, "")
    name = raw.strip().lower() or "cpu"
    if name not in DEVICES:
        where = "--device" if option is not None else VARIABLE
        raise ValueError(f"{where}={raw!r} is not a test device; use one of {', '.join(DEVICES)}")
    return name


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """``(rtol, atol)`` of one comparison with another computation, per device: ``cpu`` as the suite
    has always measured it, ``cuda`` for float32 kernels whose sums change order between runs,
    ``bf16`` under bf16 autocast."""

    cpu: tuple[float, float]
    cuda: tuple[float, float]
    bf16: tuple[float, float]


#: ``tests.steps.wrong_grads``' defaults on a CPU (measured: 0 on a CPU, bit for bit); on
#: CUDA ten times looser in float32, and bf16's half-percent rounding, compounded over a few layers.
GRADIENTS = Tolerances(cpu=(1e-5, 1e-6), cuda=(1e-4, 1e-5), bf16=(5e-2, 1e-2))


@dataclasses.dataclass(frozen=True)
class Device:
    """Where a test runs: ``type`` (``cpu`` or ``cuda``) and whether under bf16 autocast."""

    type: str = "cpu"
    bf16: bool = False

    def __str__(self) -> str:
        return f"{self.type}-bf16" if self.bf16 else self.type

    @property
    def cuda(self) -> bool:
        return self.type == "cuda"

    def put(self, thing: Any) -> Any:
        """A module or tensor on this device (a no-op on a CPU)."""
        return thing if self.type == "cpu" else thing.to(self.type)

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on this device for a ``bf16`` variant, else nothing."""
        if not self.bf16:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(self.type, dtype=torch.bfloat16)

    def tolerance(self, stated: Tolerances = GRADIENTS) -> dict[str, float]:
        """``rtol`` and ``atol`` of ``stated`` for this device, as keywords."""
        rtol, atol = stated.bf16 if self.bf16 else stated.cuda if self.cuda else stated.cpu
        return {"rtol": rtol, "atol": atol}


CPU = Device()  #: the default device, for helpers' defaults


def variants(name: str) -> list[Device]:
    """The devices an ``autocast`` test runs on: on CUDA float32 and bf16 autocast; a CPU's alone."""
    return [Device(name), Device(name, bf16=True)] if name == "cuda" else [Device(name)]


def opt_in(environ: Mapping[str, str] = os.environ) -> set[str]:
    """The parts of ``DO_NO_HARM`` (``full``, ``inductor``): the compile tests' opt-ins."""
    return {part.strip() for part in environ.get("DO_NO_HARM", "").split(",") if part.strip()}


def backends(name: str, opted: set[str]) -> list[str]:
    """The ``torch.compile`` backends the compile tests run on device ``name``: ``eager`` and
    ``aot_eager`` everywhere; ``inductor``, the default backend, on CUDA (Triton kernels), and on a
    CPU only when ``DO_NO_HARM`` opts in (a minute or two per case to compile C++ there)."""
    return ["eager", "aot_eager"] + (["inductor"] if name == "cuda" or "inductor" in opted else [])


def from_environment() -> Device:
    """The test device in a workflow's fresh interpreter (``SHIM_TEST_DEVICE``, set by the suite)."""
    return Device(chosen())


def deterministic(device: Device) -> None:
    """Make CUDA repeat a computation bit for bit, as one CPU thread does (call before the first CUDA
    call; :data:`CUDA_ENVIRONMENT` is in the environment by then). Nothing on a CPU."""
    if not device.cuda:
        return
    import torch

    for key, value in CUDA_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
