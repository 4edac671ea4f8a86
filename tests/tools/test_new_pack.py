"""``python -m shim new-pack NAME [DIR]``: the pack it writes installs as it is, and is listed, opted
out and doctor-checked with no edit; its own tests pass; ``index --check`` holds for it."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, clean_environment
from tests.tools.test_patch_pack import installer

pytestmark = pytest.mark.any_version  # the gate is written from the installed transformers

NAME = "my-team-fixes"


def shim_command(*args, site=None, env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    clean = clean_environment(env)
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(site or "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=clean, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """The new pack's folder, and the folder it is installed into."""
    root = tmp_path_factory.mktemp("new-pack")
    done = shim_command("-m", "shim", "new-pack", NAME, str(root / "source"))
    assert done.returncode == 0, done.stderr
    assert f"the patch pack {NAME}" in done.stdout
    installed = subprocess.run(installer(root / "site", root / "source"), capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    return root / "source", root / "site"


def test_the_new_pack_is_listed_as_a_pack_that_will_apply(pack):
    _source, site = pack
    lines = shim_command("-m", "shim", site=site).stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith(NAME))
    assert lines[row].split()[1:3] == ["will", "apply"]
    assert f"from: {NAME} (a patch pack)" in [line.strip() for line in lines[row : row + 4]]


def test_the_new_pack_waits_for_its_target_and_is_opted_out_by_name(pack):
    _source, site = pack
    code = """
import json, sys
import shim
before = "my_team_fixes.fixes" in sys.modules
import transformers.trainer_utils
(status,) = [s for s in shim.status() if s.name == "my-team-fixes"]
print(json.dumps([before, "my_team_fixes.fixes" in sys.modules, str(status.state)]))
"""
    assert json.loads(shim_command("-c", code, site=site).stdout) == [False, True, "applied"]
    off = shim_command("-c", code, site=site, env={"SHIM_DISABLE": NAME})
    assert json.loads(off.stdout) == [False, False, "disabled"]


def test_doctor_checks_the_new_pack(pack):
    _source, site = pack
    done = shim_command("-m", "shim", "doctor", "--json", NAME, site=site)
    assert done.returncode == 0, done.stderr
    (finding,) = json.loads(done.stdout)
    assert (finding["state"], finding["bug_upstream"], finding["bug_with_shim"]) == ("applied", "no", "no")


def test_the_new_packs_own_tests_pass(pack):
    source, site = pack
    done = shim_command("-m", "pytest", "-q", "-p", "no:cacheprovider", str(source / "tests"), site=site, cwd=source)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout


def test_a_name_that_is_no_patch_name_or_a_folder_in_use_is_refused(tmp_path):
    done = shim_command("-m", "shim", "new-pack", "My_Fixes", str(tmp_path / "a"))
    assert done.returncode == 2 and "'My_Fixes' is not a patch name" in done.stderr
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    done = shim_command("-m", "shim", "new-pack", NAME, str(tmp_path / "b"))
    assert done.returncode == 2 and "exists and is not an empty folder" in done.stderr
    assert os.listdir(tmp_path / "b") == ["keep.txt"]


@pytest.mark.parametrize(
    "name, why",
    [
        ("shim", "its package 'shim' would shadow the module 'shim' importable here"),
        ("torch", "its package 'torch' would shadow the module 'torch' importable here"),
        ("transformers", "its package 'transformers' would shadow the module 'transformers' importable here"),
        ("json", "its package 'json' would shadow the standard library's module 'json'"),
        ("checkpointing-restore", "'checkpointing-restore' is a built-in patch's name"),
        ("a" * 300, "(300 characters) is longer than 64 characters"),
    ],
)
def test_a_name_that_would_shadow_a_module_or_a_patch_or_is_too_long_is_refused(tmp_path, name, why):
    """In the pack's folder, a package named ``shim`` (or ``torch``, ``json``) is what ``import``
    finds: ``import shim`` there would silently apply nothing. Refused in one line, nothing written."""
    done = shim_command("-m", "shim", "new-pack", name, str(tmp_path / "p"))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("python -m shim new-pack: ") and done.stderr.count("\n") == 1
    assert why in done.stderr
    assert not (tmp_path / "p").exists()


def unwritable_folders(tmp_path) -> dict[str, tuple[str, str]]:
    """``{case: (folder, what the line says)}`` for the folders no pack can be written into here."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "a-file").write_text("mine")
    folders = {
        "dangling symbolic link": (str(tmp_path / "dangling"), "is a symbolic link to nothing"),
        "a file": (str(tmp_path / "a-file"), "exists and is not an empty folder"),
        "below a file": (str(tmp_path / "a-file" / "pack"), "Not a directory"),
        "300-character folder": (str(tmp_path / ("d" * 300)), "File name too long"),
    }
    if os.geteuid() != 0:  # root writes into a read-only folder
        (tmp_path / "read-only").mkdir(mode=0o555)
        folders["read-only folder"] = (str(tmp_path / "read-only"), "Permission denied")
    elif os.path.isdir("/sys"):  # sysfs refuses a new folder, root's too
        folders["read-only folder"] = ("/sys/my-team-fixes", "Operation not permitted")
    return folders


def test_a_folder_that_cannot_take_the_pack_is_one_line_and_no_traceback(tmp_path):
    for case, (folder, why) in unwritable_folders(tmp_path).items():
        done = shim_command("-m", "shim", "new-pack", NAME, folder)
        assert done.returncode == 2, case
        assert len(done.stderr.splitlines()) == 1 and why in done.stderr, (case, done.stderr)
    assert sorted(os.listdir(tmp_path)) == sorted(["dangling", "a-file", *(["read-only"] * (os.geteuid() != 0))])


def test_pack_index_writes_and_checks_the_target_modules(tmp_path):
    assert shim_command("-m", "shim", "new-pack", NAME, str(tmp_path / "p")).returncode == 0
    pyproject = tmp_path / "p" / "pyproject.toml"
    written = pyproject.read_text()
    fixes = tmp_path / "p" / "src" / "my_team_fixes" / "fixes.py"
    fixes.write_text(
        fixes.read_text().replace("transformers.trainer_utils:set_seed", "transformers.trainer:Trainer.train")
    )
    stale = shim_command("-m", "shim", "index", "--check", str(tmp_path / "p"))
    assert stale.returncode == 1 and "run python -m shim index" in stale.stderr
    assert pyproject.read_text() == written, "--check changes nothing"
    assert shim_command("-m", "shim", "index", str(tmp_path / "p")).returncode == 0
    assert '"my-team-fixes.transformers.trainer" = "transformers.trainer"' in pyproject.read_text()
    assert "transformers.trainer_utils" not in pyproject.read_text().split("hf_train_shim.targets", 1)[1]
    assert shim_command("-m", "shim", "index", "--check", str(tmp_path / "p")).returncode == 0
    missing = shim_command("-m", "shim", "index", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "No such file" in missing.stderr
