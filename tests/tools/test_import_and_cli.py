"""The shim as a user meets it, each case in a fresh interpreter on the real transformers."""

import json

import pytest
import transformers
from packaging.version import Version

from shim import Evidence, Patch, Registry, Target
from shim.tools import doctor
from tests.conftest import run_python

NAME = "load-keeps-requires-grad"
#: Version rule of the load bug: transformers 5.x resets requires_grad on load; 4.x keeps it and has no
#: core_model_loading module, so there the patch is skipped and loading keeps the flags anyway.
LOAD_BUG = Version(transformers.__version__) >= Version("5.0")
LOAD_PATCH_STATE = "applied" if LOAD_BUG else "skipped"

ROUND_TRIP = """
import json, tempfile
import shim
from shim.patches.load_keeps_requires_grad import requires_grad_map
from tests.tinymodels import frozen_llama_class
from shim.tools.targets import quiet_transformers
from tests.tinymodels import tiny_llama_config
quiet_transformers()
model_class = frozen_llama_class()
model = model_class(tiny_llama_config())
with tempfile.TemporaryDirectory() as directory:
    model.save_pretrained(directory)
    loaded = model_class.from_pretrained(directory)
state = {s.name: s.state for s in shim.status()}["load-keeps-requires-grad"]
print(json.dumps({"kept": requires_grad_map(loaded) == requires_grad_map(model), "state": state}))
"""


def round_trip(first_import: str, env=None) -> dict:
    output = run_python(first_import + "\n" + ROUND_TRIP, env=env, torch_first=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def test_import_shim_first_keeps_requires_grad_on_load():
    assert round_trip("import shim\nimport transformers") == {"kept": True, "state": LOAD_PATCH_STATE}


def test_import_transformers_first_keeps_requires_grad_on_load():
    first = "import transformers, transformers.modeling_utils"
    if LOAD_BUG:
        first += ", transformers.core_model_loading"
    assert round_trip(first + "\nimport shim") == {"kept": True, "state": LOAD_PATCH_STATE}


@pytest.mark.parametrize("value", ["all", NAME])
def test_shim_disable_shows_the_bug_again(value):
    # On 4.x there is no bug to show: the flags are kept with the shim opted out too.
    assert round_trip("import shim", env={"SHIM_DISABLE": value}) == {"kept": not LOAD_BUG, "state": "disabled"}


def test_import_shim_imports_neither_torch_nor_transformers():
    code = """
    import sys
    import shim
    heavy = sorted(m for m in ("torch", "transformers", "trl", "peft") if m in sys.modules)
    print(heavy)
    """
    assert run_python(code).stdout.strip() == "[]"


@pytest.mark.skipif(
    not LOAD_BUG,
    reason="version rule: the load bug exists from transformers 5.0 (4.x has no core_model_loading to wrap)",
)
def test_reload_adds_no_second_layer_and_the_new_registry_controls_it():
    code = """
    import importlib, wrapt, shim
    import transformers.modeling_utils, transformers.core_model_loading as loading
    from shim.wrapping import patch_names_of
    importlib.reload(shim)
    importlib.reload(shim)
    shim.activate()
    layers = lambda: sum(1 for e in wrapt.wrapper_chain(loading.set_param_for_module) if patch_names_of(e))
    print(layers())
    shim.deactivate()
    print(layers())
    """
    assert run_python(code, torch_first=True).stdout.split() == ["1", "0"]


def test_status_cli_json_and_table():
    records = json.loads(
        run_python("from shim.tools.cli import main; main(['--json', '--import-targets'])", torch_first=True).stdout
    )
    record = next(r for r in records if r["name"] == NAME)
    assert record["installed"] == transformers.__version__
    assert record["state"] == LOAD_PATCH_STATE
    assert record["targets"][0] == "transformers.core_model_loading:set_param_for_module"
    table = run_python(
        "from shim.tools.cli import main; main(['--import-targets'])", env={"SHIM_DISABLE": "all"}, torch_first=True
    ).stdout
    lines = table.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith(NAME))
    assert lines[row].split()[1:3] == ["disabled", transformers.__version__]
    assert "reason: opted out with SHIM_DISABLE=all" in lines[row + 2]


def test_doctor_reports_the_load_bug_present_upstream_and_fixed():
    # `doctor NAME`: that patch's self-check alone (every patch's: test_cli_edges.py's column check)
    out = run_python(
        f"from shim.tools.cli import main; raise SystemExit(main(['doctor', '--json', '{NAME}']))", torch_first=True
    ).stdout
    (finding,) = json.loads(out)
    assert finding["name"] == NAME
    expected = ("yes", "no", "fixed") if LOAD_BUG else ("no", "no", "not affected")
    assert (finding["bug_upstream"], finding["bug_with_shim"], finding["verdict"]) == expected


def test_doctor_flags_a_patch_that_does_not_fix_its_bug(fake_modules):
    pkg = fake_modules(target="def f():\n    return 1\n")
    import importlib

    module = importlib.import_module(f"{pkg}.target")

    def no_op(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    def found(present):
        return Evidence(present, "f() returns 1")

    registry = Registry(
        [
            Patch(
                "broken", "s", pkg, ">=1", (Target(f"{pkg}.target:f", no_op),), bug_probe=lambda: found(module.f() == 1)
            ),
            Patch("fine", "s", pkg, ">=1", (Target(f"{pkg}.target:f", no_op),), bug_probe=lambda: found(False)),
            Patch("not-needed", "s", pkg, ">=9", (Target(f"{pkg}.target:f", no_op),), bug_probe=lambda: found(False)),
        ]
    )
    registry.activate()
    verdicts = {f.name: f.verdict for f in doctor.run(registry)}
    assert verdicts == {"broken": doctor.NOT_FIXED, "fine": doctor.NOT_REPRODUCED, "not-needed": doctor.NOT_AFFECTED}
