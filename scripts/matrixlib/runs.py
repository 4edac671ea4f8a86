"""Running a cell: its suite and doctor, and the loop that builds and runs the cells in order."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .cells import DEFAULT, REPORTS, ROOT, Cell, build, measured_as, run_env, say, show_build

DISTRIBUTIONS = ("transformers", "trl", "peft", "accelerate", "kernels", "torch", "deepspeed")

# Runs inside a cell: the installed versions and, per patch, what the engine's own gate decides,
# for the patch and for each target that names its own requirement (``Target.requires``, where the
# engine has it). A patch is "inside" when its gate admits the release and at least one target does.
CELL_PROBE = """
import importlib.metadata as md, json, re, shim
from packaging.specifiers import SpecifierSet
from shim import gating
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
patches = []
for name in shim.registry.names:
    patch = shim.registry.patch(name)
    decision = gating.check_versions(patch.distribution, patch.specifier)
    targets = []
    for target in patch.targets:
        requires = getattr(target, "requires", "") or ""
        if requires:
            distribution, specifier = re.match(r"\\s*([A-Za-z0-9_.-]+)\\s*(.*)$", str(requires)).groups()
            gate = gating.check_versions(distribution, SpecifierSet(specifier))
            targets.append(dict(target=target.spec, distribution=distribution, requires=specifier,
                                gated_as=gate.gated_as, admitted=gate.admitted))
        else:
            targets.append(dict(target=target.spec, distribution=None, requires="", gated_as=None, admitted=True))
    patches.append(dict(name=name, distribution=patch.distribution, requires=patch.requires,
                        installed=decision.installed, gated_as=decision.gated_as,
                        admitted=decision.admitted and any(t["admitted"] for t in targets),
                        patch_admitted=decision.admitted, targets=targets,
                        has_probe=bool(patch.probes)))
print(json.dumps(dict(versions={d: version(d) for d in __DISTRIBUTIONS__}, patches=patches)))
""".replace("__DISTRIBUTIONS__", repr(DISTRIBUTIONS))


#: Tests that a cell runs besides each patch's own ``tests/patches/test_<patch module>.py``: the gradient
#: comparisons of the checkpointing family and the everyday workflows with the shim off and on.
EVERYDAY_WORKFLOWS = "tests/do_no_harm/test_do_no_harm.py::test_everyday_workflows_end_as_without_the_shim"
CELL_TESTS = ("tests/patches/test_checkpointing_gradients.py", EVERYDAY_WORKFLOWS)


def cell_tests(cell: Cell | None = None) -> list[str]:
    """What a cell other than the default runs: every patch's own test file (the bug with the patch
    off, the fix with it on, on this cell's releases; a new patch's file is picked up by its name)
    and :data:`CELL_TESTS`, the everyday workflows left to ``cell.workflows_in`` where it names a
    cell. The rest of the suite (the engine, the command line, import orders, processes) is the same
    on every release and runs in the default cell."""
    modules = sorted(path.stem for path in (ROOT / "patches").glob("[a-z]*.py"))
    own = [ROOT / "tests" / "patches" / f"test_{name}.py" for name in modules]
    extra = [test for test in CELL_TESTS if not (test == EVERYDAY_WORKFLOWS and cell and cell.workflows_in)]
    return [str(path.relative_to(ROOT)) for path in own if path.exists()] + extra


def suite_command(cell: Cell) -> list[str]:
    """pytest as the README runs it; outside the default cell :func:`cell_tests` (a focused cell: its
    ``tests``) only, without the ``any_version`` tests among them."""
    command = [str(cell.python), "-m", "pytest", "-q"]
    if cell.name != DEFAULT:
        # One process (-n 0): a minute of tests does not pay for two more interpreters importing the
        # stack, and CI runs the matrix beside the end-to-end tests, which keep the other core busy.
        command += ["-n", "0", "-m", "not e2e and not any_version", *(cell.tests or cell_tests(cell))]
    return command


def run_suite(cell: Cell, out: Path) -> bool:
    with open(out / "pytest.log", "w") as log:
        process = subprocess.Popen(
            suite_command(cell),
            cwd=ROOT,
            env=run_env(cell),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in process.stdout:
            sys.stdout.write(line)
            log.write(line)
        sys.stdout.flush()
    return process.wait() == 0


def run_doctor(cell: Cell, out: Path) -> bool:
    # SHIM_PROBE=always: every patch's bug probe decides at its targets' import as on an unmeasured
    # build, so a probe that disagrees with its gate changes the verdict and fails the gate check.
    env = run_env(cell) | {"SHIM_PROBE": "always"}
    probe = subprocess.run([str(cell.python), "-c", CELL_PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    if probe.returncode:
        say(probe.stdout + probe.stderr)
        return False
    (out / "cell.json").write_text(probe.stdout)
    # One doctor run (the bug probes are the slow part): its table printed and saved, its findings
    # written as JSON beside it by doctor itself.
    found = subprocess.run(
        [str(cell.python), "-m", "shim", "doctor", "--json-file", str(out / "doctor.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    (out / "doctor.txt").write_text(found.stdout)
    say(found.stdout.rstrip("\n"))
    try:
        json.loads((out / "doctor.json").read_text())
    except (OSError, ValueError):
        say(found.stderr)
        say(f"{cell.name}: doctor wrote no JSON findings (exit {found.returncode})")
        return False
    # doctor's own exit code is not the verdict here: a bug left unfixed on purpose outside a gate
    # (constraints/known-unfixed.txt) makes it exit 1; the gate check (gates.py) decides.
    return True


def claim(cell: Cell, share: Path | None) -> bool:
    """Whether this run takes ``cell``: always, unless it shares its cells with another run through the
    folder ``share`` (``--share``), where the first run to create ``share/<cell>`` takes it."""
    if share is None:
        return True
    try:
        os.close(os.open(share / cell.name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def take_and_build(cell: Cell, share: Path | None) -> dict | None:
    """The cell claimed (:func:`claim`), its report folder emptied and the cell built; ``None`` when
    another run took it (its reports are that run's to write)."""
    if not claim(cell, share):
        return None
    out = REPORTS / cell.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if cell.latest:
        start = time.monotonic()
        same = measured_as(cell, out)
        if same:
            return dict(ok=True, code=0, seconds=time.monotonic() - start, same_as=same)
    return build(cell, out)


def build_cells(cells: list[Cell], jobs: int) -> bool:
    """``--build-only``: build the cells, ``jobs`` at a time, and run nothing (CI builds every cell while
    the README's test command runs: most of a build is waiting for downloads)."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(lambda cell: (cell, take_and_build(cell, None)), cells))
    ok = True
    for cell, built in results:
        if built.get("same_as"):
            say(f"{cell.name}: the newest releases are {built['same_as']}'s pins: nothing to build")
            continue
        ok = show_build(cell, REPORTS / cell.name, built) and ok
    return ok


def run_cells(cells: list[Cell], skips: dict, jobs: int, share: Path | None = None) -> list[dict]:
    """Every cell: build, suite (unless ``skips`` says why not), doctor; times each step.

    Builds run ``jobs`` cells ahead of the tests, in the cells' order: while one cell's suite runs,
    the next ones are built (downloads and unpacking overlap the tests). Suites and doctors run one
    cell at a time, in order, so the output reads cell by cell. ``jobs=0``: each cell is built just
    before its tests, nothing overlaps. With ``share``, another run goes through the same cells and
    each cell is run by the one that reaches it first (:func:`claim`): a build ahead claims its
    cell, so a run claims at most ``jobs`` cells it has not started testing.
    """
    records = []
    queue = iter(cells)
    ahead: deque = deque()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:

        def top_up() -> None:
            while len(ahead) < max(1, jobs) and (cell := next(queue, None)) is not None:
                ahead.append((cell, pool.submit(take_and_build, cell, share)))

        top_up()
        while ahead:
            cell, pending = ahead.popleft()
            start = time.monotonic()
            built = pending.result()
            if jobs:
                top_up()  # the next builds run while this cell's tests do
            if built is not None:  # None: the other run took it
                records.append(run_cell(cell, built, time.monotonic() - start, skips.get(cell.name, "")))
            if not jobs:
                top_up()  # the next cell is built now, just before its tests
    return records


def run_cell(cell: Cell, built: dict, waited: float, skip: str) -> dict:
    """A built cell's suite (unless ``skip`` says why not) and doctor, timed; its record."""
    out = REPORTS / cell.name
    say(f"\n=== cell {cell.name} ({cell.constraints.relative_to(ROOT)}, {cell.python.parents[1].relative_to(ROOT)})")
    times = {"setup": built["seconds"], "waited": waited}
    if built.get("same_as"):
        note = f"the newest releases are {built['same_as']}'s pins: measured there"
        say(f"--- {cell.name}: {note} (doctor-reports/{cell.name}/resolved.txt)")
        record = dict(cell=cell.name, ok=True, times=times, note=note, same_as=built["same_as"])
        (out / "times.json").write_text(json.dumps(record))
        return record
    ok = show_build(cell, out, built)
    if ok:
        if cell.suite and not skip:
            start = time.monotonic()
            ok = run_suite(cell, out)
            times["suite"] = time.monotonic() - start
        start = time.monotonic()  # doctor runs even after a failing suite: its report helps
        ok = run_doctor(cell, out) and ok
        times["doctor"] = time.monotonic() - start
    note = "doctor only" if not cell.suite else skip
    record = dict(cell=cell.name, ok=ok, times=times, note=note)
    (out / "times.json").write_text(json.dumps(record))
    say(
        f"--- {cell.name}: {'ok' if ok else 'FAILED'}; setup {times['setup']:.0f}s "
        f"(waited {times['waited']:.0f}s), "
        + ", ".join(f"{k} {times[k]:.0f}s" for k in ("suite", "doctor") if k in times)
        + (f" ({note})" if note else "")
    )
    return record
