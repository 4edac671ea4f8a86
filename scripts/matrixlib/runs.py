"""Running a cell: its suite and doctor, and the loop that builds and runs the cells in order."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .cells import DEFAULT, REPORTS, ROOT, Cell, build, run_env, say, show_build

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
    decision = gating.decide(patch.distribution, patch.specifier)
    targets = []
    for target in patch.targets:
        requires = getattr(target, "requires", "") or ""
        if requires:
            distribution, specifier = re.match(r"\\s*([A-Za-z0-9_.-]+)\\s*(.*)$", str(requires)).groups()
            gate = gating.decide(distribution, SpecifierSet(specifier))
            targets.append(dict(target=target.spec, distribution=distribution, requires=specifier,
                                gated_as=gate.gated_as, admitted=gate.admitted))
        else:
            targets.append(dict(target=target.spec, distribution=None, requires="", gated_as=None, admitted=True))
    patches.append(dict(name=name, distribution=patch.distribution, requires=patch.requires,
                        installed=decision.installed, gated_as=decision.gated_as,
                        admitted=decision.admitted and any(t["admitted"] for t in targets),
                        patch_admitted=decision.admitted, targets=targets,
                        has_self_check=patch.self_check is not None))
print(json.dumps(dict(versions={d: version(d) for d in __DISTRIBUTIONS__}, patches=patches)))
""".replace("__DISTRIBUTIONS__", repr(DISTRIBUTIONS))


#: Tests that a cell runs besides each patch's own ``tests/patches/test_<patch module>.py``: the gradient
#: comparisons of the checkpointing family and the everyday workflows with the shim off and on.
CELL_TESTS = (
    "tests/patches/test_checkpointing_gradients.py",
    "tests/do_no_harm/test_do_no_harm.py::test_everyday_workflows_end_as_without_the_shim",
)


def cell_tests() -> list[str]:
    """What a cell other than the default runs: every patch's own test file (the bug with the patch
    off, the fix with it on, on this cell's releases; a new patch's file is picked up by its name)
    and :data:`CELL_TESTS`. The rest of the suite (the engine, the command line, import orders,
    processes) is the same on every release and runs in the default cell."""
    modules = sorted(path.stem for path in (ROOT / "patches").glob("[a-z]*.py"))
    own = [ROOT / "tests" / "patches" / f"test_{name}.py" for name in modules]
    return [str(path.relative_to(ROOT)) for path in own if path.exists()] + list(CELL_TESTS)


def suite_command(cell: Cell) -> list[str]:
    """pytest as the README runs it; outside the default cell :func:`cell_tests` (a focused cell: its
    ``tests``) only, without the ``any_version`` tests among them."""
    command = [str(cell.python), "-m", "pytest", "-q"]
    if cell.name != DEFAULT:
        # One process (-n 0): a minute of tests does not pay for two more interpreters importing the
        # stack, and CI runs the matrix beside the end-to-end tests, which keep the other core busy.
        command += ["-n", "0", "-m", "not e2e and not any_version", *(cell.tests or cell_tests())]
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
    env = run_env(cell)
    probe = subprocess.run([str(cell.python), "-c", CELL_PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    if probe.returncode:
        say(probe.stdout + probe.stderr)
        return False
    (out / "cell.json").write_text(probe.stdout)
    # One doctor run (the self-checks are the slow part): its table printed and saved, its findings
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


def run_cells(cells: list[Cell], skips: dict, jobs: int) -> list[dict]:
    """Every cell: build, suite (unless ``skips`` says why not), doctor; times each step.

    Builds run ``jobs`` at a time, in the cells' order, ahead of the tests: while one cell's suite
    runs, the next cells are built (downloads and unpacking overlap the tests). Suites and doctors
    run one cell at a time, in order, so the output reads cell by cell. ``jobs=0``: each cell is
    built just before its tests, nothing overlaps.
    """
    outs = {}
    for cell in cells:
        outs[cell.name] = REPORTS / cell.name
        shutil.rmtree(outs[cell.name], ignore_errors=True)
        outs[cell.name].mkdir(parents=True)
    records = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        ahead = [pool.submit(build, cell, outs[cell.name]) for cell in cells] if jobs > 0 else None
        for index, cell in enumerate(cells):
            pending = ahead[index] if ahead else pool.submit(build, cell, outs[cell.name])
            out, skip = outs[cell.name], skips.get(cell.name, "")
            say(
                f"\n=== cell {cell.name} ({cell.constraints.relative_to(ROOT)}, {cell.python.parents[1].relative_to(ROOT)})"
            )
            start = time.monotonic()
            built = pending.result()
            times = {"setup": built["seconds"], "waited": time.monotonic() - start}
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
            records.append(record)
    return records
