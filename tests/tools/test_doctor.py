"""doctor: its verdicts on made-up patches, what it says where it cannot check (torch cannot be
imported) and where its --json-file cannot be written, and the incompatibility of the installed
releases that no patch fixes, with the error a user meets: transformers 5.24 asks for peft >= 0.22.0
while the newest peft is 0.21.2."""

import importlib.util
import json
import subprocess
import sys

import pytest
from packaging.version import Version

from shim import SKIPPED, Registry
from shim.tools import doctor
from tests.conftest import ROOT, run_python
from tests.engine.fakes import TARGET, finds, make_patch

HAS_PEFT = importlib.util.find_spec("peft") is not None


def test_the_peft_note_appears_only_where_peft_is_older_than_transformers_needs():
    note = doctor.peft_note("5.24.0", "0.21.2", "0.22.0")
    assert note is not None and note.startswith("transformers 5.24.0 needs peft >= 0.22.0")
    assert "'ValueError: The version of PEFT you are using is not compatible, please use a version >= 0.22.0'" in note
    assert doctor.peft_note("5.23.0", "0.21.2", "0.20.0") is None
    assert doctor.peft_note("5.24.0", "0.22.0", "0.22.0") is None
    assert doctor.peft_note(None, "0.21.2", "0.22.0") is None and doctor.peft_note("5.24.0", None, "0.22.0") is None


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed")
def test_the_note_quotes_what_transformers_raises_on_these_releases():
    import peft
    import transformers
    from transformers.integrations.peft import MIN_PEFT_VERSION

    from tests.tinymodels import tiny_llama_config

    notes = [note for note in doctor.notes() if note not in doctor.newer_notes()]
    if Version(peft.__version__) >= Version(MIN_PEFT_VERSION):
        assert notes == []
        return
    (note,) = notes
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    with pytest.raises(ValueError) as raised:
        model.add_adapter(peft.LoraConfig(target_modules=["q_proj"]))
    assert f"'ValueError: {raised.value}'" in note


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed")
@pytest.mark.parametrize("patch", ["kbit-prepare-keeps-checkpointing", "checkpointing-restore"])
def test_doctor_prints_a_note_below_its_table_only_with_the_patches_it_concerns(patch):
    """The peft note is about peft: ``doctor kbit-prepare-keeps-checkpointing`` (a patch on peft)
    prints it where the installed peft is older than transformers needs, ``doctor
    checkpointing-restore`` never does (it printed it for every patch before)."""
    table = run_python(
        f"from shim.tools.cli import main; raise SystemExit(main(['doctor', '{patch}']))",
        timeout=600,
        torch_first=True,
    ).stdout
    assert table.splitlines()[2].startswith(f"{patch} "), "one row: the patch asked for"
    import shim

    about = doctor.concerned(shim.registry, [patch])
    assert ("peft" in about) == (patch == "kbit-prepare-keeps-checkpointing")
    peft_notes = [note for note in doctor.notes() if note not in doctor.newer_notes()]
    shown = " ".join(table.split())
    for note in doctor.notes():  # each note the environment has: printed exactly with the patches it concerns
        assert (f"note: {' '.join(note.split())}" in shown) == (note in doctor.notes(about)), note
    assert all((note in doctor.notes(about)) == ("peft" in about) for note in peft_notes)
    assert all(len(line) <= 100 for line in table.splitlines())


def test_doctor_measures_the_bug_when_a_target_module_does_not_exist(fake_modules):
    from shim.tools import doctor

    pkg = fake_modules(target=TARGET)
    importlib.import_module(pkg)
    registry = Registry(
        [
            make_patch(pkg, "nowhere:f", requires=">=2.0", name="absent", bug_probe=finds(False)),
            make_patch(pkg, "nowhere:f", requires=">=1.0", name="present", bug_probe=finds(True)),
            make_patch("not_a_distribution_here", "nowhere:f", name="uninstalled", bug_probe=finds(True)),
        ]
    )
    registry.activate()
    findings = {f.name: f for f in doctor.run(registry)}
    assert (findings["absent"].state, findings["absent"].verdict) == (SKIPPED, doctor.NOT_AFFECTED)
    assert findings["present"].verdict == doctor.NOT_FIXED, "the bug shows and the patch cannot apply"
    assert f"{pkg}.nowhere cannot be imported" in findings["present"].detail
    assert findings["uninstalled"].verdict == doctor.NOT_INSTALLED


#: torch installed but not importable, two ways: Python's own block (``None`` in ``sys.modules``) and
#: what a CUDA-only wheel raises on a machine without the CUDA libraries.
TORCH_UNIMPORTABLE = {
    "blocked": 'sys.modules["torch"] = None',
    "cuda wheel on a cpu machine": """
import importlib.util
class CudaOnly:  # found as installed; its body fails where torch loads its CUDA libraries
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "torch" else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        raise OSError("libcudart.so.13: cannot open shared object file: No such file or directory")
sys.meta_path.insert(0, CudaOnly())""",
}


@pytest.mark.parametrize("how", TORCH_UNIMPORTABLE)
def test_where_torch_cannot_be_imported_doctor_says_it_cannot_check_and_exits_0(how):
    # It said "check error ... import of torch halted" for every patch and exited 1: "not fixed".
    code = f"import sys\n{TORCH_UNIMPORTABLE[how]}\nfrom shim.tools.cli import main\nraise SystemExit(main(['doctor', '--json']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    findings = json.loads(done.stdout)
    checked = [f for f in findings if f["verdict"] not in (doctor.NOT_INSTALLED, doctor.NO_CHECK)]
    assert checked, "the patches with a self-check for installed libraries"
    assert {f["verdict"] for f in checked} == {doctor.CANNOT_CHECK}
    assert all(f["detail"].startswith("torch cannot be imported: ") for f in checked)
    table = subprocess.run(
        [sys.executable, "-c", code.replace("'doctor', '--json'", "'doctor'")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert table.returncode == 0 and "not fixed" not in table.stderr
    assert f"{checked[0]['name']}: cannot check here: torch cannot be imported: " in " ".join(table.stdout.split())
    status = subprocess.run(
        [sys.executable, "-c", code.replace("'doctor', '--json'", "'--import-targets'")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr


def test_a_json_file_that_cannot_be_written_fails_before_the_run_with_exit_2(tmp_path):
    target = tmp_path / "no-such-folder" / "doctor.json"
    done = subprocess.run(
        [sys.executable, "-m", "shim", "doctor", "--json-file", str(target)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == "", "no check ran"
    assert done.stderr.startswith("usage: python -m shim doctor ")
    assert done.stderr.splitlines()[-1] == (
        f"python -m shim doctor: error: --json-file {target}: No such file or directory"
    )
    assert "Traceback" not in done.stderr


def test_doctor_says_which_installed_releases_are_newer_than_any_measured(monkeypatch, tmp_path):
    """Below doctor's table, once per distribution newer than the newest release measured
    (``shim/measured.json``): its table is then the first measurement of it."""
    from shim import gating

    installed = {name: gating.installed_version(name) for name in ("transformers", "torch")}
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"newest": {"transformers": "5.0.0", "torch": "99.0.0", "peft": "0.1.0"}}))
    monkeypatch.setattr(gating, "MEASURED", str(measured))
    gating.newest_measured.cache_clear()
    try:
        notes = doctor.newer_notes()
        assert [note.split(" is newer")[0] for note in notes] == [f"transformers {installed['transformers']}"] + (
            [f"peft {gating.installed_version('peft')}"] if HAS_PEFT else []
        )
        assert notes[0].startswith(
            f"transformers {installed['transformers']} is newer than the newest release measured (5.0.0): "
        )
        assert "the verdicts above are the first measurement of it" in notes[0]
        assert notes == doctor.notes()[: len(notes)]
    finally:
        gating.newest_measured.cache_clear()


def test_a_packs_check_runs_where_torch_cannot_be_imported_a_builtins_cannot(fake_modules, monkeypatch):
    """A built-in's self-check trains on torch: without it doctor says it cannot check here. A patch
    pack's check needs only what its author says, so it runs, and a check that needed torch after all
    is its own error."""
    from shim.catalogue import PROVIDER, Listing

    pkg = fake_modules(target="def f():\n    return 1\n")
    importlib.import_module(f"{pkg}.target")
    builtin = Listing.of(make_patch(pkg, name="built-in", bug_probe=finds(True)))
    builtin.provider = PROVIDER  # as the catalogue's records say
    registry = Registry([builtin, make_patch(pkg, name="from-a-pack", bug_probe=finds(True))])
    registry.activate()
    monkeypatch.setitem(sys.modules, "torch", None)  # Python's way to make a module unimportable
    findings = {finding.name: finding for finding in doctor.run(registry)}
    assert findings["built-in"].verdict == doctor.CANNOT_CHECK
    assert findings["from-a-pack"].verdict == doctor.NOT_FIXED, "its check ran: the bug shows with it on"


def test_doctor_prints_each_row_as_its_check_finishes_then_a_total():
    """The header comes at once and each row when its check is done (flushed through a pipe), not
    everything at the end; then the total. The checks take seconds: the lines arrive spread out."""
    import time

    patches = ["checkpointing-restore", "input-grad-hook-dedupe"]
    arrived = []
    with subprocess.Popen(
        [sys.executable, "-m", "shim", "doctor", *patches],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as process:
        for line in process.stdout:
            arrived.append((time.monotonic(), line.rstrip("\n")))
        process.wait(timeout=600)
    lines = [line for _, line in arrived]
    assert lines[0].split()[:2] == ["patch", "installed"] and [line.split()[0] for line in lines[2:4]] == patches
    total = next(line for line in lines if line.startswith("doctor: "))
    assert total.startswith("doctor: 2 patches checked: ")
    header_at, first_row_at = arrived[0][0], arrived[2][0]
    assert first_row_at - header_at > 0.2, "the header is printed before the first check runs"


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")
def test_doctor_shows_no_warning_its_own_imports_cause():
    """trl warns on every import of trl.experimental; doctor imports trl.experimental.utils (the
    target of kbit-prepare-keeps-checkpointing) and hides that notice, and only around its import."""
    plain = "import warnings; warnings.simplefilter('always'); import trl.experimental.utils"
    shown = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, timeout=300)
    assert "TRLExperimentalWarning" in shown.stderr, "the notice doctor hides: there without it"
    done = subprocess.run(
        [sys.executable, "-W", "always", "-m", "shim", "doctor", "kbit-prepare-keeps-checkpointing"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "TRLExperimentalWarning" not in done.stderr, done.stderr
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from shim.tools.targets import import_quietly\n"
        "import_quietly('trl.experimental.utils')\n"
        "warnings.warn('still shown', UserWarning)\n"
    )
    quiet = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "TRLExperimentalWarning" not in quiet.stderr and "still shown" in quiet.stderr


def test_doctor_says_the_patch_packs_left_out_at_import_shim_below_a_table_of_every_patch(fake_modules):
    """A pack's patch refused at ``import shim`` (an order that cannot hold) has no row: doctor says it
    below the table where it checks every patch, as ``python -m shim`` does; ``doctor NAME`` does not."""
    pkg = fake_modules(target="def f():\n    return 1\n")
    importlib.import_module(f"{pkg}.target")
    registry = Registry([make_patch(pkg, bug_probe=finds(True))])
    registry.left_out.append("patch pack tpack 1.0 entry point ...: its place in the order cannot hold")
    registry.activate()
    for names, said in (((), True), (("demo",), False)):
        written = []
        doctor.print_table(registry, names, True, written.append)
        assert ("\nnote: patch pack tpack 1.0 entry point ...: its place in the order cannot hold" in written) is said
    registry.deactivate()
