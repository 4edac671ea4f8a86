"""The cells of the version matrix, where each one lives and how it is built (``scripts/setup.sh``)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "doctor-reports"  # <cell>/: written by runs.py, read by gates.py
DEFAULT = "default"  # the cell .ci/run and the README set up: every test runs there


@dataclass(frozen=True)
class Cell:
    name: str
    venv: str = ""  # default: .venvs/<name>
    suite: bool = True  # False: an edge cell that runs doctor only
    #: A focused cell (the default stack with one package changed): only these tests, instead of
    #: every patch's own (:func:`.runs.cell_tests`), the tests of the patches on that package.
    tests: tuple[str, ...] = ()
    #: What the table of cells says the cell runs, for a focused cell whose tests are too many to name.
    runs: str = ""
    #: Dependencies the cell is built without (``SHIM_EXCLUDE``, uv's ``--excludes``), each with why:
    #: a release that requires a package the package index cannot meet. The table of cells names them.
    without: tuple[tuple[str, str], ...] = ()
    #: Environment variables the cell's suite and doctor run with, each with why (the table of cells
    #: names them): how a release is used without a dependency left out above.
    env: tuple[tuple[str, str, str], ...] = ()
    #: Built from the newest releases on the index when it runs (``constraints/<name>.txt`` names the
    #: packages without pins; the build writes what it resolved to ``doctor-reports/<name>/resolved.txt``).
    #: Its verdict is printed and never fails the matrix; it is not in the tables, the gate check
    #: or the measured ranges: what it measures changes from day to day.
    latest: bool = False
    #: The cell whose run of the everyday workflows stands for this one's: the same patches applied (the
    #: table of cells' columns are equal) on the same layer API, so the shim's code they meet is the same.
    #: The workflows are left out here (50 of a cell's 110 s of tests); the cell's patch tests still run.
    workflows_in: str = ""

    @property
    def constraints(self) -> Path:
        return ROOT / "constraints" / f"{self.name}.txt"

    @property
    def python(self) -> Path:
        return ROOT / (self.venv or f".venvs/{self.name}") / "bin" / "python"


#: The checkpointing families' tests where torch is what changed: the path every layer's checkpoint function
#: takes to ``torch.utils.checkpoint`` (the four patches in its slot, a ``torch.compile``-d class forward
#: checkpointed as often as without the shim, counted outside compiled code), its gradient comparisons, and the
#: two patches whose bug is torch's reentrant checkpoint itself (keyword tensors, frozen inputs). About 125 s on
#: torch 2.15. The torch cells and the latest cell run them; each patch's own other tests depend on
#: transformers, trl and peft, which these cells share with the default cell.
CHECKPOINTING_TESTS = (
    "tests/patches/test_checkpointing_path.py",
    "tests/patches/test_checkpointing_gradients.py",
    "tests/patches/test_reentrant_keyword_grads.py",
    "tests/patches/test_reentrant_frozen_input_grads.py",
)
#: The do-no-harm workflows a new torch can change: ``torch.compile`` of the tiny models with the shim off and on
#: (dynamo meets the shim's objects: 100 s on torch 2.15) and the everyday workflows (50 s). The newest torch runs
#: them (torch2.15).
COMPILE_TESTS = (
    "tests/do_no_harm/test_do_no_harm.py::test_torch_compile_works_as_without_the_shim",
    "tests/do_no_harm/test_do_no_harm.py::test_everyday_workflows_end_as_without_the_shim",
)


#: The cells. Full cells run doctor and the cell's tests (:func:`.runs.cell_tests`). Edge cells run doctor only and sit on the first
#: or last release line of a gate that no full cell measures: trl 0.26 (trl's positional re-enable starts), trl 0.28 (last
#: line before trl 0.29 renames unwrap_model_for_generation), transformers 5.2 and 5.3 (the Trainer's DDP decision in
#: _wrap_model, then in _build_accelerator_args), 5.16 (every_n_layers is sent), 5.22 and 5.23 (the Trainer path before
#: activation_checkpointing_enable, and the override path after). peft0.20 is the transformers 5.24 stack with peft 0.20.0,
#: the last peft line before 0.21.0 fixed adapter trainability (peft-adapter-trainability). edge-trl1.15 is the
#: transformers 5.24 stack with trl 1.15.0, the first trl with selective activation checkpointing (trl-selective-reaches-peft's
#: gate). The default cell is the newest releases: transformers 5.25.0 with kernels 0.19.1 (from_pretrained's default
#: use_kernels path), accelerate 1.16.0, on torch 2.13.0 (CPU). torch2.14 and torch2.15 are the default stack on torch
#: 2.14.1 and 2.15.0 (PyPI's CUDA builds, run on the CPU): doctor and the checkpointing tests, and on the newest torch
#: the do-no-harm workflows too (docs/testing.md says why these). latest is the newest release of everything, torch
#: included, resolved when it runs: doctor and the checkpointing tests, its verdict printed, never failing.
CELLS = (
    Cell("tf4.57-trl0.25"),
    Cell("edge-trl0.26", suite=False),
    Cell("edge-trl0.28", suite=False),
    Cell("tf5.0-trl0.29", workflows_in="tf5.20-trl1.12"),
    Cell("edge-tf5.2", suite=False),
    Cell("edge-tf5.3", suite=False),
    Cell("tf5.14-trl1.0", workflows_in="tf5.20-trl1.12"),
    Cell("edge-tf5.16", suite=False),
    Cell("tf5.20-trl1.12"),
    Cell("edge-tf5.22", suite=False),
    Cell("edge-tf5.23", suite=False),
    Cell("edge-trl1.15", suite=False),
    Cell("peft0.20"),
    Cell("default", venv=".venv"),
    Cell("torch2.14", tests=CHECKPOINTING_TESTS, runs="doctor + checkpointing tests"),
    Cell("torch2.15", tests=CHECKPOINTING_TESTS + COMPILE_TESTS, runs="doctor + checkpointing and do-no-harm tests"),
    Cell("latest", tests=CHECKPOINTING_TESTS, runs="doctor + checkpointing tests", latest=True),
)
BY_NAME = {cell.name: cell for cell in CELLS}


def clean_env(cell: Cell) -> dict:
    """No SHIM_* settings of the developer's, no foreign PYTHONPATH or venv, and bytecode written (the
    cells are built without it: :func:`build`)."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    return {k: v for k, v in os.environ.items() if not k.startswith("SHIM_") and k not in dropped}


def run_env(cell: Cell) -> dict:
    """The environment of the cell's suite and doctor: :func:`clean_env` and the cell's own ``env``."""
    return clean_env(cell) | {name: value for name, value, _ in cell.env}


def build_env(cell: Cell) -> dict:
    """What ``scripts/setup.sh`` needs to build the cell (its venv is set by the caller)."""
    env = clean_env(cell)
    if cell.name != DEFAULT:  # .venv is the README's: built as a user builds it, bytecode included
        env["SHIM_COMPILE"] = "0"
    if cell.without:
        env["SHIM_EXCLUDE"] = " ".join(name for name, _ in cell.without)
    return env


def say(text: str = "") -> None:
    print(text, flush=True)


# -- building a cell ------------------------------------------------------------------------------


def build(cell: Cell, out: Path) -> dict:
    """``scripts/setup.sh`` for the cell, its output in ``setup.log``; runs beside other builds.

    uv hard-links every cell from one cache, torch included, so a cell costs the packages no other
    cell has. A cell gets no bytecode at install (``SHIM_COMPILE=0``): its first interpreter compiles
    what it imports and writes it beside the sources for the next ones, a fraction of compiling the
    whole environment (measured: a tf5.0 cell built in 24 s of wall time and 33 CPU-seconds with
    bytecode, 8 s and 8 CPU-seconds without). The default cell, ``.venv``, is built as the README builds it.
    """
    start = time.monotonic()
    extra = {"SHIM_RESOLVE": str(out / "resolved.txt")} if cell.latest else {}
    code = setup(cell, out / "setup.log", extra)
    return dict(ok=code == 0, code=code, seconds=time.monotonic() - start)


def setup(cell: Cell, log_path: Path, extra: dict) -> int:
    """``scripts/setup.sh`` for the cell's venv, with ``extra`` variables, its output in ``log_path``."""
    env = build_env(cell) | {"SHIM_VENV": str(cell.python.parents[1])} | extra
    with open(log_path, "w") as log:
        return subprocess.run(
            ["bash", "scripts/setup.sh", str(cell.constraints)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode


def normalized(name: str) -> str:
    """A distribution's name as pip compares names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict:
    """``name==version`` lines of a constraints file, by :func:`normalized` name."""
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;#]+)", line)
        if match:
            found[normalized(match.group(1))] = match.group(2)
    return found


#: What a resolution adds beside the packages (uv writes the build tools a package asks for): not a
#: difference between two environments that run the same code.
TOOLING = {"setuptools", "pip", "wheel"}


def measured_as(cell: Cell, out: Path) -> str | None:
    """For the latest cell: resolve the newest releases (``doctor-reports/<cell>/resolved.txt``) and
    return the measured cell pinned to exactly those releases, if one is; it runs in the same matrix,
    so building and testing the same environment again would measure nothing new."""
    if setup(cell, out / "resolve.log", {"SHIM_RESOLVE": str(out / "resolved.txt"), "SHIM_RESOLVE_ONLY": "1"}):
        return None  # the build says why
    newest = {name: v for name, v in pins(out / "resolved.txt").items() if name not in TOOLING}
    for other in CELLS:
        if not other.latest and other.constraints.exists():
            if {name: v for name, v in pins(other.constraints).items() if name not in TOOLING} == newest:
                return other.name
    return None


def show_build(cell: Cell, out: Path, built: dict) -> bool:
    lines = (out / "setup.log").read_text().splitlines()
    if not built["ok"]:
        say("\n".join(lines[-25:]))
        say(f"{cell.name}: setup failed (exit {built['code']}), log in {out / 'setup.log'}")
        return False
    say(lines[-1] if lines else "")
    return True
