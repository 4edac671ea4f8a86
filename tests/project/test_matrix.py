"""The version matrix's gate check and its two tables (scripts/matrixlib/) on made-up doctor reports.

No cells are built here: the reports are what ``python -m shim doctor --json`` and the cell probe
write, so these tests pin down which measurements make CI fail.
"""

import ast
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# The outcome does not depend on the installed transformers / trl / peft: the default cell runs it,
# the version matrix's other cells deselect it (scripts/matrix.py).
pytestmark = pytest.mark.any_version


spec = importlib.util.spec_from_file_location("shim_matrix", ROOT / "scripts" / "matrix.py")
matrix = importlib.util.module_from_spec(spec)
sys.modules["shim_matrix"] = matrix
spec.loader.exec_module(matrix)  # the command line puts scripts/ on sys.path and imports its package
# Where the code lives (scripts/matrixlib/); a value is patched on the module that reads it.
cells, gates, runs, table, measured = (
    importlib.import_module(f"matrixlib.{name}") for name in ("cells", "gates", "runs", "table", "measured")
)


@pytest.fixture(autouse=True)
def no_known_unfixed(tmp_path, monkeypatch):
    known = tmp_path / "known-unfixed.txt"
    known.write_text("# none\n")
    monkeypatch.setattr(gates, "KNOWN_UNFIXED", known)
    return known


def report(version, verdict, requires=">=5.0", name="demo", has_probe=True):
    gated = version.split("+")[0]
    admitted = tuple(int(x) for x in gated.split(".")) >= tuple(int(x) for x in requires[2:].split("."))
    return {
        "versions": {
            "transformers": version,
            "trl": "1.0.0",
            "peft": "0.21.2",
            "accelerate": "1.15.0",
            "torch": "2.13.0",
        },
        "patches": [
            dict(
                name=name,
                distribution="transformers",
                requires=requires,
                installed=version,
                gated_as=gated,
                admitted=admitted,
                has_probe=has_probe,
            )
        ],
        "findings": {
            name: dict(
                name=name,
                installed=version,
                state="applied" if admitted else "skipped",
                bug_upstream="-",
                bug_with_shim="-",
                verdict=verdict,
                detail="d",
            )
        },
    }


def texts(problems):
    return [text for _cell, text in problems]


def test_fixed_inside_and_absent_outside_the_gate_hold():
    reports = {"old": report("4.57.6", "not affected"), "new": report("5.0.0", "fixed")}
    problems, notes = gates.check(reports)
    assert problems == []
    assert notes == ["demo (transformers>=5.0): first cell inside 5.0.0 (new), last 5.0.0 (new)"]


def test_a_bug_outside_the_gate_fails_unless_known_unfixed(no_known_unfixed):
    reports = {"old": report("4.57.6", "NOT FIXED"), "new": report("5.0.0", "fixed")}
    assert any("outside transformers>=5.0 but the bug reproduces" in t for t in texts(gates.check(reports)[0]))

    no_known_unfixed.write_text("demo old the 4.x code has another shape\n")
    assert gates.check(reports)[0] == []
    assert "skipped: the 4.x code has another shape" in table.render(reports)


def test_a_stale_known_unfixed_line_fails(no_known_unfixed):
    no_known_unfixed.write_text("demo old no longer true\n")
    reports = {"old": report("4.57.6", "not affected"), "new": report("5.0.0", "fixed")}
    assert any("remove the line" in t for t in texts(gates.check(reports)[0]))


@pytest.mark.parametrize("verdict", ["not reproduced", "not affected", "NOT FIXED", "check error"])
def test_anything_but_fixed_inside_the_gate_fails(verdict):
    problems, _ = gates.check({"new": report("5.0.0", verdict)})
    assert len(problems) == 1 and problems[0][0] == "new" and "inside transformers>=5.0" in problems[0][1]


def test_the_first_release_inside_a_gate_must_be_a_cell():
    reports = {"old": report("5.14.1", "not affected", ">=5.16"), "new": report("5.20.2", "fixed", ">=5.16")}
    problems, _ = gates.check(reports)
    assert [cell for cell, _ in problems] == [None]
    assert "needs a cell on transformers 5.16.x (>= 5.16), the first line inside" in problems[0][1]

    reports["edge"] = report("5.16.0", "fixed", ">=5.16")
    assert gates.check(reports)[0] == []


def test_a_lower_bound_below_the_oldest_cell_needs_no_cell():
    assert gates.check({"a": report("4.57.6", "fixed", ">=4.0"), "b": report("5.0.0", "fixed", ">=4.0")})[0] == []


@pytest.mark.parametrize(
    "requires, measured, wanted",
    [
        (">=5.0", ["4.57.6", "5.0.0", "5.24.0"], []),
        (">=5.16", ["5.14.1", "5.16.1", "5.24.0"], []),  # the first line, not necessarily its .0
        (">=5.16", ["5.14.1", "5.20.2"], ["5.16.x (>= 5.16), the first line inside"]),
        ("<5.23", ["5.20.2", "5.24.0"], ["5.22.x, the last line inside < 5.23"]),
        ("<5.23", ["5.22.2", "5.23.0"], []),
        ("<5.30", ["5.22.2", "5.24.0"], []),  # above the newest cell: nothing to prove yet
        ("<0.29", ["0.25.1", "0.29.1"], ["0.28.x, the last line inside < 0.29"]),
        ("<1.0", ["0.29.1", "1.16.0"], []),  # the last 0.x line is not known from the bound
        ("<=5.20", ["5.14.1", "5.24.0"], ["5.20.x, the last line inside <= 5.20"]),
        (">=5.16,<5.23", ["5.14.1", "5.16.0", "5.22.2", "5.24.0"], []),
    ],
)
def test_gate_edges_are_release_lines(requires, measured, wanted):
    assert gates.missing_edges(requires, measured) == wanted


def test_target_requirements_narrow_the_gate_and_their_edges_are_checked():
    def with_target(version, verdict, target_requires, admitted):
        r = report(version, verdict, ">=4.57")
        gate = r["patches"][0]
        gate["targets"] = [
            dict(
                target="trl.models.utils:f",
                distribution="transformers",
                requires=target_requires,
                gated_as=version,
                admitted=admitted,
            )
        ]
        gate["admitted"] = gate["admitted"] and admitted
        return r

    reports = {
        "a": with_target("4.57.6", "not affected", ">=5.16", False),
        "b": with_target("5.20.2", "fixed", ">=5.16", True),
    }
    problems, _ = gates.check(reports)
    assert [
        text for cell, text in problems if cell is not None
    ] == []  # outside the target's gate: not affected is right
    assert any(
        "target trl.models.utils:f gate transformers>=5.16 needs a cell on transformers 5.16.x" in t
        for t in texts(problems)
    )
    assert "`transformers>=4.57`; targets `transformers>=5.16`" in table.render(reports)


def test_a_patch_without_a_bug_probe_or_with_stale_reports_fails():
    assert "no bug probe" in texts(gates.check({"a": report("5.0.0", "no bug probe", has_probe=False)})[0])[0]
    stale = {"a": report("5.0.0", "fixed", ">=5.0"), "b": report("5.1.0", "fixed", ">=5.1")}
    assert any("disagree on the gate" in t for t in texts(gates.check(stale)[0]))


def test_new_patches_are_new_rows_and_the_readme_block_round_trips(tmp_path, monkeypatch):
    reports = {"old": report("4.57.6", "not affected"), "new": report("5.0.0", "fixed")}
    for cell, verdict in (("old", "not affected"), ("new", "fixed")):
        extra = report(reports[cell]["versions"]["transformers"], verdict, name="second")
        reports[cell]["patches"] += extra["patches"]
        reports[cell]["findings"].update(extra["findings"])
    rendered = table.render(reports)
    rows = [line for line in rendered.splitlines() if line.startswith("| `demo`") or line.startswith("| `second`")]
    assert rows == [f"| `{n}` | `transformers>=5.0` | not needed | applied, fixed |" for n in ("demo", "second")]

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{table.START}\nold table\n{table.END}\noutro\n")
    monkeypatch.setattr(table, "README", readme)
    assert table.readme_block() == "old table"
    table.write_readme(rendered)
    assert table.readme_block() == rendered
    assert readme.read_text().startswith("intro\n") and readme.read_text().endswith(f"{table.END}\noutro\n")


def test_every_cell_has_a_constraints_file_pinning_torch_first():
    """torch 2.13.0 (the CPU build) everywhere but in the torch cells, which pin the release they are named
    after, and the latest cell, which names the packages it takes the newest releases of."""
    torch_cells = [cell.name for cell in cells.CELLS if cell.name.startswith("torch")]
    assert torch_cells == ["torch2.14", "torch2.15"]
    for cell in cells.CELLS:
        lines = [line for line in cell.constraints.read_text().splitlines() if line and not line.startswith("#")]
        if cell.latest:
            assert lines[0] == "torch" and {"transformers", "trl", "peft", "accelerate"} <= set(lines), cell.name
            assert not any("==" in line for line in lines if line.split("==")[0] in ("transformers", "trl", "peft"))
            continue
        if cell.name in torch_cells:
            assert lines[0] == {"torch2.14": "torch==2.14.1", "torch2.15": "torch==2.15.0"}[cell.name]
        else:
            assert lines[0] == "torch==2.13.0", cell.name
        assert any(line.startswith("transformers==") for line in lines) and any(
            line.startswith("trl==") for line in lines
        )


def test_the_torch_cells_are_the_default_stack_on_another_torch():
    def pins(name):
        top = cells.BY_NAME[name].constraints.read_text().split("# --- locked")[0]
        return {line.split("==")[0]: line for line in top.splitlines() if "==" in line and not line.startswith("#")}

    default = pins("default")
    assert default["transformers"] == "transformers==5.25.0" and default["kernels"] == "kernels==0.19.1"
    for name in ("torch2.14", "torch2.15"):
        assert {k: v for k, v in pins(name).items() if k != "torch"} == {
            k: v for k, v in default.items() if k != "torch"
        }


def test_outside_the_default_cell_a_cell_runs_every_patchs_own_tests():
    default = runs.suite_command(cells.BY_NAME[cells.DEFAULT])
    assert default[1:] == ["-m", "pytest", "-q"]  # everything the README's command runs
    from shim.patches import INDEX

    names = [f"test_{row['module']}.py" for row in INDEX]
    patch_tests = [f"tests/patches/{name}" for name in names if (ROOT / "tests" / "patches" / name).exists()]
    assert len(patch_tests) >= 14
    for cell in cells.CELLS:
        if cell.name != cells.DEFAULT:
            command = runs.suite_command(cell)
            assert command[command.index("-m", 2) + 1] == "not e2e and not any_version", cell.name
            if cell.tests:  # a focused cell: its own tests only
                assert command[command.index("-m", 2) + 2 :] == list(cell.tests), cell.name
                assert all((ROOT / test.split("::")[0]).exists() for test in cell.tests), cell.name
            else:
                assert set(patch_tests) <= set(command), cell.name
                everyday = "tests/do_no_harm/test_do_no_harm.py::test_everyday_workflows_end_as_without_the_shim"
                assert (everyday in command) == (not cell.workflows_in), cell.name
            assert all((ROOT / test.split("::")[0]).exists() for test in runs.CELL_TESTS)
        if cell.workflows_in:  # the cell named stands for it: it runs them, with the same patches applied
            assert cells.BY_NAME[cell.workflows_in].suite and not cells.BY_NAME[cell.workflows_in].workflows_in


def test_a_cell_built_without_a_dependency_says_so_and_how_it_runs(monkeypatch):
    lean = cells.Cell("lean", without=(("kernels", "the index lacks it"),), env=(("USE_X", "NO", "x's switch"),))
    focused = cells.Cell("focused", tests=("tests/patches/test_demo.py",))
    monkeypatch.setattr(table, "BY_NAME", {"lean": lean, "focused": focused})
    assert cells.build_env(lean)["SHIM_EXCLUDE"] == "kernels" and "SHIM_EXCLUDE" not in cells.build_env(focused)
    assert cells.run_env(lean)["USE_X"] == "NO"
    rendered = table.render({"lean": report("5.1.0", "fixed"), "focused": report("5.0.0", "fixed")})
    assert "| `lean` | 5.1.0 | 1.0.0 | 0.21.2 | 1.15.0 | - | 2.13.0 | suite + doctor (note below) |" in rendered
    assert "| `focused` | 5.0.0 | 1.0.0 | 0.21.2 | 1.15.0 | - | 2.13.0 | doctor + `test_demo.py` |" in rendered
    assert rendered.endswith(
        "\n\n*`lean`*: built without `kernels` (the index lacks it); run with `USE_X=NO` (x's switch)."
    )


def test_a_package_a_cell_is_built_without_is_not_pinned_in_it():
    for cell in cells.CELLS:
        pinned = {line.split("==")[0].lower() for line in cell.constraints.read_text().splitlines() if "==" in line}
        for name, _why in cell.without:
            assert name.lower() not in pinned, cell.name


def test_the_command_line_starts_from_anywhere_without_its_folder_on_sys_path(tmp_path):
    # -I: no script folder on sys.path (as PYTHONSAFEPATH), the cwd elsewhere.
    command = [sys.executable, "-I", str(ROOT / "scripts" / "matrix.py"), "--help"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--report-only" in result.stdout and "--lock CELL" in result.stdout


def test_the_matrix_needs_only_the_standard_library():
    # It starts before any environment exists: python3 >= 3.10, nothing installed.
    for path in [ROOT / "scripts" / "matrix.py", *sorted((ROOT / "scripts" / "matrixlib").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ("__future__", "matrixlib"), f"{path.name}: {name}"


def test_the_measured_ranges_are_the_oldest_and_newest_release_of_each_gated_distribution_and_torch():
    reports = {"old": report("4.57.6", "not affected"), "new": report("5.25.0", "fixed")}
    reports["new"]["versions"]["torch"] = "2.15.0"  # a torch cell
    reports["old"]["versions"]["torch"] = "2.13.0+cpu"  # the CPU build is measured as its release
    reports["new"]["patches"].append(dict(reports["new"]["patches"][0], name="ds", distribution="deepspeed"))
    ranges = measured.ranges(reports)
    assert ranges["oldest"]["transformers"] == "4.57.6" and ranges["newest"]["transformers"] == "5.25.0"
    assert ranges["oldest"]["torch"] == "2.13.0" and ranges["newest"]["torch"] == "2.15.0"
    # DeepSpeed is in no cell: the end-to-end environments' pins are its measurements.
    pins = sorted(
        line.split("==")[1].strip()
        for path in (ROOT / "constraints").glob("e2e*.txt")
        for line in path.read_text().splitlines()
        if line.startswith("deepspeed==")
    )
    assert set(ranges["newest"]) == {"transformers", "torch", "deepspeed"}  # what the made-up patches gate on
    assert ranges["newest"]["deepspeed"] == pins[-1] and ranges["oldest"]["deepspeed"] == pins[0]
    assert json.loads(measured.render(reports))["newest"] == ranges["newest"]


def test_the_latest_cell_is_measured_nowhere_and_its_verdict_never_fails(tmp_path, monkeypatch, capsys):
    latest = cells.BY_NAME["latest"]
    assert latest.latest and latest not in matrix.MEASURED
    assert [cell.name for cell in cells.CELLS if cell.latest] == ["latest"]
    assert latest.tests == cells.CHECKPOINTING_TESTS
    assert "SHIM_RESOLVE" not in cells.build_env(latest)  # set by build(), to the cell's report folder

    # A latest cell whose newest transformers no longer shows a bug inside the gate: printed, not failing.
    monkeypatch.setattr(gates, "REPORTS", tmp_path)
    (tmp_path / "latest").mkdir()
    made_up = report("5.26.0", "not reproduced")
    (tmp_path / "latest" / "cell.json").write_text(json.dumps({k: made_up[k] for k in ("versions", "patches")}))
    (tmp_path / "latest" / "doctor.json").write_text(json.dumps(list(made_up["findings"].values())))
    record = dict(cell="latest", ok=True, times={"setup": 2.0, "suite": 120.0, "doctor": 25.0}, note="")
    assert matrix.latest_verdicts([record]) == ["latest: FAILED (not failing the matrix)"]
    shown = capsys.readouterr().out
    assert "transformers 5.26.0" in shown and "NEW demo in latest: transformers 5.26.0 is inside" in shown

    (tmp_path / "latest" / "doctor.json").write_text(json.dumps([dict(made_up["findings"]["demo"], verdict="fixed")]))
    assert matrix.latest_verdicts([record]) == ["latest: ok (not failing the matrix)"]


def test_the_torch_cells_and_the_latest_cell_name_what_they_run_in_the_table():
    rendered = table.render({"torch2.15": report("5.25.0", "fixed"), "default": report("5.25.0", "fixed")})
    assert (
        "| `torch2.15` | 5.25.0 | 1.0.0 | 0.21.2 | 1.15.0 | - | 2.13.0 | doctor + checkpointing and do-no-harm tests |"
        in rendered
    )
    for name in ("torch2.14", "torch2.15", "latest"):
        assert all((ROOT / test.split("::")[0]).exists() for test in cells.BY_NAME[name].tests), name


def test_runs_that_share_their_cells_run_each_cell_once(tmp_path, monkeypatch):
    """``--share``: the first run to reach a cell takes it; a cell another run took is neither built
    nor run here, and its report folder is left alone (CI's two lanes, one folder of claims)."""
    monkeypatch.setattr(runs, "REPORTS", tmp_path / "reports")
    ran = []
    monkeypatch.setattr(
        runs, "build", lambda cell, out: ran.append(("build", cell.name)) or dict(ok=True, code=0, seconds=0)
    )
    monkeypatch.setattr(runs, "show_build", lambda cell, out, built: True)
    monkeypatch.setattr(runs, "run_suite", lambda cell, out: ran.append(("suite", cell.name)) or True)
    monkeypatch.setattr(runs, "run_doctor", lambda cell, out: ran.append(("doctor", cell.name)) or True)
    share = tmp_path / "claims"
    share.mkdir()
    picked = [cells.BY_NAME[name] for name in ("tf5.0-trl0.29", "edge-tf5.2", "tf5.14-trl1.0")]
    assert runs.claim(picked[1], share) and not runs.claim(picked[1], share)  # the other run took edge-tf5.2
    (tmp_path / "reports" / "edge-tf5.2").mkdir(parents=True)
    (tmp_path / "reports" / "edge-tf5.2" / "doctor.json").write_text("[]")  # the other run's report

    for jobs in (1, 0):
        ran.clear()
        for cell in ("tf5.0-trl0.29", "tf5.14-trl1.0"):
            (share / cell).unlink(missing_ok=True)
        records = runs.run_cells(picked, {}, jobs, share)
        assert [r["cell"] for r in records] == ["tf5.0-trl0.29", "tf5.14-trl1.0"]
        assert ("build", "edge-tf5.2") not in ran and ("doctor", "edge-tf5.2") not in ran
        assert (tmp_path / "reports" / "edge-tf5.2" / "doctor.json").exists()
        assert not runs.run_cells(picked, {}, jobs, share)  # all taken now: a second run finds nothing


def test_the_latest_cell_on_a_measured_cells_releases_runs_nothing_again(tmp_path, monkeypatch, capsys):
    """When the newest releases on the index are exactly a measured cell's pins (build tools aside),
    the latest cell's verdict is that cell's, measured in the same matrix: nothing is built or run."""
    latest, torch215 = cells.BY_NAME["latest"], cells.BY_NAME["torch2.15"]
    out = tmp_path / "latest"
    out.mkdir()

    def resolve(command, cwd, env, stdout, stderr):
        assert env["SHIM_RESOLVE_ONLY"] == "1" and env["SHIM_RESOLVE"] == str(out / "resolved.txt")
        (out / "resolved.txt").write_text(resolved)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(cells.subprocess, "run", resolve)
    resolved = torch215.constraints.read_text() + "setuptools==99.0\n"
    assert cells.measured_as(latest, out) == "torch2.15"
    resolved = torch215.constraints.read_text().replace("transformers==", "transformers==9") + "\n"
    assert cells.measured_as(latest, out) is None

    record = dict(cell="latest", ok=True, times={"setup": 3.0}, note="", same_as="torch2.15")
    assert matrix.latest_verdicts([record]) == ["latest: the releases of torch2.15 (not failing the matrix)"]
    assert "the same releases as torch2.15" in capsys.readouterr().out


def test_a_cell_that_leaves_its_workflows_to_another_must_apply_the_same_patches():
    """tf5.0 and tf5.14 leave the everyday workflows to tf5.20 (same patches applied, same layer API):
    the gate check fails the day their applied patches differ."""
    stand_in = cells.BY_NAME["tf5.0-trl0.29"]
    assert stand_in.workflows_in == "tf5.20-trl1.12"
    same = {stand_in.name: report("5.0.0", "fixed"), stand_in.workflows_in: report("5.20.2", "fixed")}
    for one in same.values():
        one["findings"]["demo"]["state"] = "applied"
    assert not [text for _, text in gates.check(same)[0] if "everyday workflows" in text]
    same[stand_in.name]["findings"]["demo"]["state"] = "skipped"
    assert [text for _, text in gates.check(same)[0] if "everyday workflows" in text]


def test_the_readme_table_is_a_version_range_per_patch_with_what_the_cells_measured():
    """One row per patch, by name whatever order the reports hold them in: its range (and what its
    targets need where every target names a requirement on another distribution), then the cells
    by verdict, with the releases of the gate's distribution each covers."""
    reports = {
        "old": report("4.57.6", "not affected"),
        "new": report("5.0.0", "fixed"),
        "newer": report("5.2.0", "fixed"),
    }
    for cell, verdict in (("old", "not affected"), ("new", "fixed"), ("newer", "fixed")):
        first = report(reports[cell]["versions"]["transformers"], verdict, name="zeta")
        reports[cell]["patches"].insert(0, first["patches"][0])  # the reports list zeta first
        reports[cell]["findings"].update(first["findings"])
        narrowed = reports[cell]["patches"][-1]
        narrowed["targets"] = [dict(target="trl.x:f", distribution="trl", requires=">=0.26")]
    rendered = table.render_ranges(reports)
    rows = [line for line in rendered.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `demo` | `transformers>=5.0` where `trl>=0.26` | applied, fixed (transformers 5.0.0 – 5.2.0, 2 cells); "
        "not needed (transformers 4.57.6, 1 cell) |",
        "| `zeta` | `transformers>=5.0` | applied, fixed (transformers 5.0.0 – 5.2.0, 2 cells); "
        "not needed (transformers 4.57.6, 1 cell) |",
    ]
    assert "(docs/testing.md#the-cells-measured)" in rendered
    # The matrix of cells lists the patches by name too.
    cells_table = [
        line.split("`")[1]
        for line in table.render(reports).split("| patch | gate |")[1].splitlines()[2:]
        if line.startswith("| `")
    ]
    assert cells_table == ["demo", "zeta"]


def test_a_target_on_the_gates_own_distribution_narrows_nothing_in_the_readme():
    gate = dict(distribution="transformers", requires=">=4.57")
    split = [dict(distribution="transformers", requires="<5.23"), dict(distribution="transformers", requires=">=5.23")]
    assert table.applies_to(gate | {"targets": split}) == "`transformers>=4.57`"
    open_target = [dict(distribution=None, requires=""), dict(distribution="trl", requires=">=0.28")]
    assert table.applies_to(gate | {"targets": open_target}) == "`transformers>=4.57`"  # one target always applies
    both = [dict(distribution="trl", requires=">=0.26"), dict(distribution="transformers", requires=">=5.23")]
    assert (
        table.applies_to(gate | {"targets": both}) == "`transformers>=4.57` where `transformers>=5.23` or `trl>=0.26`"
    )


def test_each_generated_block_round_trips_in_its_own_file(tmp_path, monkeypatch):
    for name, attribute, start, end in (
        ("README.md", "README", table.START, table.END),
        ("docs/testing.md", "TESTING", table.CELLS_START, table.CELLS_END),
    ):
        path = tmp_path / name.replace("/", "-")
        path.write_text(f"intro\n{start}\nold\n{end}\noutro\n")
        monkeypatch.setattr(table, attribute, path)
        assert table.block(name) == "old"
        table.write_block(name, "new\ntable")
        assert table.block(name) == "new\ntable" and path.read_text().endswith(f"{end}\noutro\n")


def test_a_shared_run_with_report_only_runs_nothing_and_says_so(tmp_path, capsys):
    """``--share DIR --report-only``: no cell runs here, so the shared run's line counts none (it
    used to stop on the run's time, which only a run that ran cells has)."""
    assert matrix.main(["--share", str(tmp_path / "claims"), "--report-only"]) == 0
    assert "matrix (shared, this run's cells): 0 passed, 0 failed" in capsys.readouterr().out
