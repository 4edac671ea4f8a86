"""The example patch pack (examples/patch-pack), built and installed into a folder of its own as a
user installs it, then used from fresh interpreters with that folder on ``PYTHONPATH``: its patch is
applied under ``import shim`` and ``shim-run``, listed with its distribution, opted out by name,
explained from its own text and checked by doctor, and the pack's own test passes."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, clean_environment

pytestmark = pytest.mark.any_version  # the pack patches a module of its own, not the HF stack

NAME = "example-mean-loss-empty"
PACK = ROOT / "examples" / "patch-pack"


def installer(site, source) -> list[str]:
    """The command that installs the pack from ``source`` into ``site``: uv as scripts/_venv.sh
    finds it, else pip; setuptools from this environment builds it (no index needed)."""
    uv = next(
        (p for p in (shutil.which("uv"), str(ROOT / ".venvs" / "_uv" / "bin" / "uv")) if p and os.access(p, os.X_OK)),
        None,
    )
    if uv is not None:
        return [uv, "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-cache",
                "--python", sys.executable, "--target", str(site), str(source)]  # fmt: skip
    return [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
            "--disable-pip-version-check", "--target", str(site), str(source)]  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The folder the example pack is installed into (built from a copy: the build's files stay out
    of the repository)."""
    root = tmp_path_factory.mktemp("patch-pack")
    shutil.copytree(PACK, root / "source", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    result = subprocess.run(installer(root / "site", root / "source"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (root / "site" / "shim_example_pack-0.1.0.dist-info" / "entry_points.txt").is_file()
    return root


def run(site, *args, code=None, env=None, check=True) -> subprocess.CompletedProcess:
    """``python -c code`` (or ``python args...``) with the pack installed, the SHIM_* variables only from ``env``."""
    clean = clean_environment(env)
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site / "site")])
    command = [sys.executable, "-c", textwrap.dedent(code)] if code is not None else list(args)
    result = subprocess.run(command, capture_output=True, text=True, env=clean, cwd=site, timeout=300)
    assert not check or result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result


APPLIED = """
import importlib, json, sys
import shim
waits = "shim_example_pack.losses" not in sys.modules  # the pack's module is imported, its target is not
from shim_example_pack import losses
importlib.reload(shim)  # idempotent: the new registry adopts the layer
(status,) = [s for s in shim.status() if s.name == "example-mean-loss-empty"]
print(json.dumps({
    "waits": waits, "state": status.state, "provider": status.provider, "empty": losses.mean_loss([]),
    "mean": losses.mean_loss([1.0, 3.0]), "layers": len(shim.wrappers(losses.mean_loss)),
    "effects": shim.status()[-1].effects,
}))
"""


def test_import_shim_applies_the_pack_once_when_its_target_is_imported(site):
    out = json.loads(run(site, code=APPLIED).stdout)
    assert out == {
        "waits": True, "state": "applied", "provider": "shim-example-pack", "empty": 0.0, "mean": 2.0,
        "layers": 1, "effects": 1,
    }  # fmt: skip


def test_shim_run_applies_the_pack_and_the_exit_report_counts_it(site):
    code = "from shim_example_pack import losses; print(losses.mean_loss([]))"
    result = run(site, sys.executable, "-m", "shim", "run", "--", sys.executable, "-c", code, env={"SHIM_REPORT": "1"})
    assert result.stdout.strip() == "0.0"
    assert NAME in result.stderr and "returned 0.0 for an empty accumulation window" in result.stderr


def test_the_table_and_json_name_the_packs_distribution(site):
    lines = run(site, sys.executable, "-m", "shim").stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith(NAME))
    assert lines[row].split()[1:4] == ["will", "apply", "0.1.0"]  # pending: its target is not imported yet
    assert lines[row + 2].strip() == "from: shim-example-pack (a patch pack)"
    assert not any("(a patch pack)" in line for line in lines[: row + 1]), "a built-in names no pack"
    records = json.loads(run(site, sys.executable, "-m", "shim", "--json").stdout)
    assert {r["provider"] for r in records} == {"hf-train-shim", "shim-example-pack"}
    assert next(r for r in records if r["name"] == NAME)["targets"] == ["shim_example_pack.losses:mean_loss"]


def test_shim_disable_opts_the_pack_out_by_name(site):
    code = """
    import shim
    from shim_example_pack import losses
    (status,) = [s for s in shim.status() if s.name == "example-mean-loss-empty"]
    try:
        losses.mean_loss([])
    except ZeroDivisionError:
        print(status.state, "|", status.reason)
    """
    out = run(site, code=code, env={"SHIM_DISABLE": "EXAMPLE_MEAN_LOSS_EMPTY"}).stdout.strip()
    assert out == "disabled | opted out with SHIM_DISABLE=example-mean-loss-empty"


def test_doctor_runs_the_packs_self_check(site):
    # Neither torch nor transformers: a pack's check needs only what its author says.
    code = """
    import sys
    sys.modules.update(torch=None, transformers=None)
    from shim.tools.cli import main
    sys.exit(main(["doctor", "--json", "example-mean-loss-empty"]))
    """
    (finding,) = json.loads(run(site, code=code).stdout)
    expected = {"name": NAME, "installed": "0.1.0", "state": "applied", "bug_upstream": "yes", "bug_with_shim": "no"}
    assert finding | expected == finding and finding["verdict"] == "fixed"


def test_explain_prints_the_patchs_own_text(site):
    out = run(site, sys.executable, "-m", "shim", "explain", NAME, "--markdown").stdout
    assert out.startswith(f"## {NAME}\n\nthe mean loss of an empty accumulation window is 0.0")
    assert "From the patch pack shim-example-pack 0.1.0 (entry point hf_train_shim.patches:" in out
    assert "Symptom: ``shim_example_pack.losses.mean_loss([])`` raises ``ZeroDivisionError``" in out


def test_the_packs_own_test_passes(site):
    tests = site / "source" / "tests"  # with the pack's own pytest settings (its pyproject.toml)
    result = run(site, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                 env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # fmt: skip
    assert result.stdout.splitlines()[-1].startswith("3 passed")
