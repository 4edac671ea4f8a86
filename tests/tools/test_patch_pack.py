"""The example patch pack (examples/patch-pack, a patch of transformers' ``get_last_checkpoint``),
built and installed into a folder of its own as a user installs it, then used from fresh interpreters
with that folder on ``PYTHONPATH``: its patch is applied under ``import shim`` and ``shim-run``, listed
with its distribution, opted out by name, explained from its own text and checked by doctor, and the
pack's own test passes."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, clean_environment

pytestmark = pytest.mark.any_version  # the pack's gate covers every release the suite runs on

NAME = "example-resume-complete-checkpoint"
STEP = "example-checkpoint-keeps-dropout-masks"  # the pack's step on the checkpointing path
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


#: A Trainer's output folder: checkpoint-10 saved whole, checkpoint-20 cut short (no trainer_state.json).
OUTPUT = """
import os, tempfile
output = tempfile.mkdtemp()
for step in (10, 20):
    os.mkdir(os.path.join(output, f"checkpoint-{step}"))
open(os.path.join(output, "checkpoint-10", "trainer_state.json"), "w").write("{}")
"""

APPLIED = (
    OUTPUT
    + """
import importlib, json, sys
import shim
waits = not {"transformers.trainer_utils", "shim_example_pack.fixes"} & set(sys.modules)  # the pack waits for its target
import transformers.trainer
from transformers import trainer_utils
importlib.reload(shim)  # idempotent: the new registry adopts the layer
(status,) = [s for s in shim.status() if s.name == "example-resume-complete-checkpoint"]
print(json.dumps({
    "waits": waits, "state": status.state, "provider": status.provider,
    "chosen": os.path.basename(trainer_utils.get_last_checkpoint(output)),
    "trainer's": os.path.basename(transformers.trainer.get_last_checkpoint(output)),
    "layers": len(shim.wrappers(trainer_utils.get_last_checkpoint)),
    "effects": status.effects,
}))
"""
)


def test_import_shim_applies_the_pack_once_when_its_target_is_imported(site):
    out = json.loads(run(site, code=APPLIED).stdout.splitlines()[-1])
    assert out == {
        "waits": True, "state": "applied", "provider": "shim-example-pack", "chosen": "checkpoint-10",
        "trainer's": "checkpoint-10", "layers": 1, "effects": 0,
    }  # fmt: skip


def test_shim_run_applies_the_pack_and_the_exit_line_counts_it(site):
    code = OUTPUT + "from transformers.trainer_utils import get_last_checkpoint\nprint(get_last_checkpoint(output))"
    result = run(site, sys.executable, "-m", "shim", "run", "--", sys.executable, "-c", code)
    assert result.stdout.strip().endswith("checkpoint-10")
    assert f"hf-train-shim: 1 fix acted: {NAME} ×1 (SHIM_REPORT=1 for the table)" in result.stderr
    table = run(site, sys.executable, "-m", "shim", "run", "--", sys.executable, "-c", code, env={"SHIM_REPORT": "1"})
    assert NAME in table.stderr and "passed over checkpoint-20, which has no trainer_state.json" in table.stderr


def test_the_table_and_json_name_the_packs_distribution(site):
    import transformers

    lines = run(site, sys.executable, "-m", "shim").stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith(NAME))
    assert lines[row].split()[1:4] == ["will", "apply", transformers.__version__]  # its target is not imported yet
    assert lines[row + 3].strip() == "from: shim-example-pack (a patch pack)"
    first = next(i for i, line in enumerate(lines) if line.startswith("example-"))  # the pack's first row
    assert not any("(a patch pack)" in line for line in lines[: first + 1]), "a built-in names no pack"
    records = json.loads(run(site, sys.executable, "-m", "shim", "--json").stdout)
    assert {r["provider"] for r in records} == {"hf-train-shim", "shim-example-pack"}
    record = next(r for r in records if r["name"] == NAME)
    assert record["targets"] == ["transformers.trainer_utils:get_last_checkpoint"]
    assert record["requires"] == "transformers>=4.57,<6"


def test_shim_disable_opts_the_pack_out_by_name(site):
    code = (
        OUTPUT
        + """
import sys
import shim
from transformers import trainer_utils
(status,) = [s for s in shim.status() if s.name == "example-resume-complete-checkpoint"]
imported = "shim_example_pack.fixes" in sys.modules
print(os.path.basename(trainer_utils.get_last_checkpoint(output)), "|", status.state, "|", imported, "|", status.reason)
"""
    )
    out = run(site, code=code, env={"SHIM_DISABLE": "EXAMPLE_RESUME_COMPLETE_CHECKPOINT"}).stdout.strip()
    reason = "opted out with SHIM_DISABLE=example-resume-complete-checkpoint; its module is not imported while it is switched off"
    assert out == f"checkpoint-20 | disabled | False | {reason}"


def test_doctor_runs_the_packs_self_checks(site):
    code = f"""
    import sys
    from shim.tools.cli import main
    sys.exit(main(["doctor", "--json", "{NAME}", "{STEP}"]))
    """
    import transformers

    findings = json.loads(run(site, code=code).stdout)
    expected = {"installed": transformers.__version__, "state": "applied", "bug_upstream": "yes", "bug_with_shim": "no"}
    assert [f["name"] for f in findings] == sorted([NAME, STEP])
    assert all(finding | expected == finding and finding["verdict"] == "fixed" for finding in findings)


#: A tiny Llama whose attention drops out, checkpointed with preserve_rng_state=False (for speed):
#: are its gradients those of the loss, as without checkpointing? Plain transformers code.
DROPOUT = """
import json, sys
SHIM
import torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, attention_dropout=0.5)
torch.manual_seed(0)
model = LlamaForCausalLM(config).train()
ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
def gradients():
    model.zero_grad()
    torch.manual_seed(2)
    model(ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]
reference = gradients()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False})
same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(reference, gradients()))
print(json.dumps([same, "shim_example_pack.dropout_masks" in sys.modules]))
"""


def test_the_packs_checkpointing_step_replays_dropout_masks_end_to_end(site):
    """The pack's step on the checkpointing path, with the shim on, opted out by name (its module
    never imported), and without the shim."""
    on = run(site, code=DROPOUT.replace("SHIM", "import shim")).stdout.splitlines()[-1]
    off = run(site, code=DROPOUT.replace("SHIM", "import shim"), env={"SHIM_DISABLE": STEP}).stdout.splitlines()[-1]
    without = run(site, code=DROPOUT.replace("SHIM", "")).stdout.splitlines()[-1]
    assert (json.loads(on), json.loads(off), json.loads(without)) == ([True, True], [False, False], [False, False])


def test_explain_prints_the_patchs_own_text(site):
    out = run(site, sys.executable, "-m", "shim", "explain", NAME, "--markdown").stdout
    assert out.startswith(f"## {NAME}\n\nTrainer.train(resume_from_checkpoint=True) resumes from the newest")
    assert "From the patch pack shim-example-pack 0.1.0 (entry point hf_train_shim.patches:" in out
    assert "it applies to transformers>=4.57,<6." in " ".join(out.split())
    assert "Symptom: a run killed while it saved a checkpoint" in " ".join(out.split())
    plain = run(site, sys.executable, "-m", "shim", "explain", NAME).stdout
    assert plain.startswith(f"{NAME}\n\n") and "``" not in plain


def test_the_packs_own_test_passes(site):
    tests = site / "source" / "tests"  # with the pack's own pytest settings (its pyproject.toml)
    result = run(site, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                 env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # fmt: skip
    assert next(line for line in result.stdout.splitlines() if " passed" in line).startswith("6 passed")
